"""Learning-rate schedules: DeepSpeed's (JSON scheduler) and Megatron's (flags), by hand."""
import json
import math

import pytest

from training.args import parse_args
from training.lr_schedule import build_lr_schedule
from zeropp.config import ConfigError, DeepSpeedConfig

BASE = ["--train-iters", "100", "--data-path", "corpus_text_document"]


def schedule_of(tmp_path, scheduler, *flags, optimizer=None):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"scheduler": scheduler, **({"optimizer": optimizer} if optimizer else {})}))
    args = parse_args(BASE + ["--deepspeed_config", str(ds), *flags])
    return args, build_lr_schedule(args)


def test_warmup_lr_log(tmp_path):
    args, lr = schedule_of(tmp_path, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}})
    assert args.lr == 0.01    # no --lr needed: the schedule's peak
    # Step k runs with DeepSpeed's schedule at last_batch_iteration k - 1 (step 0: not started).
    assert lr(0) == pytest.approx(0.001)
    assert lr(1) == pytest.approx(0.001)                                      # log(1) = 0
    assert lr(2) == pytest.approx(0.001 + 0.009 * math.log(2) / math.log(5))
    assert lr(5) == pytest.approx(0.001 + 0.009 * math.log(5) / math.log(5))  # the peak
    assert lr(6) == lr(99) == pytest.approx(0.01)


def test_warmup_decay_lr_linear(tmp_path):
    _, lr = schedule_of(tmp_path, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_num_steps": 4, "warmup_max_lr": 0.01, "warmup_type": "linear"}})
    assert lr(0) == lr(1) == 0.0
    assert lr(3) == pytest.approx(0.005)        # 2 / 4 of the way up
    assert lr(5) == pytest.approx(0.01)         # last 4: (10 - 4) / (10 - 4)
    assert lr(8) == pytest.approx(0.005)        # last 7: (10 - 7) / 6
    assert lr(11) == lr(50) == 0.0


def test_warmup_cosine_lr_scales_the_optimizer_lr(tmp_path):
    _, lr = schedule_of(tmp_path, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 12, "warmup_num_steps": 2, "warmup_type": "linear", "cos_min_ratio": 0.0}},
        "--train-iters", "13", optimizer={"type": "AdamW", "params": {"lr": 0.1}})
    assert lr(0) == 0.0 and lr(1) == 0.0        # DeepSpeed's first step runs with 0
    assert lr(2) == pytest.approx(0.05)         # last 1: 1 / 2 of warmup
    assert lr(3) == pytest.approx(0.1 * (1 + math.cos(math.pi / 10)) / 2)
    assert lr(7) == pytest.approx(0.05)         # half way down the cosine
    assert lr(12) == pytest.approx(0.0)


def test_cosine_past_total_steps_notes(tmp_path, capsys):
    schedule_of(tmp_path, {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}},
                "--lr", "0.1")
    out = capsys.readouterr().out
    assert "> note: --train-iters" in out and "cosine rises again" in out


def test_megatron_schedule_from_flags():
    args = parse_args(BASE + ["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "10",
                              "--train-iters", "110"])
    lr = build_lr_schedule(args)
    # Megatron: the first step runs at the warmup's start; the peak at step 10, inclusive.
    assert lr(0) == 0.0 and lr(1) == pytest.approx(0.1) and lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)        # half way from lr to min_lr
    assert lr(200) == pytest.approx(0.1)


