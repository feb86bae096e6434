"""Run a function on N local processes joined by gloo, as torchrun would:
the harness the tests and the benchmarks share.

    results = run_distributed(fn, world_size=4, args=(...))   # one result per rank, or raises
    results, error = spawn_ranks(fn, 4, args=(...))           # a failure as a message instead

`fn(rank, world_size, *args)` runs on every rank with MASTER_ADDR/PORT, RANK,
WORLD_SIZE and LOCAL_RANK set, one torch thread (the ranks share the machine's
cores) and, unless `init_process_group=False`, torch.distributed initialised with
gloo. Its return value (picklable) comes back in rank order. The first rank to
fail, die, or the timeout, ends the run: the other ranks may be waiting in a
collective, so they are killed.

By default each call starts fresh processes (the benchmarks measure a process's
memory from its start). They are forked from a server process that imported
torch once (multiprocessing's forkserver): a rank started from nothing spends
about 5 s of CPU importing torch and torch._dynamo (which a torch optimizer
imports when it is made), seconds that add up over a suite on 2 cores. A
call with `env=` starts its ranks from nothing (spawn), so that torch's imports
see that environment too. With `pool=True` (the tests' default, tests/distributed.py)
the call runs on a kept set of rank processes of that world size, started and
joined by gloo once: importing torch and joining the group cost seconds per rank
on a small machine, the test bodies milliseconds. Between calls a pooled rank
puts back what a body may leave behind (os.environ, cwd, torch's default dtype,
threads, grad mode and seed, process groups other than the world); a failure,
a death or a timeout ends the pool, and a body that destroys the world ends it
after the call, so the next call starts on fresh processes.
"""
from __future__ import annotations

import atexit
import collections
import gc
import os
import pickle
import signal
import socket
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.torch_private import forget_dtensor_plans

MAX_THREADS = 32   # a pooled rank past this many threads is replaced (gloo groups a body kept alive keep their loops)
MAX_POOLS = 3   # world sizes kept alive at once (the least recently used goes first): 1, 2 and 4 are the common ones
# What the fork server imports once for every rank: torch, torch._dynamo (torch's optimizers import
# it), DCP, and train.py, which imports the project's packages (about 1 s a rank on 2 cores).
# A name the server cannot import is skipped (a caller outside the repository has no train.py).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- in a rank process -----------------------------------------------------------------------------
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _save_state() -> tuple:
    return (dict(os.environ), os.getcwd(), torch.get_default_dtype(), torch.get_num_threads(),
            torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
            [signal.getsignal(s) for s in _SIGNALS])


def _restore_state(saved: tuple) -> bool:
    """Puts back what a body may have changed; False if this process can no longer serve (its
    world was destroyed by the body, or a group would not go)."""
    env, cwd, dtype, threads, grad, deterministic, handlers = saved
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    torch.use_deterministic_algorithms(deterministic)
    for s, handler in zip(_SIGNALS, handlers):   # train.main installs its StopRequest's
        signal.signal(s, handler)
    if not dist.is_initialized():
        return False
    try:  # the body's groups: every rank destroys the same ones, so the next body starts as if fresh
        world = dist.GroupMember.WORLD
        for group in [g for g in dist.distributed_c10d._world.pg_map if g is not world]:
            dist.destroy_process_group(group)
    except Exception:
        return False
    forget_dtensor_plans()   # they hold meshes of the groups just destroyed, found by equal meshes after
    gc.collect()   # frees the groups' gloo contexts, and their threads, once nothing holds them
    try:   # a gloo group still referenced keeps threads that poll its (closed) peers: CPU lost to every test
        return len(os.listdir("/proc/self/task")) <= MAX_THREADS
    except OSError:   # not Linux
        return True


