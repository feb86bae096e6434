"""The collectives one training iteration issues, and the bytes each rank sends.

The engine's own parts say what they send: `zeropp.build.plan_parts` builds, on the meta
device and without process groups, the weight sources, gradient reduction and carried parts
the engine would build for the job (the techniques of the registry, zeropp/techniques), and
each answers `plan()` with its collectives (zeropp/collectives/protocols.py
`PlannedCollective`); the buckets and orders come from the engine's schedule functions
(zeropp/stages/schedule.py: `live_budget`, `gather_buckets`, `backward_order`, `reuse_set`;
zeropp/collectives/partition.py: `gradient_buckets`). Each rank's bytes, intra- and
inter-node, come from `parallel.comm.wire_bytes`, the Communicator's own charge model (NCCL
rings; all-to-all direct). Where one collective stands in for another (on gloo the plain
reduce-scatter goes as the all-to-all of its rows, collectives/exact.py) the bytes counted are
the one charged, as the Communicator counts them, and `issued_bytes` those sent, which the time
model follows. What this module keeps is the steady state: which source a gather reads from in
a step after the first.

Per iteration (A = gradient accumulation steps, micro-step m = 0..A-1):
- forward_gather, per micro-step, one all-gather per schedule bucket of T
  elements (sum of the weights' chunks): S = T w bytes over all W ranks
  (qwZ: S = wire_nbytes(T, 8, block): INT8 + an fp32 scale per block; T
  elements quantized, W T dequantized); with
  hpZ, micro-steps m > 0 gather the secondary partition inside the group of
  h ranks (S = sum of secondary chunks x w);
  weight deltas (with hpZ), micro-step 0: S = sum of wire_nbytes(chunk,
  bits (4 or 2), 128) over the bucket's weights among the W/h ranks at my index in their
  hpZ group ("strided"), then those W/h rows and the previous weights'
  secondary slices inside the hpZ group (the steady state: a full gather every
  refresh_interval steps and after a load is left out);
- backward_gather, per micro-step, the weights backward needs that were not
  held from forward, bucketed the same way (hpZ: always the secondary
  partition, inside the node);
- grad_reduce, per micro-step (stage 1: the last only), one collective per
  gradient bucket of T elements: reduce-scatter, S = T c bytes (c = bytes of
  the communication dtype; on gloo sent as an all-to-all of W S, charged as the
  ring); qgZ: all-to-all of L x wire_nbytes(N P, 4, block)
  inside the node, then of N x wire_nbytes(P, 4, block) between nodes, P = T
  padded to whole blocks; (2W + N) P elements through the INT4 kernels;
- optimizer: an all-reduce of the 8-byte squared gradient norm (weight deltas:
  and of a 4-byte flag per partitioned weight), then the
  persistent weights (stage 3) or all weights (stages 1-2) all-gathered in
  allgather_bucket_size buckets.
Stage 0 (zeropp.stages.stage0.DDPEngine, torch DDP): grad_reduce is one all-reduce
per DDP bucket, S = bucket elements x c, on the last micro-step in fp32
(no_sync before it) and on every micro-step in 16-bit; nothing else (every
rank holds the whole gradient, so the norm needs no collective). The buckets
are those DDP rebuilds after its first iteration, in gradient-ready order
(reverse parameter order here): 1 MiB first, then DDP_BUCKET_MB, each closed
once it reaches its limit.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from parallel.comm import wire_bytes
from parallel.topology import Topology
from zeropp.config import ZeroConfig
from zeropp.build import PlannedParts, plan_parts
from zeropp.collectives.protocols import PlannedCollective as Collective
from zeropp.stages.stage0 import DDP_BUCKET_MB
from zeropp.collectives.partition import bucketize, gradient_buckets
from zeropp.stages.schedule import backward_order, gather_buckets, live_budget, reuse_set, without

PHASES = ("forward_gather", "backward_gather", "grad_reduce", "optimizer")


@dataclass
class Step:
    """Every collective of one iteration, in issue order per phase."""
    collectives: list[Collective] = field(default_factory=list)
    parts: PlannedParts | None = None        # the engine's parts, which said what they send (and keep)
    held: set = field(default_factory=set)   # weights held from forward to backward
    forward_buckets: list = field(default_factory=list)
    backward_buckets: list = field(default_factory=list)
    gradient_buckets: list = field(default_factory=list)


def iteration_collectives(shards, trace, zero: ZeroConfig, world: int, ranks_per_node: int,
                          accumulation: int, weight_bytes: int, grad_bytes: int, rank: int = 0,
                          backend: str = "nccl") -> Step:
    """The collectives of one steady-state iteration (after the first, whose
    schedules are still being recorded), on `backend`. `shards`: rank `rank`'s layout
    (planner.trace.shard_layout); sizes are the same on every rank."""
    step = Step()
    if zero.stage == 0:
        return _ddp_collectives(step, [s.numel for s in shards], accumulation, weight_bytes, grad_bytes)
    # The engine's own parts for this job (zeropp/build.py), on "meta": each says what it sends.
    dtype = {2: torch.float16, 4: torch.float32}[weight_bytes]
    topology = Topology(world, rank, ranks_per_node)
    step.parts = plan_parts(zero, topology, shards, dtype, backend)
    sources, reduction, carried = step.parts.sources, step.parts.reduction, step.parts.carried

    def add(collectives, m=0):
        step.collectives.extend(dataclasses.replace(c, micro_step=m) for c in collectives)

    def gather(bucket, phase, m, secondary):
        """Steady state: the weights' first gather of a step (micro-step 0, forward) from the primary
        partition, as deltas when they are on; hpZ's copy holds them for every later one."""
        weights = [shards[i] for i in bucket]
        if secondary:
            add(sources.secondary.plan(weights, phase), m)
        elif sources.deltas is not None and phase == "forward_gather":
            add(sources.deltas.plan(weights, phase), m)
        else:
            add(sources.primary.plan(weights, phase), m)

    hpz = sources is not None and sources.secondary is not None
    if zero.stage == 3:
        numels = [s.numel for s in shards]
        order = backward_order(trace.touch)
        budget = live_budget(zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size, numels,
                             trace.events, trace.outside)
        step.held = reuse_set(trace.events, order, numels, zero.stage3_max_reuse_distance, budget.hold,
                              pinned=trace.outside)
        step.forward_buckets = gather_buckets(trace.events, numels, budget.bucket)
        step.backward_buckets = gather_buckets(without(order, step.held), numels, budget.bucket)
    grad_buckets = [[shards[i] for i in b]
                    for b in gradient_buckets([s.chunk for s in shards], world, zero.reduce_bucket_size)]
    step.gradient_buckets = [[s.index for s in b] for b in grad_buckets]
    reduction.expect({k: sum(s.chunk for s in b) for k, b in enumerate(grad_buckets)}, topology, "meta")

    for m in range(accumulation):
        if zero.stage == 3:
            for bucket in step.forward_buckets:
                gather(bucket, "forward_gather", m, secondary=hpz and m > 0)
            for bucket in step.backward_buckets:
                gather(bucket, "backward_gather", m, secondary=hpz)
        if zero.stage == 1 and m < accumulation - 1:
            continue  # stage 1 reduces once, at the accumulation boundary
        for b in grad_buckets:
            add(reduction.plan(sum(s.chunk for s in b), grad_bytes), m)

    add([Collective("optimizer", "all_reduce", "world", 8)])   # the squared gradient norm, float64
    for part in carried.values():
        add(part.plan_step())
    published = [s for s in shards if s.persistent] if zero.stage == 3 else list(shards)
    for b in bucketize(published, lambda s: s.chunk * world, zero.allgather_bucket_size):
        add([Collective("optimizer", "all_gather", "world", sum(s.chunk for s in b) * weight_bytes)])
    return step


