"""A worker's start-up under torchrun (or as a plain single process): the process group torchrun
describes in the environment and this rank's device, what the C library is told (glibc's mmap
threshold on CPU, the kernel's parent-death signal), and where this rank stands (rank, world size,
a line printed by rank 0). The launcher, `python -m parallel.launch`, is parallel/launch.py."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from common import ConfigError, job_rank


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_devices(backend: str | None = None) -> str:
    """The backend, once this node can run it: NCCL needs a GPU for each of torchrun's ranks here."""
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
    if backend == "nccl" and ranks > gpus:
        raise ConfigError(f"torchrun starts {ranks} ranks on this node and it has {gpus} GPU(s): pass "
                          f"--nproc-per-node {gpus} (GPUS_PER_NODE={gpus} for the launch scripts)")
    return backend


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> torch.device:
    """Join the process group torchrun describes in the environment and return
    this rank's device. Without torchrun's variables, run as one process."""
    backend = check_devices(backend)
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
    gradient rows freed below it stay in the heap (bench/memory/train.py measures the
    difference). A MALLOC_MMAP_THRESHOLD_ set by the user wins."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # another C library (musl): its own allocator
        return
    libc.mallopt(-3, MMAP_THRESHOLD)   # -3: M_MMAP_THRESHOLD (malloc.h)


def die_with_launcher():
    """Let the kernel end this rank when the process that started it (torchrun's agent) dies:
    a killed launcher must not leave ranks of its group running (Linux prctl PR_SET_PDEATHSIG;
    elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:   # the launcher died before the call
        os._exit(1)


def rank() -> int:
    """The process group's rank, or torchrun's (RANK) before the group exists."""
    return job_rank()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print_rank0(*args, **kwargs):
    if rank() == 0:
        print(*args, flush=True, **kwargs)
