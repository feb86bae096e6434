"""Checkpoints: sharded, reshardable on load, and never half-written.

Layout (one directory per saved iteration, Megatron's tracker file on top):

    SAVE/latest_checkpointed_iteration.txt   "100"
    SAVE/iter_0000100/.metadata              torch.distributed.checkpoint (DCP): where each slice lives
    SAVE/iter_0000100/__3_0.distcp           rank 3's slices: its fp32 masters and optimizer moments
    SAVE/iter_0000100/meta.json              iteration, consumed samples, model config, arguments,
                                             loss scaler, every rank's RNG states
    SAVE/iter_0000100/checksums.json         size and CRC-32 of every file above

Every rank writes only what it owns: each tensor of `engine.checkpoint_state()`
is saved as one flat global tensor (`model.<name>`, `optim.<moment>.<name>`),
of which each rank holds the slice its ZeRO partition gives it (a DTensor
sharded on dim 0). DCP records the slices, so a checkpoint loads on any number
of ranks and any stage: each rank reads the parts of the files that overlap
its new slices, never the whole model. 16-bit weights (stage 3's shards,
stages 1-2's full copies) and hpZ's secondary partition are not saved; they
are rebuilt from the fp32 masters.

Atomicity: everything is written into `iter_0000100.tmp` (DCP fsyncs its
files); after every rank has finished, rank 0 writes the checksums and meta,
renames the directory, and only then rewrites the tracker (write, fsync,
rename). A crash, kill or full disk at any point leaves the previous
checkpoint as the latest; a stale `.tmp` directory is removed by the next save.
Loading verifies every checksum first (the files are split over the ranks).
"""
from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import glob
import json
import os
import random
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common import ConfigError
from zeropp.engine import FlatState

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
CHECKSUMS = "checksums.json"
FORMAT_VERSION = 2
# GPTConfig fields that must match to load weights (dropout, recomputation may change)
ARCHITECTURE = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "max_position_embeddings", "make_vocab_size_divisible_by")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""


@dataclass
class SaveResult:
    iteration: int
    path: str
    seconds: float
    bytes_this_rank: int
    bytes_max_rank: int
    bytes_total: int


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj):
    """Rank 0's `obj` on every rank (errors found by rank 0 reach them all)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    """Every rank's `obj`, on rank 0 (others get an empty list)."""
    if not dist.is_initialized():
        return [obj]
    rank, world = _rank_world()
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: str, text: str):
    """Write, fsync, rename: readers see the old file or the new one, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# -- RNG states as JSON -------------------------------------------------------------------
def _rng_state() -> dict:
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _set_rng_state(state: dict):
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


# -- engine state <-> DCP ------------------------------------------------------------------
def _as_dcp(state: dict[str, FlatState], device: torch.device, group=None) -> dict:
    """FlatStates as DCP sees them: a sharded one is a DTensor over all ranks,
    Shard(0) of its flat global tensor (the partition layout is torch.chunk's)."""
    _, world = _rank_world()
    if world == 1:
        return {k: v.local for k, v in state.items()}
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type)
    else:
        mesh = init_device_mesh(device.type, (world,))  # over the default group: no new process group
    return {k: DTensor.from_local(v.local, mesh, [Shard(0)], run_check=False, shape=(v.numel,), stride=(1,))
            if v.sharded else v.local for k, v in state.items()}


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _engine_device(state: dict[str, FlatState]) -> torch.device:
    return next((v.local.device for v in state.values() if v.sharded), torch.device("cpu"))


