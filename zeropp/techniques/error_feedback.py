"""LoCo's carried state (zeropp/techniques/loco.py, arXiv 2407.04480): the INT4 (or,
with `zero_quantized_gradients_bits` 2, INT2) error of what a rank sends across
nodes, carried into its next reduction of the same gradient bucket, and kept in
checkpoints.

Per bucket one error of [N, P] elements: the node's sums for the owners with this
rank's local index (HierarchicalQuantizedReduce's inter-node rows), 1/L of the
bucket. As in the LoCo paper it is kept in 8 bits: INT8 blocks of ERROR_BLOCK (256)
elements with one fp32 scale each (zeropp/kernels/quant.py's INT8 format and kernels,
the same bits on every backend), stored as one uint8 buffer in the wire layout
(scales, then data): 1 + 4/256 bytes per element, so all buffers together are
1.016/L bytes per parameter. A reduction sends Q(x) for x = rows + e and keeps
e = Q8(beta e + (1 - beta)(x - Q(x))) (beta 0: classic error feedback); every
`reset_every` reductions of a bucket e starts again from zero. Storing e costs at
most half an INT8 step per element, max|e over its block| / 254, on top of what
the fp32 error kept (tests/unit/zeropp/test_zeropp_loco.py checks the bound). Without error
feedback each step's INT4 error is lost; with it what was not sent is sent later,
so the sum of what the optimizer receives over steps tracks the sum of the true
gradients (tests/unit/zeropp/test_zeropp_loco.py: over 20 reductions of the same rows, the drift stays
about one step's error instead of growing twentyfold).

With Hadamard smoothing (`zero_hadamard_gradients`) the rows are sent rotated
(zeropp/techniques/hadamard.py), each padded to whole blocks of B, so the buffers are [N, P
padded to B] in the rotated domain; `hadamard` (B, 0 = off) is part of the layout.

Carried state is committed with the step (ARCHITECTURE.md, "State carried across
steps"): a reduction writes the new error into a second buffer per bucket, and
`end_step` swaps it in only when the optimizer step is applied. A skipped step (an
fp16 overflow on any rank, a non-finite gradient) leaves the error and the counts as
they were, so one overflow never poisons later steps. This costs a second INT8
buffer: 2.03/L bytes per parameter in all (fp32 errors took 8/L).

Checkpoints: each buffer is a sharded uint8 tensor of W x wire_nbytes(N x P) bytes
(rank r's buffer is its r-th chunk), and the layout (ranks, nodes, each bucket's
shape), the error's bits and the reduction counts go to the metadata. A load with
the same layout restores them exactly; any other layout (world size, node shape,
buckets, with or without the rotation) cannot place them, so they start from zero and
the load says so. A checkpoint saved with fp32 errors (no bits in its metadata) is
read into fp32 staging tensors (`stage_load`) and quantized to INT8 on load, said
in one line.
"""
from __future__ import annotations

import torch

from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.collectives.partition import FlatState
from zeropp.kernels.quant import DEFAULT_BLOCK_SIZE, dequantize, quantize
from zeropp.kernels.format import Quantized, wire_nbytes

KEY = "error_feedback."   # checkpoint keys: KEY + bucket index
MEMORY_KEY = "error_feedback_bytes"
ERROR_BITS, ERROR_BLOCK = 8, DEFAULT_BLOCK_SIZE[8]   # the stored error's format


def error_nbytes(numel: int) -> int:
    """Bytes of one stored error of `numel` elements (INT8 blocks and their fp32 scales)."""
    return wire_nbytes(numel, ERROR_BITS, ERROR_BLOCK)


ERROR_BYTES_PER_ELEMENT = error_nbytes(1 << 20) / (1 << 20)   # 1 + 4/256


