"""Command line: Megatron-LM's flags (defined in training/flags.py), a YAML file
(`--config`), and a DeepSpeed JSON (`--deepspeed_config`), merged into one set of
arguments and one DeepSpeedConfig.

Precedence: flags given on the command line > YAML > DeepSpeed JSON > defaults.
When a flag (or YAML value) and the JSON disagree the flag wins and the conflict
is reported as a UserWarning. Exception: the learning-rate schedule, where a JSON
`scheduler` and Megatron's schedule flags together are an error (see
training/lr_schedule.py). A JSON `optimizer` section brings DeepSpeed's defaults
for the parameters it leaves out (e.g. weight_decay 0), not the flags' defaults.

The merging with the JSON is in training/deepspeed_args.py.

Every user error (a bad flag value, YAML key, JSON key, or a combination that
would do nothing or the wrong thing) raises zeropp.ConfigError with one line
that names the flag, key or file; train.py prints it and exits with status 2.
Numeric flags check their range as they are parsed (the same check runs on
YAML values), so nothing out of range reaches the model or the loop.
"""
from __future__ import annotations

import argparse
import difflib
import os

import yaml

from training.deepspeed_args import merge_deepspeed_config
from training.flags import NO_TP, Refused, build_parser
from training.lr_schedule import build_lr_schedule
from training.outer import check_outer_args
from common import ConfigError


# Megatron flags that describe features this product does not have: refuse
# values other than the one that means "off".
_MUST_BE = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = _explicit_dests(parser, argv)
    args.from_yaml = set()
    if args.config:
        _apply_yaml(parser, args, explicit)
    args.explicit = explicit
    _check_supported(args)
    args.ds_config = merge_deepspeed_config(args, explicit)
    _check_fp16_only(args)
    _derive(args)
    check_outer_args(args, flag)
    build_lr_schedule(args)  # a JSON scheduler against Megatron's schedule flags fails here, early
    return args


def flag(args, dest: str, value=None) -> str:
    """An option (and its value) as a message names it: `--min-lr 0.5`, or
    `--min-lr 0.5 (from run.yaml)` when the --config YAML set it."""
    text = "--" + dest.replace("_", "-") + ("" if value is None else f" {value}")
    return f"{text} (from {args.config})" if dest in getattr(args, "from_yaml", ()) else text


