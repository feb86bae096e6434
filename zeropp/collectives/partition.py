"""How a parameter is split over a group of ranks.

Layout (DeepSpeed stage 3's, used by stages 1, 2 and 3): a parameter of n
elements is flattened and padded to a multiple of the group size N; with
chunk c = ceil(n / N), member r owns elements [r*c, (r+1)*c). The *valid*
part of that range (clipped to n) is what the member's fp32 master, optimizer
state and gradient partition hold; padding exists only inside communication
buffers (and in stage 3's 16-bit shard buffer, whose slices must all be c
long to be all-gathered).

Because every parameter is split at the same fractions, any set of
parameters goes through one collective: a bucket buffer is an [N, sum c]
matrix whose row j holds chunk j of each parameter; all-gather fills the rows
from the members, reduce-scatter hands row j (summed) to member j.

A `Partition` names the group. Stage 3 partitions weights over all ranks (the
primary partition); ZeRO++'s hpZ adds a secondary partition inside a node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn


@dataclass
class FlatState:
    """One tensor of a checkpoint, flattened to 1-D. `sharded`: this rank holds
    elements [r*c, min((r+1)*c, numel)) with c = ceil(numel / world), the
    partition layout of zeropp/collectives/partition.py (and torch.chunk's); otherwise
    `local` is the whole tensor, the same on every rank."""
    local: torch.Tensor
    numel: int
    sharded: bool
    # Several groups of nodes, each its own engine (zeropp/outer/diloco.py): each group holds its own
    # value (False: the same value in every group, saved once).
    per_group: bool = True


def as_dcp(state: dict[str, FlatState], device: torch.device, group=None, topology=None) -> dict:
    """FlatStates as DCP (torch.distributed.checkpoint) sees them: a sharded one is a DTensor
    over all ranks, Shard(0) of its flat global tensor (the partition layout is torch.chunk's).
    With the engine's `topology` one of several groups (zeropp/outer/diloco.py), each group holds its
    own state: the global tensor is the groups' tensors end to end, Shard(0) over the groups,
    then Shard(0) over each group's ranks (what all groups share: replicated over them)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: v.local for k, v in state.items()}
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if topology is not None and topology.groups > 1:
        g = topology.groups
        mesh = DeviceMesh.from_group([topology.across_group, topology.world_group], device.type,
                                     mesh=torch.arange(g * topology.world_size).view(g, topology.world_size),
                                     mesh_dim_names=("groups", "ranks"))

        def grouped(v):   # each group's own value end to end, or one value all groups share
            n, first = (g * v.numel, Shard(0)) if v.per_group else (v.numel, Replicate())
            return DTensor.from_local(v.local, mesh, [first, Shard(0)], run_check=False, shape=(n,), stride=(1,))
        return {k: grouped(v) if v.sharded else v.local for k, v in state.items()}
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the default group: no new process group
    return {k: DTensor.from_local(v.local, mesh, [Shard(0)], run_check=False, shape=(v.numel,), stride=(1,))
            if v.sharded else v.local for k, v in state.items()}


@dataclass(frozen=True)
class Partition:
    group: object      # torch.distributed process group; None = the whole world
    size: int          # members
    rank: int          # this rank's index inside the group


class ShardedParam:
    """One parameter's place in the data-parallel partition: its layout, its
    fp32 master slice and its fp32 gradient partition (views into flat buffers
    the engine owns)."""

    def __init__(self, index: int, name: str, param: nn.Parameter, partition: Partition):
        self.index = index
        self.name = name
        self.param = param
        self.shape = param.shape
        self.numel = n = param.numel()
        self.chunk = c = max(1, -(-n // partition.size))
        self.lo, self.hi = min(partition.rank * c, n), min((partition.rank + 1) * c, n)
        self.valid = self.hi - self.lo
        self.decay = param.ndim >= 2                 # weight decay on matrices only
        self.master: torch.Tensor | None = None      # fp32, `valid` elements
        self.grad: torch.Tensor | None = None        # fp32, `valid` elements, accumulates

    def __repr__(self):
        return f"ShardedParam({self.name}, {tuple(self.shape)})"


def fill_rows(rows: torch.Tensor, flat: torch.Tensor, chunk: int):
    """Write the flat tensor `flat` into `rows` [N, chunk]: chunk j into row j,
    zero padding after the last element."""
    n = flat.numel()
    full = n // chunk
    if full:
        rows[:full].copy_(flat[:full * chunk].view(full, chunk))
    rest = n - full * chunk
    if rest:
        rows[full, :rest].copy_(flat[full * chunk:])
        rows[full, rest:].zero_()
        full += 1
    if full < rows.shape[0]:
        rows[full:].zero_()


def bucketize(items: list, size_of: Callable, limit: int) -> list[list]:
    """Split `items` (in order) into consecutive buckets of at most `limit`
    total size; an item larger than the limit gets a bucket of its own."""
    buckets, current, total = [], [], 0
    for item in items:
        size = size_of(item)
        if current and total + size > limit:
            buckets.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    if current:
        buckets.append(current)
    return buckets


def gradient_buckets(chunks: Sequence[int], members: int, bucket_elems: int) -> list[list[int]]:
    """Reduce buckets over weights 0..n-1 whose partition chunks are `chunks`:
    in reverse weight order (as backward usually produces gradients), each at
    most `bucket_elems` elements of [members, sum of chunks] rows."""
    return bucketize(list(reversed(range(len(chunks)))), lambda i: chunks[i] * members, bucket_elems)
