"""Command line: Megatron-LM's flags (defined in training/flags.py), a YAML file
(`--config`), and a DeepSpeed JSON (`--deepspeed_config`), merged into one set of
arguments and one DeepSpeedConfig.

Precedence: flags given on the command line > YAML > DeepSpeed JSON > defaults.
A value flag given '' (`--tokenizer-model ''`) takes its default, whatever the YAML says.
When a flag (or YAML value) and the JSON disagree the flag wins and the conflict
is reported in a `> note:` line. Exception: the learning-rate schedule, where a JSON
`scheduler` and Megatron's schedule flags together are an error (see
training/lr_schedule.py). A JSON `optimizer` section brings DeepSpeed's defaults
for the parameters it leaves out (e.g. weight_decay 0), not the flags' defaults.

The merging with the JSON is in training/deepspeed_args.py.

Every user error (a bad flag value, YAML key, JSON key, or a combination that
would do nothing or the wrong thing) is a zeropp.ConfigError naming the flag, key or
file, and every one of them in a command line is reported in the same one-line error
(common.Problems); train.py prints it and exits with status 2.
Numeric flags check their range as they are parsed (the same check runs on
YAML values), so nothing out of range reaches the model or the loop.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

from training.argv import explicit_dests, parse_flags, spellings, take_unset
from training.checkpoint import CheckpointError, read_meta, resolve_checkpoint
from training.deepspeed_args import merge_deepspeed_config
from training.flags import build_parser
from training.lr_schedule import build_lr_schedule
from training.megatron_compat import NO_TP, no_op_note, refused_given
from training.outer_args import check_outer_args, groups_job
from training.yaml_config import apply_yaml
from common import ConfigError, Problems, note


# Megatron flags that describe features this product does not have: refuse
# values other than the one that means "off".
_MUST_BE = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The merged arguments; every problem of the command line, its YAML and its JSON in one ConfigError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    problems = Problems()
    argv, unset = take_unset(parser, argv)
    argv, args, bad = parse_flags(parser, argv, problems)
    args.start_time = time.time()   # --exit-duration-in-mins counts from here
    explicit = explicit_dests(parser, argv)
    args.from_yaml, args.unset, args.no_op_extra, args.notes = set(), unset, [], []
    args.spelled = spellings(parser, argv)
    if args.config:
        with problems.collect():
            bad |= apply_yaml(parser, args, explicit, problems)
    args.explicit = explicit
    for message in refused_given(parser, args):
        problems.add(message)
    # The checks below see a refused value's default instead: what they find about that flag is not news.
    later = Problems()
    if args.use_checkpoint_args and args.load:
        with later.collect():
            _take_checkpoint_args(args)
    _check_supported(args, later)
    args.ds_config = None
    with later.collect():
        args.ds_config = merge_deepspeed_config(args, explicit, later)
    if args.ds_config is not None:   # the checks below read the merged config
        with later.collect():
            _check_fp16_only(args)
        _derive(args, later, bad)
        with later.collect():
            check_outer_args(args, flag)
        if not problems and not later:
            with later.collect():
                build_lr_schedule(args)  # a JSON scheduler against Megatron's schedule flags fails here, early
    names = [re.compile(re.escape(name) + r"(?![\w-])") for d in bad
             for name in {"--" + d.replace("_", "-"), args.spelled.get(d, "")} if name]
    for message in later.messages:
        if not any(name.search(message) for name in names):
            problems.add(message)
    problems.raise_if_any()
    args.groups = groups_job(args)   # the outer mode, typed: what the wiring below the edge reads
    _say_notes(parser, args)
    return args


def _say_notes(parser, args):
    """What the run should know and is not an error: each a `> note:` line, once per job."""
    import torch
    on_cpu = not args.dry_run and not torch.cuda.is_available()
    for text in args.notes:   # the flags' conflicts with the JSON, --use-checkpoint-args
        note(text)
    if on_cpu and args.log_memory_to_tensorboard:
        args.no_op_extra.append("--log-memory-to-tensorboard on CPU (CUDA's allocator statistics; memory/peak-MB "
                                "holds the peak resident memory)")
    text = no_op_note(parser, args)
    if text:
        note(text)
    if on_cpu and args.fp16:
        note("--fp16 on CPU is slower than fp32 (CPUs have no fast fp16 matrix kernels); use --bf16 or drop --fp16")


def flag(args, dest: str, value=None) -> str:
    """An option (and its value) as a message names it: `--min-lr 0.5`, or
    `--min-lr 0.5 (from run.yaml)` when the --config YAML set it; by the name the user wrote
    (`--model-parallel-size 2`, Megatron's old name of --tensor-model-parallel-size)."""
    name = getattr(args, "spelled", {}).get(dest, "--" + dest.replace("_", "-"))
    text = name + ("" if value is None else f" {value}")
    return f"{text} (from {args.config})" if dest in getattr(args, "from_yaml", ()) else text


def _take_checkpoint_args(args):
    """--use-checkpoint-args: the model's shape from the checkpoint in --load, as Megatron takes it."""
    try:
        path = resolve_checkpoint(args.load) if os.path.isdir(args.load) else None
        meta = read_meta(path) if path else None
    except CheckpointError as e:
        raise ConfigError(f"--use-checkpoint-args: {e}") from None
    if meta is None:
        args.notes.append(f"--use-checkpoint-args: no checkpoint in {args.load} yet; the model flags stand")
        return
    taken = []
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                 "make_vocab_size_divisible_by"):
        value = meta["model_config"].get(dest)
        # what the flags would give: unset sizes are derived (model/gpt.py, _derive)
        now = getattr(args, dest) or {"ffn_hidden_size": 4 * args.hidden_size,
                                      "max_position_embeddings": args.seq_length}.get(dest)
        if value is not None and now != value:
            taken.append(f"{flag(args, dest)} {value}")
        if value is not None:
            setattr(args, dest, value)
            args.explicit.add(dest)
    if taken:
        args.notes.append(f"--use-checkpoint-args: {', '.join(taken)} from {path}")