def _explicit_dests(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Which options the command line set (so that they win over files)."""
    shadow = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            kwargs = {"dest": action.dest, "nargs": action.nargs} if action.nargs is not None else {"dest": action.dest}
            if isinstance(action, (argparse._StoreTrueAction,)):
                kwargs = {"dest": action.dest, "action": "store_true"}
            shadow.add_argument(*action.option_strings, **kwargs)
    return set(vars(shadow.parse_known_args(argv)[0]))


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"--config: no such file {path}")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"--config {path} is {kind}; pass a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a text (UTF-8) file") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"--config {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must be a mapping of flag names to values (key: value lines), "
                          f"got a {type(values).__name__}")
    return values


def _yaml_value(action: argparse.Action, key: str, value, path: str):
    """A YAML value for `action`, checked as strictly as the same flag on the command line."""
    where = f"--config {path}: {key}"
    if isinstance(action, Refused):
        if value in (None, False):
            return None  # "off" asks for what happens anyway
        raise ConfigError(f"{where} is not supported: {action.reason}")
    if action.nargs == 0:  # on/off switches: a YAML true/false, never a string ("false" is true in Python)
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false (unquoted), got {value!r}")
        return value
    if action.nargs == "+":
        items = value if isinstance(value, list) else str(value).split()
        if not items or any(isinstance(v, (list, dict)) for v in items):
            raise ConfigError(f"{where} must be a value or a list of values, got {value!r}")
        return [str(v) for v in items]
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where} takes one value, got {value!r}")
    if isinstance(value, bool) and action.type is None:
        raise ConfigError(f"{where} takes a value, not {str(value).lower()}")
    text = str(value)
    if action.type is not None:
        if isinstance(value, bool):  # str(True) would read as a number-parse error; say it plainly
            expected = getattr(action.type, "expected", "a number")
            raise ConfigError(f"{where} must be {expected}, got {str(value).lower()}")
        try:
            value = action.type(text)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{where}: {e}") from None
    else:
        value = text
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def _apply_yaml(parser, args, explicit: set[str]):
    values = _read_yaml(args.config)
    known = {a.dest: a for a in parser._actions if a.option_strings}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest in ("config", "help"):
            close = difflib.get_close_matches(dest, [d for d, a in known.items() if a.help != argparse.SUPPRESS], n=1)
            hint = f"; did you mean '{close[0].replace('_', '-')}'?" if close else ""
            raise ConfigError(f"--config {args.config}: unknown key '{key}'{hint}")
        if value is None:
            continue  # `key:` with no value keeps the default
        value = _yaml_value(known[dest], key, value, args.config)
        if dest in explicit or value is None:
            continue  # the command line wins
        setattr(args, dest, value)
        explicit.add(dest)
        args.from_yaml.add(dest)


_FP16_ONLY = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def _check_fp16_only(args):
    """Loss-scaling flags act on fp16 training only; in bf16 or fp32 they would do nothing."""
    given = [flag(args, d) for d in _FP16_ONLY if d in args.explicit]
    if given and not args.ds_config.fp16.enabled:
        precision = "bf16" if args.ds_config.bf16.enabled else "fp32"
        raise ConfigError(f"{', '.join(given)} act(s) on fp16 loss scaling only, and this run is {precision} "
                          f"(no loss scaling); drop the flag(s) or train with --fp16")


def _check_supported(args):
    for name, value in _MUST_BE.items():
        if getattr(args, name) != value:
            raise ConfigError(f"{flag(args, name, getattr(args, name))} is not supported: {NO_TP}; "
                              f"use {value}")
    if args.data_impl not in (None, "mmap", "infer"):
        raise ConfigError(f"{flag(args, 'data_impl', args.data_impl)} is not supported: only Megatron's mmap "
                          f".bin/.idx format is read (data.preprocess writes it); use mmap or drop the flag")
    full = args.checkpoint_activations or args.deepspeed_activation_checkpointing
    if args.recompute_activations and (full or args.recompute_granularity == "full"):
        raise ConfigError("--recompute-activations (selective recompute) and full recompute "
                          "(--checkpoint-activations / --recompute-granularity full) are both set; pick one")
    if args.recompute_granularity == "selective" and full:
        raise ConfigError("--recompute-granularity selective and --checkpoint-activations are both set; pick one")
    if args.recompute_method == "block" or args.recompute_num_layers not in (None, 1):
        raise ConfigError("--recompute-method block and --recompute-num-layers above 1 are not supported: "
                          "each transformer block is recomputed on its own (Megatron's uniform method "
                          "with 1 layer); drop these flags")
    selective = args.recompute_activations or args.recompute_granularity == "selective"
    if selective and args.recompute_method is not None:
        raise ConfigError("--recompute-method applies to full recompute only (as in Megatron); drop it "
                          "with selective recompute")
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are both set; pick one")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"{flag(args, 'num_attention_heads', args.num_attention_heads)} must divide "
                          f"{flag(args, 'hidden_size', args.hidden_size)}")
    # Tokenizer files the chosen tokenizer does not read would be ignored: refuse them.
    unused = ("vocab_file", "merge_file") if args.tokenizer_type == "SentencePieceTokenizer" else ("tokenizer_model",)
    unused = [flag(args, d) for d in unused if getattr(args, d) is not None]
    if unused:
        raise ConfigError(f"{', '.join(unused)} has no effect with --tokenizer-type {args.tokenizer_type}; "
                          f"remove it or change --tokenizer-type")
    if args.save_interval is not None and args.save is None:
        raise ConfigError(f"{flag(args, 'save_interval')} has no effect without --save; add --save DIR")


def _derive(args):
    if args.deepspeed_activation_checkpointing or args.recompute_granularity == "full":
        args.checkpoint_activations = True
    if args.recompute_activations:  # Megatron: --recompute-activations means selective recompute
        args.recompute_granularity = "selective"
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"{flag(args, 'seq_length', args.seq_length)} exceeds "
                          f"{flag(args, 'max_position_embeddings', args.max_position_embeddings)}")
    scheduler = args.ds_config.scheduler
    if args.lr is None and scheduler is not None and "warmup_max_lr" in scheduler.params:
        args.lr = args.optimizer_settings.lr = scheduler.params["warmup_max_lr"]  # the schedule's peak
    if args.lr is None:
        raise ConfigError("--lr is required")
    if not args.dry_run:  # the planner needs no data and no length of training
        if args.data_path is None:
            raise ConfigError("--data-path is required")
        if args.train_iters is None and args.train_samples is None:
            raise ConfigError("--train-iters (or --train-samples) is required")
    _check_schedule(args)
    if args.train_samples is None:  # iteration-based; sample-based converts in resolve_batch
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        if args.lr_warmup_fraction is not None and args.lr_decay_iters is not None:
            args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
        _check_warmup(args)
    # Under torchrun the job's shape is known before any work (it sets these before starting
    # us); a single process (world size 1) runs unsharded and ZeRO++ has nothing to do.
    world = int(os.environ.get("WORLD_SIZE", 1))
    ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % ranks_per_node:
        raise ConfigError(f"{flag(args, 'ranks_per_node', ranks_per_node)} must divide the world size "
                          f"{world}; pass a divisor of {world}")
    if "WORLD_SIZE" in os.environ:
        args.ds_config.zero_optimization.validate_topology(ranks_per_node, world)
    if args.sharding == "fsdp2":
        _check_fsdp2(args, ranks_per_node, world)
    elif args.data_parallel_replicate_degree != 1:
        raise ConfigError(f"{flag(args, 'data_parallel_replicate_degree')} is HSDP under --sharding fsdp2; this "
                          f"application's engine shards over every rank (hpZ keeps a copy inside the node): pass "
                          f"--sharding fsdp2 or drop it")


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
    if args.lr_warmup_fraction is not None and (given("lr_warmup_iters") or given("lr_warmup_samples")):
        raise ConfigError(f"{flag(args, 'lr_warmup_fraction')} and an explicit warmup length are both set; "
                          f"keep one")
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
    if args.train_samples is None or args.global_batch_size is None:
        return
    batch = args.global_batch_size
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
    if args.ds_config.scheduler is not None:
        build_lr_schedule(args)  # its check of train_iters against total_num_steps


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
