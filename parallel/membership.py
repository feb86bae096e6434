"""Who takes part in an exchange across groups of nodes (zeropp/outer/diloco.py's outer step).

Two memberships with one interface (`open`, `all_reduce`, `all_gather`, `commit`, `group_sum`, `size`):
- `FixedGroups`: the groups of one torch job, the same rank of each in a process group that
  never changes; a group's failure is the job's (it stops and resumes together).
- `TorchftGroups` (parallel/torchft_groups.py): each group is its own job; torchft's `Manager` and
  its Lighthouse own the quorum (who is present at this exchange), a gloo process group
  reconfigured per quorum, the agreement to commit, and the live recovery ("heal") of a group
  that is behind from a healthy peer over its checkpoint transport (torchft,
  github.com/pytorch/torchft). One Manager per rank: replica_id is the group, its rank and world
  size the in-group ones, so rank r of every group meets the others' rank r, which holds the same
  shard.

An exchange starts with `open(steps, fragment, tokens)`: the members agree which fragment is
exchanged at which inner step (a group that joins late or healed adopts them) and each
member's weight, its share of the tokens trained since its last exchange.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from parallel.comm import Work

JOINING = -1   # the fragment of a member that is not at an exchange of its own (a start, a rejoin)
FRAGMENT_SPAN = 2 ** 16   # (step, fragment) as one number: step * SPAN + fragment + 1, exact in float64
DRIFT = "outer_drift"   # what a group's ranks agree on inside the group (zeropp/outer/settings.py's too)


@dataclass
class Opened:
    """An exchange the members agreed on."""
    steps: int              # the inner step it follows (a joining member adopts it)
    fragment: int           # JOINING: nobody exchanges (every member is joining)
    size: int               # members
    rank: int               # my place among them
    scale: float | None     # multiply my values by it before the sum (token weights); None: divide the sum by size
    healed: bool = False    # my outer state was just replaced by a peer's
    quorum: bool = False    # a torchft quorum was formed: `commit` must follow
    failed: bool = False    # ...but a member, a heal or the header failed in it: nobody exchanges
    weights: list = field(default_factory=list)   # every member's weight, by its place (empty: equal weights)
    run_rounds: int = 0     # the most exchanges a member has committed (0: every group is at its start)
    leader_steps: int = 0   # the largest inner step among the members
    extra: list = field(default_factory=list)     # the caller's fields, their maximum over the members
    counted: bool = False   # my values count in it (agreed by my group's ranks)
    groups: list = field(default_factory=list)    # the group ids of the members

    def equal_weights(self) -> bool:
        return not self.weights or all(w == self.weights[0] for w in self.weights)


class FixedGroups:
    """The same rank of every group of one job (parallel/topology.py `build_strided_group`)."""
    fault_tolerant = False

    def __init__(self, comm, group, size: int, rank: int):
        self.comm, self.group, self.size, self.rank = comm, group, size, rank

    def open(self, steps: int, fragment: int, tokens: int) -> Opened:
        return Opened(steps, fragment, self.size, self.rank, None)

    def all_reduce(self, tensor: torch.Tensor, phase: str, async_op: bool = True) -> Work:
        if self.size == 1:
            return Work()
        return self.comm.all_reduce(tensor, group=self.group, async_op=async_op, phase=phase)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, phase: str) -> Work:
        """`out`: a row per group."""
        if self.size == 1:
            out.copy_(tensor.view(1, -1))
            return Work()
        return self.comm.all_gather(out.view(-1), tensor, group=self.group, async_op=True, phase=phase)

    def group_sum(self, tensor: torch.Tensor):
        """`tensor` summed over my group's ranks (the job's failures are every group's)."""
        self.comm.all_reduce(tensor, phase=DRIFT)

    def commit(self) -> bool:
        return True

    def layout_key(self):
        return self.size

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None):
        pass


def lighthouse_answers(url: str, seconds: float) -> bool:
    """Whether something accepts connections at the Lighthouse's `url` (http://host:port) within
    `seconds` (tried again every half second: a Lighthouse started with the groups may be late)."""
    where = urlsplit(url if "//" in url else "http://" + url)
    end = time.monotonic() + seconds
    while True:
        try:
            left = max(0.1, end - time.monotonic())
            with socket.create_connection((where.hostname, where.port or 29510), timeout=left):
                return True
        except (OSError, ValueError):
            if time.monotonic() >= end:
                return False
            time.sleep(0.5)


class InGroup:
    """My group's own ranks in a gloo group of their own, for what they agree on during an exchange,
    each wait bounded by `timeout_s` (the job's process group waits 30 minutes) and apart from the
    engine's collectives (an exchange may run beside them, zeropp/outer/rounds.py). `bound` says
    the bound in the user's terms."""

    def __init__(self, timeout_s: float, bound: str):
        from datetime import timedelta
        self.timeout_s, self.bound = timeout_s, bound
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, phase: str = DRIFT):
        try:
            dist.all_reduce(tensor, op=op, group=self.group)
        except RuntimeError as e:
            raise GroupBroken(f"a rank of this group did not answer within {self.bound} during an exchange: this "
                              f"group stops (its ranks are stuck or gone); restart it and it heals from the "
                              f"others") from e


class GroupBroken(RuntimeError):
    """A rank of my own group is gone or stuck: the group cannot go on (its launcher restarts it)."""
