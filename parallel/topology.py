"""Which ranks share a node, and the process groups that follow from it.

Ranks are laid out node-major, as torchrun does: global rank = node * L + local,
for L ranks per node. A topology may also describe one of several equal groups of
consecutive nodes that each run an engine of their own (`group_topology`, for the
outer synchronization of zeropp/outer/diloco.py): its world is the group's ranks, `rank` is
the index in the group, and every rank list it gives (node_ranks, peer_ranks, ...)
holds global ranks, so byte accounting sees the real nodes. `ranks_per_node` normally comes from torchrun's
LOCAL_WORLD_SIZE; overriding it (``--ranks-per-node``) lets one machine emulate
several nodes so that the hierarchical ZeRO++ paths run and are tested on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist


class TopologyError(ValueError):
    """The job's shape does not fit the requested layout (a user error)."""


@dataclass
class Topology:
    world_size: int
    rank: int
    ranks_per_node: int
    # Process groups, created by `build_groups` once torch.distributed is up.
    intra_node_group: object = field(default=None, repr=False)
    inter_node_group: object = field(default=None, repr=False)
    # All ranks again, for gradient reductions: a group runs its collectives in issue
    # order, so reductions on their own group never queue behind weight gathers (and
    # ranks that interleave the two differently still agree on each group's order).
    gradient_group: object = field(default=None, repr=False)
    # One of `groups` groups of consecutive ranks: its first global rank, and its process
    # group (None: the job's default group, when the topology is the whole job).
    offset: int = 0
    groups: int = 1
    world_group: object = field(default=None, repr=False)
    across_group: object = field(default=None, repr=False)   # my index in every group, one rank a group

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise TopologyError(
                f"--ranks-per-node {self.ranks_per_node} must divide the world size "
                f"{self.world_size}; pass a divisor of {self.world_size}")

    @property
    def global_rank(self) -> int:
        return self.offset + self.rank

    @property
    def ranks(self) -> list[int]:
        """Global ranks of this topology's world."""
        return list(range(self.offset, self.offset + self.world_size))

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.global_rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks on `node`."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with the same local index on every node."""
        return [self.offset + n * self.ranks_per_node + local_rank for n in range(self.num_nodes)]

    def group_topology(self, nodes: int) -> "Topology":
        """My group of `nodes` consecutive nodes, as a topology of its own (no groups built)."""
        if nodes < 1 or self.num_nodes % nodes:
            raise TopologyError(f"groups of {nodes} node(s) must divide the {self.num_nodes} node(s)")
        size = nodes * self.ranks_per_node
        return Topology(world_size=size, rank=self.rank % size, ranks_per_node=self.ranks_per_node,
                        offset=self.global_rank // size * size, groups=self.world_size // size)

    def _each_group(self, ranks_of) -> object:
        """new_group(ranks_of(first)) for the first global rank of every group, in group order
        (every rank calls new_group for every group, in the same order); returns mine."""
        mine = None
        for g in range(self.groups):
            group = dist.new_group(ranks_of(g * self.world_size))
            if g * self.world_size == self.offset:
                mine = group
        return mine

    def build_groups(self) -> "Topology":
        """Create the intra-node, inter-node, gradient (and a group's world) groups (collective
        on all ranks)."""
        if not dist.is_initialized():
            return self
        L = self.ranks_per_node
        for node in range(self.num_nodes):
            g = self._each_group(lambda first, node=node: list(range(first + node * L, first + (node + 1) * L)))
            if node == self.rank // L:
                self.intra_node_group = g
        for local in range(L):
            g = self._each_group(lambda first, local=local: [first + n * L + local for n in range(self.num_nodes)])
            if local == self.local_rank:
                self.inter_node_group = g
        whole = lambda first: list(range(first, first + self.world_size))  # noqa: E731
        if self.world_size > 1:
            self.gradient_group = self._each_group(whole)
        if self.groups > 1:
            self.world_group = self._each_group(whole)
            for i in range(self.world_size):
                g = dist.new_group([first + i for first in range(0, self.groups * self.world_size, self.world_size)])
                if i == self.rank:
                    self.across_group = g
        return self

    def subgroup_ranks(self, size: int) -> list[int]:
        """This rank's group of `size` consecutive ranks inside its node (hpZ's
        secondary partition); `size` must divide the ranks per node."""
        if size < 1 or self.ranks_per_node % size:
            raise TopologyError(f"a group of {size} ranks must divide the {self.ranks_per_node} ranks per node")
        first = self.global_rank // size * size
        return list(range(first, first + size))

    def build_subgroup(self, size: int):
        """A new process group of `subgroup_ranks(size)` (collective on all ranks:
        each calls new_group for every subgroup, in the same order); never one of
        the groups above, so its collectives do not queue behind theirs."""
        mine = None
        for first in range(0, self.world_size, size):
            g = self._each_group(lambda base, first=first: list(range(base + first, base + first + size)))
            if first <= self.rank < first + size:
                mine = g
        return mine

    def build_strided_group(self, size: int):
        """A new process group of the ranks at my index in their groups of `size`
        consecutive ranks: {i, size + i, 2 size + i, ...} (with size = ranks per node,
        one rank per node, like inter_node_group; collective on all ranks)."""
        mine = None
        for i in range(size):
            g = self._each_group(lambda base, i=i: list(range(base + i, base + self.world_size, size)))
            if self.rank % size == i:
                mine = g
        return mine


def expected_topology(ranks_per_node: int | None = None) -> Topology:
    """The topology torchrun's environment describes (WORLD_SIZE, LOCAL_WORLD_SIZE), as rank 0
    will see it, before any process group exists: for checks made before the workers start."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return Topology(world_size=world, rank=0, ranks_per_node=ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                                   world)))


def topology_from_env(ranks_per_node: int | None = None) -> Topology:
    """The topology of the running job. With no override, torchrun's
    LOCAL_WORLD_SIZE says how many ranks share a node."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Topology(world_size=world, rank=rank, ranks_per_node=ranks_per_node).build_groups()
