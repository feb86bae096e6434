"""The pooled rank processes of tests/distributed.py (scenarios/harness/spawn.py): a call runs on kept
processes, a failure comes back as the rank's traceback and ends the pool, a hang times out,
and what a body changes does not reach the next call."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from scenarios.harness import spawn
from tests.distributed import run_distributed, spawn_ranks
from tests import REPO


def whoami(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return os.getpid(), rank, world, t.item(), os.environ.get("POOL_TEST"), torch.get_default_dtype()


def fails_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one's own message")
    dist.barrier()   # rank 0 waits for a peer that has failed: the pool must not be reused
    return rank


def hangs(rank, world):
    if rank == 0:
        dist.barrier()   # rank 1 never comes
    else:
        time.sleep(60)


def dies(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def leaves_state(rank, world):
    drawn = torch.rand(1).item()
    os.environ["POOL_TEST"] = "leaked"
    torch.set_default_dtype(torch.float64)
    dist.new_group([0, 1])
    return drawn


def first_random(rank, world):
    return torch.rand(1).item()


def destroys_world(rank, world):
    dist.destroy_process_group()
    return rank


@pytest.mark.slow
def test_pool_keeps_processes_and_a_failure_restarts_it():
    spawn.close_pools()
    first = run_distributed(whoami, 2)
    assert [r[1:4] for r in first] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert [r[0] for r in run_distributed(whoami, 2)] == [r[0] for r in first]   # the same processes

    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*ValueError: rank one's own message"):
        run_distributed(fails_on_one, 2, timeout=60)
    after = run_distributed(whoami, 2)   # a later call works, on new processes
    assert [r[3] for r in after] == [3.0, 3.0]
    assert not {r[0] for r in after} & {r[0] for r in first}


@pytest.mark.slow
def test_hang_times_out_and_the_next_call_works():
    start = time.monotonic()
    results, error = spawn_ranks(hangs, 2, timeout=3)
    assert results is None and "timed out after 3 s" in error
    assert time.monotonic() - start < 30
    assert [r[3] for r in run_distributed(whoami, 2)] == [3.0, 3.0]


@pytest.mark.slow
def test_dead_rank_ends_the_call_at_once():
    start = time.monotonic()
    results, error = spawn_ranks(dies, 2, timeout=120)
    assert results is None and "rank 1:" in error and "exit code 3" in error
    assert time.monotonic() - start < 30
    assert [r[3] for r in run_distributed(whoami, 2)] == [3.0, 3.0]


def test_body_state_does_not_leak_to_the_next_call():
    drawn = run_distributed(leaves_state, 2)
    for _, _, _, total, env, dtype in run_distributed(whoami, 2):
        assert (total, env, dtype) == (3.0, None, torch.float32)
    assert run_distributed(first_random, 2) == drawn   # each call starts from its process's first seed


@pytest.mark.slow
def test_body_that_destroys_the_world_gets_a_new_one():
    pids = [r[0] for r in run_distributed(whoami, 2)]
    assert run_distributed(destroys_world, 2) == [0, 1]
    again = run_distributed(whoami, 2)
    assert [r[3] for r in again] == [3.0, 3.0] and not set(pids) & {r[0] for r in again}


@pytest.mark.slow
def test_env_gets_processes_of_its_own():
    pooled = {r[0] for r in run_distributed(whoami, 2)}
    own = run_distributed(whoami, 2, env={"POOL_TEST": "mine"})
    assert [r[4] for r in own] == ["mine", "mine"] and not pooled & {r[0] for r in own}


def test_a_fresh_world_sees_the_callers_environment_as_it_is_now(monkeypatch):
    """Fresh ranks are forked from a server started with the first of them: the caller's
    environment must still reach them as it is at the call, as it would reach a spawned process."""
    run_distributed(whoami, 2, fresh=True)   # the fork server is up
    monkeypatch.setenv("POOL_TEST", "set after the server started")
    assert [r[4] for r in run_distributed(whoami, 2, fresh=True)] == ["set after the server started"] * 2


def imported(rank, world):
    import sys
    return [m for m in spawn.PRELOAD if m in sys.modules]


def test_fresh_ranks_start_with_torch_and_the_project_imported():
    """Fresh ranks are forked from a server that imported them once (seconds of CPU a rank
    otherwise); a call with env= starts from nothing, so imports see that environment."""
    assert run_distributed(imported, 2, fresh=True) == [spawn.PRELOAD] * 2
    assert run_distributed(imported, 2, env={"POOL_TEST": "mine"}) == [["torch", "torch.distributed"]] * 2


CALLER = """
import sys, time
sys.path.insert(0, {root!r})
from scenarios.harness import spawn
from tests.unit.scenarios.test_spawn_pool import whoami
if __name__ == "__main__":
    print(*[r[0] for r in spawn.run_distributed(whoami, 2, pool=True)], flush=True)
    time.sleep(300)
"""


def test_ranks_leave_when_their_caller_is_killed(tmp_path):
    """A killed test process (SIGKILL: no atexit) must not leave its pooled ranks waiting for
    work: a forked rank's parent is the fork server, so each rank watches the caller itself."""
    import signal
    import subprocess
    import sys
    script = tmp_path / "caller.py"
    root = str(REPO)
    script.write_text(CALLER.format(root=root))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 2, "the caller never ran its ranks"
        caller.kill()
        caller.wait()
        deadline = time.time() + 30
        while time.time() < deadline and any(_running(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if _running(p)], "ranks outlived their killed caller"
    finally:
        caller.kill()
        for p in pids if "pids" in locals() else []:
            if _running(p):
                os.kill(p, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has left
    except FileNotFoundError:
        return False
