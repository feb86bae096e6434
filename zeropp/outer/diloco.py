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
Top-k (`quantization="topk2"`, after SparseLoCo, arXiv 2508.15706): each rank sends the sparse
2-bit code of its D_i (zeropp/kernels/sparse.py: per chunk of 2048 elements the `topk_fraction`
largest in magnitude, 2 bits each, compact positions), and what it did not send stays in its own
masters instead of an error buffer: the merge moves them by the global values' step plus what
this rank sent, l_i <- l_i + (1 - alpha)((g' - g) + sent_i) (alpha the streaming merge's share
below, 0 without a delay), so the unsent rest D_i - sent_i stays in l_i and the next D_i sends
it again (error feedback in the weights). Most of a sparse exchange is unsent: a group that
dropped it from its weights until it was sent would train for many exchanges from stale values
(bench.convergence compares the two ways: docs/results.md, "Convergence"). The
final synchronization averages the groups' masters exactly, so the global parameters take every
unsent rest.

Streaming (arXiv 2501.18512): each rank's shard is cut into F fragments of equal bytes (the
paper cuts by layers, strided; a cut by bytes keeps the largest exchange, which the link
decides, at 1/F of the shard even when the embedding outweighs the layers); fragment f is exchanged after the inner steps s with s % H == f H // F, issued async and
merged `delay` inner steps later (their tau; torchft's fragment_sync_delay): meanwhile those
steps trained the fragment from its unsynchronized values, and the paper's merge keeps part
of it: local <- alpha local + (1 - alpha) global (their mixing factor, torchft's
fragment_update_alpha; `--outer-merge-alpha`, 0.5 by default). With delay 0 the exchange is
waited for at once and the local fragment becomes the global one.

A non-finite outer gradient skips that exchange's outer step in every group (their global
copies stay equal); the group whose own copy is not finite takes the global values, so the
fragment's next exchange is every group's again. The end of training averages every fragment
over the groups once more, exactly (`final_sync`): the global parameters, which an export
takes, are the groups' trained model.

A warm-up (`warmup` inner steps, 0 by default) trains the groups as one synchronous job first:
each step's reduced gradients are averaged across the groups before the norm and the update,
so every group takes the step data parallel over all of them takes, and the global parameters
follow the masters; the first exchange comes after it. DiLoCo's own runs start from a model
trained synchronously (arXiv 2311.08105, section 3): from scratch, the first exchanges average
models that are far apart while the loss falls fastest.

An exchange in flight at a checkpoint is completed and its outer step taken (the global
values, the momentum and the error are saved as they will be), while the masters, which the
inner steps own until the merge, are saved as they are: the merge comes at its own step
after a resume as in a run that never stopped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from parallel.membership import JOINING, FixedGroups
from zeropp.collectives.partition import FlatState, Partition
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.config import ConfigError
from zeropp.outer.fragments import FragmentLayout, fragment_bounds
from zeropp.kernels.format import DEFAULT_BLOCK_SIZE, Quantized, wire_nbytes
from zeropp.kernels import sparse
from zeropp.kernels.quant import dequantize, dequantize_reduce, quantize

KEY = "outer_sync"
GLOBAL = KEY + ".global."   # + a parameter's name: its global values in checkpoints
PHASE = "outer_sync"
WARMUP = "outer_warmup"   # the warm-up's gradient all-reduce across the groups
DRIFT = "outer_drift"   # the drift's all-reduce inside a group (not across groups)
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class OuterSettings:
    interval: int                 # H: inner steps between two exchanges of a fragment
    lr: float = 0.7
    momentum: float = 0.9         # Nesterov
    fragments: int = 1
    quantization: str = "none"    # or "int4", "topk2"
    delay: int = 1                # inner steps between issuing an exchange and merging it (< H)
    merge_alpha: float = 0.5      # the share of the local values a delayed merge keeps
    block_size: int = DEFAULT_BLOCK_SIZE[4]
    warmup: int = 0               # inner steps trained as one synchronous job before the first exchange
    topk_fraction: float = 0.02   # topk2: the share of each chunk sent


