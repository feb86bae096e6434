"""Run a function on N local processes joined by gloo, as torchrun would:
the harness the tests and the benchmarks share.

    results = run_distributed(fn, world_size=4, args=(...))   # one result per rank, or raises
    results, error = spawn_ranks(fn, 4, args=(...))           # a failure as a message instead

`fn(rank, world_size, *args)` runs in a fresh (spawned) process with
MASTER_ADDR/PORT, RANK, WORLD_SIZE and LOCAL_RANK set, one torch thread (the
ranks share the machine's cores) and, unless `init_process_group=False`,
torch.distributed initialised with gloo. Its return value (picklable) comes back
in rank order. The first rank to fail, or the timeout, ends the run: the other
ranks may be waiting in a collective, so they are killed.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env, init_process_group):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share the machine's cores
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle: tensors travel by value, not as shared-memory handles
        # that die with this process.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:   # a peer already gone: nothing left to tear down
            pass


def spawn_ranks(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                init_process_group: bool = True) -> tuple[list | None, str | None]:
    """(results in rank order, None), or (None, what went wrong)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env or {},
                                               init_process_group))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, error = {}, None
    deadline = time.monotonic() + timeout
    while len(results) < world_size and error is None:
        try:  # a hung collective must end the run, not stall it
            rank, status, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_module.Empty:
            error = f"timed out after {timeout:.0f} s (hung or too slow); {len(results)}/{world_size} ranks done"
            break
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            error = f"rank {rank}:\n{value}"
    for p in procs:
        p.join(timeout=5 if error else 30)
        if p.is_alive():
            p.kill()
            p.join()
    if error:
        return None, error
    return [results[r] for r in range(world_size)], None


def run_distributed(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                    init_process_group: bool = True) -> list:
    """spawn_ranks, raising RuntimeError with the failing rank's traceback."""
    results, error = spawn_ranks(fn, world_size, args, env, timeout, init_process_group)
    if error:
        raise RuntimeError("distributed run failed\n" + error)
    return results
