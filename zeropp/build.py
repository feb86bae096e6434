"""The one place an engine is composed: from (config, topology) it creates the process groups,
builds each part once, in one order on every rank, and hands them to the engine
(zeropp/stages/sharded.py). The techniques come from the registry (zeropp/techniques), each
filling its slot; nothing here names one.

Stage 1/2: the weights whole (`FullWeights`); stage 3: partitioned (`PartitionedWeights`) with
the weight sources the techniques add, and the hooks that order the gathers. Every stage: fp32
masters and optimizer (`Masters`), the gradient reducer over the reduction the techniques chose.
Parameters may arrive on the meta device: each is materialized whole (`param_init`), sliced into
what this rank keeps and dropped before the next one (zeropp/stages/init.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import Communicator
from zeropp import techniques
from zeropp.techniques import hpz
from zeropp.collectives.exact import GradientReducer, ShardGather, ShardReduce
from zeropp.collectives.partition import Partition, ShardedParam
from zeropp.stages.engine import communication_dtype, compute_dtype, make_optimizer
from zeropp.stages.init import full_value, materialize_rest
from zeropp.stages.masters import Masters
from zeropp.stages.sharded import ShardedEngine, ShardedParts
from zeropp.stages.stage3.gathers import WeightGathers
from zeropp.stages.stage3.hooks import Stage3Hooks
from zeropp.stages.stage3.param import GatheredWeights, PrimaryWeights, Stage3Param
from zeropp.stages.stage3.weights import PartitionedWeights, WeightSources, place_weights
from zeropp.stages.stage12 import AccumulatedGradients, FullWeights, ImmediateGradients


class ProcessGroups:
    """Every group the parts communicate over, created here, in one order on every rank
    (parallel/topology.py). Weight gathers use the world; gradient reductions a second world
    group (`gradient`), so a reduction never queues behind a gather; qgZ the node groups;
    hpZ a group inside the node, the weight deltas two of their own."""

    def __init__(self, topo, zero, create: bool = True):
        """`create=False`: the layouts only, no process group (the planner's parts)."""
        self.world = Partition(group=None, size=topo.world_size, rank=topo.rank)
        self.gradient = Partition(group=topo.gradient_group, size=topo.world_size, rank=topo.rank)
        h = hpz.group_size(zero.stage, zero.zero_hpz_partition_size, topo.world_size)   # 0: none
        subgroup = topo.build_subgroup if create else (lambda size: None)
        self.hpz = Partition(group=subgroup(h), size=h, rank=topo.rank % h) if h else None
        self.deltas_across = self.deltas_within = None
        if h and zero.zero_quantized_weight_deltas:
            strided = topo.build_strided_group(h) if create else None
            self.deltas_across = Partition(group=strided, size=topo.world_size // h, rank=topo.rank // h)
            self.deltas_within = Partition(group=subgroup(h), size=h, rank=topo.rank % h)


def build_sharded_engine(module, config, comm, device, optim, gradient_accumulation_steps: int,
                         param_init=None) -> ShardedEngine:
    """ZeRO stages 1-3 for `module`, composed of parts."""
    zero, dtype = config.zero_optimization, compute_dtype(config)
    groups = ProcessGroups(comm.topology, zero)
    stage3 = zero.stage == 3
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    shards = [(Stage3Param if stage3 else ShardedParam)(i, n, p, groups.world) for i, (n, p) in enumerate(named)]
    # Untrained parameters and buffers are materialized whole, in the compute dtype.
    materialize_rest(module, param_init, device, dtype, skip={id(s.param) for s in shards})
    trained = {id(s.param) for s in shards}
    for p in module.parameters():
        if id(p) not in trained:
            p.data = p.data.to(device=device, dtype=dtype)
    for b in module.buffers():
        b.data = b.data.to(device)

    masters = Masters(shards, dtype, device)
    exact = ShardGather(comm)   # state dicts, stage 1/2 weights, persistent weights, evaluation
    ctx = techniques.BuildContext(zero, comm, groups, dtype, device, weights=[], flat=None)
    gathered = GatheredWeights()
    if stage3:
        flat = place_weights(shards, zero.stage3_param_persistence_threshold, groups.hpz, dtype, device, gathered)
        ctx.weights, ctx.flat = [s for s in shards if not s.persistent], flat
    techniques.fill_slots(ctx)
    if stage3:
        weights = PartitionedWeights(shards, ctx.flat, _sources(ctx, exact, groups.world), exact, groups.world,
                                     zero.allgather_bucket_size, zero.stage3_prefetch_bucket_size)
    else:
        weights = FullWeights(shards, exact, groups.world, dtype, device, zero.allgather_bucket_size)
    for s in shards:  # one full parameter alive at a time
        full = full_value(s.name, s.param, param_init, device).view(-1)
        weights.adopt(s, full)
        masters.adopt(s, full, weights.weight_slice(s))
        del full
    owned = masters.owned
    masters.optimizer = make_optimizer(optim, device, [s.master for s in owned if s.decay],
                                       [s.master for s in owned if not s.decay])

    pre, post = config.gradient_scale_factors(groups.world.size)
    reduction = ctx.gradient_reduction or ShardReduce(comm)
    reducer = GradientReducer(reduction, shards, groups.gradient, zero.reduce_bucket_size,
                              communication_dtype(config), device, zero.overlap, pre=pre, post=post)
    reducer.pool.budget = reducer.buffers_bound()
    reduction.expect({b.index: b.total for b in reducer.buckets}, comm.topology, device)
    carried = _carried(ctx, reduction)
    hooks = None
    if stage3:
        hooks = Stage3Hooks(module, {id(s.param): s for s in shards}, WeightGathers(weights, gathered, zero, module))
        weights.pool.budget = weights.gather_bound(hooks.module_weights.values())
        gradients = ImmediateGradients(reducer, released=hooks.gathers.release)
    elif zero.stage == 2:
        gradients = ImmediateGradients(reducer)
    else:
        gradients = AccumulatedGradients(reducer, shards, dtype)
    parts = ShardedParts(groups.world, shards, weights, masters, reducer, gradients, exact, hooks, carried=carried)
    return ShardedEngine(module, config, comm, device, optim, gradient_accumulation_steps, parts)


@dataclass
class PlannedParts:
    """The parts `plan_parts` builds: each says what it sends (`plan`), keeps (`memory_lines`,
    `memory`; LoCo's errors once the reduction `expect`s the gradient buckets) and saves."""
    sources: WeightSources | None     # stage 3's weight sources
    reduction: object                 # the gradient reduction
    carried: dict                     # the carried parts, by scalar-state key


def plan_parts(zero, topology, shards: list, dtype, backend: str = "nccl") -> PlannedParts:
    """The weight sources (stage 3), gradient reduction and carried parts `build_sharded_engine`
    builds for this rank's `shards` (laid out by planner/trace.py's shard_layout), on the meta
    device and with no process group, for a job on `backend` (gloo: the plain reduce-scatter goes
    by an all-to-all, collectives/exact.py): the planner asks them for their collectives and memory."""
    comm = Communicator(topology)
    groups = ProcessGroups(topology, zero, create=False)
    ctx = techniques.BuildContext(zero, comm, groups, dtype, torch.device("meta"), weights=[], flat=None)
    if zero.stage == 3:
        ctx.flat = place_weights(shards, zero.stage3_param_persistence_threshold, groups.hpz, dtype, "meta",
                                 GatheredWeights())
        ctx.weights = [s for s in shards if not s.persistent]
    techniques.fill_slots(ctx)
    reduction = ctx.gradient_reduction or ShardReduce(comm, by_all_to_all=backend == "gloo")
    sources = _sources(ctx, ShardGather(comm), groups.world) if zero.stage == 3 else None
    return PlannedParts(sources, reduction, _carried(ctx, reduction))


def _carried(ctx, reduction) -> dict:
    """The parts carrying state from step to step (protocols.CarriedState), by scalar-state key."""
    return {**reduction.carried_parts(), **(ctx.weight_deltas.carried_parts() if ctx.weight_deltas is not None else {})}


def _sources(ctx, exact: ShardGather, world: Partition) -> WeightSources:
    """The primary partition gathers with the weight-gather technique's collective (or exactly)
    and hands what arrives to the deltas or hpZ's partition to keep; evaluation gathers exactly,
    and keeps what arrives there too (marked exact: its later batches read it inside the node)."""
    keeper = ctx.weight_deltas or ctx.secondary
    primary = PrimaryWeights(world, ctx.flat, ctx.weight_gather or exact, keeper, exact=ctx.weight_gather is None)
    quantized = ctx.weight_gather is not None or ctx.weight_deltas is not None
    zero = ctx.zero   # any quantized path on: its kernels' scratch (the largest block)
    block = (max(zero.zero_quantized_weights_block_size, zero.zero_quantized_gradients_block_size)
             if quantized or ctx.gradient_reduction is not None else 0)
    return WeightSources(primary, PrimaryWeights(world, ctx.flat, exact, keeper) if quantized else None,
                         ctx.secondary, ctx.weight_deltas, block)
