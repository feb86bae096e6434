"""Megatron-LM's and Megatron-DeepSpeed's flags that are not this product's own, so that their
GPT pretraining scripts run unchanged: flags that mean nothing here are accepted and named in one
`> note:` line (`no_op_note`), flags of features that would change training in a way this product
does not do are refused by name with the reason (all of one command line together, training/args.py).
Old names that Megatron maps to new ones are option strings of the new flag (training/flags.py)."""
from __future__ import annotations

import argparse

from common import ConfigError


class Refused(argparse.Action):
    """A flag for a feature this product does not have: its message is kept in the namespace
    (training/args.py reports every one of them together), never silently ignored. Hidden from --help."""

    def __init__(self, option_strings, dest, reason="", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, nargs="*", default=None, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, f"{option_string} is not supported: {self.reason}")


class NoOp(argparse.Action):
    """A flag that means nothing here: it takes its value (if any, checked against `choices`) and
    `no_op_note` names it once, with `reason`."""

    def __init__(self, option_strings, dest, reason="", nargs=0, choices=None, **kwargs):
        self.reason = reason
        shown = f"no effect here: {reason}"
        super().__init__(option_strings, dest, nargs=nargs, choices=choices, default=None, help=shown,
                         metavar=None if nargs == 0 or choices else "X")

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values if values != [] else True)


NO_TP = "this product does data parallelism with ZeRO sharding only"
_GPT2 = "the model is GPT-2 (learned positions, GeLU MLP, LayerNorm, tied embeddings); remove the flag"
_FUSION = "a kernel-fusion switch; the model is plain torch modules and attention is torch's " \
          "scaled_dot_product_attention, which picks its kernel"
_TP_ONE = "it acts across tensor-parallel ranks, and the tensor-parallel size is 1"
_CKPT = "it tunes where DeepSpeed keeps recomputed blocks' inputs; each block's input stays where torch put it"
_ATTENTION = "attention is torch's scaled_dot_product_attention, which picks its kernel and softmax precision"
_QK_SCALING = "query-key layer scaling guards Megatron's fp16 softmax; scaled_dot_product_attention does not use it"
_OFFLOAD = "ZeRO-Offload is not implemented; the optimizer runs where the model does"

# (flag, nargs, choices, reason)
NO_OP_FLAGS = [
    *[(f, 0, None, _FUSION) for f in (
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--bias-gelu-fusion", "--bias-dropout-fusion",
        "--scaled-upper-triang-masked-softmax-fusion", "--scaled-masked-softmax-fusion")],
    *[(f, 0, None, _TP_ONE) for f in (
        "--no-async-tensor-model-parallel-allreduce", "--distribute-checkpointed-activations",
        "--distribute-saved-activations", "--scattered-embeddings", "--partition-activations")],
    *[(f, 0, None, _CKPT) for f in ("--contigious-checkpointing", "--split-transformers")],
    ("--synchronize-each-layer", 0, None, "a device synchronization after each block, for debugging"),
    ("--profile-backward", 0, None, "DeepSpeed's activation-checkpointing timers"),
    ("--use-cpu-initialization", 0, None, "each rank creates only its own shard of every weight, on its device"),
    ("--DDP-impl", None, ["local", "torch"], "the ZeRO engine reduces the gradients itself"),
    ("--use-mcore-models", 0, None, "the model is this product's GPT-2 (torch modules)"),
    ("--transformer-impl", None, ["local", "transformer_engine"], "the model is this product's GPT-2 (torch modules)"),
    ("--attention-backend", None, ["auto", "flash", "fused", "unfused", "local"], _ATTENTION),
    ("--attention-softmax-in-fp32", 0, None, _ATTENTION),
    ("--no-query-key-layer-scaling", 0, None, _QK_SCALING),
    ("--apply-query-key-layer-scaling", 0, None, _QK_SCALING),
    ("--timing-log-level", None, ["0", "1", "2"], "Megatron's timers; wall_clock_breakdown in --deepspeed_config "
                                                   "times the step's phases"),
    ("--log-num-zeros-in-grad", 0, None, "the gradient shards are consumed inside the engine's step, uncounted"),
    ("--log-optimizer-states-to-tensorboard", 0, None, "optimizer-state norms are not computed"),
    ("--lazy-loader", 0, None, "the .bin/.idx data is memory-mapped, read as it is used"),
    *[(f, 0, None, "attention is torch's scaled_dot_product_attention, which picks a flash kernel by itself "
                   "where the device has one") for f in ("--use-flash-attn", "--use-flash-attn-v2",
                                                          "--use-flash-attn-triton")],
    ("--checkpoint-in-cpu", 0, None, "recomputed blocks' inputs stay on the device (the same training; "
                                     "--dry-run plans the device memory it takes)"),
]

