"""The collectives the FSDP2 plug-in (zeropp/fsdp/apply.py) gives FSDP2 through its public comm hooks:
`NodeAwareGather` for `set_custom_all_gather`, one `UnitReduce` per FSDP unit for
`set_custom_reduce_scatter`."""
from __future__ import annotations

import math

import torch
from torch.distributed import ReduceOp

from common.torch_private import (divide_factor, group_params, in_backward, reads_of_reduction, reduces_unused,
                                  replica_all_reduce_on, sharded_param, unsharded_param)
from zeropp.collectives.exact import ShardGather
from zeropp.collectives.partition import Partition
from zeropp.fsdp.plugin import Issued, PluginError


class NodeAwareGather:
    """FSDP2's `AllGather` comm: qwZ (or exact) over a group that spans nodes, exact over one
    inside a node (hpZ's post-forward group), exact for a tensor that is not floating point (an
    extension's packed bytes). Bytes are booked by pass: forward or backward."""

    def __init__(self, plugin, across):
        self.plugin, self.across, self.exact = plugin, across, ShardGather(plugin.comm)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.plugin.progress()
        n = output_tensor.numel() // input_tensor.numel()
        exact = (self.plugin.inside_node(group) or self.plugin.exact_gathers
                 or not input_tensor.is_floating_point())
        gather = self.exact if exact else self.across
        phase = "backward_gather" if in_backward() else "forward_gather"
        world = self.plugin.topology.world_size
        # hpZ's gather inside the node stands in for plain FSDP2's over the world, which crosses nodes
        stands_in = self.plugin.hpz and n < world and self.plugin.inside_node(group)
        if stands_in:
            per_rank = output_tensor.numel() // world * input_tensor.element_size()
            self.plugin.comm.charge_plain("all_gather", None, per_rank)
        work = gather.start(input_tensor, Partition(group, n, -1), phase, async_op=True,
                            out=output_tensor.view(n, input_tensor.numel()), plain=not stands_in)
        if async_op:
            return Issued(work)
        work.wait()
        return None