# -- saving ----------------------------------------------------------------------------------
def check_save_dir(save_dir: str, expected_bytes: int | None = None) -> str | None:
    """Fail now, not after hours of training, if checkpoints cannot be written
    to `save_dir` (a ConfigError naming it). Returns a warning if the disk has
    less free space than `expected_bytes` (one checkpoint), else None."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_test.{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--save {save_dir} is not writable ({e.strerror or e}); "
                          f"pass a directory this job can create and write") from None
    if expected_bytes:
        free = shutil.disk_usage(save_dir).free
        if free < expected_bytes:
            return (f"--save {save_dir}: {free / 2**30:.1f} GiB free, a checkpoint needs about "
                    f"{expected_bytes / 2**30:.1f} GiB")
    return None


def checkpoint_bytes(num_params: int, optimizer_moments: int) -> int:
    """What one checkpoint writes in total: fp32 masters and fp32 moments."""
    return 4 * num_params * (1 + optimizer_moments)


def save_checkpoint(save_dir: str, iteration: int, engine, consumed_train_samples: int, meta: dict,
                    keep_last: int | None = None, storage_writer=None, async_group=None):
    """Collective: every rank calls it. `storage_writer(path)` makes the DCP
    writer (default: FileSystemWriter, fsyncing its files).

    With `async_group` (a gloo process group of all ranks, kept for checkpoints
    so the writer's collectives never interleave with training's), the state is
    copied to CPU memory and written by a background thread;
    a `PendingSave` comes back, whose finish() (every rank, e.g. before the next
    save) completes the checkpoint. Otherwise the files are written now and a
    SaveResult comes back."""
    rank, world = _rank_world()
    start = time.time()
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(save_dir, "iter_*.tmp")):  # left by a crash or kill
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _raise_save_error(save_dir, iteration, _broadcast(error))

    # What the metadata records is taken now: training may go on while the files are written.
    info = dict(meta, format=FORMAT_VERSION, iteration=iteration, consumed_train_samples=consumed_train_samples,
                world_size=world, engine=engine.scalar_state())
    done = _Finisher(save_dir, iteration, tmp, final, info, _rng_state(), keep_last, start)
    state = engine.checkpoint_state()
    writer = (storage_writer or _default_writer)(tmp)
    try:
        if async_group is not None:
            # Our own staging: a CPU copy of this rank's slices, then DCP's save in a thread over the
            # checkpoint group. (DCP's async_save stages by storage and rejects our views into one
            # flat buffer.)
            staged = {k: FlatState(v.local.to("cpu", copy=True), v.numel, v.sharded) for k, v in state.items()}
            future = _background_writer().submit(dcp.save, _as_dcp(staged, torch.device("cpu"), async_group),
                                                 storage_writer=writer, process_group=async_group)
            return PendingSave(done, future, time.time() - start)
        with single_process_quiet():
            dcp.save(_as_dcp(state, _engine_device(state)), storage_writer=writer, no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as e:  # any rank's failure, reported on every rank
        _raise_save_error(save_dir, iteration, e)
    return done()


class PendingSave:
    """A checkpoint whose files a background thread is writing."""

    def __init__(self, finisher, future, blocked_seconds: float):
        self.finisher, self.future, self.blocked_seconds = finisher, future, blocked_seconds
        self.iteration = finisher.iteration

    def finish(self) -> SaveResult:
        """Wait for the files, then checksum, rename and point the tracker at it (collective)."""
        try:
            self.future.result()
        except (Exception, dcp.api.CheckpointException) as e:
            _raise_save_error(self.finisher.save_dir, self.iteration, e)
        return self.finisher()


class _Finisher:
    """The end of a save, once every rank's files are written: checksums and
    metadata by rank 0, the rename, then the tracker."""

    def __init__(self, save_dir, iteration, tmp, final, info, rng, keep_last, start):
        self.save_dir, self.iteration, self.tmp, self.final = save_dir, iteration, tmp, final
        self.info, self.rng, self.keep_last, self.start = info, rng, keep_last, start

    def __call__(self) -> SaveResult:
        rank, _ = _rank_world()
        tmp, final, save_dir = self.tmp, self.final, self.save_dir
        mine = sorted(glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")))
        if rank == 0:
            mine.append(os.path.join(tmp, ".metadata"))
        sums = {os.path.basename(p): [os.path.getsize(p), _crc32(p)] for p in mine}
        gathered = _gather({"checksums": sums, "rng": self.rng})
        error = None
        if rank == 0:
            try:
                info = dict(self.info, rng=[g["rng"] for g in gathered])
                checksums = {name: v for g in gathered for name, v in g["checksums"].items()}
                _write_text(os.path.join(tmp, CHECKSUMS), json.dumps(checksums, indent=1))
                _write_text(os.path.join(tmp, META), json.dumps(info, indent=1, default=str))
                _fsync_dir(tmp)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(save_dir)
                _write_text(os.path.join(save_dir, TRACKER), str(self.iteration))
                if self.keep_last:
                    _prune(save_dir, self.keep_last, self.iteration)
            except OSError as e:
                error = e
        _raise_save_error(save_dir, self.iteration, _broadcast(error))
        sizes = _broadcast([sum(v[0] for v in g["checksums"].values()) for g in gathered])
        return SaveResult(self.iteration, final, time.time() - self.start, sizes[rank], max(sizes), sum(sizes))


_WRITER = []


def _background_writer() -> concurrent.futures.ThreadPoolExecutor:
    """One thread: background saves go one at a time."""
    if not _WRITER:
        _WRITER.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint"))
    return _WRITER[0]


def _default_writer(path: str):
    return dcp.FileSystemWriter(path, sync_files=True)


def _raise_save_error(save_dir: str, iteration: int, error):
    if error is None:
        return
    latest = latest_iteration(save_dir)
    kept = (f"the previous checkpoint (iteration {latest}) is intact and still the latest"
            if latest is not None else "no earlier checkpoint exists there")
    raise CheckpointError(f"could not save iteration {iteration} to {save_dir}: {_reason(error)}; {kept}. "
                          f"Free space there or pass another --save") from error


def _reason(error: BaseException) -> str:
    """One line for an OSError, or for the first rank's failure inside DCP's CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, exc = sorted(failures.items())[0]
        exc = exc[0] if isinstance(exc, tuple) else getattr(exc, "exc", exc)  # DCP keeps (exception, frames)
        return f"rank {rank}: {_reason(exc)}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def _prune(save_dir: str, keep_last: int, newest: int):
    """Remove complete checkpoints older than the `keep_last` newest."""
    done = sorted(complete_iterations(save_dir))
    for it in done[:-keep_last]:
        if it != newest:
            shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)


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


