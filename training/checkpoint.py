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

The files' names, atomic writes and checksums are in training/checkpoint_files.py;
the engine's state as DCP sees it and the RNG states in training/checkpoint_state.py.
"""
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

from common import ConfigError
from parallel.launch import print_rank0, rank, world_size
from training.checkpoint_files import (CHECKSUMS, FORMAT_VERSION, META, TRACKER, CheckpointError, checksums_json,
                                       file_crc32, fsync_dir, iteration_dir, latest_iteration, prune_checkpoints,
                                       read_meta, resolve_checkpoint, verify_on_all_ranks, write_text_atomic)
from training.checkpoint_state import engine_device, rng_state, set_rng_state, single_process_quiet
from training.preflight import check_writable_dir
from zeropp.collectives.partition import as_dcp
from zeropp.outer.diloco import GLOBAL

# GPTConfig fields that must match to load weights (dropout, recomputation may change)
ARCHITECTURE = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "max_position_embeddings", "make_vocab_size_divisible_by")


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
def check_save_dir(save_dir: str, expected_bytes: int | None = None) -> str | None:
    """Fail now, not after hours of training, if checkpoints cannot be written
    to `save_dir` (a ConfigError naming it). Returns a warning if the disk has
    less free space than `expected_bytes` (one checkpoint), else None."""
    check_writable_dir(save_dir, "--save")
    if expected_bytes:
        free = shutil.disk_usage(save_dir).free
        if free < expected_bytes:
            return (f"--save {save_dir}: {free / 2**30:.1f} GiB free, a checkpoint needs about "
                    f"{expected_bytes / 2**30:.1f} GiB")
    return None


def checkpoint_bytes(num_params: int, optimizer_moments: int) -> int:
    """What one checkpoint writes in total: fp32 masters and fp32 moments."""
    return 4 * num_params * (1 + optimizer_moments)


def optimizer_moments(settings) -> int:
    """The fp32 moments per parameter that `settings`' optimizer keeps: Adam 2, SGD 1 with momentum."""
    return {"sgd": int(settings.momentum > 0)}.get(settings.type, 2)