class UnitReduce:
    """FSDP2's `ReduceScatter` comm for one FSDP unit (its one parameter group). It knows which of
    the unit's parameters a reduction holds (those that got a gradient: a hook on each gathered
    parameter marks it), so LoCo keeps one error per set of parameters reduced: the unit's
    trainable parameters under the unit's index, any other set under its own name."""

    def __init__(self, plugin, key: int, group, world: int):
        self.plugin, self.key, self.group = plugin, key, group
        self.fsdp_params = group_params(group)
        self.params = [sharded_param(p) for p in self.fsdp_params]
        self.numels = [shard_numel(p, world) for p in self.params]
        self.trained = tuple(i for i, p in enumerate(self.params) if p.requires_grad)
        self.marked: set[int] = set()
        self.reads: list[str] | None = None   # what read the last reduction at once (None: none yet)
        self._watched: dict[int, torch.Tensor] = {}
        self._kept = False   # HSDP: FSDP2 kept this reduction to add to the next (no all-reduce)
        self._named: set = set()

    @property
    def trained_numel(self) -> int:
        return sum(self.numels[i] for i in self.trained)

    def watch(self, *_):
        """After the unit's forward (its parameters gathered): mark each gathered parameter when
        autograd accumulates its gradient."""
        for i, fsdp_param in enumerate(self.fsdp_params):
            p = unsharded_param(fsdp_param)
            if p is not None and p.requires_grad and id(p) not in self._watched:
                # the hook holds the set, not self: self holds p, and a cycle through a tensor's
                # hooks is one Python's collector cannot see (the model and its groups would leak)
                p.register_post_accumulate_grad_hook(lambda _, i=i, marked=self.marked: marked.add(i))
                self._watched[id(p)] = p

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=ReduceOp.SUM, async_op: bool = False):
        plugin = self.plugin
        world, shards = plugin.partition.size, plugin.shards
        if input_tensor.numel() != shards * output_tensor.numel():
            raise PluginError(f"apply_zeropp: FSDP2 reduced over {input_tensor.numel() // output_tensor.numel()} "
                              f"ranks, not the {shards} its mesh shards over: apply it to a model sharded on one mesh")
        factor = divide_factor(self.group)
        scaled = op not in (ReduceOp.SUM, ReduceOp.AVG)   # set_gradient_divide_factor: a pre-multiplied sum
        if scaled and factor is None:
            raise PluginError(f"apply_zeropp's reduction sums or averages; FSDP2 asked for "
                              f"{getattr(op, 'name', type(op).__name__)}: reduce with SUM or AVG")
        plugin.check_committed()
        plugin.progress()
        reduced = self.reduced(output_tensor.numel())
        key = self.error_key(reduced, output_tensor.numel()) if plugin.carried else self.key
        if plugin.reduction is None or plugin.replicas:   # FSDP2's own reduce-scatter, counted (gloo has no
            # pre-multiplied sum); on HSDP it stays inside the node and the replicas' all-reduce follows
            work = plugin.comm.reduce_scatter(output_tensor, input_tensor, op=ReduceOp.SUM if scaled else op,
                                              group=group, async_op=True, phase="grad_reduce")
            divisor = factor if scaled else 1
        else:
            work = plugin.reduction.start(input_tensor.view(world, output_tensor.numel()), output_tensor,
                                          plugin.partition, "grad_reduce", async_op=True, key=key)
            divisor = factor if scaled else (world if op == ReduceOp.AVG else 1)
        plugin.reducing = (output_tensor, key)
        self.reads = self.readers(output_tensor, op)
        plugin.issued(work, output_tensor, divisor, later=plugin.overlap and not self.reads)
        return None

    def readers(self, output_tensor, op) -> list[str]:
        """What reads this reduction's output before backward ends: then it completes at once.
        Otherwise FSDP2 only makes views of it (a new gradient, same dtype, nothing to divide)."""
        reads = reads_of_reduction(self.group)
        if op != ReduceOp.AVG:
            reads.append("FSDP2's division after a sum")
        if output_tensor.dtype != self.params[0].dtype:
            reads.append("a dtype conversion")
        if any(p.grad is not None for p in self.params):
            reads.append("gradient accumulation")
        if self.plugin.replicas is not None:   # HSDP: FSDP2 adds a kept shard to the next one
            kept, self._kept = self._kept, not replica_all_reduce_on(self.group)
            if kept or self._kept:
                reads.append("set_requires_all_reduce(False)")
        return reads

    def reduced(self, numel: int) -> tuple[int, ...] | None:
        """The indices of the parameters this reduction holds (FSDP2 reduces those that got a
        gradient, or every trainable one with `set_reduce_scatter_unused_params`); None if the
        marks do not add up to the reduction's size."""
        marked = tuple(sorted(self.marked))
        self.marked.clear()
        if sum(self.numels[i] for i in marked) == numel:
            return marked
        if reduces_unused(self.group) and self.trained_numel == numel:
            return self.trained
        return None

    def error_key(self, reduced: tuple[int, ...] | None, numel: int):
        if reduced == self.trained:
            return self.key
        name = f"{self.key}p{'_'.join(map(str, reduced))}" if reduced is not None else f"{self.key}n{numel}"
        if name not in self._named:
            self._named.add(name)
            which = (f"{len(reduced)} of its {len(self.trained)} trainable parameters" if reduced is not None
                     else f"{numel} elements it could not attribute")
            self.plugin.new_error(name, numel, f"apply_zeropp: FSDP unit {self.key} reduced {which}: LoCo keeps "
                                               f"a separate error for that set ({name})")
        return name


def shard_dim(param) -> int:
    """The dim FSDP2 shards `param` on: 0, or what a `shard_placement_fn` chose."""
    from torch.distributed.tensor import Shard
    return next((p.dim for p in getattr(param, "placements", ()) if isinstance(p, Shard)), 0)


def shard_numel(param, world: int) -> int:
    """Elements of one rank's shard of `param` as FSDP2 reduces it: its shard dim padded to the world."""
    shape = list(param.shape)
    if shape:
        dim = shard_dim(param)
        shape[dim] = -(-shape[dim] // world)
    return math.prod(shape)
