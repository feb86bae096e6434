"""TensorBoard's tags (docs/tensorboard.md lists them all): Megatron-LM's names, each with its
`vs samples` twin (megatron/training/training.py: training_log, evaluate_and_print_results),
written when Megatron's switches say so; DeepSpeed's monitor tags (`Train/Samples/...`) when the
JSON's tensorboard section turned TensorBoard on, as DeepSpeed's engine writes them; and this
product's own under their own prefixes (throughput/, comm/, memory/, time/, outer/)."""
from __future__ import annotations

import math
import resource
from dataclasses import dataclass

import torch

Point = tuple[float, int]   # (value, step): the step is the iteration, or the samples consumed for `vs samples`


def peak_memory_mb() -> float:
    """Peak GPU memory allocated, or peak resident memory of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass
class TensorBoardOptions:
    """What the command line asks TensorBoard for (Megatron's switches, with Megatron's defaults)."""
    queue_size: int = 1000          # --tensorboard-queue-size
    log_interval: int = 1           # --tensorboard-log-interval: written at log lines of iterations divisible by it
    timers: bool = False            # --log-timers-to-tensorboard: iteration-time
    validation_ppl: bool = False    # --log-validation-ppl-to-tensorboard
    learning_rate: bool = True      # --no-log-learning-rate-to-tensorboard
    loss_scale: bool = True         # --no-log-loss-scale-to-tensorboard
    world_size: int | None = None   # --log-world-size-to-tensorboard: the job's ranks
    memory: bool = False            # --log-memory-to-tensorboard: CUDA's allocator statistics
    deepspeed: bool = False         # the JSON's tensorboard section: DeepSpeed's Train/Samples/ tags too
    fp16: bool = False              # DeepSpeed writes its loss scale in fp16 only

    @classmethod
    def from_args(cls, args, world_size: int) -> "TensorBoardOptions":
        return cls(args.tensorboard_queue_size, args.tensorboard_log_interval, args.log_timers_to_tensorboard,
                   args.log_validation_ppl_to_tensorboard, args.log_learning_rate_to_tensorboard,
                   args.log_loss_scale_to_tensorboard, world_size if args.log_world_size_to_tensorboard else None,
                   args.log_memory_to_tensorboard, getattr(args, "deepspeed_tensorboard", False), args.fp16)


def _with_samples(values: dict, iteration: int, samples: int) -> dict[str, Point]:
    """Megatron writes each of these twice: against the iteration, and `vs samples`."""
    points = {}
    for name, value in values.items():
        if value is not None:
            points[name] = (value, iteration)
            points[f"{name} vs samples"] = (value, samples)
    return points


def training_points(it: int, s: dict, opts: TensorBoardOptions) -> dict[str, Point]:
    """The tags of a training log line (`s`: its fields, training/trainer.py log_window)."""
    samples = s["consumed"]
    points = _with_samples({"learning-rate": s["lr"] if opts.learning_rate else None,
                            "batch-size": s["global_batch"], "lm loss": s["loss"],
                            "loss-scale": s["loss_scale"] if opts.loss_scale else None,
                            "world-size": opts.world_size, "grad-norm": s["grad_norm"],
                            "params-norm": s.get("params_norm")}, it, samples)
    if opts.timers:
        points["iteration-time"] = (s["iter_ms"] / 1000, it)
    if opts.memory and torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        for name, key in (("mem-reserved-bytes", "reserved_bytes.all.current"),
                          ("mem-allocated-bytes", "allocated_bytes.all.current"),
                          ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                          ("mem-allocated-count", "allocation.all.current")):
            points[name] = (stats.get(key, 0), it)
    ours = {"throughput/samples-per-second": s["samples_per_s"], "throughput/tokens-per-second": s["tokens_per_s"],
            "throughput/TFLOPs": s["tflops"], "comm/intra-node-MB-per-iteration": s["intra_mb"],
            "comm/inter-node-MB-per-iteration": s["inter_mb"], "memory/peak-MB": peak_memory_mb()}
    if "outer_steps" in s:
        ours.update({"outer/steps": s["outer_steps"], "outer/cross-group-MB-per-iteration": s["cross_group_mb"],
                     "outer/drift": s["outer_drift"]})
    if "quorum" in s:
        ours.update({"outer/quorum-size": s["quorum"], "outer/heals": s["heals"]})
    points.update((name, (value, it)) for name, value in ours.items())
    if opts.deepspeed:
        points["Train/Samples/train_loss"] = (s["loss"], samples)
        points["Train/Samples/lr"] = (s["lr"], samples)
        if opts.fp16:
            points["Train/Samples/loss_scale"] = (s["loss_scale"], samples)
    return points


def wall_clock_points(it: int, samples: int, ms: dict, opts: TensorBoardOptions) -> dict[str, Point]:
    """wall_clock_breakdown's phases (ms per iteration): ours as time/<phase> in seconds, and
    DeepSpeed's Train/Samples/elapsed_time_ms_<phase> when its tensorboard section is on."""
    points = {f"time/{name}": (value / 1000, it) for name, value in ms.items()}
    if opts.deepspeed:
        points.update((f"Train/Samples/elapsed_time_ms_{name}", (value, samples)) for name, value in ms.items())
    return points


def evaluation_points(it: int, samples: int, name: str, loss: float, drift: float | None,
                      opts: TensorBoardOptions) -> dict[str, Point]:
    """`lm loss validation` (Megatron's; its ppl with --log-validation-ppl-to-tensorboard). The test
    set's are `lm loss test` (Megatron-DeepSpeed's name; Megatron-LM writes it over the validation tags)."""
    values = {f"lm loss {name}": loss}
    if opts.validation_ppl:
        values[f"lm loss {name} ppl"] = math.exp(min(20.0, loss))
    points = _with_samples(values, it, samples)
    if drift is not None:
        points[f"outer/{name}-drift"] = (drift, it)
    return points