def outer_wire_nbytes(numel: int, s: OuterSettings) -> int:
    """Bytes a rank sends for `numel` elements of outer gradient, quantized (int4, topk2)."""
    if s.quantization == "topk2":
        return sparse.wire_nbytes(numel, s.topk_fraction)
    return wire_nbytes(numel, 4, s.block_size)


def saved_layout(s: OuterSettings) -> list:
    """What a saved outer state's shape and schedule depend on."""
    topk = [s.topk_fraction] if s.quantization == "topk2" else []   # what the masters hold unsent
    return [s.interval, s.fragments, s.quantization, bool(s.momentum), s.delay] + topk


def encode_outer(send: torch.Tensor, s: OuterSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized outer gradient: (its wire, what the wire decodes to)."""
    if s.quantization == "topk2":
        q = sparse.encode(send, s.topk_fraction)
        return q.to_bytes(), sparse.decode(q)
    q = quantize(send, 4, s.block_size)
    return q.to_bytes(), dequantize(q)


def decode_mean(buf: torch.Tensor, numel: int, groups: int, s: OuterSettings) -> torch.Tensor:
    """The mean of the gathered wires `buf` [groups, bytes], fp32 [numel]."""
    if s.quantization == "topk2":
        return sparse.decode_reduce(sparse.SparseTopK.from_bytes(buf, numel, s.topk_fraction), 1.0 / groups)
    return dequantize_reduce(Quantized.from_bytes(buf, numel, 4, s.block_size), torch.float32, 1.0 / groups)


def exchange_per_step(owned: int, s: OuterSettings) -> PlannedCollective:
    """A rank's exchanges of one inner step over the group "outer" (a rank of every group), for
    `owned` master elements: every fragment once in H steps, so the whole shard / H (rounded down)."""
    if s.quantization == "none":
        return PlannedCollective(PHASE, "all_reduce", "outer", owned * 4 // s.interval)
    return PlannedCollective(PHASE, "all_gather", "outer", outer_wire_nbytes(owned, s) // s.interval,
                             owned // s.interval, 4)


@dataclass
class Exchange:
    fragment: int
    merge_at: int                 # the inner step after which it is merged into the masters
    work: object = None           # parallel.comm.Work; None once the outer step is taken
    buf: torch.Tensor | None = None     # exact: the summed locals; int4, topk2: the gathered wire rows
    mine: torch.Tensor | None = None    # my outer gradient g - l_i (the drift from the mean)
    error: torch.Tensor | None = None   # int4: the error this exchange leaves; topk2: my unsent rest
    stepped: bool = False         # the outer step is taken: the global values are the new ones
    drift: float = float("nan")   # the group's RMS of l_i - mean(l), once stepped
    note: str | None = None       # why the outer step was skipped, if it was
    reseed: bool = False          # skipped because my group's copy is not finite: it takes the global one
    wire: torch.Tensor | None = None    # int4: what I send, held until it is sent
    size: int = 1                 # the groups in it
    weighted: bool = False        # the sum is the token-weighted mean (a fault-tolerant membership)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf, self.mine, self.error, self.wire) if t is not None)


def in_flight_bound(numels: list[int], s: OuterSettings, groups: int) -> int:
    """The most bytes of exchanges in flight at once (`Exchange.nbytes`), for fragments of `numels`
    master elements: those issued in the last max(delay, 1) inner steps, at the worst step."""
    def held(n):   # my outer gradient and (exact) my locals to sum or (int4) the error and the wires
        return 8 * n + (0 if s.quantization == "none" else (groups + 1) * outer_wire_nbytes(n, s))
    window, H, F = max(s.delay, 1), s.interval, s.fragments
    return max(sum(held(n) for f, n in enumerate(numels) if (step - f * H // F) % H < window) for step in range(H))


def group_check(comm, outer: torch.Tensor, mine: torch.Tensor) -> tuple[bool, bool, float]:
    """Whether `outer` is finite on every shard of my group (so all its ranks agree, and the
    other groups too: they hold the same outer gradient), whether my group's own outer
    gradient `mine` is not (its copy went bad), and the RMS of `outer - mine` over them."""
    diff = outer - mine
    sums = torch.stack([diff.square().sum().nan_to_num(), diff.new_tensor(float(diff.numel())),
                        (~torch.isfinite(outer)).any().float(), (~torch.isfinite(mine)).any().float()])
    comm.all_reduce(sums, phase=DRIFT)
    return sums[2].item() == 0, sums[3].item() > 0, (sums[0] / sums[1].clamp(min=1)).sqrt().item()


class OuterSync:
    """The outer loop of one rank, a carried part of its engine (zeropp/collectives/protocols.py
    CarriedState): `end_step` counts the inner steps, issues the exchanges and merges them."""

    def __init__(self, engine, cross, settings: OuterSettings):
        # cross: who takes part in an exchange (parallel/membership.py)
        self.engine, self.cross, self.s = engine, cross, settings
        self.comm = engine.comm
        self.layout = FragmentLayout(engine.shards, settings.fragments, engine.device)
        self.owned, self.local, self._set_masters = self.layout.owned, self.layout.local, self.layout.set
        self.flat = {"global": torch.cat([self.local(f) for f in range(settings.fragments)])}
        if settings.momentum:
            self.flat["momentum"] = torch.zeros_like(self.flat["global"])
        if settings.quantization != "none":
            self.flat["error"] = torch.zeros_like(self.flat["global"])
        self.glob, self.mom, self.err = (self.layout.views(self.flat.get(k)) for k in ("global", "momentum", "error"))
        self.steps = self.outer_steps = 0
        self.since = [0] * settings.fragments   # inner steps trained since each fragment's last exchange
        self.pending: list[Exchange] = []
        self.joined = not cross.fault_tolerant   # in an exchange since this process started
        self.drift = float("nan")   # of the last merged exchange
        self.in_flight_peak = 0     # bytes (Exchange.nbytes) of the exchanges in flight at once

    def due(self, step: int) -> list[int]:
        """The fragments exchanged after inner step `step` (1, 2, ...)."""
        H, F = self.s.interval, self.s.fragments
        return [f for f in range(F) if step % H == f * H // F]

    def average_gradients(self, grads: torch.Tensor):
        """The warm-up: my reduced gradient shard averaged over the groups (the engine's hook)."""
        if self.steps < self.s.warmup:
            self.cross.all_reduce(grads, WARMUP, async_op=False)
            grads.div_(self.cross.size)

    # -- CarriedState ---------------------------------------------------------------------------
    def end_step(self, applied: bool) -> str | None:
        """After every inner step (applied or skipped: the schedule counts steps)."""
        self.steps += 1
        if self.steps <= self.s.warmup:   # one job so far: the global parameters are its, in every group
            for f in range(self.s.fragments):
                self.glob[f].copy_(self.local(f))
            return None
        self.since = [n + 1 for n in self.since]
        notes = [self._merge(x) for x in self.pending if x.merge_at == self.steps]
        self.pending = [x for x in self.pending if x.merge_at > self.steps]
        for f in self.due(self.steps):
            x = self.start(self.cross.open(self.steps, f, self.since[f]))
            if x is None:   # nobody to exchange with at this step (a fault-tolerant group cut off)
                continue
            self.in_flight_peak = max(self.in_flight_peak, x.nbytes() + sum(p.nbytes() for p in self.pending))
            if self.s.delay:
                self.pending.append(x)
            else:
                notes.append(self._merge(x))
        return "; ".join(n for n in notes if n) or None

    def start(self, opened) -> Exchange | None:
        """Issue the exchange the members agreed on (parallel/membership.py Opened); None if none."""
        self.steps = opened.steps   # a group that joined the others' exchange takes their inner step
        if opened.fragment == JOINING:
            if opened.quorum:
                self.cross.commit()
            return None
        f = opened.fragment
        local, g = self.local(f), self.glob[f]
        mine = g - local
        x = Exchange(f, self.steps + self.s.delay, mine=mine, size=opened.size, weighted=opened.scale is not None)
        if self.err is None:   # the locals, summed over the groups
            x.buf = local if opened.scale is None else local.mul_(opened.scale)
            x.work = self.cross.all_reduce(x.buf, PHASE)
            return x
        send = mine + self.err[f]   # topk2: err is 0 between exchanges (the rest is in my masters)
        wire, sent = encode_outer(send, self.s)
        x.buf, x.wire = torch.empty(opened.size, wire.numel(), dtype=torch.uint8, device=wire.device), wire
        x.work = self.cross.all_gather(x.buf, wire, PHASE)
        x.error = send.sub_(sent)
        return x

    def _outer_step(self, x: Exchange):
        """Wait for `x` and step the outer state of its fragment (collective over my group)."""
        if x.stepped or x.note:
            return
        x.work.wait()
        f, g, n = x.fragment, self.glob[x.fragment], x.size
        if not self.cross.commit():   # a member failed during the exchange: every group skips it
            x.work = x.buf = x.wire = None
            x.note = f"exchange of fragment {f} not committed (a group failed during it): skipped"
            return
        self.since[f], self.joined = 0, True
        if x.error is None:
            mean = x.buf.div_(n) if n > 1 and not x.weighted else x.buf
            outer = g - mean
        else:
            outer = decode_mean(x.buf, g.numel(), n, self.s)
            mean = g - outer
        x.work = x.buf = x.wire = None
        finite, x.reseed, x.drift = group_check(self.comm, outer, x.mine)
        if not finite:   # a group diverged: every rank keeps the outer state as it was
            x.note = f"outer step of fragment {f} skipped: its outer gradient is not finite" + (
                f"; group {self.cross.rank}'s copy is not: it takes the global values" if x.reseed else "")
            return
        new = mean.add(outer, alpha=1.0 - self.s.lr)
        if self.mom is not None:
            self.mom[f].mul_(self.s.momentum).add_(outer)
            new.add_(self.mom[f], alpha=-self.s.lr * self.s.momentum)
        if self.s.quantization == "topk2":   # the merge's move of my masters: the global values' and what I sent
            self.err[f].copy_(new.sub(g).add_(x.mine).sub_(x.error))
        elif x.error is not None:
            self.err[f].copy_(x.error)
        g.copy_(new)
        x.mine = x.error = None
        x.stepped = True
        self.outer_steps += 1

    def _merge(self, x: Exchange) -> str | None:
        """The new global values of `x`'s fragment into the masters (collective over my group)."""
        self._outer_step(x)
        if x.note:   # skipped: the group whose copy went bad starts again from the global values
            if x.reseed:
                self._set_masters(x.fragment, 0.0, self.glob[x.fragment])
                self.engine.masters_changed()
            return x.note
        f, keep = x.fragment, self.s.merge_alpha if self.s.delay else 0.0   # delay 0: nothing trained it meanwhile
        if self.s.quantization == "topk2":   # what I did not send stays in my masters
            self._set_masters(f, 0.0, self.local(f).add_(self.err[f], alpha=1.0 - keep))
            self.err[f].zero_()
        else:
            self._set_masters(f, keep, self.glob[f])
        self.engine.masters_changed()
        self.drift = x.drift
        return None

    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        """My slices of the outer state, in the masters' layout (a key per parameter), with the
        outer steps of the exchanges in flight taken (collective over my group)."""
        for x in self.pending:
            self._outer_step(x)
        return {f"{KEY}.{name}.{s.name}": FlatState(part, s.numel, sharded=True, per_group=name == "error")
                for name, flat in self.flat.items()   # the groups share the global values and the momentum
                for s, part in self.layout.per_parameter(flat)}

    def scalar_state(self) -> dict:
        """With the merges to come: taken after checkpoint_state(), which steps them."""
        return {"steps": self.steps, "outer_steps": self.outer_steps, "groups": self.cross.layout_key(),
                "since": self.since, "membership": self.cross.state_dict(),
                "settings": saved_layout(self.s),
                "merges": [[x.fragment, x.merge_at, x.drift, x.note, x.reseed]
                           for x in self.pending if x.stepped or x.note]}

    def carried(self, saved: dict | None) -> bool:
        return (saved is not None and saved.get("groups") == self.cross.layout_key()
                and saved.get("settings") == saved_layout(self.s))

    def load_scalar_state(self, saved: dict | None) -> str | None:
        self.drain()
        if self.carried(saved):
            self.steps, self.outer_steps = saved["steps"], saved["outer_steps"]
            self.since = saved.get("since", self.since)
            self.cross.load_state_dict(saved.get("membership"))
            self.pending = [Exchange(f, at, stepped=note is None, drift=drift, note=note, reseed=bool(rest and rest[0]))
                            for f, at, drift, note, *rest in saved.get("merges", [])]
            return None
        for f in range(self.s.fragments):   # the global parameters: the mean of the groups' loaded masters,
            self.glob[f].copy_(self.local(f))   # the same in every group (the outer step assumes it)
            if self.cross.size > 1 and not self.cross.fault_tolerant:   # (torchft: a heal replaces them)
                self.cross.all_reduce(self.glob[f], PHASE, async_op=False)
                self.glob[f].div_(self.cross.size)
        for state in (self.mom, self.err):
            for t in state or []:
                t.zero_()
        return "outer state (global parameters, outer momentum, error feedback) reset: saved by another layout"

    def memory(self) -> MemoryLine:
        tensors = list(self.flat.values())
        psi = sum(s.numel for s in self.engine.shards)
        return MemoryLine(KEY, "optimizer", tensors, sum(t.numel() * 4 for t in tensors) / max(psi, 1))

    def peak_buffers(self) -> dict:
        return {"outer_exchange_peak": self.in_flight_peak,
                "outer_exchange_bound": in_flight_bound([g.numel() for g in self.glob], self.s, self.cross.size)}

    def plan_step(self) -> list[PlannedCollective]:
        return [exchange_per_step(sum(g.numel() for g in self.glob), self.s)]

    def drain(self) -> int:
        """Complete the exchanges in flight, neither stepped nor merged (the end of training: a
        run resumed from the last checkpoint takes them again)."""
        for x in self.pending:
            if x.work is not None:
                x.work.wait()
        n, self.pending = len(self.pending), []
        return n

    def summary(self) -> str | None:
        """The end of training: the exchanges in flight complete, unapplied, as at a checkpoint."""
        unmerged = self.drain()
        return (f"outer synchronization: {self.outer_steps} outer steps (fragment exchanges) over {self.cross.size} "
                f"groups (every {self.s.interval} inner steps, {self.s.fragments} fragment(s), "
                f"{self.s.quantization} outer gradients)"
                + (f"; {unmerged} exchange(s) not merged at the end (a resume merges them)" if unmerged else ""))


def attach(engine, cross, settings: OuterSettings) -> OuterSync:
    """Make `engine` (a sharded engine over one group) synchronize across the groups: `cross` is a
    membership (parallel/membership.py) or the Partition of the same rank in every group of this job."""
    if not hasattr(engine, "masters_changed"):
        raise ConfigError("--outer-sync-interval needs ZeRO stage 1-3 over groups of more than one rank; "
                          "pass --zero-stage 3 and a --group-size of at least one node of 2+ ranks")
    if isinstance(cross, Partition):
        cross = FixedGroups(engine.comm, cross.group, cross.size, cross.rank)
    sync = OuterSync(engine, cross, settings)
    if settings.warmup:
        engine.parts.gradient_hooks.append(sync.average_gradients)
    engine.parts.carried[KEY] = sync   # last: after the techniques' parts commit their step
    return sync