def megatron_get_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps, style):
    """Megatron-LM's OptimizerParamScheduler.get_lr, transcribed (init_lr 0)."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if style == "constant":
        return max_lr
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def lr_per_iteration(get_lr, skipped_at, iters=12):
    """The LR of each of `iters` iterations of Megatron's loop: the scheduler steps
    only after an update that succeeded (`if update_successful`)."""
    num_steps, out = 0, []
    for it in range(iters):
        out.append(get_lr(num_steps))
        if it not in skipped_at:
            num_steps += 1
    return out


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_megatron_schedule_step_for_step_with_a_skipped_step(style):
    """12 iterations, warmup 3, decay over 10, the 5th update skipped (an fp16 overflow):
    the LR of every iteration is Megatron's. The trainer calls the schedule with
    iteration - engine.skipped_steps, which a skipped step does not advance."""
    args = parse_args(BASE + ["--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "3",
                              "--lr-decay-iters", "10", "--lr-decay-style", style, "--train-iters", "12"])
    ours = build_lr_schedule(args)
    expect = lr_per_iteration(lambda n: megatron_get_lr(n, 0.01, 0.001, 3, 10, style), skipped_at={4})
    assert lr_per_iteration(ours, skipped_at={4}) == pytest.approx(expect, rel=1e-12, abs=0)
    assert expect[0] == 0.0 and expect[4] == expect[5]   # the skipped step does not advance


@pytest.mark.parametrize("flags, named", [
    (["--lr-warmup-iters", "10"], "--lr-warmup-iters"),
    (["--lr-decay-style", "cosine"], "--lr-decay-style"),
    (["--min-lr", "1e-5", "--lr-decay-iters", "50"], "--lr-decay-iters, --min-lr"),
    (["--lr", "1e-4"], "--lr"),                 # WarmupLR sets the LR itself
])
def test_json_scheduler_and_schedule_flags_conflict(tmp_path, flags, named):
    with pytest.raises(ConfigError, match=f"{named} and scheduler WarmupLR in .*ds.json both set"):
        schedule_of(tmp_path, {"type": "WarmupLR"}, *flags)


def test_yaml_schedule_keys_count_as_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr-warmup-iters: 5\n")
    with pytest.raises(ConfigError, match="--lr-warmup-iters and scheduler WarmupDecayLR"):
        schedule_of(tmp_path, {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}, "--config", str(cfg))


def test_lr_is_the_base_of_warmup_cosine(tmp_path):
    args, lr = schedule_of(tmp_path, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.5}}, "--lr", "0.2")
    assert args.optimizer_settings.lr == 0.2
    assert lr(1) == pytest.approx(0.1)          # warmup_min_ratio x --lr


def test_scheduler_without_flags_needs_no_lr_only_for_warmup_lr(tmp_path):
    with pytest.raises(ConfigError, match="--lr is required"):
        schedule_of(tmp_path, {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}})
    assert DeepSpeedConfig.from_dict({"scheduler": {"type": "WarmupLR"}}).scheduler.params["warmup_max_lr"] == 1e-3


def deepspeed_run(min_lr, max_lr, warmup, total, warmup_type, skipped_at, iters=12):
    """DeepSpeed's WarmupDecayLR, transcribed: the LR is set at construction
    (last_batch_iteration -1: min_lr) and after each optimizer step that was applied
    (the engine does not step the scheduler on an overflow)."""
    warmup = max(2, warmup)

    def get_lr(last):
        if last < 0:
            return min_lr
        if last < warmup:
            gamma = (math.log(last + 1) / math.log(warmup) if warmup_type == "log" else last / warmup)
        else:
            gamma = max(0.0, float(total - last) / float(max(1.0, total - warmup)))
        return min_lr + (max_lr - min_lr) * gamma

    last, out = -1, []
    for it in range(iters):
        out.append(get_lr(last))
        if it not in skipped_at:
            last += 1
    return out


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_deepspeed_schedule_step_for_step_with_a_skipped_step(tmp_path, warmup_type):
    _, ours = schedule_of(tmp_path, {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3, "total_num_steps": 10,
        "warmup_type": warmup_type}})
    expect = deepspeed_run(0.001, 0.01, 3, 10, warmup_type, skipped_at={4})
    assert lr_per_iteration(ours, skipped_at={4}) == pytest.approx(expect, rel=1e-12, abs=0)
