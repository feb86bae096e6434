"""Saving a checkpoint (collective): every rank writes its slices with DCP into `iter_N.tmp`, then
rank 0 writes the checksums and meta.json, renames the directory and moves the tracker; in the
background (`PendingSave`) where asked. What a save refuses (another run's checkpoint, a tracker
moved back), a failed save's one line, and what one checkpoint weighs."""
from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import shutil
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common import note
from parallel.startup import rank, world_size
from training.checkpoint.files import (CHECKSUMS, FORMAT_VERSION, META, TRACKER, CheckpointError, checksums_json,
                                       file_crc32, fsync_dir, iteration_dir, latest_iteration, prune_checkpoints,
                                       run_of, write_text_atomic)
from training.checkpoint.rank0_files import gather_16bit, rank0_file_names, write_rank0_files
from training.checkpoint.state import engine_device, rng_state, single_process_quiet
from zeropp.collectives.partition import as_dcp


@dataclass
class SaveResult:
    iteration: int
    path: str
    seconds: float
    bytes_this_rank: int
    bytes_max_rank: int
    bytes_total: int


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
    this_rank, world = rank(), world_size()
    out = [None] * world if this_rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


# -- saving ----------------------------------------------------------------------------------
def checkpoint_bytes(num_params: int, optimizer_moments: int, consolidated_itemsize: int = 0) -> int:
    """What one checkpoint writes in total: fp32 masters and fp32 moments, and the consolidated model
    with `consolidated_itemsize` bytes per parameter (stage3_gather_16bit_weights_on_model_save)."""
    return num_params * (4 * (1 + optimizer_moments) + consolidated_itemsize)


def optimizer_moments(settings) -> int:
    """The fp32 moments per parameter that `settings`' optimizer keeps: Adam 2, SGD 1 with momentum."""
    return {"sgd": int(settings.momentum > 0)}.get(settings.type, 2)


def save_checkpoint(save_dir: str, iteration: int, engine, consumed_train_samples: int, meta: dict,
                    keep_last: int | None = None, storage_writer=None, async_group=None,
                    save_optim: bool = True, save_rng: bool = True, overwrite: bool = False,
                    files: dict[str, bytes] | None = None, consolidated_16bit: bool = False):
    """Collective: every rank calls it. `storage_writer(path)` makes the DCP
    writer (default: FileSystemWriter, fsyncing its files). `meta["run"]` names
    the run: --keep-last prunes only its checkpoints, and one of another run is
    replaced (or the tracker moved back) only with `overwrite`. Rank 0 writes
    `files` ({name: bytes}, the tokenizer's) into the checkpoint, and with
    `consolidated_16bit` the whole model in the compute dtype (rank0_files.py).

    With `async_group` (a gloo process group of all ranks, kept for checkpoints
    so the writer's collectives never interleave with training's), the state is
    copied to CPU memory and written by a background thread;
    a `PendingSave` comes back, whose finish() (every rank, e.g. before the next
    save) completes the checkpoint. Otherwise the files are written now and a
    SaveResult comes back. `save_optim`, `save_rng`: False for --no-save-optim, --no-save-rng."""
    this_rank, world = rank(), world_size()
    start = time.time()
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    error = None
    if this_rank == 0:
        try:
            error = _refusal(save_dir, iteration, meta.get("run"), overwrite)
            if error is None:
                os.makedirs(save_dir, exist_ok=True)
                for stale in glob.glob(os.path.join(save_dir, "iter_*.tmp")):  # left by a crash or kill
                    shutil.rmtree(stale, ignore_errors=True)
                os.makedirs(tmp)
        except OSError as e:
            error = e
    raise_save_error(save_dir, iteration, _broadcast(error))

    # The tensors first: taking them may complete what the scalar state then records (an outer
    # exchange in flight, zeropp/outer/diloco.py). The metadata is taken now: training may go on
    # while the files are written.
    state = engine.checkpoint_state(optimizer=save_optim)
    scalars = engine.scalar_state()   # rank 0's is meta.json's "engine"; with groups, each group's too
    topology = engine.comm.topology
    whole = gather_16bit(state, meta["param_shapes"], engine.dtype, topology) if consolidated_16bit else None
    files = (files or {}) if this_rank == 0 else {}
    info = dict(meta, format=FORMAT_VERSION, iteration=iteration, consumed_train_samples=consumed_train_samples,
                world_size=world, groups=topology.groups, engine=scalars, optimizer_saved=save_optim)
    own = {"rng": rng_state() if save_rng else None, "engine": scalars}
    done = _Finisher(save_dir, iteration, tmp, final, info, own, keep_last, start, topology.groups,
                     rank0_file_names(files, whole))
    writer = (storage_writer or _default_writer)(tmp)
    try:
        if async_group is not None:
            # Our own staging: a CPU copy of this rank's slices, then DCP's save in a thread over the
            # checkpoint group. (DCP's async_save stages by storage and rejects our views into one
            # flat buffer.)
            staged = {k: replace(v, local=v.local.to("cpu", copy=True)) for k, v in state.items()}

            def write():
                dcp.save(as_dcp(staged, torch.device("cpu"), async_group, engine.comm.topology),
                         storage_writer=writer, process_group=async_group)
                write_rank0_files(tmp, files, whole)
            return PendingSave(done, _background_writer().submit(write), time.time() - start)
        with single_process_quiet():
            dcp.save(as_dcp(state, engine_device(state), topology=engine.comm.topology), storage_writer=writer,
                     no_dist=not dist.is_initialized())
        write_rank0_files(tmp, files, whole)
    except (Exception, dcp.api.CheckpointException) as e:  # any rank's failure, reported on every rank
        raise_save_error(save_dir, iteration, e)
    return done()


