"""hpZ: ZeRO++'s secondary weight partition (arXiv 2306.10209, section 3.2; DeepSpeed's ZeRO++ tutorial).

When a weight arrives from the primary partition (over all ranks), each rank
keeps a slice of it partitioned over its group of h ranks inside the node:
2M/h bytes of 16-bit weights per rank. Every later gather of that weight
(backward, activation-checkpoint recompute, the next micro-step's forward,
eval) reads this partition inside the group only, with the exact gather, in
place of a gather over the world. The slices hold exactly the values the
primary gather produced, so results are bit-identical to plain ZeRO-3. They go
stale after each optimizer step and each load of weights (`invalidate`).

With qwZ or the weight deltas, training's copies hold a reconstruction, which
evaluation must not read: it computes with the exact weights. So each slice also
records whether its values are exact. An evaluation's first gather of a weight
after a step brings the exact values from the primary partition and keeps them
here; its later batches gather inside the node, and so does the next training
forward, with the exact values (within any quantization bound). An evaluation
of B batches then crosses nodes once per weight instead of B times.

`SecondaryPartition` is a weight source for `zeropp.stages.stage3.param.BucketGather`,
like the primary partition, and counts its own bytes: each gather charges the
communicator with the world gather it replaces (the plain equivalent,
parallel/comm.py), as qwZ's and qgZ's collectives do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common import ConfigError
from parallel.comm import Work
from zeropp.collectives.exact import ShardGather
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.collectives.partition import Partition
from zeropp.techniques.technique import AUTO, Technique, key


MEMORY_KEY = "hpz_secondary_bytes"


@dataclass
class Keys:
    """hpZ's key in zero_optimization: the ranks of a group inside the node sharing a copy of the
    weights (1: off; "auto": planner.auto chooses 1 or the ranks per node)."""
    zero_hpz_partition_size: int | str = key(1, flag="zero_hpz_size", auto=True)


def group_size(stage: int, h, world_size: int) -> int:
    """The ranks of hpZ's secondary partition on a world of `world_size`, or 0 when it keeps none:
    off (h 1, or "auto" not yet resolved), below stage 3, or a group of the whole world (the
    primary partition itself). The one place that says whether hpZ is active: the engine's
    process groups, the planner's layout and the FSDP2 plug-in ask it."""
    return h if stage == 3 and type(h) is int and 1 < h < world_size else 0


def validate(zero, where: str):
    h = zero.zero_hpz_partition_size
    if h != AUTO and h < 1:
        raise ConfigError(f"{where}.zero_hpz_partition_size must be >= 1 (1 turns hpZ off), got {h}")


def validate_topology(zero, ranks_per_node: int, world_size: int):
    h = zero.zero_hpz_partition_size
    if h != AUTO and h > 1 and (ranks_per_node % h or h > world_size):
        raise ConfigError(
            f"zero_hpz_partition_size (--zero-hpz-size) {h} must divide the ranks per node "
            f"({ranks_per_node}): the secondary partition lives inside one node. "
            f"Use a divisor of {ranks_per_node}, ideally {ranks_per_node} itself")


@dataclass(frozen=True)
class SecondarySlice:
    """A weight's place in the secondary partition: the primary's layout over
    the h members of the group (zeropp/collectives/partition.py)."""
    chunk: int      # elements per member (padded)
    lo: int         # this member's elements [lo, hi) of the flat weight
    hi: int


