"""train.py's checkpoints, from its flags (as Megatron's megatron/training/checkpointing.py): where a
run stands (`Progress`), the resume from --load, and the `Checkpointer` that saves into --save with
what every checkpoint records besides the weights (the model, the run, the tokenizer, the command
line), each save reported in one line, in the background with --async-save."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from common import ConfigError
from parallel.startup import print_rank0, rank
from training.checkpoint.files import CheckpointError, checkpoint_size, iteration_dir
from training.checkpoint.load import load_checkpoint
from training.checkpoint.rank0_files import TOKENIZER_COPIES, tokenizer_files
from training.checkpoint.save import PendingSave, SaveResult, save_checkpoint


@dataclass
class Progress:
    """Where a run stands: what a checkpoint records besides the state, and where a
    resume starts (Megatron's iteration and consumed samples)."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0   # validation continues where it stopped
    run: str | None = None            # the run resumed (meta.json's "run"); None: a new one


class Checkpointer:
    """train.py's saves into one directory, each reported in one line. With
    `async_save` the files are written by a background thread while training
    goes on, one save at a time: the next save, or finish(), completes it."""

    def __init__(self, save_dir: str, engine, meta: dict, keep_last: int | None = None, async_save: bool = False,
                 save_optim: bool = True, save_rng: bool = True, overwrite: bool = False,
                 files: dict[str, bytes] | None = None, consolidated_16bit: bool = False):
        self.save_dir, self.engine, self.meta, self.keep_last = save_dir, engine, meta, keep_last
        self.options = dict(save_optim=save_optim, save_rng=save_rng, overwrite=overwrite, files=files or {},
                            consolidated_16bit=consolidated_16bit)
        # Background saves get a gloo group of their own, so the writer's collectives never
        # interleave with training's.
        self.async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.pending: PendingSave | None = None   # the background save in flight

    def save(self, progress: Progress, wait: bool = False) -> str:
        """Save at `progress` (collective), after finishing the save in flight; with `wait`
        a background save is finished too. Returns the checkpoint's directory."""
        self.finish()
        iteration = progress.iteration
        print_rank0(f"> saving checkpoint at iteration {iteration:7d} to {self.save_dir}")   # Megatron's line
        result = save_checkpoint(self.save_dir, iteration, self.engine, progress.consumed_train_samples,
                                 {**self.meta, "consumed_valid_samples": progress.consumed_valid_samples},
                                 keep_last=self.keep_last, async_group=self.async_group, **self.options)
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


def make_checkpointer(args, engine, cfg, model, argv, run: str | None) -> Checkpointer:
    """The Checkpointer for --save: `run` is the run resumed (None: a new one)."""
    return Checkpointer(
        args.save, engine, checkpoint_meta(args, cfg, model, argv, run), keep_last=args.keep_last,
        async_save=args.async_save, save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
        overwrite=args.overwrite_checkpoints, consolidated_16bit=gathers_16bit(args),
        files=tokenizer_files(args.tokenizer_model, args.vocab_file, args.merge_file) if rank() == 0 else None)


def resume(args, engine, cfg) -> Progress:
    """--load: where to continue from (the start where --load is --save and holds nothing yet:
    preflight.py refused every other --load without a checkpoint)."""
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
