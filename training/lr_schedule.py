"""Learning-rate schedules: Megatron's (from the flags) or DeepSpeed's (the JSON `scheduler`).

    schedule = build_lr_schedule(args)    # once
    lr = schedule(iteration - engine.skipped_steps)   # before every optimizer step

Both schedules advance only on steps that updated the weights, as Megatron
(`if update_successful`) and DeepSpeed (no scheduler step on overflow) do.

A JSON scheduler and Megatron's schedule flags together are an error: the two
describe different curves and neither can be partly overridden by the other.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

from common import ConfigError, note

# Flags that shape Megatron's schedule; a JSON scheduler replaces all of them.
MEGATRON_SCHEDULE_FLAGS = ("lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "min_lr",
                           "lr_decay_samples", "lr_warmup_samples")


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                  style: str) -> float:
    """Megatron's OptimizerParamScheduler.get_lr, in iterations: the LR of the optimizer
    step that follows `step` applied ones (0 for the first, which runs at the warmup's
    start, LR 0; skipped fp16 steps do not count). Linear warmup up to and including
    step `warmup_iters`, then decay to `min_lr` at `decay_iters`."""
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if style == "constant":
        return lr
    if step > decay_iters:
        return min_lr
    progress = (step - warmup_iters) / (decay_iters - warmup_iters)
    if style == "linear":
        coeff = 1.0 - progress
    elif style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"--lr-decay-style {style!r}: use constant, linear or cosine")
    return min_lr + coeff * (lr - min_lr)


def deepspeed_learning_rate(iteration: int, *, kind: str, params: dict, base_lr: float) -> float:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (runtime/lr_schedules.py) for
    the optimizer step that follows `iteration` applied ones. DeepSpeed sets the LR when
    it builds the scheduler (its "not started" value) and calls scheduler.step() after
    each applied optimizer step, so step k runs with the schedule at
    last_batch_iteration = k - 1.
    `params` has every parameter filled in (SchedulerConfig.validate); `base_lr` is the
    optimizer's LR, which only WarmupCosineLR scales."""
    last = iteration - 1
    warmup = max(2, params["warmup_num_steps"])  # DeepSpeed's floor: log(1) would divide by zero
    if kind == "WarmupCosineLR":
        if last < 0:
            return 0.0  # DeepSpeed's first step runs with LR 0
        if last < warmup:
            low = params["warmup_min_ratio"]
            return base_lr * (low + (1.0 - low) * _warmup_fraction(last, warmup, params["warmup_type"]))
        # Past total_num_steps the cosine rises again, as in DeepSpeed.
        progress = (last - warmup + 1) / (params["total_num_steps"] - warmup)
        low = params["cos_min_ratio"]
        return base_lr * max(0.0, low + (1.0 - low) * (1 + math.cos(math.pi * progress)) / 2)

    low, high = params["warmup_min_lr"], params["warmup_max_lr"]
    if last < 0:
        gamma = 0.0
    elif last < warmup:
        gamma = _warmup_fraction(last, warmup, params["warmup_type"])
    elif kind == "WarmupDecayLR":  # linear decay to 0 at total_num_steps
        total = params["total_num_steps"]
        gamma = max(0.0, (total - last) / max(1.0, total - warmup))
    else:  # WarmupLR holds the peak
        gamma = 1.0
    return low + (high - low) * gamma


def _warmup_fraction(last: int, warmup: int, warmup_type: str) -> float:
    """From 0 at DeepSpeed's step 0 towards 1 at the end of warmup."""
    if warmup_type == "log":
        return math.log(last + 1) / math.log(warmup)
    return last / warmup


def build_lr_schedule(args) -> Callable[[int], float]:
    """iteration -> LR: DeepSpeed's schedule when args.ds_config.scheduler is set, else Megatron's."""
    scheduler = args.ds_config.scheduler
    if scheduler is None:
        return partial(learning_rate, lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                       decay_iters=args.lr_decay_iters, style=args.lr_decay_style)
    explicit = getattr(args, "explicit", set())
    clashing = [name for name in MEGATRON_SCHEDULE_FLAGS if name in explicit]
    if "lr" in explicit and "warmup_max_lr" in scheduler.params:
        clashing.append("lr")  # WarmupLR/WarmupDecayLR set the LR themselves; --lr would do nothing
    if clashing:
        flags = ", ".join("--" + name.replace("_", "-") for name in clashing)
        raise ConfigError(f"{flags} and scheduler {scheduler.type} in {args.deepspeed_config} both set "
                          f"the learning-rate schedule; keep one: remove the flag(s) (also from the "
                          f"--config YAML) or the JSON scheduler section")
    total = scheduler.params.get("total_num_steps")
    if scheduler.type == "WarmupCosineLR" and args.train_iters is not None and args.train_iters > total + 1:
        note(f"--train-iters {args.train_iters} exceeds scheduler total_num_steps {total}: "
             f"DeepSpeed's cosine rises again after it")
    return partial(deepspeed_learning_rate, kind=scheduler.type, params=scheduler.params, base_lr=args.lr)
