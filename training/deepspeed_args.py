"""The DeepSpeed JSON (`--deepspeed_config`) merged with the flags into one
DeepSpeedConfig and the optimizer's settings (training/args.py calls it once
the command line and the YAML are read).

An explicit flag (command line or YAML) wins over the JSON, and a disagreement
is reported in a `> note:` line. A JSON `optimizer` section brings DeepSpeed's
defaults for the parameters it leaves out (e.g. weight_decay 0), not the flags'
defaults. Every file error is a ConfigError naming the file; every refusal of the
file joins the command line's problems (common.Problems).
"""
from __future__ import annotations

import dataclasses
import math
import os

from common import ConfigError, Problems
from zeropp.config import AUTO, DeepSpeedConfig, OptimizerSettings, load_json


_GIVEN = object()  # merge(): "take the flag's value if it was given"
# Megatron's --optimizer names -> OptimizerSettings.type (Megatron's adam decouples weight decay).
_MEGATRON_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def merge_deepspeed_config(args, explicit: set[str], problems: Problems) -> DeepSpeedConfig:
    """One DeepSpeedConfig from the JSON and the flags; flags win and conflicts are noted. The
    file's refusals join `problems` (a file that cannot be read at all raises)."""
    path = args.deepspeed_config
    raw = _read_json(path) if path else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a JSON object, got {type(raw).__name__}")
    # Checked once the flags are merged: a JSON section may rely on a switch a flag turns on
    # (zeropp_loco_param in the file, --zero-quantized-gradients on the command line).
    ds = DeepSpeedConfig.from_dict(raw, where=path or "defaults", validate=False, problems=problems)
    for name in ("optimizer", "scheduler"):   # sections the flags merge into: their values first
        if getattr(ds, name) is not None:
            section = Problems()
            with section.collect():
                getattr(ds, name).validate(f"{path}: {name}")
            for message in section.messages:   # reported; the flags' own go on being checked
                problems.add(message)
                setattr(ds, name, None)
    in_file = _dotted_keys(raw)
    zero = ds.zero_optimization

    def merge(dest, json_key, obj, attr, value=_GIVEN, shown=None):
        """An explicit flag (command line or YAML) wins over the JSON; a disagreement is reported."""
        if value is _GIVEN:
            value = getattr(args, dest) if dest in explicit else None
        if value is None:
            return
        if json_key in in_file and getattr(obj, attr) != value:
            _conflict(args, dest, value if shown is None else shown, json_key, getattr(obj, attr), path)
        setattr(obj, attr, value)

    merge("zero_stage", "zero_optimization.stage", zero, "stage")
    _merge_technique_flags(args, zero, explicit, merge)
    merge("zero_reduce_bucket_size", "zero_optimization.reduce_bucket_size", zero, "reduce_bucket_size")
    merge("zero_allgather_bucket_size", "zero_optimization.allgather_bucket_size", zero, "allgather_bucket_size")
    merge("zero_contigious_gradients", "zero_optimization.contiguous_gradients", zero, "contiguous_gradients")
    merge("zero_reduce_scatter", "zero_optimization.reduce_scatter", zero, "reduce_scatter")
    merge("overlap_comm", "zero_optimization.overlap_comm", zero, "overlap_comm")
    if args.accumulate_allreduce_grads_in_fp32:
        merge("accumulate_allreduce_grads_in_fp32", "communication_data_type", ds, "communication_data_type",
              value="fp32", shown="(fp32)")
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
    _tensorboard(args, ds, explicit, path)
    args.no_op_extra += ds.activation_checkpointing.no_ops(f"{path}: activation_checkpointing")
    args.optimizer_settings = _optimizer_settings(args, ds, explicit, in_file, merge)
    # The flags now mirror the merged config.
    args.fp16, args.bf16 = ds.fp16.enabled, ds.bf16.enabled
    args.zero_stage = zero.stage
    args.micro_batch_size = ds.train_micro_batch_size_per_gpu   # None: resolve_batch derives it
    args.global_batch_size = ds.train_batch_size
    args.clip_grad = ds.gradient_clipping
    with problems.collect():
        ds.validate(f"{path} with the flags" if path else "flags")
        _check_loss_scaling(ds, path or "flags")
    return ds