# -- loading ---------------------------------------------------------------------------------
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
        elif _crc32(p) != crc:
            problems.append(f"{p} does not match its checksum (corrupted)")
    return problems


def _verify_distributed(path: str):
    """Every file checked once, the files split over the ranks; all ranks raise the same error."""
    rank, world = _rank_world()
    with open(os.path.join(path, CHECKSUMS)) as f:
        names = sorted(json.load(f))
    problems = verify_checksums(path, names[rank::world])
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


def load_checkpoint(load: str, engine, load_optim: bool = True, load_rng: bool = True,
                    model_config: dict | None = None) -> dict | None:
    """Restore the checkpoint `load` names into `engine`, on any world size and
    ZeRO stage (collective). Returns its meta, or None if there is none yet."""
    rank, world = _rank_world()
    path = resolve_checkpoint(load)
    if path is None:
        return None
    meta = read_meta(path)
    if model_config is not None:
        diff = [f"{k} {meta['model_config'].get(k)} (checkpoint) vs {model_config[k]} (now)"
                for k in ARCHITECTURE if meta["model_config"].get(k) != model_config[k]]
        if diff:
            raise ConfigError(f"--load {path} holds a different model: {'; '.join(diff)}; "
                              f"pass the model flags it was trained with")
    _verify_distributed(path)

    state = engine.checkpoint_state(for_load=True, optimizer=load_optim)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, entry in state.items():
        if key not in stored:
            what = ("optimizer state of another optimizer type; pass --no-load-optim to start a new optimizer"
                    if key.startswith("optim.") else "this model's parameter; check the model flags")
            raise CheckpointError(f"--load {path} has no {key}: {what}")
        if stored[key].size.numel() != entry.numel:
            raise CheckpointError(f"--load {path}: {key} has {stored[key].size.numel()} elements there and "
                                  f"{entry.numel} in this model; pass the model flags it was trained with")
    with single_process_quiet():
        dcp.load(_as_dcp(state, _engine_device(state)), storage_reader=dcp.FileSystemReader(path),
                 no_dist=not dist.is_initialized())
    engine.checkpoint_loaded(state)
    if load_optim:
        engine.load_scalar_state(meta["engine"])
    if load_rng:
        if rank < len(meta["rng"]):
            _set_rng_state(meta["rng"][rank])
        elif rank == len(meta["rng"]):
            print(f"> {path} was saved by {len(meta['rng'])} ranks: ranks from {len(meta['rng'])} on "
                  f"keep their fresh RNG states", flush=True)
    return meta
