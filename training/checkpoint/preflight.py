"""train.py's checks of --load and --save before any work: a slip of the hand (a mistyped --load,
a --save holding another run's checkpoints) must not start a run that replaces them, and a --save
that cannot be written, or holds less than one checkpoint's space, is found now, not after hours
of training."""
from __future__ import annotations

import os
import shutil

from common import ConfigError, check_writable_dir, note
from model import num_parameters
from parallel.startup import print_rank0
from training.checkpoint.checkpointer import gathers_16bit
from training.checkpoint.files import (TRACKER, CheckpointError, complete_iterations, iteration_dir, latest_iteration,
                                       read_meta, resolve_checkpoint, run_of)
from training.checkpoint.save import checkpoint_bytes, optimizer_moments


def check_load_path(load: str):
    """--load names an existing directory."""
    if os.path.exists(load) and not os.path.isdir(load):
        raise ConfigError(f"--load {load} is a file; pass the --save directory of a run, or one of its "
                          f"iter_* directories")
    if not os.path.exists(load):
        raise ConfigError(f"--load {load} does not exist; pass the --save directory of a run, or one of its "
                          f"iter_* directories")


def check_checkpoint_dirs(args) -> tuple[str, dict] | None:
    """What --load names and whether --save may take this run's checkpoints, before any work: a slip
    of the hand (a mistyped --load, a --save of another run) must not start a run that replaces them.
    Returns the checkpoint to load and its meta (None: start from scratch)."""
    if gathers_16bit(args) and not args.save:
        note("stage3_gather_16bit_weights_on_model_save writes pytorch_model.bin beside each checkpoint: "
             "nothing without --save")
    try:
        loading = resolve_load(args.load, args.save) if args.load else None
        if args.save:   # --finetune: a new run from iteration 0, whatever it loads
            check_save_holds_no_other_run(args.save, None if args.finetune else loading, args.overwrite_checkpoints)
    except CheckpointError as e:   # damaged: the line names the intact checkpoint to --load instead
        raise ConfigError(str(e)) from None
    return loading


def resolve_load(load: str, save: str | None) -> tuple[str, dict] | None:
    """The checkpoint --load names and its meta.json, or None where there is none yet and --load is
    --save (Megatron's auto-resume: one command starts a run and, restarted, resumes it). Anything
    else without a checkpoint is a mistyped path, not a fresh start: a ConfigError."""
    idiom = save is not None and os.path.realpath(load) == os.path.realpath(save)
    if not (idiom and not os.path.exists(load)):
        check_load_path(load)
    path = resolve_checkpoint(load) if os.path.exists(load) else None
    if path is None and idiom:
        note(f"no checkpoint in --load {load} yet (it is --save): starting from scratch")
        return None
    if path is None:
        raise ConfigError(f"--load {load} holds no checkpoint (no {TRACKER} and no iter_*/meta.json); pass "
                          f"the --save directory of a run, or drop --load to start from scratch")
    return path, read_meta(path)


def check_save_holds_no_other_run(save: str, loading: tuple[str, dict] | None, overwrite: bool):
    """--save must not hold checkpoints this run would replace or move the tracker back from: any,
    starting from scratch; those newer than the one loaded (or of another run at its iteration)."""
    start = loading[1]["iteration"] if loading else None
    run = loading[1].get("run") if loading else None
    tracker = latest_iteration(save) if os.path.isdir(save) else None
    done = complete_iterations(save)
    if start is None:   # from scratch: every checkpoint there is another run's
        others = sorted(set(done) | ({tracker} if tracker is not None else set()))
    elif tracker is not None and tracker > start:   # the tracker would move back
        others = sorted({it for it in done if it > start} | {tracker})
    else:   # another run's checkpoints this run would replace
        others = [it for it in done if it >= start and run_of(iteration_dir(save, it)) != run]
    if not others:
        return
    if overwrite:
        note(f"--overwrite-checkpoints: --save {save} holds checkpoints of another run (iterations "
             f"{_listed(others)}); this run's saves replace those of the same iterations and move "
             f"{TRACKER} to its own")
        return
    what = "this run starts from scratch" if loading is None else f"this run resumes at iteration {start}"
    latest = f", latest {tracker}" if tracker is not None else ""
    raise ConfigError(f"--save {save} holds checkpoints of another run (iterations {_listed(others)}{latest}) and "
                      f"{what}: its saves would replace them and move {TRACKER} back. "
                      f"Pass --load {save} to resume that run, another --save, or --overwrite-checkpoints")


def _listed(iterations: list[int]) -> str:
    its = sorted(set(iterations))
    return ", ".join(map(str, its)) if len(its) <= 6 else f"{its[0]}, {its[1]}, ..., {its[-1]} ({len(its)})"


def preflight_save_dir(args, cfg):
    """Fail now, not after hours of training, if checkpoints cannot be written to --save (a ConfigError
    naming it); warn if its disk has less free space than one checkpoint."""
    check_writable_dir(args.save, "--save")
    itemsize = (2 if args.ds_config.bf16.enabled or args.ds_config.fp16.enabled else 4) if gathers_16bit(args) else 0
    expected = checkpoint_bytes(num_parameters(cfg), optimizer_moments(args.optimizer_settings), itemsize)
    free = shutil.disk_usage(args.save).free
    if free < expected:
        print_rank0(f"> warning: --save {args.save}: {free / 2**30:.1f} GiB free, a checkpoint needs about "
                    f"{expected / 2**30:.1f} GiB")
