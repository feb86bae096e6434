"""Who takes part in an exchange across groups of nodes (zeropp/outer/diloco.py's outer step).

Two memberships with one interface (`open`, `all_reduce`, `commit`, `size`):
- `FixedGroups`: the groups of one torch job, the same rank of each in a process group that
  never changes; a group's failure is the job's (it stops and resumes together).
- `TorchftGroups`: each group is its own job; torchft's `Manager` and its Lighthouse own the
  quorum (who is present at this exchange), a gloo process group reconfigured per quorum,
  the agreement to commit, and the live recovery ("heal") of a group that is behind from a
  healthy peer over its checkpoint transport (torchft, github.com/pytorch/torchft). One
  Manager per rank: replica_id is the group, its rank and world size the in-group ones, so
  rank r of every group meets the others' rank r, which holds the same shard.

An exchange starts with `open(steps, fragment, tokens)`: the members agree which fragment is
exchanged at which inner step (a group that joins late or healed adopts them) and each
member's weight, its share of the tokens trained since its last exchange.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common import ConfigError
from common.torchft_private import forget_failed_quorum, gloo_within
from parallel.comm import Work

JOINING = -1   # the fragment of a member that is not at an exchange of its own (a start, a rejoin)
FRAGMENT_SPAN = 2 ** 16   # (step, fragment) as one number: step * SPAN + fragment + 1, exact in float64


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


def different_shapes() -> ConfigError:
    return ConfigError("the groups in the quorum run different models or group shapes (their engines' fingerprints "
                       "differ); start every group with the same model flags and ranks per group")


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

    def commit(self) -> bool:
        return True

    def layout_key(self):
        return self.size

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None):
        pass


class TorchftGroups:
    """torchft's quorum, process group and recovery over groups that are separate jobs."""
    fault_tolerant = True

    def __init__(self, comm, group_id: int, lighthouse: str, timeout_s: float, quorum_timeout_s: float):
        from torchft.manager import Manager

        topology = comm.topology
        self.comm, self.group_id = comm, group_id
        self.fingerprint = 0
        self.manager = Manager(
            pg=gloo_within(timedelta(seconds=timeout_s)), load_state_dict=None,
            state_dict=None, min_replica_size=1, use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=quorum_timeout_s),
            # reconnecting to a Lighthouse that went away waits no longer than an exchange (default: 60 s)
            connect_timeout=timedelta(seconds=timeout_s),
            rank=topology.rank, world_size=topology.world_size, lighthouse_addr=lighthouse,
            replica_id=f"group{group_id}")
        self.size, self.rank = 1, 0
        self.events: list[str] = []   # quorum changes and heals since the last `status()`
        self.heals = 0
        self.timeout_s, self.retry_at = timeout_s, 0.0   # after a failed quorum: alone until retry_at

    def register(self, state_dict, load_state_dict, fingerprint: str):
        """What a peer sends a group that heals, what loads it (collectives inside the group), and
        what the groups must share."""
        self._load = load_state_dict
        self.manager.register_state_dict_fn("outer", self._receive, state_dict)
        self.fingerprint = zlib.crc32(fingerprint.encode()) & 0xFFFFFF   # exact in float64

    _received = None

    def _receive(self, state: dict):
        """torchft calls it inside the quorum on each rank whose fetch from a peer succeeded. A
        rank's fetch can fail when its group's others succeeded: what came is only kept here,
        loaded by `open` once the whole group has it (never half a group's outer state)."""
        self._received = state

    def open(self, steps: int, fragment: int, tokens: int) -> Opened:
        """A quorum (blocking until the members present meet or the join timeout), a heal if my
        group is behind, then the header: the exchange's inner step and fragment (the largest
        step's; a joining member sends JOINING), the members' tokens, the groups' fingerprints."""
        m, why = self.manager, None
        # After a failed quorum a group asks again only once a timeout has passed, so that one cut
        # off spends at most half its time waiting for a Lighthouse it cannot reach (monotonic
        # clocks differ between ranks: the group agrees first, as on every path below).
        if self._any_in_group(time.monotonic() < self.retry_at):
            self.size, self.rank = 1, 0
            return Opened(steps, JOINING, 1, 0, None)
        before = m.state_dict()   # the committed step, which torchft moves to the peer's on a heal
        try:
            m.start_quorum()
        except Exception as e:   # no quorum in time (cut off, Lighthouse away): train on alone
            forget_failed_quorum(m)
            why = type(e).__name__
        received, self._received = self._received, None
        if self._any_in_group(why is not None):   # every rank of my group takes the same path
            self.retry_at = time.monotonic() + self.timeout_s
            self._event(f"no quorum ({why or 'on another rank of this group'}): this group goes on alone and asks "
                        f"again in {self.timeout_s:g} s")
            self.size, self.rank = 1, 0
            return Opened(steps, JOINING, 1, 0, None)
        size = m.num_participants()
        if size != self.size:
            self._event(f"quorum of {size} group(s), was {self.size}")
        self.size, self.rank = size, m.participating_rank() or 0
        # Who is where: the largest (step, fragment) is the exchange; members elsewhere (joining, or
        # behind after a cut) adopt it with no weight. The fingerprints' max and min must agree.
        top = torch.tensor([float(steps * FRAGMENT_SPAN + fragment + 1), float(self.fingerprint),
                            -float(self.fingerprint)], dtype=torch.float64)
        m.allreduce(top, reduce_op=dist.ReduceOp.MAX).wait()
        agreed_steps, agreed_fragment = divmod(int(top[0].item()), FRAGMENT_SPAN)
        agreed_fragment -= 1
        counts = agreed_steps == steps and fragment == agreed_fragment != JOINING
        total = torch.tensor([float(tokens) if counts else 0.0, float(counts)], dtype=torch.float64)
        if not m.errored():
            m.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        # Each rank met its own peers: a failure or a mismatch seen by one rank is its whole group's.
        failed, mismatch, some, not_all = self._any_in_group(
            m.errored() is not None, not m.errored() and top[1] != -top[2], received is not None, received is None)
        if mismatch:
            raise different_shapes()
        healed = some and not not_all
        if healed:   # every rank of my group fetched its part: loaded together (even if the exchange fails)
            self._load(received)
            self.heals += 1
            self._event(f"healed from a peer (outer state of its exchange {m.current_step()})")
        elif some:   # it reached part of my group: undone where it came, so the group heals again next time
            m.load_state_dict(before)
            if not failed:
                m.report_error(RuntimeError("a heal reached only part of this group"))
            failed = True
        if failed:   # commit says no in the whole group (torchft: an error on any rank)
            return Opened(steps, JOINING, self.size, self.rank, None, healed, quorum=True, failed=True)
        tokens_in, members_in = total.tolist()
        weight = 0.0 if not counts else tokens / tokens_in if tokens_in > 0 else 1.0 / members_in
        return Opened(agreed_steps, agreed_fragment, self.size, self.rank, weight, healed, quorum=True)

    def _any_in_group(self, *flags: bool):
        """Each flag, true on any rank of my group (an all-reduce inside the group)."""
        t = torch.tensor([float(f) for f in flags])
        self.comm.all_reduce(t, op=dist.ReduceOp.MAX, phase="outer_membership")
        out = [bool(v) for v in t.tolist()]
        return out[0] if len(out) == 1 else out

    def all_reduce(self, tensor: torch.Tensor, phase: str, async_op: bool = True) -> Work:
        """A sum over the quorum's members; on a member's failure the tensor is garbage and
        `commit` says False in my whole group (torchft's Manager)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.comm.stats.add("all_reduce", phase, 0, 2 * (self.size - 1) * nbytes // max(self.size, 1))
        work = self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
        if not async_op:
            work.wait()
            return Work()
        return Work(work)

    def all_gather(self, out, tensor, phase: str) -> Work:
        raise ConfigError("INT4 outer gradients are not fault tolerant yet; pass --outer-quantization none")

    def commit(self) -> bool:
        """Whether every rank of my group saw the exchange succeed (agreed in the group; a group
        that commits when another did not is behind it at the next quorum and heals)."""
        return self.manager.should_commit()

    def layout_key(self):
        return "torchft"

    def state_dict(self) -> dict:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict | None):
        if state:
            self.manager.load_state_dict(state)

    def status(self) -> dict:
        events, self.events = self.events, []
        return {"quorum_size": self.size, "heals": self.heals, "events": events}

    def _event(self, what: str):
        self.events.append(what)

    def shutdown(self):
        self.manager.shutdown(wait=False)
