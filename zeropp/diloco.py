"""Streaming DiLoCo across groups of nodes, with the engine (ZeRO-3/ZeRO++) inside each group.

Each group of consecutive nodes trains with its own engine over its own ranks
(parallel/topology.py `group_topology`); every H inner steps each rank synchronizes ITS
shard of the fp32 masters with the ranks that hold the same shard in the other groups
(a group per in-group rank, `Topology.build_strided_group`), so no rank holds more than
its shard of the outer state (the global parameters, the outer momentum, the error).

Outer step (DiLoCo, arXiv 2311.08105; FedOpt): with g the global shard and l_i group i's
local shard, the outer gradient is D = g - mean_i(l_i); Nesterov momentum m <- mu m + D;
g <- g - lr (D + mu m), written as mean(l) + (1 - lr) D - lr mu m so that lr 1, mu 0 give
exactly the mean of the locals (one group: exactly its own, bit for bit). Exact exchange:
an all-reduce of the locals. INT4 (`quantization="int4"`): each rank sends its own D_i plus
its error e_i, block-quantized by zeropp/kernels/quant.py, all-gathered, dequantized and
averaged; e_i <- (D_i + e_i) - Q(D_i + e_i), committed only when the outer step is applied.

Streaming (arXiv 2501.18512): the model is cut into F fragments, contiguous runs of layers
(parameters outside the layers go with the nearest: embeddings first, the final norm last);
fragment f is exchanged after the inner steps s with s % H == f H // F. With `overlap` the
exchange is issued async and applied after the next inner step (tau = 1): meanwhile that
step trained the fragment from its unsynchronized values, and the paper's merge keeps half
of it: local <- MIX local + (1 - MIX) global (their mixing factor alpha; MIX = 0.5). Without
overlap the exchange is applied at once and the local fragment becomes the global one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from parallel.comm import Work
from zeropp.collectives.partition import FlatState, Partition
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.config import ConfigError
from zeropp.kernels.format import DEFAULT_BLOCK_SIZE, Quantized, wire_nbytes
from zeropp.kernels.quant import dequantize, dequantize_reduce, quantize

MIX = 0.5
KEY = "outer_sync"
GLOBAL = KEY + ".global."   # + a parameter's name: its global values in checkpoints
PHASE = "outer_sync"
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class OuterSettings:
    interval: int                 # H: inner steps between two exchanges of a fragment
    lr: float = 0.7
    momentum: float = 0.9         # Nesterov
    fragments: int = 1
    quantization: str = "none"    # or "int4"
    overlap: bool = True          # apply each exchange one inner step after issuing it
    block_size: int = DEFAULT_BLOCK_SIZE[4]


def exchange_per_step(owned: int, s: OuterSettings) -> PlannedCollective:
    """A rank's exchanges of one inner step over the group "outer" (a rank of every group), for
    `owned` master elements: every fragment once in H steps, so the whole shard / H (rounded down)."""
    if s.quantization == "none":
        return PlannedCollective(PHASE, "all_reduce", "outer", owned * 4 // s.interval)
    return PlannedCollective(PHASE, "all_gather", "outer", wire_nbytes(owned, 4, s.block_size) // s.interval,
                             owned // s.interval, 4)


def layer_fragments(names: list[str], fragments: int) -> list[int]:
    """The fragment of each parameter (by name, in order): layer i of n goes to i F // n; a
    parameter outside the layers goes with the layer before it (before the first: fragment 0)."""
    layers = [int(m.group(1)) if (m := _LAYER.search(n)) else None for n in names]
    n = len({i for i in layers if i is not None})
    if fragments > max(n, 1):
        raise ConfigError(f"--outer-fragments {fragments} exceeds the model's {n} layers; "
                          f"pass at most {max(n, 1)}")
    out, current = [], 0
    for i in layers:
        current = current if i is None else i * fragments // n
        out.append(current)
    return out


@dataclass
class Exchange:
    fragment: int
    work: object                  # parallel.comm.Work
    buf: torch.Tensor             # exact: the summed locals; int4: the gathered wire rows
    mine: torch.Tensor            # my outer gradient g - l_i (the drift from the mean, when applied)
    error: torch.Tensor | None    # int4: the error this exchange leaves, if it is applied


class OuterSync:
    """The outer loop of one rank, a carried part of its engine (zeropp/collectives/protocols.py
    CarriedState): `end_step` counts the inner steps and issues and applies the exchanges."""

    def __init__(self, engine, cross: Partition, settings: OuterSettings):
        self.engine, self.cross, self.s = engine, cross, settings
        self.comm = engine.comm
        owned = [s for s in engine.shards if s.valid]
        frag = layer_fragments([s.name for s in engine.shards], settings.fragments)
        which = {id(s): f for s, f in zip(engine.shards, frag)}
        self.fragments = [[s for s in owned if which[id(s)] == f] for f in range(settings.fragments)]
        self.glob = [self._local(f).clone() for f in range(settings.fragments)]
        zeros = lambda: [torch.zeros_like(g) for g in self.glob]   # noqa: E731
        self.mom = zeros() if settings.momentum else None
        self.err = zeros() if settings.quantization == "int4" else None
        self.steps = self.outer_steps = 0
        self.pending: list[Exchange] = []
        self.drift = float("nan")   # RMS over my shard of l_i - mean(l) at the last outer step

    def _local(self, f: int) -> torch.Tensor:
        ms = [s.master.detach().reshape(-1) for s in self.fragments[f]]
        return torch.cat(ms) if ms else torch.zeros(0, device=self.engine.device)

    def due(self, step: int) -> list[int]:
        """The fragments exchanged after inner step `step` (1, 2, ...)."""
        H, F = self.s.interval, self.s.fragments
        return [f for f in range(F) if step % H == f * H // F]

    # -- CarriedState ---------------------------------------------------------------------------
    def end_step(self, applied: bool) -> str | None:
        """After every inner step (applied or skipped: the schedule counts steps)."""
        self.steps += 1
        notes = [self._apply(x, mix=True) for x in self.pending]
        self.pending = []
        for f in self.due(self.steps):
            x = self._issue(f)
            if self.s.overlap:
                self.pending.append(x)
            else:
                notes.append(self._apply(x, mix=False))
        return "; ".join(n for n in notes if n) or None

    def _issue(self, f: int) -> Exchange:
        local, g = self._local(f), self.glob[f]
        mine, alone = g - local, self.cross.size == 1   # one group: nobody to exchange with
        if self.err is None:   # the locals, summed over the groups
            work = Work() if alone else self.comm.all_reduce(local, group=self.cross.group, async_op=True,
                                                             phase=PHASE)
            return Exchange(f, work, local, mine, None)
        send = mine + self.err[f]
        q = quantize(send, 4, self.s.block_size)
        wire = q.to_bytes()
        rows = torch.empty(self.cross.size, wire.numel(), dtype=torch.uint8, device=wire.device)
        if alone:
            rows.copy_(wire.view(1, -1))
        work = Work() if alone else self.comm.all_gather(rows.view(-1), wire, group=self.cross.group,
                                                         async_op=True, phase=PHASE)
        return Exchange(f, work, rows, mine, send.sub_(dequantize(q)))

    def _apply(self, x: Exchange, mix: bool) -> str | None:
        x.work.wait()
        f, g, n = x.fragment, self.glob[x.fragment], self.cross.size
        if x.error is None:
            mean = x.buf.div_(n) if n > 1 else x.buf
            outer = g - mean
        else:
            parts = Quantized.from_bytes(x.buf, g.numel(), 4, self.s.block_size)
            outer = dequantize_reduce(parts, torch.float32, 1.0 / n)
            mean = g - outer
        if not bool(torch.isfinite(outer).all()):   # a group diverged: keep every state as it was
            return f"outer step of fragment {f} skipped: its outer gradient is not finite"
        self.drift = (outer - x.mine).square().mean().sqrt().item() if g.numel() else 0.0
        new = mean.add(outer, alpha=1.0 - self.s.lr)
        if self.mom is not None:
            self.mom[f].mul_(self.s.momentum).add_(outer)
            new.add_(self.mom[f], alpha=-self.s.lr * self.s.momentum)
        if x.error is not None:
            self.err[f].copy_(x.error)
        g.copy_(new)
        off = 0
        with torch.no_grad():
            for s in self.fragments[f]:
                part = new[off:off + s.valid].view_as(s.master)
                s.master.mul_(MIX).add_(part, alpha=1.0 - MIX) if mix else s.master.copy_(part)
                off += s.valid
        self.engine.masters_changed()
        self.outer_steps += 1
        return None

    def finish(self):
        """Apply what is in flight (before a checkpoint, or at the end of training)."""
        notes = [self._apply(x, mix=True) for x in self.pending]
        self.pending = []
        return "; ".join(n for n in notes if n) or None

    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        """My slices of the outer state, in the masters' layout (a key per parameter)."""
        self.finish()
        out = {}
        empty = torch.zeros(0, device=self.engine.device)
        for name, state in (("global", self.glob), ("momentum", self.mom), ("error", self.err)):
            if state is None:
                continue
            views = {}
            for f, flat in enumerate(state):
                off = 0
                for s in self.fragments[f]:
                    views[s.index], off = flat[off:off + s.valid], off + s.valid
            for s in self.engine.shards:   # the groups share the global values and the momentum
                out[f"{KEY}.{name}.{s.name}"] = FlatState(views.get(s.index, empty), s.numel, sharded=True,
                                                          per_group=name == "error")
        return out

    def scalar_state(self) -> dict:
        # outer steps counting those in flight: a checkpoint applies them (checkpoint_state)
        return {"steps": self.steps, "outer_steps": self.outer_steps + len(self.pending), "groups": self.cross.size,
                "settings": self._layout()}

    def _layout(self) -> list:
        """What the saved outer state's shape and schedule depend on."""
        return [self.s.interval, self.s.fragments, self.s.quantization, self.mom is not None]

    def carried(self, saved: dict | None) -> bool:
        return saved is not None and saved.get("groups") == self.cross.size and saved.get("settings") == self._layout()

    def load_scalar_state(self, saved: dict | None) -> str | None:
        if self.carried(saved):
            self.steps, self.outer_steps = saved["steps"], saved["outer_steps"]
            return None
        for f in range(self.s.fragments):   # the loaded masters are the global parameters
            self.glob[f].copy_(self._local(f))
        for state in (self.mom, self.err):
            for t in state or []:
                t.zero_()
        return "outer state (global parameters, outer momentum, INT4 error) reset: saved by another layout"

    def memory(self) -> MemoryLine:
        tensors = self.glob + (self.mom or []) + (self.err or [])
        psi = sum(s.numel for s in self.engine.shards)
        return MemoryLine(KEY, "optimizer", tensors, sum(t.numel() * 4 for t in tensors) / max(psi, 1))

    def plan_step(self) -> list[PlannedCollective]:
        return [exchange_per_step(sum(g.numel() for g in self.glob), self.s)]

    def summary(self) -> str | None:
        return (f"outer synchronization: {self.outer_steps} fragment exchanges over {self.cross.size} groups "
                f"(every {self.s.interval} inner steps, {self.s.fragments} fragment(s), "
                f"{self.s.quantization} outer gradients)")


def attach(engine, cross: Partition, settings: OuterSettings) -> OuterSync:
    """Make `engine` (a sharded engine over one group) synchronize across the groups."""
    if not hasattr(engine, "masters_changed"):
        raise ConfigError("--outer-sync-interval needs ZeRO stage 1-3 over groups of more than one rank; "
                          "pass --zero-stage 3 and a --group-size of at least one node of 2+ ranks")
    sync = OuterSync(engine, cross, settings)
    engine.parts.carried[KEY] = sync   # last: after the techniques' parts commit their step
    return sync