def save_checkpoint(save_dir: str, iteration: int, engine, consumed_train_samples: int, meta: dict,
                    keep_last: int | None = None, storage_writer=None, async_group=None,
                    save_optim: bool = True, save_rng: bool = True):
    """Collective: every rank calls it. `storage_writer(path)` makes the DCP
    writer (default: FileSystemWriter, fsyncing its files).

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
            os.makedirs(save_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(save_dir, "iter_*.tmp")):  # left by a crash or kill
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _raise_save_error(save_dir, iteration, _broadcast(error))

    # The tensors first: taking them may complete what the scalar state then records (an outer
    # exchange in flight, zeropp/outer/diloco.py). The metadata is taken now: training may go on
    # while the files are written.
    state = engine.checkpoint_state(optimizer=save_optim)
    scalars = engine.scalar_state()   # rank 0's is meta.json's "engine"; with groups, each group's too
    topology = engine.comm.topology
    info = dict(meta, format=FORMAT_VERSION, iteration=iteration, consumed_train_samples=consumed_train_samples,
                world_size=world, groups=topology.groups, engine=scalars, optimizer_saved=save_optim)
    own = {"rng": rng_state() if save_rng else None, "engine": scalars}
    done = _Finisher(save_dir, iteration, tmp, final, info, own, keep_last,
                     start, topology.groups)
    writer = (storage_writer or _default_writer)(tmp)
    try:
        if async_group is not None:
            # Our own staging: a CPU copy of this rank's slices, then DCP's save in a thread over the
            # checkpoint group. (DCP's async_save stages by storage and rejects our views into one
            # flat buffer.)
            staged = {k: replace(v, local=v.local.to("cpu", copy=True)) for k, v in state.items()}
            future = _background_writer().submit(dcp.save, as_dcp(staged, torch.device("cpu"), async_group,
                                                                   engine.comm.topology),
                                                 storage_writer=writer, process_group=async_group)
            return PendingSave(done, future, time.time() - start)
        with single_process_quiet():
            dcp.save(as_dcp(state, engine_device(state), topology=engine.comm.topology), storage_writer=writer,
                     no_dist=not dist.is_initialized())
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

    def __init__(self, save_dir, iteration, tmp, final, info, own, keep_last, start, groups=1):
        self.save_dir, self.iteration, self.tmp, self.final = save_dir, iteration, tmp, final
        self.info, self.own, self.keep_last, self.start, self.groups = info, own, keep_last, start, groups

    def __call__(self) -> SaveResult:
        this_rank = rank()
        tmp, final, save_dir = self.tmp, self.final, self.save_dir
        mine = sorted(glob.glob(os.path.join(tmp, f"__{this_rank}_*.distcp")))
        if this_rank == 0:
            mine.append(os.path.join(tmp, ".metadata"))
        sums = {os.path.basename(p): [os.path.getsize(p), file_crc32(p)] for p in mine}
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
                    prune_checkpoints(save_dir, self.keep_last, self.iteration)
            except OSError as e:
                error = e
        _raise_save_error(save_dir, self.iteration, _broadcast(error))
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


# torch's own file writer reports a short write ("... vs 598") without the errno: a save that
# failed on a file system with less than this left is reported as the full disk it is.
_FULL_DISK_BYTES = 64 * 2**20


def _raise_save_error(save_dir: str, iteration: int, error):
    if error is None:
        return
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


@dataclass
class Progress:
    """Where a run stands: what a checkpoint records besides the state, and where a
    resume starts (Megatron's iteration and consumed samples)."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0   # validation continues where it stopped


class Checkpointer:
    """train.py's saves into one directory, each reported in one line. With
    `async_save` the files are written by a background thread while training
    goes on, one save at a time: the next save, or finish(), completes it."""

    def __init__(self, save_dir: str, engine, meta: dict, keep_last: int | None = None, async_save: bool = False,
                 save_optim: bool = True, save_rng: bool = True):
        self.save_dir, self.engine, self.meta, self.keep_last = save_dir, engine, meta, keep_last
        self.save_optim, self.save_rng = save_optim, save_rng
        # Background saves get a gloo group of their own, so the writer's collectives never
        # interleave with training's.
        self.async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.pending: PendingSave | None = None   # the background save in flight

    def save(self, progress: Progress, wait: bool = False) -> str:
        """Save at `progress` (collective), after finishing the save in flight; with `wait`
        a background save is finished too. Returns the checkpoint's directory."""
        self.finish()
        iteration = progress.iteration
        result = save_checkpoint(self.save_dir, iteration, self.engine, progress.consumed_train_samples,
                                 {**self.meta, "consumed_valid_samples": progress.consumed_valid_samples},
                                 keep_last=self.keep_last, async_group=self.async_group,
                                 save_optim=self.save_optim, save_rng=self.save_rng)
        if isinstance(result, PendingSave):
            self.pending = result
            print_rank0(f"> writing checkpoint at iteration {iteration} in the background (training paused "
                        f"{result.blocked_seconds:.2f} s to copy it)")
            if wait:
                self.finish()
        else:
            self._report(result)
        return iteration_dir(self.save_dir, iteration)

    def finish(self):
        """Complete the background save in flight, if any (collective)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._report(pending.finish())

    @staticmethod
    def _report(result: SaveResult):
        print_rank0(f"> saved checkpoint at iteration {result.iteration} to {result.path} in "
                    f"{result.seconds:.2f} s: {result.bytes_total / 2**20:.1f} MB written, "
                    f"{result.bytes_max_rank / 2**20:.1f} MB by the largest rank")


# -- loading ---------------------------------------------------------------------------------
def load_checkpoint(load: str, engine, load_optim: bool = True, load_rng: bool = True,
                    model_config: dict | None = None) -> dict | None:
    """Restore the checkpoint `load` names into `engine`, on any world size and
    ZeRO stage (collective). Returns its meta, or None if there is none yet."""
    this_rank = rank()
    path = resolve_checkpoint(load)
    if path is None:
        return None
    verify_on_all_ranks(path)   # every file, meta.json included, before anything is read from them
    meta = read_meta(path)
    if model_config is not None:
        diff = [f"{k} {meta['model_config'].get(k)} (checkpoint) vs {model_config[k]} (now)"
                for k in ARCHITECTURE if meta["model_config"].get(k) != model_config[k]]
        if diff:
            raise ConfigError(f"--load {path} holds a different model: {'; '.join(diff)}; "
                              f"pass the model flags it was trained with")

    if load_optim and meta.get("optimizer_saved") is False:
        load_optim = False
        print_rank0(f"> {path} was saved without its optimizer state (--no-save-optim): a new optimizer starts")
    topology = engine.comm.topology
    groups, saved_groups = topology.groups, meta.get("groups", 1)
    grouped = saved_groups == groups > 1   # each group's own state end to end (zeropp/outer/diloco.py)
    # Saved by another number of groups: start from the global parameters they shared, optimizers anew.
    regroup = saved_groups > 1 and saved_groups != groups
    scalars = meta["engine"]   # a group's own (loss scale, skipped steps, ...) where it saved them
    if grouped and len(meta.get("engine_groups", [])) == groups:
        scalars = meta["engine_groups"][topology.offset // topology.world_size]
    state = engine.checkpoint_state(for_load=True, optimizer=load_optim and not regroup)
    for key in engine.uncarried_state(scalars) if load_optim and not regroup else []:
        del state[key]   # saved in another layout (or not at all): reset, and load_scalar_state says so
    if regroup:
        state = {GLOBAL + k[len("model."):] if k.startswith("model.") and v.sharded else k: v
                 for k, v in state.items()}
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, entry in state.items():
        if key not in stored:
            what = ("optimizer state of another optimizer type; pass --no-load-optim to start a new optimizer"
                    if key.startswith("optim.") else "this model's parameter; check the model flags")
            raise CheckpointError(f"--load {path} has no {key}: {what}")
        if stored[key].size.numel() != entry.numel * (groups if grouped and entry.sharded and entry.per_group else 1):
            raise CheckpointError(f"--load {path}: {key} has {stored[key].size.numel()} elements there and "
                                  f"{entry.numel} in this model; pass the model flags it was trained with")
    with single_process_quiet():
        dcp.load(as_dcp(state, engine_device(state), None if grouped else topology.world_group,
                        topology if grouped else None), storage_reader=dcp.FileSystemReader(path),
                 no_dist=not dist.is_initialized())
    engine.checkpoint_loaded(state)
    if regroup and this_rank == 0:
        print(f"> {path} was saved by {saved_groups} groups of nodes and this run has {groups}: it starts from "
              f"the global parameters they shared; the optimizer state (inner and outer) starts anew; every group "
              f"takes group 0's loss scale, hysteresis and skipped-step count (its learning rate)", flush=True)
    if load_optim:
        for note in engine.load_scalar_state(scalars):
            if this_rank == 0:
                print(f"> {path}: {note}", flush=True)
    if load_rng:
        if not meta["rng"]:
            print_rank0(f"> {path} was saved without random-number states (--no-save-rng): fresh ones")
        elif this_rank < len(meta["rng"]):
            set_rng_state(meta["rng"][this_rank])
        elif this_rank == len(meta["rng"]):
            print(f"> {path} was saved by {len(meta['rng'])} ranks: ranks from {len(meta['rng'])} on "
                  f"keep their fresh RNG states", flush=True)
    return meta
