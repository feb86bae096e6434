"""Start-up under torchrun (or as a plain single process)."""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common import ConfigError, job_rank


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> torch.device:
    """Join the process group torchrun describes in the environment and return
    this rank's device. Without torchrun's variables, run as one process."""
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if torch.cuda.is_available() and backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    unmap_freed_blocks()
    return torch.device("cpu")


MMAP_THRESHOLD = 64 * 1024   # bytes: glibc's M_MMAP_THRESHOLD on CPU


def unmap_freed_blocks():
    """Training on CPU under glibc: every block of 64 KiB or more gets a mapping of its own,
    returned to the kernel when freed (mallopt(3) M_MMAP_THRESHOLD). Otherwise glibc's threshold
    climbs to the largest block freed so far (up to 32 MiB), and the gathered weights and
    gradient rows freed below it stay in the heap (bench/train_memory.py measures the
    difference). A MALLOC_MMAP_THRESHOLD_ set by the user wins."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # another C library (musl): its own allocator
        return
    libc.mallopt(-3, MMAP_THRESHOLD)   # -3: M_MMAP_THRESHOLD (malloc.h)


def report_error_to_torchrun(line: str):
    """Under torchrun (torch.distributed.elastic), put `line` where its failure
    summary looks for this worker's error (the file @record writes), so the summary
    shows the one line instead of "To enable traceback see ...". Nothing otherwise."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                   "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass   # the summary then shows torchrun's generic text: the line is on stderr anyway


USER_ERROR_KEY = "train/user_error_reported"


def report_user_error(line: str, rank: int, wait_s: float = 60.0):
    """Print a user error once per job. Every rank finds the same error; rank 0 prints it.
    torchrun stops every worker as soon as one exits, so a quiet rank that exited first could
    kill rank 0 before it printed: under torchrun the others wait on the agent's store (it
    lives as long as the job) until rank 0 says it has reported this line. A rank that hears
    nothing, or another line, within `wait_s` prints its own (an error only it found). Under
    other launchers the other ranks stay quiet."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    store = _agent_store(wait_s)
    if rank == 0:
        if store is not None:
            store.set(USER_ERROR_KEY, line)
        return
    if store is not None:
        try:
            store.wait([USER_ERROR_KEY], timedelta(seconds=wait_s))
            if store.get(USER_ERROR_KEY).decode() == line:
                return
        except RuntimeError:   # DistStoreError: rank 0 never reported
            pass
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def _agent_store(timeout_s: float):
    """torchrun's own key-value store (its agent hosts it for the job's life), or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    except (KeyError, ValueError, RuntimeError):
        return None


def rank() -> int:
    """The process group's rank, or torchrun's (RANK) before the group exists."""
    return job_rank()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print_rank0(*args, **kwargs):
    if rank() == 0:
        print(*args, flush=True, **kwargs)


# -- torchrun's exit status on SIGTERM ------------------------------------------------------
# torchrun's agent turns a SIGTERM (or SIGINT) into SignalException: it forwards the signal to
# the workers, waits up to --shutdown-timeout for them, then re-raises, so torchrun exits 1
# with a traceback even when every worker saved and exited 0. `python -m parallel.launch`
# (torchrun's arguments; what scripts/lib/launch.sh runs) runs torchrun and asks the workers
# instead: each marks its start and a clean exit in a directory it is given, and when every
# worker of this node's last attempt exited 0 the launcher exits 0 too.
EXIT_MARKS = "ZEROPP_EXIT_MARKS"


def mark_worker(status: int | None = None):
    """A worker's start (status None) or its exit status, for `python -m parallel.launch`;
    nothing under another launcher."""
    folder = os.environ.get(EXIT_MARKS)
    if not folder:
        return
    name = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.environ.get('LOCAL_RANK', '0')}"
    try:
        with open(os.path.join(folder, name + (".started" if status is None else f".exit{status}")), "w") as f:
            f.write(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except OSError:
        pass   # then the launcher reports torchrun's own status


def workers_exited_cleanly(folder: str) -> tuple[int, int]:
    """(workers of the last attempt that exited 0, workers that attempt had on this node)."""
    marks = os.listdir(folder)
    started = [m for m in marks if m.endswith(".started")]
    if not started:
        return 0, 1
    last = max(int(m.split(".")[0]) for m in started)
    with open(os.path.join(folder, next(m for m in started if int(m.split(".")[0]) == last))) as f:
        expected = int(f.read() or 1)
    return sum(m.startswith(f"{last}.") and m.endswith(".exit0") for m in marks), expected


def torchrun_main(argv: list[str]) -> int:
    """torchrun with `argv`; exit status 0 after a SIGTERM/SIGINT that every worker survived
    by saving and exiting 0, torchrun's own otherwise."""
    import signal
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with tempfile.TemporaryDirectory(prefix="zeropp_exit.") as folder:
        os.environ[EXIT_MARKS] = folder
        try:
            torchrun.main(argv)
        except SignalException as e:
            if e.sigval not in (signal.SIGTERM, signal.SIGINT):
                raise
            clean, expected = workers_exited_cleanly(folder)
            if clean < expected:
                print(f"error: torchrun stopped by {e.sigval.name}: {expected - clean} of {expected} workers "
                      f"on this node did not exit 0 (their lines above say why)", file=sys.stderr, flush=True)
                return 1
            print(f"> torchrun stopped by {e.sigval.name}: all {expected} workers on this node exited 0",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))


def die_with_launcher():
    """Let the kernel end this rank when the process that started it (torchrun's agent) dies:
    a killed launcher must not leave ranks of its group running (Linux prctl PR_SET_PDEATHSIG;
    elsewhere nothing)."""
    import ctypes
    import signal
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:   # the launcher died before the call
        os._exit(1)