_FP16_ONLY = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def _check_fp16_only(args):
    """Loss-scaling flags act on fp16 training only; in bf16 or fp32 they would do nothing."""
    given = [flag(args, d) for d in _FP16_ONLY if d in args.explicit]
    if given and not args.ds_config.fp16.enabled:
        precision = "bf16" if args.ds_config.bf16.enabled else "fp32"
        raise ConfigError(f"{', '.join(given)} act(s) on fp16 loss scaling only, and this run is {precision} "
                          f"(no loss scaling); drop the flag(s) or train with --fp16")


def _check_supported(args, problems: Problems):
    """Flag values and combinations this product refuses, each one joining `problems`."""
    for name, value in _MUST_BE.items():
        if getattr(args, name) != value:
            problems.add(f"{flag(args, name, getattr(args, name))} is not supported: {NO_TP}; use {value}")
    if args.data_impl not in (None, "mmap", "infer"):
        problems.add(f"{flag(args, 'data_impl', args.data_impl)} is not supported: only Megatron's mmap .bin/.idx "
                     f"format is read (data.preprocess writes it); use mmap or drop the flag")
    full = args.checkpoint_activations or args.deepspeed_activation_checkpointing
    if args.recompute_activations and (full or args.recompute_granularity == "full"):
        problems.add("--recompute-activations (selective recompute) and full recompute "
                     "(--checkpoint-activations / --recompute-granularity full) are both set; pick one")
    if args.recompute_granularity == "selective" and full:
        problems.add("--recompute-granularity selective and --checkpoint-activations are both set; pick one")
    if args.recompute_method == "block" or args.recompute_num_layers not in (None, 1):
        problems.add("--recompute-method block and --recompute-num-layers above 1 are not supported: each "
                     "transformer block is recomputed on its own (Megatron's uniform method with 1 layer); "
                     "drop these flags")
    selective = args.recompute_activations or args.recompute_granularity == "selective"
    if selective and args.recompute_method is not None:
        problems.add("--recompute-method applies to full recompute only (as in Megatron); drop it with selective "
                     "recompute")
    if args.fp16 and args.bf16:
        problems.add("--fp16 and --bf16 are both set; pick one")
    if args.hidden_size % args.num_attention_heads:
        problems.add(f"{flag(args, 'num_attention_heads', args.num_attention_heads)} must divide "
                     f"{flag(args, 'hidden_size', args.hidden_size)}")
    _check_tokenizer_files(args, problems)
    for dest, needs in (("save_interval", "save"), ("no_save_optim", "save"), ("no_save_rng", "save"),
                        ("finetune", "load"), ("use_checkpoint_args", "load")):
        if getattr(args, dest) not in (None, False) and getattr(args, needs) is None:
            problems.add(f"{flag(args, dest)} has no effect without --{needs}; add --{needs} DIR")


