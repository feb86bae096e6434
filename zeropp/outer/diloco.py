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

from dataclasses import dataclass
from typing import Protocol

import torch

from parallel.membership import JOINING, FixedGroups
from zeropp.collectives.partition import FlatState, Partition
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.config import ConfigError
from zeropp.outer.fragments import FragmentLayout, StepsSince, fragment_bounds  # noqa: F401 (the planner's)
from zeropp.outer.settings import DRIFT, GLOBAL, KEY, PHASE, WARMUP, OuterSettings, saved_layout  # noqa: F401
from zeropp.outer.wire import decode_mean, decode_weighted, encode_outer, exchange_per_step, in_flight_bound  # noqa: F401

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
    weights: list | None = None   # int4, topk2: each member's weight when they are not equal
    counted: bool = True          # my values are in it (a member that joins or is behind has weight 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf, self.mine, self.error, self.wire) if t is not None)


def group_check(cross, outer: torch.Tensor, mine: torch.Tensor) -> tuple[bool, bool, float]:
    """Whether `outer` is finite on every shard of my group (so all its ranks agree, and the
    other groups too: they hold the same outer gradient), whether my group's own outer
    gradient `mine` is not (its copy went bad), and the RMS of `outer - mine` over them."""
    diff = outer - mine
    sums = torch.stack([diff.square().sum().nan_to_num(), diff.new_tensor(float(diff.numel())),
                        (~torch.isfinite(outer)).any().float(), (~torch.isfinite(mine)).any().float()])
    cross.group_sum(sums)
    return sums[2].item() == 0, sums[3].item() > 0, (sums[0] / sums[1].clamp(min=1)).sqrt().item()


def nesterov(mean: torch.Tensor, outer: torch.Tensor, mom: torch.Tensor | None, s: OuterSettings) -> torch.Tensor:
    """The new global values from the members' `mean` and the outer gradient `outer` = g - mean
    (Nesterov: m <- mu m + outer, g <- g - lr (outer + mu m), written from the mean so that lr 1,
    mu 0 give the mean exactly); `mom` (a fragment's momentum) is updated in place."""
    new = mean.add(outer, alpha=1.0 - s.lr)
    if mom is not None:
        mom.mul_(s.momentum).add_(outer)
        new.add_(mom, alpha=-s.lr * s.momentum)
    return new


class OuterFace(Protocol):
    """What the trainer (training/outer.py) reads of an engine's `outer`: the iteration it is at
    (an exchange may move it: a heal, the final round), the outer steps taken, the groups' drift,
    the last inner step whose work is in the global model, its membership (`cross`: fault
    tolerant or not, group id, quorum status) and settings (`s`), and the log's lines."""
    steps: int
    outer_steps: int
    drift: float
    counted_through: int


