"""The one thin layer every collective of the product goes through.

It calls torch.distributed and counts the bytes each rank puts on the wire,
split into bytes that stay inside its node and bytes that cross to another
node (the traffic ZeRO++ exists to cut), per phase of the step and per
collective.

Charge model (what `wire_bytes` computes; the ring algorithms of NCCL's collectives, NVIDIA NCCL docs)
-------------------------------------------------------------------------------------------
Let the group have n members, taken in ascending global-rank order (node-major,
as torchrun lays ranks out and as NCCL builds its rings), and let succ(me) be
the member after me in that order, wrapping around: ring[(i + 1) % n].

- all_gather (flat: `output` = n x `input`): a ring. Every member sends
  (n-1)*S to succ(me), S = bytes of its `input` shard.
- reduce_scatter (flat: `input` = n x `output`): a ring. Every member sends
  (n-1)*S to succ(me), S = bytes of its `output` chunk.
- all_reduce: a ring (reduce-scatter then all-gather). Every member sends
  2*(n-1)*S/n (rounded down) to succ(me), S = bytes of the tensor.
- all_to_all (flat, equal chunks): direct. Chunk j of `input`, S/n bytes with
  S = bytes of `input`, goes to member j; nothing for my own chunk.
- broadcast: a chain from src along the ring order: src -> succ(src) -> ...
  Every member sends S (bytes of the tensor) to succ(me), except the last of
  the chain, the member just before src in ring order, which sends nothing.

A ring's bytes count as inter-node when succ(me) is on another node, else as
intra-node; all_to_all's chunk j counts by member j's node. A group of one
member sends nothing (the collective is a local copy). Consequence for an
all-gather of M = n*S bytes over N nodes of L ranks: only the last rank of each
node talks across, so about M leaves each node, not the M*(N-1)/N per *rank*
that "send S straight to every remote peer" would give (L(N-1)/N times more).
Gloo picks other algorithms for some sizes; the model is NCCL's, the one the
ZeRO++ 3M -> 0.75M figure assumes.

Phases
------
Every collective takes `phase=` (any string; default "other"). The engine uses:
  "forward_gather"   parameter all-gathers before a module's forward
  "backward_gather"  parameter all-gathers before its backward (hpZ: intra-node)
  "grad_reduce"      gradient reduce-scatter / all-reduce / qgZ all-to-alls
  "optimizer"        optimizer-step collectives (grad norm, overflow, updated
                     shard all-gathers of stages 1-2)
  "other"            everything else (metrics, checkpoints, set-up)
`CommStats.by_phase[phase]` and `CommStats.by_op[collective]` hold
[intra, inter] bytes; `CommStats.calls[phase]` the number of collectives issued
(groups of one member issue none).

The plain equivalent
--------------------
`CommStats.plain_intra_node_bytes` / `plain_inter_node_bytes` count what the same
step would have moved without ZeRO++: every collective adds its own bytes there,
except one issued with `plain=False`, which stands in for a plain collective that
its caller charges instead with `charge_plain` (qwZ's INT8 all-gather for the
16-bit all-gather over the world, hpZ's intra-node gather for the same, qgZ's two
all-to-alls for one reduce-scatter).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from parallel.topology import Topology

PHASES = ("forward_gather", "backward_gather", "grad_reduce", "optimizer", "other")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


# torch 2.13 renamed the flat-tensor collectives; older releases have only the old
# names. Looked up at call time, so tools that wrap torch.distributed see the calls.
def all_gather_flat(*args, **kwargs):
    """torch.distributed's flat all-gather, under the name this torch version has."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args, **kwargs):
    """torch.distributed's flat reduce-scatter, under the name this torch version has."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def wire_bytes(op: str, group_ranks: list[int], me: int, nbytes: int,
               node_of: Callable[[int], int], src: int | None = None) -> tuple[int, int]:
    """(intra_node_bytes, inter_node_bytes) that global rank `me` sends in one
    collective `op` over the group of global ranks `group_ranks` (any order;
    rings follow ascending rank order). `node_of(rank)` gives a rank's node.

    `nbytes` is S of the module docstring:
      all_gather      bytes of my input shard (output / n)
      reduce_scatter  bytes of my output chunk (input / n)
      all_reduce      bytes of the tensor
      all_to_all      bytes of my whole input (n chunks)
      broadcast       bytes of the tensor; `src` (a global rank) is required
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    ring = sorted(group_ranks)
    n = len(ring)
    if len(set(ring)) != n:
        raise ValueError(f"group ranks {group_ranks} repeat a rank")
    if me not in ring:
        raise ValueError(f"rank {me} is not in the group {group_ranks}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if op == "broadcast" and src not in ring:
        raise ValueError(f"broadcast needs src in the group {group_ranks}, got {src}")
    if n == 1:
        return 0, 0
    my_node = node_of(me)
    i = ring.index(me)
    succ = ring[(i + 1) % n]

    if op == "all_to_all":
        chunk = nbytes // n
        inter = sum(chunk for r in ring if r != me and node_of(r) != my_node)
        intra = sum(chunk for r in ring if r != me and node_of(r) == my_node)
        return intra, inter

    if op in ("all_gather", "reduce_scatter"):
        sent = (n - 1) * nbytes
    elif op == "all_reduce":
        sent = 2 * (n - 1) * nbytes // n
    else:  # broadcast: chain src -> succ(src) -> ...; the member before src ends it
        last = ring[(ring.index(src) - 1) % n]
        sent = 0 if me == last else nbytes
    return (0, sent) if node_of(succ) != my_node else (sent, 0)


def _pair():
    return [0, 0]


@dataclass
class CommStats:
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    by_phase: dict = field(default_factory=lambda: defaultdict(_pair))   # phase -> [intra, inter]
    by_op: dict = field(default_factory=lambda: defaultdict(_pair))      # collective -> [intra, inter]
    calls: dict = field(default_factory=lambda: defaultdict(int))        # phase -> collectives issued
    plain_intra_node_bytes: int = 0   # the same step without ZeRO++ (module docstring)
    plain_inter_node_bytes: int = 0
    # inter-node bytes of the collectives as issued to torch.distributed: differs from
    # inter_node_bytes where one stands in for another (`all_to_all(charge_as=...)`)
    issued_inter_node_bytes: int = 0
    # phase -> seconds the calling thread was blocked: in a synchronous collective, or in
    # Work.wait() for an asynchronous one (what is left of it on the critical path).
    wait_seconds: dict = field(default_factory=lambda: defaultdict(float))

    @property
    def total_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes

    def add_plain(self, intra: int, inter: int):
        self.plain_intra_node_bytes += intra
        self.plain_inter_node_bytes += inter

    def add(self, op: str, phase: str, intra: int, inter: int):
        self.intra_node_bytes += intra
        self.inter_node_bytes += inter
        for entry in (self.by_phase[phase], self.by_op[op]):
            entry[0] += intra
            entry[1] += inter
        self.calls[phase] += 1

    def as_dict(self) -> dict:
        def split(d):
            return {k: {"intra_node_bytes": v[0], "inter_node_bytes": v[1]} for k, v in d.items()}
        return {"intra_node_bytes": self.intra_node_bytes,
                "inter_node_bytes": self.inter_node_bytes,
                "total_bytes": self.total_bytes,
                "by_phase": split(self.by_phase),
                "by_op": split(self.by_op),
                "calls": dict(self.calls),
                "plain_intra_node_bytes": self.plain_intra_node_bytes,
                "plain_inter_node_bytes": self.plain_inter_node_bytes,
                "issued_inter_node_bytes": self.issued_inter_node_bytes,
                "wait_seconds": dict(self.wait_seconds)}


class Work:
    """The one handle for a collective, here and in zeropp/: `wait()` waits for
    the transport's handle (torch's async work, or another `Work`), then
    returns the result: `result`, or what `then()` makes of the received data
    (run once). A collective that already ran has no handle. `blocked(seconds)`,
    if given, is told how long wait() blocked on the transport."""
    __slots__ = ("_handle", "_result", "_then", "_blocked")

    def __init__(self, handle=None, result=None, then=None, blocked=None):
        self._handle, self._result, self._then, self._blocked = handle, result, then, blocked

    def is_completed(self) -> bool:
        """The transport is done (then() may still have to run): wait() would not block on it."""
        return self._handle is None or self._handle.is_completed()

    def progress(self) -> bool:
        """Advance without blocking (a collective of several steps starts its next one);
        True when wait() would not block on the transport."""
        return self.is_completed()

    def wait(self):
        if self._handle is not None:
            t0 = time.perf_counter()
            self._handle.wait()
            if self._blocked is not None:
                self._blocked(time.perf_counter() - t0)
            self._handle = None
        if self._then is not None:
            self._result, self._then = self._then(), None
        return self._result

    def get_future(self):
        """torch's Future of the transport's handle (what a DDP communication hook returns)."""
        return self._handle.get_future()


class Communicator:
    def __init__(self, topology: Topology):
        self.topology = topology
        self.stats = CommStats()
        # Collectives issued with async_op=True (real work handles handed out)
        # since construction or the last reset_stats().
        self.async_handles = 0
        self._group_ranks: dict = {}

    def reset_stats(self) -> CommStats:
        old, self.stats = self.stats, CommStats()
        self.async_handles = 0
        return old

    # -- accounting -------------------------------------------------------
    def group_ranks(self, group) -> list[int]:
        """Global ranks of `group` (None: the topology's world, a group's own or the job's)."""
        key = id(group) if group is not None else None
        if key not in self._group_ranks:
            if group is None:
                ranks = self.topology.ranks
            else:
                ranks = dist.get_process_group_ranks(group)
            self._group_ranks[key] = ranks
        return self._group_ranks[key]

    def _wire(self, op: str, group, nbytes: int, src: int | None = None) -> tuple[int, int]:
        return wire_bytes(op, self.group_ranks(group), self.topology.global_rank, nbytes,
                          self.topology.node_of, src=src)

    def _charge(self, op: str, phase: str, group, nbytes: int, src: int | None = None,
                plain: bool = True, issued: int | None = None):
        """`issued`: inter-node bytes of the collective sent instead (default: this one's)."""
        intra, inter = self._wire(op, group, nbytes, src)
        self.stats.add(op, phase, intra, inter)
        self.stats.issued_inter_node_bytes += inter if issued is None else issued
        if plain:
            self.stats.add_plain(intra, inter)

    def charge_plain(self, op: str, group, nbytes: int):
        """Count, as the plain equivalent only, the collective `op` of `nbytes`
        (the size argument its method would charge) over `group`."""
        if self._size(group) > 1:
            self.stats.add_plain(*self._wire(op, group, nbytes))

    @property
    def wait_seconds(self) -> dict:
        """phase -> seconds blocked in collectives (CommStats.wait_seconds)."""
        return self.stats.wait_seconds

    def _issued(self, work, async_op: bool, phase: str, t0: float):
        stats = self.stats
        if async_op and work is not None:
            self.async_handles += 1

            def blocked(seconds):
                stats.wait_seconds[phase] += seconds
            return Work(work, blocked=blocked)
        stats.wait_seconds[phase] += time.perf_counter() - t0
        return Work()

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _size(self, group) -> int:
        return len(self.group_ranks(group))

    def _pg(self, group):
        """The process group to issue on: group=None is the topology's world (zeropp/outer/diloco.py's
        engines run over a group of the job's ranks)."""
        return self.topology.world_group if group is None else group

    # -- collectives ------------------------------------------------------
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, phase="other"):
        """Reduce `tensor` in place over the group's members."""
        if self._size(group) == 1:
            return Work()
        self._charge("all_reduce", phase, group, self._nbytes(tensor))
        t0 = time.perf_counter()
        return self._issued(dist.all_reduce(tensor, op=op, group=self._pg(group), async_op=async_op), async_op, phase, t0)

    def all_gather(self, output, input, group=None, async_op=False, phase="other", plain=True):
        """Gather equal `input` tensors of every member into flat `output`."""
        if self._size(group) == 1:
            output.copy_(input.view_as(output))
            return Work()
        self._charge("all_gather", phase, group, self._nbytes(input), plain=plain)
        t0 = time.perf_counter()
        return self._issued(all_gather_flat(output, input, group=self._pg(group), async_op=async_op), async_op, phase, t0)

    def reduce_scatter(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False,
                       phase="other", plain=True):
        """Sum flat `input` over members; member j keeps chunk j in `output`."""
        if self._size(group) == 1:
            output.copy_(input.view_as(output))
            return Work()
        self._charge("reduce_scatter", phase, group, self._nbytes(output), plain=plain)
        t0 = time.perf_counter()
        return self._issued(reduce_scatter_flat(output, input, op=op, group=self._pg(group), async_op=async_op),
                            async_op, phase, t0)

    def all_to_all(self, output, input, group=None, async_op=False, phase="other", plain=True,
                   charge_as="all_to_all", output_splits=None, input_splits=None):
        """Chunk j of flat `input` goes to member j; chunk j of `output` comes from it.
        `charge_as="reduce_scatter"`: this all-to-all carries a reduce-scatter's rows (the
        receiver sums them), charged as the ring reduce-scatter of one chunk it stands for.
        `input_splits`, `output_splits`: uneven chunks (elements per member, in group order),
        charged as what goes to each member."""
        if self._size(group) == 1:
            output.copy_(input)
            return Work()
        if input_splits is not None:
            ranks, me, size = self.group_ranks(group), self.topology.global_rank, input.element_size()
            node = self.topology.node_of
            intra = sum(n * size for r, n in zip(ranks, input_splits) if r != me and node(r) == node(me))
            inter = sum(n * size for r, n in zip(ranks, input_splits) if r != me and node(r) != node(me))
            self.stats.add("all_to_all", phase, intra, inter)
            self.stats.issued_inter_node_bytes += inter
            if plain:
                self.stats.add_plain(intra, inter)
            t0 = time.perf_counter()
            return self._issued(dist.all_to_all_single(output, input, output_splits, input_splits,
                                                       group=self._pg(group), async_op=async_op), async_op, phase, t0)
        nbytes = self._nbytes(input)
        if charge_as not in ("all_to_all", "reduce_scatter"):
            raise ValueError(f"charge_as must be all_to_all or reduce_scatter, got {charge_as!r}")
        issued = self._wire("all_to_all", group, nbytes)[1]
        if charge_as == "reduce_scatter":
            nbytes //= self._size(group)
        self._charge(charge_as, phase, group, nbytes, plain=plain, issued=issued)
        t0 = time.perf_counter()
        return self._issued(dist.all_to_all_single(output, input, group=self._pg(group), async_op=async_op),
                            async_op, phase, t0)

    def broadcast(self, tensor, src: int, group=None, phase="other"):
        """`tensor` of global rank `src` to every member (synchronous)."""
        if self._size(group) == 1:
            return
        self._charge("broadcast", phase, group, self._nbytes(tensor), src=src)
        dist.broadcast(tensor, src=src, group=self._pg(group))

    def barrier(self, group=None):
        if dist.is_initialized():
            dist.barrier(group=self._pg(group))