def _check_tokenizer_files(args, problems: Problems):
    """Megatron's pretrain_gpt takes GPT-2's BPE by default: --vocab-file/--merge-file without a
    --tokenizer-type mean GPT2BPETokenizer, as there; otherwise sentencepiece. Files the chosen
    tokenizer does not read would be ignored: refused."""
    if args.tokenizer_type is None:
        bpe = args.vocab_file is not None or args.merge_file is not None
        args.tokenizer_type = "GPT2BPETokenizer" if bpe and args.tokenizer_model is None else "SentencePieceTokenizer"
    unused = ("vocab_file", "merge_file") if args.tokenizer_type == "SentencePieceTokenizer" else ("tokenizer_model",)
    unused = [flag(args, d) for d in unused if getattr(args, d) is not None]
    if unused:
        problems.add(f"{', '.join(unused)} has no effect with --tokenizer-type {args.tokenizer_type}; remove it or "
                     f"change --tokenizer-type")


def _derive(args, problems: Problems, bad: set[str] = frozenset()):
    if args.deepspeed_activation_checkpointing or args.recompute_granularity == "full":
        args.checkpoint_activations = True
    if args.recompute_activations:  # Megatron: --recompute-activations means selective recompute
        args.recompute_granularity = "selective"
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
    if args.finetune:   # Megatron: the weights only, from iteration 0 (train.py resets the progress)
        args.no_load_optim = args.no_load_rng = True
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        problems.add(f"{flag(args, 'seq_length', args.seq_length)} exceeds "
                     f"{flag(args, 'max_position_embeddings', args.max_position_embeddings)}")
    scheduler = args.ds_config.scheduler
    if args.lr is None and scheduler is not None and "warmup_max_lr" in scheduler.params:
        args.lr = args.optimizer_settings.lr = scheduler.params["warmup_max_lr"]  # the schedule's peak
    missing = ["--lr"] if args.lr is None and "lr" not in bad else []
    if not args.dry_run:  # the planner needs no data and no length of training
        missing += ["--data-path"] if args.data_path is None and "data_path" not in bad else []
        if args.train_iters is None and args.train_samples is None and not {"train_iters", "train_samples"} & bad:
            missing.append("--train-iters (or --train-samples)")
    if missing:
        problems.add(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    if args.lr is not None:
        with problems.collect():
            _check_schedule(args)
            if args.train_samples is None:  # iteration-based; sample-based converts in resolve_batch
                if args.lr_decay_iters is None:
                    args.lr_decay_iters = args.train_iters
                if args.lr_warmup_fraction is not None and args.lr_decay_iters is not None:
                    args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
                _check_warmup(args)
    with problems.collect():
        _check_topology(args)


def _check_topology(args):
    # Under torchrun the job's shape is known before any work (it sets these before starting
    # us); a single process (world size 1) runs unsharded and ZeRO++ has nothing to do.
    world = int(os.environ.get("WORLD_SIZE", 1))
    ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not args.dry_run:   # the planner checks the flags against --cluster's world (planner/plan.py)
        _check_job_shape(args, world, ranks_per_node)
    if args.sharding == "fsdp2":
        _check_fsdp2(args, ranks_per_node, world)
    elif args.data_parallel_replicate_degree != 1:
        raise ConfigError(f"{flag(args, 'data_parallel_replicate_degree')} is HSDP under --sharding fsdp2; this "
                          f"application's engine shards over every rank (hpZ keeps a copy inside the node): pass "
                          f"--sharding fsdp2 or drop it")


def _check_job_shape(args, world: int, ranks_per_node: int):
    if "WORLD_SIZE" not in os.environ and ranks_per_node > 1:   # emulated nodes, and one process
        raise ConfigError(f"{flag(args, 'ranks_per_node', ranks_per_node)} emulates nodes of {ranks_per_node} "
                          f"ranks, and this is one process: launch with torchrun --nproc-per-node "
                          f"{2 * ranks_per_node} (2 nodes of {ranks_per_node}), or drop --ranks-per-node")
    if world % ranks_per_node:
        raise ConfigError(f"{flag(args, 'ranks_per_node', ranks_per_node)} must divide the world size "
                          f"{world}; pass a divisor of {world}")
    if "WORLD_SIZE" in os.environ:
        args.ds_config.zero_optimization.validate_topology(ranks_per_node, world)


def _check_fsdp2(args, ranks_per_node: int, world: int):
    from zeropp.fsdp.engine import check_fsdp2_config, check_replicas
    if args.dry_run:
        raise ConfigError("--dry-run plans this application's engine; drop --sharding fsdp2 to plan it")
    zero = args.ds_config.zero_optimization
    if zero.auto_switches():
        raise ConfigError("--zeropp auto chooses for this application's engine; under --sharding fsdp2 "
                          "name the switches (--zero-quantized-weights, --zero-hpz-size, ...)")
    check_fsdp2_config(zero, ranks_per_node, world)
    check_replicas(args.data_parallel_replicate_degree, ranks_per_node, world,
                   flag(args, "data_parallel_replicate_degree"))


def _check_schedule(args):
    """Megatron's rules: training and its schedule are counted in iterations or in samples, not both."""
    given = lambda dest: getattr(args, dest) not in (None, 0)  # noqa: E731 (0: the warmup default)
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError(f"{flag(args, 'train_iters')} and {flag(args, 'train_samples')} are both set; "
                          f"keep one (Megatron counts training in iterations or in samples)")
    if args.train_samples is not None:
        wrong = [flag(args, d) for d in ("lr_decay_iters", "lr_warmup_iters") if given(d)]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)} does not fit training counted in samples (--train-samples); "
                              f"use --lr-decay-samples / --lr-warmup-samples")
    else:
        wrong = [flag(args, d) for d in ("lr_decay_samples", "lr_warmup_samples") if given(d)]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)} needs --train-samples (training is counted in iterations "
                              f"here); use --lr-decay-iters / --lr-warmup-iters")
    warmups = [flag(args, d) for d in ("lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples",
                                       "lr_warmup_tokens") if given(d)]
    if len(warmups) > 1:
        raise ConfigError(f"{' and '.join(warmups)} are both set: each is a warmup length; keep one")
    if args.ds_config.scheduler is None and args.min_lr > args.lr:
        raise ConfigError(f"{flag(args, 'min_lr', args.min_lr)} is above {flag(args, 'lr', args.lr)}: the "
                          f"schedule decays from --lr down to --min-lr; lower --min-lr")


