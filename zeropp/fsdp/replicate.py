"""HSDP: the FSDP2 plug-in (zeropp/fsdp/apply.py) on a (replicate, shard) mesh whose shard
dimension is inside a node (torchtitan's `data_parallel_replicate_degree`). FSDP2 then reduces a
unit's gradients in two collectives: a reduce-scatter over the shard group, inside the node (the
plug-in's counted `UnitReduce`, zeropp/fsdp/comms.py: FSDP2's own collective), and an all-reduce of
the reduced shard over the replicate group, across nodes, in full precision: HSDP's one
cross-node collective. The weights never leave the node, so qwZ and hpZ have nothing to do.

FSDP2 has no comm hook for that all-reduce (`set_all_reduce_hook` runs after it): the plug-in
gives each unit's mesh a `ReplicaGroup` in place of its replicate group (common/torch_private.py),
whose all-reduce is `ReplicaReduce`:
- qgZ off: FSDP2's all-reduce on the replicate group itself, counted (plain HSDP's bits);
- qgZ on: the shard, zero-padded to R rows of whole quantization blocks, row a to replica a through
  qgZ's hop across nodes (`start_across` in zeropp/techniques/qgz.py: INT4, or INT2 with LoCo, and
  with LoCo each replica's row sent with its carried error, kept per set of parameters a unit
  reduces as on the 1-D path), then an all-gather of the reduced rows over the replicas, exact (the
  reduce dtype) or, by default, quantized at the same bits (with LoCo its error carried too, under
  the unit's key + "g"). Every replica, the row's owner too, takes the gathered rows, so the
  replicas' gradients, and so their weights, stay identical.

Bounds (tests/unit/fsdp/test_fsdp_hsdp.py), per element of a row a replica owns: the hop across is qgZ's with
one rank per node, at most half a step of each replica's block (sum over replicas of block max /
7 / 2 for INT4); the exact gather adds nothing; the quantized gather adds half a step of the
reduced row's own block (its block max / 7 / 2). With LoCo what a step leaves out is sent later.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from common.notes import note
from common.torch_private import hsdp_internals_problem, replicate_group, set_replicate_group
from parallel.comm import Work
from parallel.topology import Topology
from zeropp.collectives.buffer_pool import BufferPool, take_wire
from zeropp.collectives.two_hop import TwoHops
from zeropp.fsdp.plugin import Issued, PluginError
from zeropp.kernels.quant import Quantized, dequantize, quantize


def replicas_of(mesh, topology: Topology) -> int:
    """How many replicas the FSDP mesh holds: 1 on a 1-D mesh over the world, R on a (replicate,
    shard) mesh whose shard groups are consecutive ranks inside a node; anything else is one line."""
    world = topology.world_size
    order = mesh.mesh.flatten().tolist()
    if mesh.ndim not in (1, 2) or mesh.size() != world:
        raise PluginError(f"apply_zeropp shards over all {world} ranks; this model's FSDP mesh is "
                          f"{tuple(mesh.shape)}: pass fully_shard a 1-D mesh over the world or a (replicate, "
                          f"shard) mesh (HSDP)")
    if order != list(range(world)):
        raise PluginError(f"apply_zeropp's nodes are consecutive ranks; this model's FSDP mesh orders them {order}: "
                          f"pass fully_shard a mesh over ranks 0..{world - 1} in order")
    if mesh.ndim == 1:
        return 1
    replicas, shard = mesh.shape
    if shard == 1:
        raise PluginError(f"apply_zeropp on HSDP: this mesh's shard dimension has 1 rank (it replicates only): "
                          f"shard over the ranks of a node, e.g. init_device_mesh(..., ({world // topology.ranks_per_node}, "
                          f"{topology.ranks_per_node}))")
    nodes = {topology.node_of(r) for r in order[:shard]}
    if len(nodes) > 1:
        raise PluginError(f"apply_zeropp on HSDP: the shard groups of this ({replicas}, {shard}) mesh span "
                          f"{len(nodes)} nodes of {topology.ranks_per_node} ranks; shard inside a node: pass "
                          f"fully_shard a ({world // topology.ranks_per_node}, {topology.ranks_per_node}) mesh "
                          f"(or a shard dimension dividing {topology.ranks_per_node})")
    return replicas


def weights_note(quantized_weights: bool, hpz: bool):
    """On HSDP the weights are gathered inside the node only: say once that qwZ and hpZ do nothing."""
    on = [name for name, flag in (("qwZ", quantized_weights), ("hpZ", hpz)) if flag]
    if on:
        note(f"apply_zeropp on HSDP: FSDP2 gathers the weights inside the node only, so {' and '.join(on)} "
             f"{'have' if len(on) > 1 else 'has'} nothing to do; the gradient all-reduce across replicas is "
             f"what crosses nodes (qgZ and LoCo compress it)")


class ReplicaGroup(dist.ProcessGroup):
    """What FSDP2 takes for a unit's replicate group: its one call, `dist.all_reduce` of the
    reduced shard, goes to `reduce`, which issues it into the plug-in's reductions in flight (they
    complete before backward returns, or at once where something reads them: comms.UnitReduce)."""

    def __init__(self, inner, reduce: "ReplicaReduce"):
        super().__init__(inner.rank(), inner.size())
        self.inner, self.reduce = inner, reduce

    def allreduce(self, tensors, opts=None):
        self.reduce(tensors[0], opts is not None and opts.reduceOp == ReduceOp.AVG)
        return Issued(Work())


class ReplicaReduce:
    """The all-reduce of a reduced shard across the R replicas of `group` (module docstring)."""

    def __init__(self, plugin, group, exact_gather: bool, device):
        self.plugin, self.group, self.exact_gather = plugin, group, exact_gather
        self.size = group.size()
        self.pool = BufferPool(device)
        self.block = plugin.reduction.block_size if plugin.reduction is not None else 1

    def row(self, numel: int) -> int:
        """Elements of one replica's row of a shard of `numel`: whole quantization blocks."""
        return -(-numel // (self.size * self.block)) * self.block

    def error_shapes(self, key, numel: int) -> dict:
        """LoCo's errors of a set of `numel` reduced elements: the R rows it sends across, and the
        row it gathers (quantized gather only)."""
        shapes = {key: (self.size, self.row(numel))}
        if not self.exact_gather:
            shapes[f"{key}g"] = (1, self.row(numel))
        return shapes

    def __call__(self, tensor: torch.Tensor, average: bool):
        """FSDP2's all-reduce of `tensor`, the output of the unit's reduce-scatter just before (which
        refused any op but a sum or an average): a sum, or an average over the replicas. (Nothing
        raised here reaches the user: torch's c10d logger fails on a group it did not make.)"""
        plugin = self.plugin
        key, plugin.reducing = plugin.reducing[1], None
        op = ReduceOp.AVG if average else ReduceOp.SUM
        divisor = self.size if average else 1

        def start() -> Work:
            if plugin.reduction is None:   # plain HSDP's all-reduce, counted
                return plugin.comm.all_reduce(tensor, op=op, group=self.group, async_op=True, phase="grad_reduce")
            return self.start(tensor, key)
        if not plugin.chain(tensor, start, 1 if plugin.reduction is None else divisor):
            plugin.issued(start(), tensor, 1 if plugin.reduction is None else divisor, later=False)

    def start(self, tensor: torch.Tensor, key) -> Work:
        """qgZ's hop across (row a to replica a), then the gather of the reduced rows into `tensor`."""
        plugin, pool, size = self.plugin, self.pool, self.size
        numel, row = tensor.numel(), self.row(tensor.numel())
        plugin.comm.charge_plain("all_reduce", self.group, numel * tensor.element_size())
        rows = pool.take(size * row, tensor.dtype)
        rows[:numel].copy_(tensor.view(-1))
        rows[numel:].zero_()
        mine = pool.take(row, torch.float32)
        across = plugin.reduction.start_across(rows.view(size, row), mine, self.group, "grad_reduce", True, pool, key)
        pool.give(rows)   # read when the hop was issued (quantized into its wire)
        return TwoHops(across, lambda: self.gather(mine, tensor, key))

    def gather(self, mine: torch.Tensor, tensor: torch.Tensor, key) -> Work:
        pool, comm, size, row, numel = self.pool, self.plugin.comm, self.size, mine.numel(), tensor.numel()
        if self.exact_gather:
            send = mine if tensor.dtype == torch.float32 else mine.to(tensor.dtype)
            whole = pool.take(size * row, tensor.dtype)
            work = comm.all_gather(whole, send, group=self.group, async_op=True, phase="grad_reduce", plain=False)

            def exact():
                tensor.view(-1).copy_(whole[:numel])
                pool.give(whole)
                pool.give(mine)
            return Work(work, then=exact)
        reduction = self.plugin.reduction
        bits, block = reduction.bits, reduction.block_size
        send, (dest,) = take_wire(pool, 1, row, bits, block)
        errors = self.plugin.carried.get("error_feedback")
        if errors is not None:
            errors.send(f"{key}g", mine.view(1, row), [dest], pool)
        else:
            quantize(mine, bits, block, out=dest)
        pool.give(mine)
        recv = pool.take(size * send.numel(), torch.uint8)
        work = comm.all_gather(recv, send.view(-1), group=self.group, async_op=True, phase="grad_reduce", plain=False)

        def quantized():
            pool.give(send)
            rows = dequantize(Quantized.from_bytes(recv.view(size, -1), row, bits, block), torch.float32)
            tensor.view(-1).copy_(rows.view(-1)[:numel])
            pool.give(recv)
        return Work(work, then=quantized)


def check_internals(units):
    """Before anything is installed: one line if this torch lacks what HSDP's reduction reads."""
    for _, group in units:
        problem = hsdp_internals_problem(group)
        if problem:
            raise PluginError(f"apply_zeropp on HSDP: {problem}: install a torch in that range or pass "
                              f"fully_shard a 1-D mesh")


def install(plugin, units, exact_gather: bool, totals: dict, device):
    """Give every unit's mesh a ReplicaGroup (one per replicate group FSDP2 holds) and tell LoCo
    the errors to expect (`totals`: each unit's trained shard elements)."""
    reductions: dict = {}
    for _, group in units:
        inner = replicate_group(group)
        if isinstance(inner, ReplicaGroup):
            continue
        if id(inner) not in reductions:
            reductions[id(inner)] = ReplicaGroup(inner, ReplicaReduce(plugin, inner, exact_gather, device))
        set_replicate_group(group, reductions[id(inner)])
    plugin.replicas = next(iter(reductions.values())).reduce
    errors = plugin.carried.get("error_feedback")
    if errors is not None:
        shapes = {k: v for key, total in totals.items() for k, v in plugin.replicas.error_shapes(key, total).items()}
        errors.expect(shapes, plugin.topology.world_size, plugin.replicas.size, device)
