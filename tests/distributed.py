"""Test helpers for multi-rank runs: the process harness (scenarios/harness/spawn.py,
shared with bench/) and a copy of an engine's checkpoint state.

    results = run_distributed(fn, world_size=4, args=(...))   # one result per rank

`fn(rank, world_size, *args)` runs on every rank with torch.distributed
initialised (gloo); an exception on any rank fails the call with that rank's
traceback. The ranks are a pool kept across tests (scenarios/harness/spawn.py: spawning
and joining gloo once per world size, not once per call, is most of the suite's
time saved); `fresh=True`, or `env=`, gives a call processes of its own.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os

from scenarios.harness import spawn

__all__ = ["run_distributed", "spawn_ranks", "train_ranks", "snapshot", "restore"]


def run_distributed(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                    init_process_group: bool = True, fresh: bool = False) -> list:
    return spawn.run_distributed(fn, world_size, args, env, timeout, init_process_group, pool=not fresh)


def spawn_ranks(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                init_process_group: bool = True, fresh: bool = False) -> tuple[list | None, str | None]:
    return spawn.spawn_ranks(fn, world_size, args, env, timeout, init_process_group, pool=not fresh)


def _train_rank(rank, world_size, argv):
    import train
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))   # as torchrun --standalone sets it
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = train.run(argv)
    return status, out.getvalue()


def train_ranks(nproc: int, argv, timeout: float = 300) -> tuple[int, str]:
    """train.py's run() on `nproc` pooled ranks: (exit status, every rank's output, rank 0 first), as
    `torchrun --standalone --nproc-per-node nproc train.py ...` gives them, without starting a job.
    torchrun itself is under test in test_train_faults.py, test_launch_signals.py and test_cli_errors.py."""
    results = run_distributed(_train_rank, nproc, (list(argv),), timeout=timeout)
    return next((status for status, _ in results if status), 0), "".join(log for _, log in results)


def snapshot(engine) -> tuple[dict, dict]:
    """A copy of what a checkpoint of `engine` holds on this rank."""
    return ({k: v.local.clone() for k, v in engine.checkpoint_state().items()},
            copy.deepcopy(engine.scalar_state()))


def restore(engine, saved: tuple[dict, dict]):
    """Load a snapshot() back, as load_checkpoint does from files."""
    state = engine.checkpoint_state(for_load=True)
    for k, v in state.items():
        v.local.copy_(saved[0][k])
    engine.checkpoint_loaded(state)
    engine.load_scalar_state(copy.deepcopy(saved[1]))