def _check_warmup(args):
    if (args.ds_config.scheduler is None and args.lr_decay_style != "constant" and args.lr_decay_iters is not None
            and args.lr_warmup_iters > args.lr_decay_iters):
        raise ConfigError(f"the warmup ({args.lr_warmup_iters} iterations) is longer than the decay "
                          f"(--lr-decay-iters {args.lr_decay_iters}); shorten the warmup or lengthen the decay")


def samples_to_iterations(args):
    """Sample-based training (--train-samples, --lr-*-samples) in iterations, as Megatron
    converts it: iterations = samples // global batch size. Needs the global batch size,
    so resolve_batch calls it; a no-op for iteration-based training."""
    if args.global_batch_size is None:
        return
    batch = args.global_batch_size
    if args.train_samples is not None:
        args.train_iters = args.train_samples // batch
        if args.train_iters < 1:
            raise ConfigError(f"{flag(args, 'train_samples', args.train_samples)} is less than one global batch "
                              f"({batch} samples); raise it or lower the batch size")
        decay_samples = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        args.lr_decay_iters = max(1, decay_samples // batch)
        if args.lr_warmup_fraction is not None:
            args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
        else:
            args.lr_warmup_iters = args.lr_warmup_samples // batch
        _check_warmup(args)
    tokens = _tokens_to_iterations(args)
    if (args.train_samples is not None or tokens) and args.ds_config.scheduler is not None:
        build_lr_schedule(args)  # its check of train_iters against total_num_steps


def _tokens_to_iterations(args):
    """Megatron-DeepSpeed's token counts (--train-tokens, --lr-decay-tokens, --lr-warmup-tokens) in
    iterations of global batch x --seq-length tokens, as it counts tokens without curriculum:
    --train-tokens stops training once that many are consumed, the others set the schedule."""
    per_iteration = args.global_batch_size * args.seq_length
    if args.train_tokens is not None:
        args.train_iters = min(args.train_iters or math.inf, -(-args.train_tokens // per_iteration))
    if args.lr_decay_tokens is not None:
        args.lr_decay_iters = max(1, args.lr_decay_tokens // per_iteration)
    if args.lr_warmup_tokens is not None:
        args.lr_warmup_iters = args.lr_warmup_tokens // per_iteration
    tokens = any(getattr(args, d) is not None for d in ("train_tokens", "lr_decay_tokens", "lr_warmup_tokens"))
    if tokens:
        _check_warmup(args)
    return tokens


def resolve_batch(args, data_parallel_size: int):
    """DeepSpeed's batch arithmetic (runtime/config.py, _set_batch_related_parameters):
    train_batch_size = micro batch x gradient_accumulation_steps x data-parallel size.
    Any two give the third; train_batch_size alone means accumulation 1; a micro batch
    alone means accumulation 1. With neither batch size the micro batch is 1 (Megatron's
    default, where DeepSpeed would refuse). Sets args.micro_batch_size,
    args.global_batch_size, args.gradient_accumulation_steps and the ds_config fields."""
    ds, world = args.ds_config, data_parallel_size
    train, micro, accum = args.global_batch_size, args.micro_batch_size, ds.gradient_accumulation_steps
    explicit = getattr(args, "explicit", set())
    t_name = "--global-batch-size" if "global_batch_size" in explicit else "train_batch_size"
    m_name = "--micro-batch-size" if "micro_batch_size" in explicit else "train_micro_batch_size_per_gpu"
    if train is None and micro is None:
        micro = 1
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world:
            raise ConfigError(
                f"{t_name} {train} != {m_name} {micro} x gradient_accumulation_steps {accum} x "
                f"data-parallel size {world} = {micro * accum * world}; fix one of the three")
    elif train is not None and micro is not None:
        if train % (micro * world):
            raise ConfigError(f"{t_name} {train} must be a multiple of {m_name} {micro} x data-parallel "
                              f"size {world} = {micro * world}")
        accum = train // (micro * world)
    elif train is not None:
        accum = accum or 1
        if train % (accum * world):
            raise ConfigError(f"{t_name} {train} must be a multiple of gradient_accumulation_steps "
                              f"{accum} x data-parallel size {world} = {accum * world}")
        micro = train // (accum * world)
    else:
        accum = accum or 1
        train = micro * accum * world
    args.micro_batch_size = ds.train_micro_batch_size_per_gpu = micro
    args.global_batch_size = ds.train_batch_size = train
    args.gradient_accumulation_steps = ds.gradient_accumulation_steps = accum
    samples_to_iterations(args)