# Flags found in Megatron-LM / Megatron-DeepSpeed GPT pretraining scripts for what this product
# does not do: refused by name with the reason.
REFUSED_FLAGS = {
    "--num-layers-per-virtual-pipeline-stage": f"pipeline parallelism is not implemented ({NO_TP})",
    "--sequence-parallel": f"sequence parallelism needs tensor parallelism ({NO_TP})",
    "--ds-sequence-parallel-size": f"DeepSpeed-Ulysses sequence parallelism is not implemented ({NO_TP})",
    "--use-distributed-optimizer": "Megatron's distributed optimizer is ZeRO stage 1 here; use --zero-stage 1 "
                                   "(or 2, 3)",
    "--cpu-optimizer": _OFFLOAD,
    "--cpu-torch-adam": _OFFLOAD,
    "--cpu_torch_adam": _OFFLOAD,
    "--num-experts": "mixture of experts is not implemented",
    "--moe-expert-parallel-size": "mixture of experts is not implemented",
    "--rampup-batch-size": "batch-size ramp-up is not implemented; use a fixed --global-batch-size",
    "--step-batch-size-schedule": "batch-size schedules are not implemented; use a fixed --global-batch-size",
    "--use-checkpoint-lr-scheduler": "the schedule always follows the flags and the iteration count",
    "--train-data": "Megatron's loose-JSON loader is not implemented; write Megatron's .bin/.idx "
                    "(python -m data.preprocess) and pass --data-path",
    "--swiglu": _GPT2,
    "--use-rotary-position-embeddings": _GPT2,
    "--position-embedding-type": _GPT2,
    "--normalization": _GPT2,
    "--untie-embeddings-and-output-weights": _GPT2,
    "--disable-bias-linear": _GPT2,
    "--group-query-attention": _GPT2,
    "--num-key-value-heads": _GPT2,
    "--fp8-format": "fp8 training is not implemented; use --fp16 or --bf16",
}


def add_compat_flags(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("Megatron and DeepSpeed flags with no effect here (named once in a note)")
    for flag, nargs, choices, reason in NO_OP_FLAGS:
        g.add_argument(flag, action=NoOp, reason=reason, nargs=nargs, choices=choices)
    for flag, reason in REFUSED_FLAGS.items():
        parser.add_argument(flag, action=Refused, reason=reason)


def refused_given(parser: argparse.ArgumentParser, args) -> list[str]:
    """The messages of the refused flags the command line gave."""
    return [getattr(args, a.dest) for a in parser._actions if isinstance(a, Refused) and getattr(args, a.dest)]


def no_op_note(parser: argparse.ArgumentParser, args) -> str | None:
    """One line naming every no-op flag given (command line or YAML), grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action, NoOp) and value not in (None, False):   # False: a YAML `key: false`
            shown = action.option_strings[0] + ("" if value is True else f" {value}")
            by_reason.setdefault(action.reason, []).append(shown)
    by_reason.update({reason: [] for reason in getattr(args, "no_op_extra", ())})
    if not by_reason:
        return None
    return "no effect here: " + "; ".join(f"{', '.join(flags)}{': ' if flags else ''}{reason}"
                                          for reason, flags in by_reason.items())


def yaml_refusal(action, value, where: str):
    """A refused flag set in the YAML: "off" (false, empty) asks for what happens anyway."""
    if value in (None, False):
        return None
    raise ConfigError(f"{where} is not supported: {action.reason}")
