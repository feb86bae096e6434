"""The one thin layer every collective of the product goes through.

It calls torch.distributed and counts the bytes each rank sends, split into
bytes that stay inside its node and bytes that cross to another node (the
traffic ZeRO++ exists to cut). Counting is logical, independent of the
algorithm NCCL or gloo picks: a rank is charged for the data it must hand to
each other member of the group.

- all_gather: my input goes to each other member.
- reduce_scatter / all_to_all: chunk j of my input goes to member j.
- all_reduce: charged as a reduce-scatter plus an all-gather (2 S/n per peer).
- broadcast: the source sends the tensor to each other member.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.topology import Topology



# torch 2.13 renamed the flat-tensor collectives; older releases have only the old
# names. Looked up at call time, so tools that wrap torch.distributed see the calls.
def _all_gather_flat(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


@dataclass
class CommStats:
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    by_op: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    @property
    def total_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes

    def as_dict(self) -> dict:
        return {"intra_node_bytes": self.intra_node_bytes,
                "inter_node_bytes": self.inter_node_bytes,
                "by_op": {k: {"intra_node_bytes": v[0], "inter_node_bytes": v[1]}
                          for k, v in self.by_op.items()}}


class _Done:
    """Stand-in work handle for collectives that ran synchronously."""

    def wait(self):
        return None


class Communicator:
    def __init__(self, topology: Topology):
        self.topology = topology
        self.stats = CommStats()
        self._group_ranks: dict = {}

    def reset_stats(self) -> CommStats:
        old, self.stats = self.stats, CommStats()
        return old

    # -- accounting -------------------------------------------------------
    def group_ranks(self, group) -> list[int]:
        key = id(group) if group is not None else None
        if key not in self._group_ranks:
            if group is None:
                ranks = list(range(self.topology.world_size))
            else:
                ranks = dist.get_process_group_ranks(group)
            self._group_ranks[key] = ranks
        return self._group_ranks[key]

    def _charge(self, op: str, group, bytes_per_peer: int):
        me = self.topology.rank
        my_node = self.topology.node_of(me)
        for peer in self.group_ranks(group):
            if peer == me:
                continue
            inter = self.topology.node_of(peer) != my_node
            if inter:
                self.stats.inter_node_bytes += bytes_per_peer
            else:
                self.stats.intra_node_bytes += bytes_per_peer
            self.stats.by_op[op][int(inter)] += bytes_per_peer

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _size(self, group) -> int:
        return len(self.group_ranks(group))

    # -- collectives ------------------------------------------------------
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, tag="all_reduce"):
        n = self._size(group)
        if n == 1:
            return _Done()
        self._charge(tag, group, 2 * self._nbytes(tensor) // n)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op) or _Done()

    def all_gather(self, output, input, group=None, async_op=False, tag="all_gather"):
        """Gather equal `input` tensors of every member into flat `output`."""
        if self._size(group) == 1:
            output.copy_(input.view_as(output))
            return _Done()
        self._charge(tag, group, self._nbytes(input))
        return _all_gather_flat(output, input, group=group, async_op=async_op) or _Done()

    def reduce_scatter(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False,
                       tag="reduce_scatter"):
        """Sum flat `input` over members; member j keeps chunk j in `output`."""
        if self._size(group) == 1:
            output.copy_(input.view_as(output))
            return _Done()
        self._charge(tag, group, self._nbytes(output))
        return _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op) or _Done()

    def all_to_all(self, output, input, group=None, async_op=False, tag="all_to_all"):
        """Chunk j of flat `input` goes to member j; chunk j of `output` comes from it."""
        n = self._size(group)
        if n == 1:
            output.copy_(input)
            return _Done()
        self._charge(tag, group, self._nbytes(input) // n)
        return dist.all_to_all_single(output, input, group=group, async_op=async_op) or _Done()

    def broadcast(self, tensor, src: int, group=None, tag="broadcast"):
        if self._size(group) == 1:
            return
        if self.topology.rank == src:
            self._charge(tag, group, self._nbytes(tensor))
        dist.broadcast(tensor, src=src, group=group)

    def barrier(self, group=None):
        if dist.is_initialized():
            dist.barrier(group=group)