def _tensorboard(args, ds: DeepSpeedConfig, explicit: set[str], path: str):
    """The JSON's tensorboard section is --tensorboard-dir's default (DeepSpeed's output_path/job_name)
    and asks for DeepSpeed's own tags too (docs/tensorboard.md); the flag wins."""
    json_dir = ds.tensorboard.log_dir()
    args.deepspeed_tensorboard = json_dir is not None
    if json_dir is None:
        return
    if "tensorboard_dir" not in explicit:
        args.tensorboard_dir = json_dir
    elif os.path.normpath(args.tensorboard_dir) != os.path.normpath(json_dir):
        _conflict(args, "tensorboard_dir", args.tensorboard_dir, "tensorboard.output_path/job_name", json_dir, path)


def _merge_technique_flags(args, zero, explicit: set[str], merge):
    """Each technique's keys with a flag (their module names it: zeropp/techniques/technique.py
    `key`): an explicit flag wins over the JSON; --zeropp auto sets the keys that may be "auto"
    (unless their own flag pins them); a section's flag (--zero-loco) brings its defaults where
    the JSON has none (the JSON's own parameters, if any, stay)."""
    for f in dataclasses.fields(zero):
        dest, section = f.metadata.get("flag"), f.metadata.get("section")
        if dest is None:
            continue
        if section is not None:
            if getattr(args, dest, None) and getattr(zero, f.name) is None:
                setattr(zero, f.name, section())
        elif f.metadata.get("auto") and _auto_wins(args, dest, explicit):
            merge("zeropp", f"zero_optimization.{f.name}", zero, f.name, value=AUTO)
        else:
            merge(dest, f"zero_optimization.{f.name}", zero, f.name)


def _auto_wins(args, dest: str, explicit: set[str]) -> bool:
    """--zeropp auto sets a technique to "auto" unless its own flag was given at the same or a
    higher level (command line over YAML): `--zeropp auto --zero-hpz-size 1` pins hpZ off."""
    if getattr(args, "zeropp", None) != AUTO:
        return False
    from_yaml = getattr(args, "from_yaml", set())
    pinned = dest in explicit and (dest not in from_yaml or "zeropp" in from_yaml)
    return not pinned


def _conflict(args, dest: str, value, json_key: str, json_value, path: str):
    """Noted once the command line is known to be good (training/args.py)."""
    args.notes.append(f"--{dest.replace('_', '-')} {value} conflicts with {json_key}={json_value} in {path}; "
                      f"using the flag")


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
            _conflict(args, "optimizer", f"{args.optimizer} ({flag_type})", "optimizer.type",
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
                    _conflict(args, dest, getattr(args, dest), f"optimizer.params.betas[{i}]", betas[i],
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


def _read_json(path: str) -> dict:
    """The --deepspeed_config file, with a one-line error for a missing, unreadable or non-JSON file."""
    if os.path.exists(path) and not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"--deepspeed_config {path} is {kind}; pass a JSON file")
    try:
        return load_json(path)
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--deepspeed_config {path} is not a text (UTF-8) JSON file") from None


def _check_loss_scaling(ds: DeepSpeedConfig, where: str):
    """fp16 settings the engine would take as they are (from the JSON; the flags check their own range)."""
    fp16 = ds.fp16
    for name, ok, rule in (("loss_scale", fp16.loss_scale >= 0, ">= 0 (0 = dynamic scaling)"),
                           ("initial_scale_power", 0 <= fp16.initial_scale_power < 64, "in [0, 64)"),
                           ("loss_scale_window", fp16.loss_scale_window >= 1, ">= 1"),
                           ("hysteresis", fp16.hysteresis >= 1, ">= 1"),
                           ("min_loss_scale", fp16.min_loss_scale > 0, "> 0")):
        if not ok:
            raise ConfigError(f"{where}: fp16.{name} must be {rule}, got {getattr(fp16, name)}")
