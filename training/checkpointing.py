"""train.py's checkpoints, from its flags (as Megatron's megatron/training/checkpointing.py): the
checks of --save before training, the resume from --load, and the Checkpointer with what every
checkpoint records besides the weights (the model, the run, the tokenizer, the command line).
What a checkpoint is and how it is written: training/checkpoint.py."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid

import torch.distributed as dist

from common import ConfigError
from model import num_parameters
from parallel.launch import print_rank0, rank
from training.checkpoint import Checkpointer, Progress, checkpoint_bytes, load_checkpoint, optimizer_moments
from training.checkpoint_16bit import tokenizer_files
from training.checkpoint_files import TOKENIZER_COPIES, CheckpointError, checkpoint_size
from training.preflight import check_save_dir


def make_checkpointer(args, engine, cfg, model, argv, run: str | None) -> Checkpointer:
    """The Checkpointer for --save: `run` is the run resumed (None: a new one)."""
    return Checkpointer(
        args.save, engine, checkpoint_meta(args, cfg, model, argv, run), keep_last=args.keep_last,
        async_save=args.async_save, save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
        overwrite=args.overwrite_checkpoints, consolidated_16bit=gathers_16bit(args),
        files=tokenizer_files(args.tokenizer_model, args.vocab_file, args.merge_file) if rank() == 0 else None)


def preflight_save_dir(args, cfg):
    """Fails if --save is not writable; warns if its disk cannot hold one checkpoint."""
    itemsize = (2 if args.ds_config.bf16.enabled or args.ds_config.fp16.enabled else 4) if gathers_16bit(args) else 0
    expected = checkpoint_bytes(num_parameters(cfg), optimizer_moments(args.optimizer_settings), itemsize)
    warning = check_save_dir(args.save, expected)
    if warning:
        print_rank0(f"> warning: {warning}")


def resume(args, engine, cfg) -> Progress:
    """--load: where to continue from (the start where --load is --save and holds nothing yet:
    training/preflight.py refused every other --load without a checkpoint)."""
    start = time.time()
    try:
        meta = load_checkpoint(args.load, engine, not args.no_load_optim, not args.no_load_rng,
                               model_config=dataclasses.asdict(cfg))
    except CheckpointError as e:   # a damaged checkpoint: the line names the intact one to --load (exit 2)
        raise ConfigError(str(e)) from None
    if meta is None:   # preflight said so in its note
        return Progress()
    if args.finetune:   # Megatron's: the weights only (parse_args set --no-load-optim/-rng), from iteration 0
        print_rank0(f"> --finetune: weights from {args.load}; training starts at iteration 0 (a new run)")
        return Progress()
    iteration, consumed = meta["iteration"], meta["consumed_train_samples"]
    print_rank0(f"> resumed from {args.load} at iteration {iteration}, {consumed} samples consumed "
                f"(saved by {meta['world_size']} ranks; {checkpoint_size(meta['loaded_from']) / 2**20:.1f} MB "
                f"loaded in {time.time() - start:.2f} s)")
    # Checkpoints from before validation progress was kept start validation over.
    return Progress(iteration, consumed, meta.get("consumed_valid_samples", 0), meta.get("run"))


def checkpoint_meta(args, cfg, model, argv, run: str | None) -> dict:
    """What every checkpoint records besides the weights: the model, the run (`run`, resumed, or a new
    one), the tokenizer (its copies in the checkpoint, and where it came from) and the command line."""
    return {"model_config": dataclasses.asdict(cfg),
            "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
            "run": _broadcast_run(run),
            "tokenizer_type": args.tokenizer_type,
            "tokenizer_copies": {key: TOKENIZER_COPIES[key] for key in ("tokenizer_model", "vocab_file", "merge_file")
                                 if getattr(args, key)},
            # absolute: where the copies came from (generate.py and the exporter may run elsewhere)
            "tokenizer_model": absolute(args.tokenizer_model),
            "vocab_file": absolute(args.vocab_file), "merge_file": absolute(args.merge_file),
            "zero_stage": args.zero_stage,
            "argv": sys.argv[1:] if argv is None else argv}


def _broadcast_run(run: str | None) -> str:
    """The run's name: the one resumed, or rank 0's new one on every rank."""
    box = [run or uuid.uuid4().hex]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gathers_16bit(args) -> bool:
    """DeepSpeed's stage3_gather_16bit_weights_on_model_save: the whole 16-bit model beside each checkpoint."""
    return args.ds_config.zero_optimization.stage3_gather_16bit_weights_on_model_save


def absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)
