"""Groups that are separate jobs meeting through torchft (parallel/membership.py's interface):
torchft's `Manager`, one per rank, owns the quorum, the process group per quorum, the commit and
the heal of a group that is behind; what is taken here without torchft is only what the members
tell each other in a quorum (parallel/run_shape.py's header, two all-reduces over torchft's
process group) and what a group's own ranks agree on (`InGroup`)."""
from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from common import ConfigError
from common.torchft_private import forget_failed_quorum, gloo_within
from parallel.comm import Work
from parallel.membership import FRAGMENT_SPAN, JOINING, InGroup, Opened
from parallel.run_shape import Header, Mine, RunShape

AFTER_TORCHFT = 2.5   # x --outer-timeout: what one rank of a group may wait for another after a torchft step


class _Reported:
    """A collective of torchft's process group whose failure is reported to the Manager (its
    `should_commit` then says no) instead of raised: torchft's `wrap_future`, with its timeout."""

    def __init__(self, manager, work):
        self.future = manager.wrap_future(work.get_future(), None)

    def wait(self):
        self.future.wait()

    def is_completed(self) -> bool:
        return self.future.done()


class TorchftGroups:
    """torchft's quorum, process group and recovery over groups that are separate jobs."""
    fault_tolerant = True

    def __init__(self, comm, group_id: int, num_groups: int, lighthouse: str, timeout_s: float,
                 min_groups: int = 1):
        from torchft.manager import Manager

        topology = comm.topology
        self.comm, self.group_id, self.num_groups = comm, group_id, num_groups
        self.pg = gloo_within(timedelta(seconds=timeout_s))
        self.manager = Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=min_groups,
            use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=timeout_s),
            # reconnecting to a Lighthouse that went away waits no longer than an exchange (default: 60 s)
            connect_timeout=timedelta(seconds=timeout_s),
            rank=topology.rank, world_size=topology.world_size, lighthouse_addr=lighthouse,
            replica_id=f"group{group_id}")
        self.ingroup = InGroup(timeout_s, f"--outer-timeout {timeout_s:g} s")
        # After a torchft step a peer rank of my group may still be inside it: a quorum and a heal
        # (each up to the timeout), or a collective that timed out where mine did not.
        self.after_torchft = InGroup(AFTER_TORCHFT * timeout_s, f"{AFTER_TORCHFT:g} x --outer-timeout "
                                     f"({AFTER_TORCHFT * timeout_s:g} s: a peer rank may be inside a quorum and a heal)")
        started = torch.tensor([time.time()], dtype=torch.float64)
        self.ingroup.all_reduce(started, op=dist.ReduceOp.MAX)   # one start time for my group's ranks
        self.started = started.item()
        self.shape, self.fingerprint = RunShape(), 0
        self.size, self.rank = 1, 0
        self.events = collections.deque()   # quorum changes and heals since the last `status()` (any thread)
        self.charged = collections.deque()  # (op, phase, bytes across groups) not yet in comm.stats
        self.heals, self.waited = 0, 0.0   # waited: seconds the inner steps' thread spent in exchanges
        self.timeout_s, self.retry_at = timeout_s, 0.0   # after a failed quorum: alone until retry_at

    def register(self, state_dict, load_state_dict, shape: RunShape):
        """What a peer sends a group that heals, what loads it (collectives inside the group), and
        what the groups must share."""
        self._load = load_state_dict
        self.manager.register_state_dict_fn("outer", self._receive, state_dict)
        self.shape, self.fingerprint = shape, shape.fingerprint

    _received = None

    def _receive(self, state: dict):
        """torchft calls it inside the quorum on each rank whose fetch from a peer succeeded. A
        rank's fetch can fail when its group's others succeeded: what came is only kept here,
        loaded by `open` once the whole group has it (never half a group's outer state)."""
        self._received = state

    def open(self, steps: int, fragment: int, tokens: int) -> Opened:
        """The synchronous exchange: a quorum, a heal if my group is behind, then the header: the
        exchange's inner step and fragment (the largest step's; a joining member sends JOINING),
        the members' tokens, the run's shape."""
        def claim(opened: Opened, header) -> tuple[float, bool]:
            agreed_steps, agreed_fragment = divmod(int(header.key), FRAGMENT_SPAN)
            opened.steps, opened.fragment = agreed_steps, agreed_fragment - 1
            return tokens, agreed_steps == steps and fragment == opened.fragment != JOINING
        opened = self.meet(steps, float(steps * FRAGMENT_SPAN + fragment + 1), claim)
        if opened.quorum and not opened.failed:
            opened.scale = opened.weights[opened.rank]   # 0 where mine does not count
        return opened

    def meet(self, steps: int, key: float, claim, extra: tuple = ()) -> Opened:
        began = time.perf_counter()
        try:
            return self._meet(steps, key, claim, extra)
        finally:
            self._waited(time.perf_counter() - began)

    def _waited(self, seconds: float):
        if threading.current_thread() is threading.main_thread():
            self.waited += seconds

    def _meet(self, steps: int, key: float, claim, extra: tuple = ()) -> Opened:
        """A quorum (blocking until the members present meet or the join timeout), a heal if my
        group is behind, then the header (parallel/run_shape.py): the largest `key` wins; `claim(
        opened, header)` -> (my tokens, whether they count) once it is known; `extra`: more fields
        agreed by their maximum. A group refused by the others (a second job with its id, or
        another shape) raises ConfigError here; the others skip this exchange."""
        m, why = self.manager, None
        # After a failed quorum a group asks again only once a timeout has passed, so that one cut
        # off spends at most half its time waiting for a Lighthouse it cannot reach (monotonic
        # clocks differ between ranks: the group agrees first, as on every path below).
        if self.any_in_group(time.monotonic() < self.retry_at):
            self.size, self.rank = 1, 0
            return Opened(steps, JOINING, 1, 0, None)
        before = m.state_dict()   # the committed step, which torchft moves to the peer's on a heal
        try:
            m.start_quorum()
        except Exception as e:   # no quorum in time (cut off, Lighthouse away): train on alone
            forget_failed_quorum(m)
            why = type(e).__name__
        received, self._received = self._received, None
        if self.any_in_group(why is not None, within=self.after_torchft):   # every rank of my group takes the same path
            self.retry_at = time.monotonic() + self.timeout_s
            self._event(f"no quorum ({why or 'on another rank of this group'}): this group goes on alone and asks "
                        f"again in {self.timeout_s:g} s")
            self.size, self.rank = 1, 0
            return Opened(steps, JOINING, 1, 0, None)
        if extra:   # my group's ranks send the same fields (each rank's header is over its own process group)
            agreed = torch.tensor([float(x) for x in extra])
            self.ingroup.all_reduce(agreed, op=dist.ReduceOp.MAX)
            extra = agreed.tolist()
        size = m.num_participants()
        if size != self.size:
            self._event(f"quorum of {size} group(s), was {self.size}")
        self.size, self.rank = size, m.participating_rank() or 0
        opened = Opened(steps, JOINING, size, self.rank, None, quorum=True)
        header = Header(Mine(key, before["step"], self.group_id, self.started, self.shape, list(extra)), size,
                        self.rank, self.num_groups)
        top = header.max_vector()
        m.allreduce(top, reduce_op=dist.ReduceOp.MAX).wait()
        read = not m.errored()
        if read:
            header.read_max(top)
        tokens, counts = claim(opened, header) if read else (0.0, False)
        counts = not self.any_in_group(not counts, within=self.after_torchft)   # every rank's, or none
        total = header.sum_vector(tokens, counts) if read else torch.zeros(1, dtype=torch.float64)
        m.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()   # (no-op once the manager has an error)
        if not m.errored():
            header.read_sum(total)
        # Each rank met its own peers: a failure or a refusal seen by one rank is its whole group's.
        errored = m.errored() is not None
        refusal = None if errored else header.refusal()
        failed, refused, some, not_all = self.any_in_group(errored, refusal is not None, received is not None,
                                                            received is None, within=self.after_torchft)
        if refused:
            raise refusal or ConfigError("this group was refused by the others at its join (another rank of it "
                                         "says why)")
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
        opened.healed = healed
        if not failed and (void := header.void()):
            self._event(void)
            m.report_error(RuntimeError(void))
            failed = True
        if failed:   # commit says no in the whole group (torchft: an error on any rank)
            opened.steps, opened.fragment, opened.failed = steps, JOINING, True
            return opened
        opened.weights, opened.run_rounds, opened.counted = header.weights(), header.run_rounds, counts
        opened.leader_steps, opened.extra = int(header.key), header.extra
        opened.groups = [g for g, n in enumerate(header.claims) if n > 0]
        return opened

    def at_start(self, meet) -> Opened:
        """A group's first quorum, `meet()`: while every member is at its start (none has committed
        an exchange) and fewer than --num-groups are there, ask again (nothing committed), for at
        most the exchange timeout: groups started together take their first step together."""
        end = time.monotonic() + self.timeout_s
        while True:
            opened = meet()
            waiting = opened.quorum and not opened.failed and opened.run_rounds == 0 and opened.size < self.num_groups
            if self.any_in_group(not waiting or time.monotonic() >= end):
                return opened
            time.sleep(0.5)

    def any_in_group(self, *flags: bool, within: InGroup | None = None):
        """Each flag, true on any rank of my group (an all-reduce inside the group, `within` the
        plain exchange timeout unless given)."""
        t = torch.tensor([float(f) for f in flags])
        (within or self.ingroup).all_reduce(t, op=dist.ReduceOp.MAX, phase="outer_membership")
        out = [bool(v) for v in t.tolist()]
        return out[0] if len(out) == 1 else out

    def group_sum(self, tensor: torch.Tensor):
        """`tensor` summed over my group's ranks (after the exchange's collectives over torchft's
        process group, which may have timed out on one rank only)."""
        self.after_torchft.all_reduce(tensor)

    waited = 0.0
    deferred = False   # the exchanges run in a thread of their own (zeropp/outer/rounds.py): counted by `settle_bytes`

    def _charge(self, op: str, phase: str, nbytes: int):
        if self.deferred:
            self.charged.append((op, phase, nbytes))
        else:
            self.comm.stats.add(op, phase, 0, nbytes)

    def settle_bytes(self):
        """The bytes of the exchanges issued since the last call into the engine's counts (called by
        the thread that owns those counts)."""
        while self.charged:
            op, phase, nbytes = self.charged.popleft()
            self.comm.stats.add(op, phase, 0, nbytes)

    def all_reduce(self, tensor: torch.Tensor, phase: str, async_op: bool = True) -> Work:
        """A sum over the quorum's members; on a member's failure the tensor is garbage and
        `commit` says False in my whole group (torchft's Manager)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._charge("all_reduce", phase, 2 * (self.size - 1) * nbytes // max(self.size, 1))
        work = Work(self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM), blocked=self._waited)
        if not async_op:
            work.wait()
            return Work()
        return work

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, phase: str) -> Work:
        """`out`: a row per member (by its place in the quorum), over torchft's process group; a
        failure is the Manager's (garbage rows, `commit` says False), as for `all_reduce`."""
        self._charge("all_gather", phase, (self.size - 1) * tensor.numel() * tensor.element_size())
        m = self.manager
        if m.errored():
            return Work()
        try:
            work = self.pg.allgather([list(out.unbind(0))], [tensor], AllgatherOptions())
        except RuntimeError as e:   # e.g. a process group that a failed reconfiguration left unset
            m.report_error(e)
            return Work()
        return Work(_Reported(m, work), blocked=self._waited)

    def commit(self) -> bool:
        """Whether every rank of my group saw the exchange succeed (agreed in the group; a group
        that commits when another did not is behind it at the next quorum and heals)."""
        began = time.perf_counter()
        try:
            return self.manager.should_commit()
        finally:
            self._waited(time.perf_counter() - began)

    def rounds(self) -> int:
        """Exchanges this group has committed (torchft's step; a heal sets it to the peer's)."""
        return self.manager.current_step()

    def layout_key(self):
        return "torchft"

    def state_dict(self) -> dict:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict | None):
        if state:
            self.manager.load_state_dict(state)

    def status(self) -> dict:
        events = []
        while self.events:
            events.append(self.events.popleft())
        return {"quorum_size": self.size, "heals": self.heals, "events": events}

    def _event(self, what: str):
        self.events.append(what)

    def shutdown(self):
        self.manager.shutdown(wait=False)
