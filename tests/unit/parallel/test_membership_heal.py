"""A heal that reaches only part of a group (parallel/membership.py TorchftGroups.open): torchft
fetches each rank's part of a peer's outer state on its own, so one rank's fetch can fail while
its group's others succeed. The group must load either every rank's part or none, and where it
loads none, put back the committed step torchft moved to the peer's, so that it heals again at
the next quorum. Two ranks of one group as two threads: a stand-in for torchft's Manager on each
(what start_quorum does on a heal: the registered load function called with the fetched state,
the step moved) and a MAX all-reduce between the threads for the group's own agreement."""
import collections
import threading

import torch

from parallel.run_shape import RunShape
from parallel.torchft_groups import TorchftGroups


class GroupComm:
    """The MAX all-reduce of a group of threads."""

    def __init__(self, size: int):
        self.size, self.values, self.barrier = size, [], threading.Barrier(size)

    def all_reduce(self, t, op=None, phase=None):
        self.barrier.wait()
        self.values.append(t.clone())
        self.barrier.wait()
        t.copy_(torch.stack(self.values).amax(0))
        if self.barrier.wait() == 0:
            self.values.clear()
        self.barrier.wait()


class Done:
    def wait(self):
        return True


class Manager:
    """What the membership asks of torchft's Manager, with a heal from a peer at step 7 whose
    fetch fails on this rank or not."""

    def __init__(self, fetch_fails: bool | None):
        self.fetch_fails, self.step, self.error, self.load = fetch_fails, 3, None, None

    def register_state_dict_fn(self, key, load, save):
        self.load = load

    def start_quorum(self):
        if self.fetch_fails:
            self.error = TimeoutError("timed out")
        elif self.fetch_fails is None:   # nothing fetched, nothing said
            pass
        else:
            self.step = 7   # torchft loads the peer's step with its state, then the user's state
            self.load({"from": "peer"})

    def state_dict(self):
        return {"step": self.step, "batches_committed": 0}

    def load_state_dict(self, state):
        self.step = state["step"]

    def errored(self):
        return self.error

    def report_error(self, e):
        self.error = e

    def allreduce(self, t, reduce_op):
        return Done()

    def num_participants(self):
        return 2

    def participating_rank(self):
        return 0

    def current_step(self):
        return self.step


def open_on_two_ranks(fails: tuple):
    comm, out, loaded = GroupComm(2), [None, None], [[], []]

    def rank(r):
        groups = TorchftGroups.__new__(TorchftGroups)
        groups.ingroup = groups.after_torchft = comm
        groups.manager, groups.events = Manager(fails[r]), collections.deque()
        groups.size, groups.rank, groups.heals, groups.timeout_s, groups.retry_at = 1, 0, 0, 10.0, 0.0
        groups.group_id, groups.num_groups, groups.started = 0, 2, 0.0
        groups.register(lambda: {}, loaded[r].append, RunShape({"model": "shape"}))
        out[r] = (groups.open(5, 0, 100), groups.manager)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out, loaded


def test_a_heal_that_reached_part_of_the_group_is_loaded_nowhere_and_comes_again():
    [(o0, m0), (o1, m1)], loaded = open_on_two_ranks((False, True))
    assert loaded == [[], []]                      # never half a group's outer state
    assert o0.failed and o1.failed and not o0.healed and not o1.healed
    assert m0.step == 3 and m1.step == 3           # behind again: the next quorum heals the group
    assert m1.errored() is not None                # should_commit: one rank's no is its group's


def test_a_heal_that_reached_part_of_the_group_without_an_error_is_refused_by_the_group():
    """The same with no error reported (a rank whose state never came, for whatever reason):
    the group reports one itself, so that its commit says no."""
    [(o0, m0), (o1, m1)], loaded = open_on_two_ranks((False, None))
    assert loaded == [[], []] and o0.failed and o1.failed
    assert m0.step == 3 and m0.errored() is not None and m1.errored() is not None


def test_a_heal_that_reached_the_whole_group_is_loaded_on_every_rank():
    out, loaded = open_on_two_ranks((False, False))
    assert loaded == [[{"from": "peer"}], [{"from": "peer"}]]
    assert all(o.healed and not o.failed for o, _ in out)
    assert all(m.step == 7 for _, m in out)