def secondary_slice(numel: int, partition: Partition) -> SecondarySlice:
    chunk = max(1, -(-numel // partition.size))
    lo = min(partition.rank * chunk, numel)
    return SecondarySlice(chunk, lo, min(lo + chunk, numel))


class SecondaryPartition:
    """This rank's slices of the partitioned weights in its node group, and
    which of them hold the current step's values."""

    writes_weights = False
    delivers_rows = False

    def __init__(self, partition: Partition, comm, weights: list, dtype: torch.dtype, device):
        """`weights`: the partitioned Stage3Params, each already `place`d."""
        self.partition = partition
        self.comm = comm
        self.gather = ShardGather(comm)       # exact, inside the group
        self.flat = torch.zeros(sum(s.secondary_slice.chunk for s in weights), dtype=dtype, device=device)
        self._slices: dict[int, torch.Tensor] = {}   # weight index -> its view of `flat`
        off = 0
        for s in weights:
            self._slices[s.index] = self.flat[off:off + s.secondary_slice.chunk]
            off += s.secondary_slice.chunk
        self._fresh: set[int] = set()        # weights whose slice holds the current values
        self._exact: set[int] = set()        # ... the exact ones, not a reconstruction (a subset)

    @property
    def group(self):
        return self.partition.group

    @property
    def size(self) -> int:
        return self.partition.size

    # -- freshness -----------------------------------------------------------------
    def holds(self, s, exact: bool = False) -> bool:
        """True when the next gather of `s` can come from this partition (`exact`: only if it holds
        the exact values, as evaluation needs)."""
        return s.index in (self._exact if exact else self._fresh)

    def keep(self, s, full: torch.Tensor, exact: bool = False):
        """`s` arrived whole from the primary partition (`exact`: its exact values, not qwZ's or
        the deltas' reconstruction): keep my slice of it."""
        sl = s.secondary_slice
        self._slices[s.index][:sl.hi - sl.lo].copy_(full.view(-1)[sl.lo:sl.hi])
        self._fresh.add(s.index)
        if exact:
            self._exact.add(s.index)
        else:
            self._exact.discard(s.index)

    def invalidate(self, s=None):
        """The weights (or weight `s`) changed: the next gather goes to the primary partition."""
        if s is None:
            self._fresh.clear()
            self._exact.clear()
        else:
            self._fresh.discard(s.index)
            self._exact.discard(s.index)

    # -- a weight source (zeropp.stages.stage3.param.BucketGather) ------------------------------
    def bytes_per_element(self, elem_bytes: int) -> float:
        return self.gather.bytes_per_element(elem_bytes, self.size)

    def fixed_bytes(self) -> int:
        return 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat]

    def plan(self, weights: list, phase: str) -> list[PlannedCollective]:
        """Inside the group: the secondary chunks, exact."""
        total = sum(s.secondary_slice.chunk for s in weights)
        return [PlannedCollective(phase, "all_gather", "secondary", total * self.flat.element_size())]

    def memory(self) -> MemoryLine:
        """The 16-bit weights again, over the h ranks of the group: w/h bytes a parameter."""
        return MemoryLine(MEMORY_KEY, "parameters", [self.flat], self.flat.element_size() / self.size,
                          label="hpZ secondary partition")

    def chunk(self, s) -> int:
        return s.secondary_slice.chunk

    def slice(self, s) -> torch.Tensor:
        return self._slices[s.index]

    def start(self, weights: list, inp: torch.Tensor, phase: str, out: torch.Tensor, pool) -> Work:
        # In place of the world gather of the same weights, which is what ZeRO-3 would send.
        self.comm.charge_plain("all_gather", None, sum(s.chunk for s in weights) * inp.element_size())
        return self.gather.start(inp, self.partition, phase, out=out, plain=False)

    def arrived(self, s, full: torch.Tensor):
        pass   # already here


def build(ctx) -> SecondaryPartition | None:
    """None when the group is the whole world (the primary partition itself: nothing to add)."""
    if ctx.groups.hpz is None:
        return None
    return SecondaryPartition(ctx.groups.hpz, ctx.comm, ctx.weights, ctx.dtype, ctx.device)


TECHNIQUE = Technique("hpZ", "secondary", Keys, "zero_hpz_partition_size", build, validate, validate_topology,
                      detail=lambda z: f"hpZ {z.zero_hpz_partition_size}", memory_key=MEMORY_KEY)
