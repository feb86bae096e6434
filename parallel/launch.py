"""Start-up under torchrun (or as a plain single process)."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_minutes: int = 30) -> torch.device:
    """Join the process group torchrun describes in the environment and return
    this rank's device. Without torchrun's variables, run as one process."""
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if torch.cuda.is_available() and backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print_rank0(*args, **kwargs):
    if rank() == 0:
        print(*args, flush=True, **kwargs)
