"""Test helpers for multi-rank runs: the process harness (parallel/spawn.py,
shared with bench/) and a copy of an engine's checkpoint state.

    results = run_distributed(fn, world_size=4, args=(...))   # one result per rank

`fn(rank, world_size, *args)` runs in a fresh process with torch.distributed
initialised (gloo); an exception on any rank fails the call with that rank's
traceback.
"""
from __future__ import annotations

import copy

from parallel.spawn import run_distributed

__all__ = ["run_distributed", "snapshot", "restore"]


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
