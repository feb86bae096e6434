"""A checkpoint's files on disk: their names, atomic writes, the tracker, which iterations in a
save directory are complete (and pruning them), meta.json, checksums, and the one line that names
a damaged checkpoint and the intact one to load instead (training/checkpoint/__init__.py has the
layout and how a save stays atomic)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import zlib

import torch.distributed as dist

from common import note
from parallel.startup import rank, world_size

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
    """The iteration the tracker names (None without a tracker)."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{os.path.join(root, TRACKER)} is unreadable ({e.__class__.__name__}); "
                              f"{_intact_hint(root, None)}") from None
    if not text.isdigit():
        raise CheckpointError(f"{os.path.join(root, TRACKER)} should hold an iteration number, got {text[:40]!r}; "
                              f"{_intact_hint(root, None)}")
    return int(text)


def run_of(path: str) -> str | None:
    """The run that wrote the checkpoint at `path` (meta.json's "run", kept from the checkpoint a run
    resumed from); None for a checkpoint from before runs were named, or an unreadable meta.json."""
    meta, _ = _read_json(os.path.join(path, META))
    return meta.get("run") if meta else None


def prune_checkpoints(save_dir: str, keep_last: int, newest: int, run: str | None):
    """Keep `newest` and the `keep_last` - 1 checkpoints of `run` before it; remove this run's older
    ones. Another run's checkpoints (or this run's newer ones) are never touched."""
    ours = [it for it in complete_iterations(save_dir)
            if it < newest and run_of(iteration_dir(save_dir, it)) == run]
    for it in ours[:max(0, len(ours) - (keep_last - 1))]:
        shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)


def iteration_of(path: str) -> int | None:
    """The iteration of an iter_* directory (None for another name)."""
    name = os.path.basename(os.path.normpath(path))
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def resolve_checkpoint(load: str) -> str | None:
    """The checkpoint directory `--load` names: the tracker's latest in a save
    directory, or an `iter_*` directory itself; without a tracker, the newest
    complete checkpoint there (the tracker is written last, so it can only be
    missing if something removed it). None if there is no checkpoint yet."""
    if os.path.exists(os.path.join(load, META)):
        return load
    if iteration_of(load) is not None and os.path.isdir(load):   # an iter_* directory without its meta
        raise damaged(load, f"{os.path.join(load, META)} is missing (the save did not finish)")
    it = latest_iteration(load)
    if it is None:
        done = complete_iterations(load)
        if not done:
            return None
        it = done[-1]
        note(f"{os.path.join(load, TRACKER)} is missing: loading the newest complete checkpoint, iteration {it}")
    path = iteration_dir(load, it)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, META)):
        raise damaged(path, f"{os.path.join(path, META)} is missing")
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {load}: the tracker names iteration {it} but {path} is missing; "
                              f"{_intact_hint(load, it)}")
    return path


# What meta.json must hold, and of which type, for a load to use it.
META_FIELDS = {"format": int, "iteration": int, "consumed_train_samples": int, "world_size": int,
               "engine": dict, "rng": list, "model_config": dict, "param_shapes": dict}


def _read_meta(path: str) -> tuple[dict | None, str | None]:
    meta, problem = _read_json(os.path.join(path, META))
    if problem is None:
        missing = [k for k, kind in META_FIELDS.items() if not isinstance(meta.get(k), kind)]
        if missing:
            meta, problem = None, f"{os.path.join(path, META)} lacks {', '.join(missing)} (or has the wrong type)"
    return meta, problem


def read_meta(path: str) -> dict:
    """The checkpoint's meta.json, checked: a damaged one is a CheckpointError naming it."""
    meta, problem = _read_meta(path)
    if problem is not None:
        raise damaged(path, problem)
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} is in checkpoint format {meta['format']}; this version reads "
                              f"format {FORMAT_VERSION} (sharded, torch.distributed.checkpoint)")
    return meta


def _read_json(file: str) -> tuple[dict | None, str | None]:
    """(its object, None), or (None, what is wrong with it)."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"{file} is missing"
    except OSError as e:
        return None, f"{file} is unreadable ({e.strerror or e.__class__.__name__})"
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"{file} is not valid JSON ({len(raw)} bytes; {str(e).splitlines()[0][:80]}: truncated or corrupted)"
    if not isinstance(value, dict):
        return None, f"{file} holds a {type(value).__name__}, not a JSON object"
    return value, None


# -- integrity -------------------------------------------------------------------------------
SELF_CRC = "__crc32__"   # checksums.json's own checksum, of its table


def _table_crc(table: dict) -> int:
    return zlib.crc32(json.dumps(table, sort_keys=True).encode())


def checksums_json(table: dict) -> str:
    """checksums.json's text: {file: [size, crc32]} for every file of the checkpoint
    (meta.json included), and the CRC of that table, so a damaged entry is told
    from a damaged file."""
    return json.dumps({**table, SELF_CRC: _table_crc(table)}, indent=1)


def _read_checksums(path: str) -> tuple[dict | None, str | None]:
    """checksums.json's table: {file: [size, crc32]}, or what is wrong with it."""
    file = os.path.join(path, CHECKSUMS)
    table, problem = _read_json(file)
    own = table.pop(SELF_CRC, None) if problem is None else None   # absent in checkpoints from before it
    if problem is None and not all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
                                   for v in table.values()):
        table, problem = None, f"{file} has entries that are not [size, crc32]"
    if problem is None and own is not None and own != _table_crc(table):
        table, problem = None, f"{file} does not match its own checksum (corrupted)"
    if problem is None and not table:
        table, problem = None, f"{os.path.join(path, CHECKSUMS)} lists no files"
    return table, problem


def checkpoint_size(path: str) -> int:
    """The bytes of every file of the (verified) checkpoint at `path`, as checksums.json lists them."""
    table, problem = _read_checksums(path)
    return sum(size for size, _ in table.values()) if problem is None else 0


def verify_checksums(path: str, files: list[str] | None = None) -> list[str]:
    """Problems found in `files` (default all) of the checkpoint at `path`, its
    checksums.json included."""
    expected, problem = _read_checksums(path)
    if problem is not None:
        return [problem]
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


def _intact(path: str) -> bool:
    return _read_meta(path)[1] is None and not verify_checksums(path)


def _intact_hint(root: str, bad: int | None) -> str:
    """Where to load from instead: the newest intact checkpoint in `root` other than `bad`."""
    good = next((it for it in reversed(complete_iterations(root)) if it != bad and _intact(iteration_dir(root, it))),
                None)
    return (f"load the last good checkpoint with --load {iteration_dir(root, good)}" if good is not None
            else "no other intact checkpoint was found there")


def damaged(path: str, problem: str) -> CheckpointError:
    """The one-line error for a damaged checkpoint: what is wrong, and what to load instead."""
    root = os.path.dirname(os.path.abspath(path))
    return CheckpointError(f"checkpoint {path} is damaged: {problem}; {_intact_hint(root, iteration_of(path))}")


def verify_on_all_ranks(path: str):
    """Every file checked once, the files split over the ranks; all ranks raise the same error."""
    this_rank, world = rank(), world_size()
    expected, problem = _read_checksums(path)   # every rank reads the same file: the same outcome
    if problem is not None:
        raise damaged(path, problem)
    problems = verify_checksums(path, sorted(expected)[this_rank::world])
    everyone = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(everyone, problems)
    else:
        everyone = [problems]
    problems = [p for ps in everyone for p in ps]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise damaged(path, problems[0] + more)