def _alive(pid: int) -> bool:
    """Whether the caller still runs (a forked rank's parent is the fork server, not the caller)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):   # gone, or its pid taken again by another user's process
        return False
    return True


def _worker(rank, world_size, port, conn, env, init_process_group, parent_pid):
    os.environ.clear()   # a forked rank has the fork server's environment: the caller's, as it is now, instead
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share the machine's cores
    fresh_seed = torch.initial_seed()   # each call starts from it, as in a new process
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        while True:
            if not conn.poll(1.0):
                if not _alive(parent_pid):   # the caller is gone (killed): leave at once,
                    os._exit(0)              # without a group teardown that would wait for peers
                continue
            try:
                task = conn.recv_bytes()
            except (EOFError, OSError):   # the test process is gone
                os._exit(0)
            if not task:   # close
                return
            saved = _save_state()
            torch.manual_seed(fresh_seed)
            try:
                fn, args = pickle.loads(task)
                # Plain pickle: tensors travel by value, not as shared-memory handles
                # that die with this process.
                reply = ("ok", pickle.dumps(fn(rank, world_size, *args)))
            except BaseException:
                reply = ("error", traceback.format_exc())
            reusable = _restore_state(saved) if init_process_group else True
            conn.send_bytes(pickle.dumps((*reply, reusable)))
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), False)))
        except Exception:
            pass
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:   # a peer already gone: nothing left to tear down
            pass


# -- in the caller ---------------------------------------------------------------------------------
class _Ranks:
    """world_size rank processes, each serving calls over its own pipe."""

    def __init__(self, world_size: int, env: dict | None = None, init_process_group: bool = True):
        if env:   # torch's imports may read it: a process started from nothing
            ctx = mp.get_context("spawn")
        else:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)   # read when the server starts (once per caller)
        self.world_size = world_size
        port = _free_port()
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self.conns = [mine for mine, _ in pipes]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, theirs, {**os.environ, **(env or {})},
                                                       init_process_group, os.getpid()))
                      for r, (_, theirs) in enumerate(pipes)]
        for p in self.procs:
            p.start()
        for _, theirs in pipes:
            theirs.close()
        self.usable = True

    def call(self, fn, args: tuple, timeout: float) -> tuple[list | None, str | None]:
        """(results in rank order, None), or (None, what went wrong); a failure leaves it unusable."""
        try:
            task = pickle.dumps((fn, args))
            for c in self.conns:
                c.send_bytes(task)
        except Exception:
            self.usable = False
            return None, "could not hand the call to the ranks:\n" + traceback.format_exc()
        results, error = {}, None
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending and error is None:
            left = deadline - time.monotonic()
            # a hung collective must end the run, not stall it; a dead rank ends it at once
            ready = wait([*pending.values(), *(self.procs[r].sentinel for r in pending)], timeout=max(0, left))
            if not ready:
                error = (f"timed out after {timeout:.0f} s (hung or too slow); "
                         f"{self.world_size - len(pending)}/{self.world_size} ranks done")
                break
            for rank in sorted(pending):
                conn = pending[rank]
                if conn.poll():
                    try:
                        status, value, reusable = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):   # the process died mid-call
                        status, value, reusable = "error", self._died(rank), False
                    del pending[rank]
                    self.usable &= reusable
                    if status == "ok":
                        results[rank] = pickle.loads(value)
                    else:
                        error = f"rank {rank}:\n{value}"
                        break
                elif self.procs[rank].sentinel in ready:
                    error = f"rank {rank}:\n{self._died(rank)}"
                    break
        if error:
            self.usable = False
            return None, error
        return [results[r] for r in range(self.world_size)], None

    def _died(self, rank) -> str:
        self.procs[rank].join(timeout=5)
        return f"the process died (exit code {self.procs[rank].exitcode})"

    def close(self, kill: bool = False):
        """Ends the processes: asked to leave (destroying their group), or killed (a peer may be stuck)."""
        if not kill:
            for c in self.conns:
                try:
                    c.send_bytes(b"")
                except Exception:
                    pass
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=5 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


_POOLS: "collections.OrderedDict[int, _Ranks]" = collections.OrderedDict()


def close_pools():
    """Ends every pooled rank process (atexit does it too)."""
    while _POOLS:
        _, ranks = _POOLS.popitem()
        ranks.close(kill=True)   # at exit nothing is worth waiting for


atexit.register(close_pools)   # registered after multiprocessing's own, so it runs before it joins children


def _pooled_call(fn, world_size, args, timeout):
    ranks = _POOLS.pop(world_size, None)
    if ranks is None:
        while len(_POOLS) >= MAX_POOLS:
            _POOLS.popitem(last=False)[1].close()
        ranks = _Ranks(world_size)
    try:
        results, error = ranks.call(fn, args, timeout)
    except BaseException:   # interrupted (Ctrl-C): the ranks are mid-call
        ranks.close(kill=True)
        raise
    if ranks.usable:
        _POOLS[world_size] = ranks   # most recently used last
    else:
        ranks.close(kill=error is not None)
    return results, error


def spawn_ranks(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                init_process_group: bool = True, pool: bool = False) -> tuple[list | None, str | None]:
    """(results in rank order, None), or (None, what went wrong). `pool`: run on the kept rank
    processes of this world size, unless the call needs processes of its own (`env`, no group)."""
    if pool and not env and init_process_group:
        return _pooled_call(fn, world_size, args, timeout)
    ranks = _Ranks(world_size, env, init_process_group)
    results, error = None, "interrupted"
    try:
        results, error = ranks.call(fn, args, timeout)
    finally:
        ranks.close(kill=error is not None)
    return results, error


def run_distributed(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 300,
                    init_process_group: bool = True, pool: bool = False) -> list:
    """spawn_ranks, raising RuntimeError with the failing rank's traceback."""
    results, error = spawn_ranks(fn, world_size, args, env, timeout, init_process_group, pool)
    if error:
        raise RuntimeError("distributed run failed\n" + error)
    return results