def ddp_buckets(numels: list[int], weight_bytes: int) -> list[list[int]]:
    """DDP's gradient buckets after its rebuild (see the module docstring)."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += numels[i] * weight_bytes
        if size >= (2**20 if not buckets else DDP_BUCKET_MB * 2**20):
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _ddp_collectives(step: Step, numels: list[int], accumulation: int, weight_bytes: int,
                     grad_bytes: int) -> Step:
    step.gradient_buckets = ddp_buckets(numels, weight_bytes)
    for m in range(accumulation):
        if weight_bytes == 4 and m < accumulation - 1:
            continue   # fp32: gradients accumulate locally until the last micro-step
        for b in step.gradient_buckets:
            step.collectives.append(Collective("grad_reduce", "all_reduce", "world",
                                               sum(numels[i] for i in b) * grad_bytes, micro_step=m))
    return step


@functools.lru_cache(maxsize=None)
def _group(kind: str, world: int, ranks_per_node: int, hpz: int, rank: int) -> tuple[int, ...]:
    topo = Topology(world_size=world, rank=rank, ranks_per_node=ranks_per_node)
    if kind == "world":
        return tuple(range(world))
    if kind == "secondary":
        return tuple(topo.subgroup_ranks(hpz))
    if kind == "strided":
        return tuple(range(rank % hpz, world, hpz))
    if kind == "intra":
        return tuple(topo.node_ranks(topo.node))
    return tuple(topo.peer_ranks(topo.local_rank))


@functools.lru_cache(maxsize=None)
def rank_bytes(c_op: str, group: tuple[int, ...], rank: int, nbytes: int, ranks_per_node: int) -> tuple[int, int]:
    """(intra, inter) bytes `rank` sends: parallel.comm.wire_bytes, cached."""
    return wire_bytes(c_op, list(group), rank, nbytes, lambda r: r // ranks_per_node)


def collective_bytes(c: Collective, world: int, ranks_per_node: int, hpz: int, rank: int) -> tuple[int, int]:
    """(intra, inter) bytes `rank` is charged for `c` (what CommStats.by_phase counts)."""
    return rank_bytes(c.op, _group(c.group, world, ranks_per_node, hpz, rank), rank, c.nbytes, ranks_per_node)


def issued_bytes(c: Collective, world: int, ranks_per_node: int, hpz: int, rank: int) -> tuple[int, int]:
    """(intra, inter) bytes `rank` puts on the wire for `c`: those of the collective sent in its
    place, if any (the all-to-all of a reduce-scatter's rows: `nbytes` to each member), else its
    own (CommStats.issued_inter_node_bytes counts the inter-node ones)."""
    if not c.sent_as:
        return collective_bytes(c, world, ranks_per_node, hpz, rank)
    group = _group(c.group, world, ranks_per_node, hpz, rank)
    return rank_bytes(c.sent_as, group, rank, c.nbytes * len(group), ranks_per_node)


def bytes_by_phase(step: Step, world: int, ranks_per_node: int, hpz: int, rank: int) -> dict[str, list[int]]:
    """{phase: [intra, inter]} bytes `rank` sends in one iteration, as the
    Communicator's CommStats.by_phase would count them."""
    out = {p: [0, 0] for p in PHASES}
    for c in step.collectives:
        intra, inter = collective_bytes(c, world, ranks_per_node, hpz, rank)
        out[c.phase][0] += intra
        out[c.phase][1] += inter
    return out