def _refusal(save_dir: str, iteration: int, run: str | None, overwrite: bool) -> str | None:
    """Why rank 0 must not save `iteration` of `run` into `save_dir`, if it must not (preflight checked
    it at start; a job writing there since is found here): the tracker would move back, or another
    run's checkpoint of this iteration would be replaced."""
    try:
        latest = latest_iteration(save_dir)
    except CheckpointError:   # an unreadable tracker: replaced by this save's
        latest = None
    final = iteration_dir(save_dir, iteration)
    if os.path.exists(os.path.join(final, META)) and run_of(final) != run and not overwrite:
        return f"{final} holds a checkpoint of another run"
    if latest is not None and latest > iteration:
        if not overwrite:
            return f"its latest checkpoint is iteration {latest}, newer than this one: {TRACKER} would move back"
        note(f"--overwrite-checkpoints: {os.path.join(save_dir, TRACKER)} moves back from {latest} to {iteration}")
    return None


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
            raise_save_error(self.finisher.save_dir, self.iteration, e)
        return self.finisher()


class _Finisher:
    """The end of a save, once every rank's files are written: checksums and
    metadata by rank 0, the rename, then the tracker."""

    def __init__(self, save_dir, iteration, tmp, final, info, own, keep_last, start, groups=1, rank0_files=()):
        self.save_dir, self.iteration, self.tmp, self.final = save_dir, iteration, tmp, final
        self.info, self.own, self.keep_last, self.start, self.groups = info, own, keep_last, start, groups
        self.rank0_files = rank0_files   # written by rank 0 beside the DCP files (the tokenizer, the 16-bit model)

    def __call__(self) -> SaveResult:
        this_rank = rank()
        tmp, final, save_dir = self.tmp, self.final, self.save_dir
        mine = sorted(glob.glob(os.path.join(tmp, f"__{this_rank}_*.distcp")))
        if this_rank == 0:
            mine += [os.path.join(tmp, name) for name in (".metadata", *self.rank0_files)]
        sums = {os.path.relpath(p, tmp): [os.path.getsize(p), file_crc32(p)] for p in mine}
        gathered = _gather({"checksums": sums, **self.own})
        error = None
        if this_rank == 0:
            try:
                info = dict(self.info, rng=[g["rng"] for g in gathered if g["rng"] is not None])
                if self.groups > 1:   # each group's own loss scale, skipped steps (its LR), ...: its first rank's
                    info["engine_groups"] = [g["engine"] for g in gathered[::len(gathered) // self.groups]]
                checksums = {name: v for g in gathered for name, v in g["checksums"].items()}
                meta_path = os.path.join(tmp, META)
                write_text_atomic(meta_path, json.dumps(info, indent=1, default=str))
                checksums[META] = [os.path.getsize(meta_path), file_crc32(meta_path)]
                write_text_atomic(os.path.join(tmp, CHECKSUMS), checksums_json(checksums))
                fsync_dir(tmp)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(save_dir)
                write_text_atomic(os.path.join(save_dir, TRACKER), str(self.iteration))
                if self.keep_last:
                    prune_checkpoints(save_dir, self.keep_last, self.iteration, self.info.get("run"))
            except OSError as e:
                error = e
        raise_save_error(save_dir, self.iteration, _broadcast(error))
        sizes = _broadcast([sum(v[0] for v in g["checksums"].values()) for g in gathered])
        return SaveResult(self.iteration, final, time.time() - self.start, sizes[this_rank], max(sizes), sum(sizes))


_WRITER = []


def _background_writer() -> concurrent.futures.ThreadPoolExecutor:
    """One thread: background saves go one at a time."""
    if not _WRITER:
        _WRITER.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint"))
    return _WRITER[0]


def _default_writer(path: str):
    return dcp.FileSystemWriter(path, sync_files=True)


# -- a save that failed ----------------------------------------------------------------------
# torch's own file writer reports a short write ("... vs 598") without the errno: a save that
# failed on a file system with less than this left is reported as the full disk it is.
_FULL_DISK_BYTES = 64 * 2**20


def raise_save_error(save_dir: str, iteration: int, error):
    """A failed save (an OSError, DCP's failure of any rank, or a refusal's text) as one CheckpointError
    on every rank that names the directory, why, and the checkpoint still intact there."""
    if error is None:
        return
    if isinstance(error, str):   # a refusal (_refusal)
        raise CheckpointError(f"could not save iteration {iteration} to {save_dir}: {error}. Pass "
                              f"--overwrite-checkpoints to let this run replace it, or another --save")
    latest = latest_iteration(save_dir)
    kept = (f"the previous checkpoint (iteration {latest}) is intact and still the latest"
            if latest is not None else "no earlier checkpoint exists there")
    reason = _reason(error)
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    if "No space left on device" not in reason and free is not None and free < _FULL_DISK_BYTES:
        reason = f"No space left on device ({free} bytes free there): {reason}"
    raise CheckpointError(f"could not save iteration {iteration} to {save_dir}: {reason}; {kept}. "
                          f"Free space there or pass another --save") from error


def _reason(error: BaseException) -> str:
    """One line for an OSError, or for the first rank's failure inside DCP's CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        failed_rank, exc = sorted(failures.items())[0]
        exc = exc[0] if isinstance(exc, tuple) else getattr(exc, "exc", exc)  # DCP keeps (exception, frames)
        return f"rank {failed_rank}: {_reason(exc)}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
