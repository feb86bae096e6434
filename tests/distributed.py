"""Run a function on N real processes joined by gloo, as torchrun would.

    results = run_distributed(fn, world_size=4, args=(...))   # one result per rank

`fn(rank, world_size, *args)` runs in a fresh process with torch.distributed
initialised; its return value (picklable) comes back in rank order. An
exception on any rank fails the call with that rank's traceback.
"""
from __future__ import annotations

import copy
import os
import pickle
import queue as queue_module
import time
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share 2 cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle: tensors travel by value, not as shared-memory handles
        # that die with this process.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    for _ in range(world_size):
        try:  # a hung collective must fail the test, not stall the suite
            rank, status, value = queue.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue_module.Empty:
            errors.append(f"timed out after {timeout} s with {len(results)}/{world_size} ranks done")
            break
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
            break  # the other ranks may now hang in a collective; stop them
    for p in procs:
        p.join(timeout=5 if errors else 30)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


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
