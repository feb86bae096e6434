"""Command line: Megatron-LM's flags, a YAML file (`--config`), and a
DeepSpeed JSON (`--deepspeed_config`).

Precedence: flags given on the command line > YAML > DeepSpeed JSON > defaults.
When a flag (or YAML value) and the JSON disagree the flag wins and the conflict
is reported as a UserWarning. Exception: the learning-rate schedule, where a JSON
`scheduler` and Megatron's schedule flags together are an error (see
training/lr_schedule.py). A JSON `optimizer` section brings DeepSpeed's defaults
for the parameters it leaves out (e.g. weight_decay 0), not the flags' defaults.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import warnings

import yaml

from data.tokenizer import TOKENIZER_TYPES
from training.lr_schedule import build_lr_schedule
from zeropp.config import ConfigError, DeepSpeedConfig, OptimizerSettings, load_json, parse_int


def _int(text: str) -> int:
    """Integers, also written as 5e8."""
    try:
        return parse_int(text, "value")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GPT-2 pretraining with ZeRO / ZeRO++", allow_abbrev=False)
    p.add_argument("--config", help="YAML file of flag values (keys as flag names); flags override it")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=12)
    g.add_argument("--hidden-size", type=int, default=768)
    g.add_argument("--num-attention-heads", type=int, default=12)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=1024)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each transformer block in backward")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="same as --checkpoint-activations (DeepSpeed's name)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with GPUs, gloo on CPU")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes of this many ranks (default: torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; torchrun's LOCAL_RANK is used instead")

    g = p.add_argument_group("ZeRO (DeepSpeed-compatible)")
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility; always on")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                   help="DeepSpeed-style JSON (.json or .config)")
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])
    g.add_argument("--zero-hpz-size", type=int, default=None, help="zero_hpz_partition_size")
    g.add_argument("--zero-quantized-weights", action="store_true", default=None)
    g.add_argument("--zero-quantized-gradients", action="store_true", default=None)
    g.add_argument("--zero-reduce-bucket-size", type=_int, default=None)

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=int, default=None,
                   help="per rank (--batch-size is Megatron's old name)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size (no accumulation)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=None, help="global gradient norm; 0 = off (default 1.0)")
    g.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam",
                   help="adam and adamw both decouple weight decay, as Megatron's adam")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum of --optimizer sgd")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="default 2**16")
    g.add_argument("--min-loss-scale", type=float, default=None)
    g.add_argument("--loss-scale-window", type=int, default=None)
    g.add_argument("--hysteresis", type=int, default=None)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="PREFIX, or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None, help="where index .npy files go (default: beside the data)")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=list(TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)

    g = p.add_argument_group("checkpointing, evaluation, logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--keep-last", type=int, default=None,
                   help="keep the K newest checkpoints in --save; older ones go once a newer one is complete")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training continues")
    g.add_argument("--max-nan-iters", type=int, default=None,
                   help="stop (saving the last good state) after this many consecutive non-finite losses")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100,
                   help="default: steps_per_print of --deepspeed_config if it sets it, else 100")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("planning")
    g.add_argument("--dry-run", action="store_true",
                   help="print the memory, communication and time plan for --cluster and exit (no training)")
    g.add_argument("--cluster", default=None, help="cluster description YAML for --dry-run (configs/clusters/)")
    return p


# Megatron flags that describe features this product does not have: refuse
# values other than the one that means "off".
_MUST_BE = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = _explicit_dests(parser, argv)
    if args.config:
        _apply_yaml(parser, args, explicit)
    args.explicit = explicit
    _check_supported(args)
    args.ds_config = _merge_deepspeed_config(args, explicit)
    _derive(args)
    build_lr_schedule(args)  # a JSON scheduler against Megatron's schedule flags fails here, early
    return args


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


def _apply_yaml(parser, args, explicit: set[str]):
    try:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
    except FileNotFoundError:
        parser.error(f"--config: no such file {args.config}")
    if not isinstance(values, dict):
        parser.error(f"--config {args.config} must be a mapping of flag names to values")
    known = {a.dest: a for a in parser._actions if a.option_strings}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest not in known or dest == "config":
            close = difflib.get_close_matches(dest, list(known), n=1)
            hint = f"; did you mean '{close[0].replace('_', '-')}'?" if close else ""
            parser.error(f"--config {args.config}: unknown key '{key}'{hint}")
        if dest in explicit:
            continue  # the command line wins
        action = known[dest]
        if action.type is not None and isinstance(value, str):
            value = action.type(value)  # e.g. "5e8" for an integer flag
        if action.choices is not None and value not in action.choices:
            parser.error(f"--config {args.config}: {key} must be one of {list(action.choices)}, got {value!r}")
        if action.nargs == "+" and not isinstance(value, list):
            value = str(value).split()
        setattr(args, dest, value)
        explicit.add(dest)


def _check_supported(args):
    for name, value in _MUST_BE.items():
        if getattr(args, name) != value:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(args, name)} is not supported: this product does data "
                              f"parallelism with ZeRO sharding only; use {flag} {value}")
    if args.recompute_granularity == "selective":
        raise ConfigError("--recompute-granularity selective is not supported; use full "
                          "(or --checkpoint-activations)")
    if args.recompute_method == "block" or args.recompute_num_layers not in (None, 1):
        raise ConfigError("--recompute-method block and --recompute-num-layers above 1 are not supported: "
                          "each transformer block is recomputed on its own (Megatron's uniform method "
                          "with 1 layer); drop these flags")
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are both set; pick one")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} must divide "
                          f"--hidden-size {args.hidden_size}")


_GIVEN = object()  # merge(): "take the flag's value if it was given"
# Megatron's --optimizer names -> OptimizerSettings.type (Megatron's adam decouples weight decay).
_MEGATRON_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def _merge_deepspeed_config(args, explicit: set[str]) -> DeepSpeedConfig:
    """One DeepSpeedConfig from the JSON and the flags; flags win and conflicts are reported."""
    path = args.deepspeed_config
    raw = load_json(path) if path else {}
    ds = DeepSpeedConfig.from_dict(raw, where=path or "defaults")
    in_file = _dotted_keys(raw)
    zero = ds.zero_optimization

    def merge(dest, json_key, obj, attr, value=_GIVEN, shown=None):
        """An explicit flag (command line or YAML) wins over the JSON; a disagreement is reported."""
        if value is _GIVEN:
            value = getattr(args, dest) if dest in explicit else None
        if value is None:
            return
        if json_key in in_file and getattr(obj, attr) != value:
            _conflict(dest, value if shown is None else shown, json_key, getattr(obj, attr), path)
        setattr(obj, attr, value)

    merge("zero_stage", "zero_optimization.stage", zero, "stage")
    merge("zero_hpz_size", "zero_optimization.zero_hpz_partition_size", zero, "zero_hpz_partition_size")
    merge("zero_quantized_weights", "zero_optimization.zero_quantized_weights", zero, "zero_quantized_weights")
    merge("zero_quantized_gradients", "zero_optimization.zero_quantized_gradients", zero,
          "zero_quantized_gradients")
    merge("zero_reduce_bucket_size", "zero_optimization.reduce_bucket_size", zero, "reduce_bucket_size")
    merge("fp16", "fp16.enabled", ds.fp16, "enabled")
    merge("bf16", "bf16.enabled", ds.bf16, "enabled")
    merge("loss_scale", "fp16.loss_scale", ds.fp16, "loss_scale")
    if "initial_loss_scale" in explicit:  # the flag is a scale, the JSON a power of two
        merge("initial_loss_scale", "fp16.initial_scale_power", ds.fp16, "initial_scale_power",
              value=int(math.log2(args.initial_loss_scale)), shown=args.initial_loss_scale)
    merge("min_loss_scale", "fp16.min_loss_scale", ds.fp16, "min_loss_scale")
    merge("loss_scale_window", "fp16.loss_scale_window", ds.fp16, "loss_scale_window")
    merge("hysteresis", "fp16.hysteresis", ds.fp16, "hysteresis")
    merge("clip_grad", "gradient_clipping", ds, "gradient_clipping")
    if "gradient_clipping" not in in_file and args.clip_grad is None:
        ds.gradient_clipping = 1.0  # Megatron's default
    merge("micro_batch_size", "train_micro_batch_size_per_gpu", ds, "train_micro_batch_size_per_gpu")
    merge("global_batch_size", "train_batch_size", ds, "train_batch_size")
    # steps_per_print is the default of --log-interval: file over built-in default, flag over file.
    merge("log_interval", "steps_per_print", ds, "steps_per_print")
    if "steps_per_print" in in_file:
        args.log_interval = ds.steps_per_print
    ds.steps_per_print = args.log_interval
    args.optimizer_settings = _optimizer_settings(args, ds, explicit, in_file, merge)
    # The flags now mirror the merged config.
    args.fp16, args.bf16 = ds.fp16.enabled, ds.bf16.enabled
    args.zero_stage = zero.stage
    args.micro_batch_size = ds.train_micro_batch_size_per_gpu   # None: resolve_batch derives it
    args.global_batch_size = ds.train_batch_size
    args.clip_grad = ds.gradient_clipping
    ds.validate("flags and --deepspeed_config")
    return ds


def _conflict(dest: str, value, json_key: str, json_value, path: str):
    warnings.warn(f"--{dest.replace('_', '-')} {value} conflicts with {json_key}={json_value} "
                  f"in {path}; using the flag", UserWarning, stacklevel=3)


def _optimizer_settings(args, ds: DeepSpeedConfig, explicit: set[str], in_file: set[str],
                        merge) -> OptimizerSettings:
    """The optimizer from the flags, or from the JSON's optimizer section with explicit flags on top."""
    flag_type = _MEGATRON_OPTIMIZERS[args.optimizer]
    if ds.optimizer is None:
        settings = OptimizerSettings(type=flag_type, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                     eps=args.adam_eps, weight_decay=args.weight_decay,
                                     momentum=args.sgd_momentum if flag_type == "sgd" else 0.0)
    else:
        # What the JSON leaves out takes DeepSpeed's defaults for its optimizer, not the flags'.
        settings = ds.optimizer.settings()
        if "optimizer" in explicit and flag_type != settings.type:
            _conflict("optimizer", f"{args.optimizer} ({flag_type})", "optimizer.type",
                      f"{ds.optimizer.type} ({settings.type})", args.deepspeed_config)
            settings.type = flag_type
        merge("lr", "optimizer.params.lr", settings, "lr")
        merge("weight_decay", "optimizer.params.weight_decay", settings, "weight_decay")
        merge("adam_eps", "optimizer.params.eps", settings, "eps")
        merge("sgd_momentum", "optimizer.params.momentum", settings, "momentum")
        betas = list(settings.betas)
        for i, dest in enumerate(("adam_beta1", "adam_beta2")):
            if dest in explicit:
                if "optimizer.params.betas" in in_file and betas[i] != getattr(args, dest):
                    _conflict(dest, getattr(args, dest), f"optimizer.params.betas[{i}]", betas[i],
                              args.deepspeed_config)
                betas[i] = getattr(args, dest)
        settings.betas = tuple(betas)
    args.lr, args.weight_decay, args.adam_eps = settings.lr, settings.weight_decay, settings.eps
    args.adam_beta1, args.adam_beta2 = settings.betas
    if settings.type == "sgd":
        args.sgd_momentum = settings.momentum
    # Flags of the other optimizer would do nothing: refuse them rather than ignore them.
    idle = ("adam_beta1", "adam_beta2", "adam_eps") if settings.type == "sgd" else ("sgd_momentum",)
    idle = [dest for dest in idle if dest in explicit]
    if idle:
        raise ConfigError(f"{', '.join('--' + d.replace('_', '-') for d in idle)} has no effect with "
                          f"optimizer {settings.type}; remove it")
    return settings


def _dotted_keys(raw: dict, prefix: str = "") -> set[str]:
    """Dotted names of the keys a JSON object sets (to tell file values from defaults)."""
    keys = set()
    for k, v in raw.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= _dotted_keys(v, prefix + k + ".")
    return keys


def _derive(args):
    if args.deepspeed_activation_checkpointing or args.recompute_granularity == "full":
        args.checkpoint_activations = True
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    scheduler = args.ds_config.scheduler
    if args.lr is None and scheduler is not None and "warmup_max_lr" in scheduler.params:
        args.lr = args.optimizer_settings.lr = scheduler.params["warmup_max_lr"]  # the schedule's peak
    for name in ("train_iters", "lr", "data_path"):
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # Under torchrun the job's shape is known before any work (it sets these before starting
    # us); a single process (world size 1) runs unsharded and ZeRO++ has nothing to do.
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        args.ds_config.zero_optimization.validate_topology(ranks_per_node, world)
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)


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