class OuterSync:
    """The outer loop of one rank, a carried part of its engine (zeropp/collectives/protocols.py
    CarriedState): `end_step` counts the inner steps, issues the exchanges and merges them."""

    def __init__(self, engine, cross, settings: OuterSettings):
        # cross: who takes part in an exchange (parallel/membership.py)
        self.engine, self.cross, self.s = engine, cross, settings
        self.comm = engine.comm
        self.layout = FragmentLayout(engine.shards, settings.fragments, engine.device)
        self.owned, self.local, self._set_masters = self.layout.owned, self.layout.local, self.layout.set
        self.flat = {"global": self.layout.local_all()}
        if settings.momentum:
            self.flat["momentum"] = torch.zeros_like(self.flat["global"])
        if settings.quantization != "none":
            self.flat["error"] = torch.zeros_like(self.flat["global"])
        self.glob, self.mom, self.err = (self.layout.views(self.flat.get(k)) for k in ("global", "momentum", "error"))
        self.steps = self.outer_steps = 0
        self.since = StepsSince(settings.fragments)   # inner steps trained since each fragment's last exchange
        self.pending: list[Exchange] = []
        self.joined = not cross.fault_tolerant   # in an exchange since this process started
        self.drift = float("nan")   # of the last merged exchange
        self.in_flight_peak = 0     # bytes (Exchange.nbytes) of the exchanges in flight at once
        self.counted_through = 0    # the last inner step whose work is in a committed exchange with my weight

    def due(self, step: int) -> list[int]:
        """The fragments exchanged after inner step `step` (1, 2, ...)."""
        return list(self.s.due(step))

    # -- CarriedState ---------------------------------------------------------------------------
    def end_step(self, applied: bool) -> str | None:
        """After every inner step (applied or skipped: the schedule counts steps)."""
        self.steps += 1
        if self.steps <= self.s.warmup:   # one job so far: the global parameters are its, in every group
            for f in range(self.s.fragments):
                self.glob[f].copy_(self.local(f))
            return None
        self.since.tick()
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
        x = Exchange(f, self.steps + self.s.delay, mine=mine, size=opened.size, weighted=opened.scale is not None,
                     weights=None if opened.equal_weights() else opened.weights, counted=opened.scale != 0)
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
        if x.counted:
            self.counted_through = max(self.counted_through, x.merge_at - self.s.delay)
        if x.error is None:
            mean = x.buf.div_(n) if n > 1 and not x.weighted else x.buf
            outer = g - mean
        else:
            outer = decode_mean(x.buf, g.numel(), n, self.s) if x.weights is None else \
                decode_weighted(x.buf, g.numel(), x.weights, self.s)
            mean = g - outer
        x.work = x.buf = x.wire = None
        finite, x.reseed, x.drift = group_check(self.cross, outer, x.mine)
        if not finite:   # a group diverged: every rank keeps the outer state as it was
            x.note = f"outer step of fragment {f} skipped: its outer gradient is not finite" + (
                f"; group {self.cross.rank}'s copy is not: it takes the global values" if x.reseed else "")
            return
        new = nesterov(mean, outer, None if self.mom is None else self.mom[f], self.s)
        if self.s.quantization == "topk2":   # the merge's move of my masters: the global values' and what I sent
            self.err[f].copy_(new.sub(g).add_(x.mine).sub_(x.error) if x.counted else new.sub(g))
        elif x.error is not None and x.counted:   # (a member of weight 0 sent nothing: its error stays)
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
                "since": self.since.as_list(), "membership": self.cross.state_dict(),
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
            if "since" in saved:
                self.since.load(saved["since"])
            self.cross.load_state_dict(saved.get("membership"))
            self.pending = [Exchange(f, at, stepped=note is None, drift=drift, note=note, reseed=bool(rest and rest[0]))
                            for f, at, drift, note, *rest in saved.get("merges", [])]
            return None
        g = self.flat["global"]   # the global parameters: the mean of the groups' loaded masters,
        g.copy_(self.layout.local_all())   # the same in every group (the outer step assumes it)
        if self.cross.size > 1 and not self.cross.fault_tolerant:   # (torchft: a heal replaces them)
            for part in self.glob:
                self.cross.all_reduce(part, PHASE, async_op=False)
            g.div_(self.cross.size)
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
                "outer_exchange_bound": in_flight_bound(self.glob.numels(), self.s, self.cross.size)}

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


def average_gradients(sync: OuterSync, grads: torch.Tensor):
    """The warm-up: my reduced gradient shard averaged over the groups (the engine's hook)."""
    if sync.steps < sync.s.warmup:
        sync.cross.all_reduce(grads, WARMUP, async_op=False)
        grads.div_(sync.cross.size)


def attach(engine, cross, settings: OuterSettings, kind=OuterSync) -> OuterSync:
    """Make `engine` (a sharded engine over one group) synchronize across the groups: `cross` is a
    membership (parallel/membership.py) or the Partition of the same rank in every group of this job;
    `kind` the synchronous OuterSync or zeropp/outer/asynchronous.py's AsyncOuterSync."""
    if not hasattr(engine, "masters_changed"):
        raise ConfigError("--outer-sync-interval needs ZeRO stage 1-3 over groups of more than one rank; "
                          "pass --zero-stage 3 and a --group-size of at least one node of 2+ ranks")
    if isinstance(cross, Partition):
        cross = FixedGroups(engine.comm, cross.group, cross.size, cross.rank)
    sync = kind(engine, cross, settings)
    if settings.warmup:
        engine.parts.gradient_hooks.append(lambda grads: average_gradients(sync, grads))
    engine.parts.carried[KEY] = sync   # last: after the techniques' parts commit their step
    engine.outer = sync   # the trainer's face (OuterFace): it never looks into the engine's parts
    return sync