class ErrorFeedback:
    """Each gradient bucket's error, committed with the step (a carried part: protocols.CarriedState)."""

    def __init__(self, beta: float, reset_every: int, hadamard: int = 0):
        self.beta, self.reset_every = beta, reset_every
        # Errors as INT8 wire buffers (error_nbytes(N P) bytes each, `_error` views them)
        self.buffers: dict[int, torch.Tensor] = {}      # the error after the last applied step
        self.reductions: dict[int, int] = {}
        self._pending: dict[int, torch.Tensor] = {}     # this step's new error, swapped in by end_step
        self._pending_reductions: dict[int, int] = {}   # buckets reduced this step -> their new count
        self.shapes: dict[int, tuple[int, int]] = {}   # every bucket's buffer shape (`expect`, `add`)
        self.added: dict[str, tuple[int, int]] = {}    # buckets met while training (`add`)
        self.layout: dict = {}
        self.hadamard = hadamard   # the rotation's block size when the rows are rotated, 0: none
        self._offered: dict[str, FlatState] = {}      # the last checkpoint_state(), for `stage_load`
        self._staged: dict[str, torch.Tensor] = {}    # fp32 errors of an old checkpoint, being loaded
        self._sent: dict = {}                         # each bucket's rows as sent: [N, P]

    def expect(self, shapes: dict[int, tuple[int, int]], world: int, nodes: int, device):
        """The buckets to come (index -> [N, P]) and the job's shape: what a checkpoint records.
        On one node nothing is quantized, so there is no error to keep."""
        if self.hadamard:   # rotated rows: P padded to whole blocks
            shapes = {k: (n, -(-p // self.hadamard) * self.hadamard) for k, (n, p) in shapes.items()}
        self.shapes, self.device = (dict(shapes) if nodes > 1 else {}), device
        self.layout = {"world": world, "nodes": nodes, "shapes": {str(k): list(v) for k, v in shapes.items()}}
        if self.hadamard:   # absent when off: checkpoints saved before the switch existed still fit
            self.layout["hadamard"] = self.hadamard

    def add(self, key: str, shape: tuple[int, int]):
        """A bucket met while training (the FSDP2 plug-in: a unit reducing another set of its
        parameters), with its own error from now on; checkpoints carry it beside the layout."""
        if self.hadamard:
            shape = (shape[0], -(-shape[1] // self.hadamard) * self.hadamard)
        if self.layout.get("nodes", 1) > 1:   # one node keeps no error
            self.shapes[key] = self.added[key] = tuple(shape)

    def adopt(self, saved: dict):
        """Before loading a checkpoint that fits (`carried`): the buckets it met while training."""
        for key, shape in saved.get("added", {}).items():
            self.add(key, tuple(shape))

    def _buffer(self, key, shape, store: dict | None = None) -> torch.Tensor:
        """The error of bucket `key` ([N, P] elements) as its INT8 wire buffer; zeros when new
        (scale 0: dequantizes to exact zeros)."""
        store = self.buffers if store is None else store
        err = store.get(key)
        if err is None or err.numel() != error_nbytes(shape[0] * shape[1]):
            err = store[key] = torch.zeros(error_nbytes(shape[0] * shape[1]), dtype=torch.uint8, device=self.device)
        return err

    @staticmethod
    def _error(buf: torch.Tensor, shape) -> Quantized:
        return Quantized.from_bytes(buf, shape[0] * shape[1], ERROR_BITS, ERROR_BLOCK)

    @staticmethod
    def _scales(buf: torch.Tensor) -> torch.Tensor:
        """The fp32 scales at the head of an error buffer (whole blocks: 4 + ERROR_BLOCK bytes each)."""
        return buf[:4 * (buf.numel() // (4 + ERROR_BLOCK))].view(torch.float32)

    def errors(self) -> dict:
        """The committed errors in fp32, [N, P] each (for inspection and tests)."""
        shapes = {**self.shapes, **self._sent}
        return {k: dequantize(self._error(b, shapes[k])).view(shapes[k]) for k, b in self.buffers.items()}

    def summary(self) -> str | None:
        return None

    def peak_buffers(self) -> dict:
        return {}   # its errors are model state (memory())

    def plan_step(self) -> list[PlannedCollective]:
        return []

    def memory(self) -> MemoryLine:
        """The committed errors and the pending ones: an INT8 error for 1/L of the gradients,
        twice (none on one node)."""
        nodes = self.layout.get("nodes", 1)
        per = 2 * ERROR_BYTES_PER_ELEMENT * nodes / self.layout["world"] if nodes > 1 else 0.0
        return MemoryLine(MEMORY_KEY, "gradients", list(self.buffers.values()) + list(self._pending.values()), per,
                          2 * sum(error_nbytes(n * p) for n, p in self.shapes.values()),
                          "qgZ error feedback (INT8, 2 x 1/L)")

    def send(self, key: int, rows: torch.Tensor, dests: list[Quantized], pool: BufferPool):
        """Quantize rows [N, total] plus the carried error into `dests` (the wire rows, INT4 or
        INT2); the new error is pending until end_step. A second reduction of the bucket in the
        same step (gradient accumulation) carries the pending error on."""
        self.device = rows.device
        self._sent[key] = tuple(rows.shape)
        again = key in self._pending_reductions
        done = self._pending_reductions[key] if again else self.reductions.get(key, 0)
        new = self._buffer(key, rows.shape, self._pending)
        old = new if again else self._buffer(key, rows.shape)
        self._pending_reductions[key] = done + 1
        carried = pool.take(rows.numel(), torch.float32).view(rows.shape)   # e in fp32
        if done and done % self.reset_every == 0:
            carried.zero_()
        else:
            dequantize(self._error(old, rows.shape), torch.float32, out=carried.view(-1))
        x = pool.take(rows.numel(), torch.float32).view(rows.shape)
        torch.add(rows, carried, out=x)
        sent = pool.take(rows.shape[1], torch.float32)
        for a, dest in enumerate(dests):
            quantize(x[a], dest.bits, dest.block_size, out=dest)
            x[a].sub_(dequantize(dest, torch.float32, out=sent))    # this quantization's error
        carried.mul_(self.beta).add_(x, alpha=1 - self.beta)
        quantize(carried, ERROR_BITS, ERROR_BLOCK, out=self._error(new, rows.shape))
        pool.give(sent)
        pool.give(x)
        pool.give(carried)

    def end_step(self, applied: bool) -> str | None:
        """The optimizer step ended: commit this step's errors if it was applied, else drop them.
        An applied step that left a non-finite error commits nothing either (the carried error
        stays the last finite one) and says so. A non-finite block shows in its scale
        (zeropp/kernels/quant.py), so the scales alone are checked."""
        touched, self._pending_reductions = self._pending_reductions, {}
        if not applied or not touched:
            return None
        if not bool(torch.stack([torch.isfinite(self._scales(self._pending[k])).all() for k in touched]).all()):
            return "qgZ's error feedback came out non-finite; the last finite error is kept"
        for k in touched:
            self.buffers[k], self._pending[k] = self._pending[k], self.buffers[k]
        self.reductions.update(touched)
        return None

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        """Every bucket's buffer (zeros for one not reduced yet), as rank r's chunk of W of them.
        A buffer is only ever made, never replaced: saving changes no error."""
        self._offered = {f"{KEY}{k}": FlatState(self._stored(k, shape), world * error_nbytes(shape[0] * shape[1]),
                                                sharded=True)
                         for k, shape in self.shapes.items()}
        return dict(self._offered)

    def _stored(self, key, shape) -> torch.Tensor:
        return self._buffer(key, shape)

    def stage_load(self, saved: dict | None):
        """Before a load that fits (`carried`) from a checkpoint saved with fp32 errors: the
        tensors the last `checkpoint_state()` offered become fp32 staging tensors of the saved
        size, filled by the load and quantized by `load_scalar_state`."""
        self._staged = {}
        if not self.carried(saved) or saved.get("error_bits") == ERROR_BITS:
            return
        for name, flat in self._offered.items():
            n, p = self.shapes[_key(name[len(KEY):])]
            flat.local = self._staged[name] = torch.zeros(n * p, dtype=torch.float32, device=self.device)
            flat.numel = flat.numel // error_nbytes(n * p) * n * p

    def scalar_state(self) -> dict:   # holds: whether there is any error (none on one node)
        out = {"layout": self.layout, "reductions": {str(k): v for k, v in self.reductions.items()},
               "holds": bool(self.shapes), "error_bits": ERROR_BITS}
        if self.added:   # absent when none: checkpoints saved before buckets could be added still fit
            out["added"] = {k: list(v) for k, v in self.added.items()}
        return out

    def carried(self, saved: dict | None) -> bool:
        """Whether a checkpoint's buffers (its scalar state `saved`) fit this job's layout."""
        return bool(saved) and saved.get("layout") == self.layout

    def load_scalar_state(self, saved: dict | None) -> str | None:
        """After the buffers were loaded (if carried): the counts; else zero everything and say why."""
        self._pending_reductions = {}
        staged, self._staged = self._staged, {}
        if self.carried(saved):
            self.reductions = {_key(k): v for k, v in saved["reductions"].items()}
            if not staged:
                return None
            for name, fp32 in staged.items():
                key = _key(name[len(KEY):])
                quantize(fp32, ERROR_BITS, ERROR_BLOCK, out=self._error(self._buffer(key, self.shapes[key]),
                                                                         self.shapes[key]))
            return (f"qgZ's error feedback was saved in fp32: converted to INT8 blocks of {ERROR_BLOCK} "
                    f"(saved again in INT8)")
        for err in self.buffers.values():
            err.zero_()
        self.reductions = {}
        if not self.shapes and (not saved or not saved.get("holds", True)):
            return None   # nothing kept then, nothing to keep now (one node): nothing was reset
        if not saved:
            return "the checkpoint has no qgZ error feedback (saved without zeropp_loco_param): it starts from zero"
        was, now = saved["layout"], self.layout
        if was.get("hadamard", 0) != now.get("hadamard", 0):
            def rotated(layout):
                b = layout.get("hadamard", 0)
                return f"rotated by Hadamard blocks of {b}" if b else "not rotated"
            return (f"qgZ's error feedback starts from zero: saved {rotated(was)} (zero_hadamard_gradients), "
                    f"now {rotated(now)} (its buffers hold the rows in that domain)")
        return (f"qgZ's error feedback starts from zero: saved on {was['world']} ranks in {was['nodes']} nodes "
                f"with {len(was['shapes'])} gradient buckets, now {now['world']} ranks in {now['nodes']} nodes "
                f"with {len(now['shapes'])} (its buffers follow that layout)")


def _key(saved: str):
    """A bucket key as saved: an engine bucket's index, or the name of one `add`ed while training."""
    return int(saved) if saved.isdigit() else saved
