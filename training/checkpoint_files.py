"""A checkpoint's files on disk: their names, atomic writes, checksums, and
which iterations in a save directory are complete (see training/checkpoint.py
for the layout and how a save stays atomic)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import zlib

import torch.distributed as dist

from parallel.launch import rank, world_size

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
CHECKSUMS = "checksums.json"
FORMAT_VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str):
    """Write, fsync, rename: readers see the old file or the new one, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# -- which checkpoints a save directory holds ------------------------------------------------
def complete_iterations(root: str) -> list[int]:
    """Iterations in `root` with a finished checkpoint directory."""
    out = []
    for path in glob.glob(os.path.join(root, "iter_*")):
        name = os.path.basename(path)
        if name[5:].isdigit() and os.path.exists(os.path.join(path, META)):
            out.append(int(name[5:]))
    return sorted(out)


def latest_iteration(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{os.path.join(root, TRACKER)} should hold an iteration number, got {text!r}")
    return int(text)


def prune_checkpoints(save_dir: str, keep_last: int, newest: int):
    """Remove complete checkpoints older than the `keep_last` newest."""
    done = sorted(complete_iterations(save_dir))
    for it in done[:-keep_last]:
        if it != newest:
            shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)


def resolve_checkpoint(load: str) -> str | None:
    """The checkpoint directory `--load` names: the tracker's latest in a save
    directory, or an `iter_*` directory itself. None if there is none yet."""
    if os.path.exists(os.path.join(load, META)):
        return load
    it = latest_iteration(load)
    if it is None:
        return None
    path = iteration_dir(load, it)
    if not os.path.exists(os.path.join(path, META)):
        raise CheckpointError(f"--load {load}: the tracker names iteration {it} but {path} is missing or "
                              f"incomplete; point --load at an earlier iter_* directory")
    return path


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is in checkpoint format {meta.get('format', 1)}; this version reads "
                              f"format {FORMAT_VERSION} (sharded, torch.distributed.checkpoint)")
    return meta


# -- integrity -------------------------------------------------------------------------------
def verify_checksums(path: str, files: list[str] | None = None) -> list[str]:
    """Problems found in `files` (default all) of the checkpoint at `path`."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            expected = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{os.path.join(path, CHECKSUMS)}: unreadable ({e})"]
    problems = []
    for name in (files if files is not None else sorted(expected)):
        p = os.path.join(path, name)
        size, crc = expected[name]
        if not os.path.exists(p):
            problems.append(f"{p} is missing")
        elif os.path.getsize(p) != size:
            problems.append(f"{p} has {os.path.getsize(p)} bytes, {size} were written (truncated?)")
        elif file_crc32(p) != crc:
            problems.append(f"{p} does not match its checksum (corrupted)")
    return problems


def verify_on_all_ranks(path: str):
    """Every file checked once, the files split over the ranks; all ranks raise the same error."""
    this_rank, world = rank(), world_size()
    with open(os.path.join(path, CHECKSUMS)) as f:
        names = sorted(json.load(f))
    problems = verify_checksums(path, names[this_rank::world])
    everyone = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(everyone, problems)
    else:
        everyone = [problems]
    problems = [p for ps in everyone for p in ps]
    if problems:
        root = os.path.dirname(os.path.abspath(path))
        bad = int(os.path.basename(path)[5:]) if os.path.basename(path)[5:].isdigit() else None
        good = next((it for it in reversed(complete_iterations(root))
                     if it != bad and not verify_checksums(iteration_dir(root, it))), None)
        hint = (f"load the last good checkpoint with --load {iteration_dir(root, good)}" if good is not None
                else "no other intact checkpoint was found there")
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}"
                              f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; {hint}")
