"""Notes for the user: `> note: ...` lines printed once per job.

Every rank of a job reads the same flags and config and finds the same things worth saying,
so only rank 0 prints (torchrun's RANK before the process group exists, the group's rank
after), and each distinct text once per process. A note is not a Python warning: it names the
setting and what it does here, with no file path or source line."""
from __future__ import annotations

import os
import sys

_said: set[str] = set()


def job_rank() -> int:
    """This process's rank in its job: the process group's once it exists, torchrun's before."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def note(text: str, *, every_rank: bool = False) -> bool:
    """Print `> note: text` once per job (rank 0), or on every rank with `every_rank` for what is
    one rank's own (that rank's number in front). Returns whether this process printed it."""
    rank = job_rank()
    if (rank != 0 and not every_rank) or text in _said:
        return False
    _said.add(text)
    prefix = f"[rank {rank}] " if every_rank and rank else ""
    print(f"{prefix}> note: {text}", file=sys.stdout, flush=True)
    return True


def forget_notes():
    """Tests and callers that run main() again in one process hear the notes again."""
    _said.clear()
