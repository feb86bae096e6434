"""The command line's flags: Megatron-LM's names and meanings (Megatron's old names as
option strings of the new flag, as Megatron maps them), each numeric flag range-checked as it is
parsed (the same types check YAML values, see training/args.py). Megatron's and DeepSpeed's flags
that mean nothing here, or that are refused, are in training/megatron_compat.py."""
from __future__ import annotations

import argparse
import difflib
import math

from data.tokenizer import TOKENIZER_TYPES
from common import OneLineParser, parse_int
from training.megatron_compat import add_compat_flags


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The message for arguments no flag takes, with a "did you mean" for each unknown flag."""
    flags = [s for a in parser._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
    hints = [close[0] for text in extras if text.startswith("--")
             for close in [difflib.get_close_matches(text.split("=")[0], flags, n=1)] if close]
    hint = f"did you mean {', '.join(hints)}? " if hints else ""
    return f"unrecognized arguments: {' '.join(extras)}; {hint}see `python train.py --help`"


class _HelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default, where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def ranged(convert, rule: str, ok, hint: str = ""):
    """An argparse type: `convert` the text, then require `ok(value)`; the message states `rule`."""
    def parse(text):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {convert.__doc__}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}{hint}")
        return value
    return parse


def whole(text) -> int:
    """a whole number"""
    return parse_int(str(text), "value")  # also 5e8; ConfigError is a ValueError


def real(text) -> float:
    """a number"""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _at_least(n: int, hint: str = ""):
    return ranged(whole, f">= {n}", lambda v: v >= n, hint)


_int = _at_least(1)                     # sizes, counts, intervals
_count = _at_least(0)                   # may be 0
_positive = ranged(real, "> 0", lambda v: v > 0)
_non_negative = ranged(real, ">= 0", lambda v: v >= 0)
_below_one = ranged(real, "in [0, 1)", lambda v: 0 <= v < 1)       # dropout, betas, momentum
_fraction = ranged(real, "in [0, 1]", lambda v: 0 <= v <= 1)
_topk_fraction = ranged(real, "in (0, 0.1]", lambda v: 0 < v <= 0.1)
# gloo counts in whole milliseconds and waits a fifth of S for a connection: below a second a
# connection's wait rounds towards 0 ms, which gloo reads as no timeout at all
_seconds = ranged(real, ">= 1 (seconds)", lambda v: v >= 1)
_power_of_two = ranged(real, "a power of two (e.g. 65536)", lambda v: v > 0 and math.log2(v).is_integer())
def _zeropp_mode(text) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(
            f"must be auto (measure the links at start-up and let the planner pick the ZeRO++ techniques), "
            f"got {text!r}; to choose yourself use --zero-quantized-weights, --zero-hpz-size N, "
            f"--zero-quantized-gradients")
    return text


_zeropp_mode.expected = "auto"   # what a YAML value must be (training/args.py says so)
_seed = ranged(whole, "in [0, 2**32)", lambda v: 0 <= v < 2**32)   # numpy's RandomState range


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="train.py", usage="[torchrun ...] %(prog)s [--flag value ...]",
                      description="GPT-2 pretraining with ZeRO / ZeRO++, Megatron-LM's flags. A flag given '' "
                                  "(--tokenizer-model '') takes its default, whatever --config sets.",
                      allow_abbrev=False, exit_on_error=False, formatter_class=_HelpFormatter)
    p.add_argument("--config", help="YAML file of flag values (keys as flag names); flags override it")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_int, default=12, help="transformer blocks")
    g.add_argument("--hidden-size", type=_int, default=768, help="width of the residual stream")
    g.add_argument("--num-attention-heads", type=_int, default=12, help="must divide --hidden-size")
    g.add_argument("--ffn-hidden-size", type=_int, default=None, help="MLP width (default: 4 x --hidden-size)")
    g.add_argument("--seq-length", type=_int, default=1024, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=_int, default=None,
                   help="learned positions (default: --seq-length)")
    g.add_argument("--hidden-dropout", type=_below_one, default=0.1, help="dropout after attention and MLP")
    g.add_argument("--attention-dropout", type=_below_one, default=0.1, help="dropout of the attention weights")
    g.add_argument("--init-method-std", type=_positive, default=0.02, help="std of the normal weight init")
    g.add_argument("--layernorm-epsilon", type=_positive, default=1e-5, help="LayerNorm's epsilon")
    g.add_argument("--make-vocab-size-divisible-by", type=_int, default=128,
                   help="pad the vocabulary to a multiple of this")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each transformer block in backward (= --recompute-granularity full)")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="same as --checkpoint-activations (DeepSpeed's name)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's selective recompute (= --recompute-granularity selective): the attention "
                        "core is recomputed in backward")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: each block is recomputed; selective: the attention core")
    g.add_argument("--recompute-method", "--activations-checkpoint-method", choices=["uniform", "block"],
                   default=None, help="uniform only (each block on its own)")
    g.add_argument("--recompute-num-layers", "--checkpoint-num-layers", "--activations-checkpoint-num-layers",
                   type=_int, default=None, help="blocks per recomputed unit: 1 only")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size", type=_int, default=1,
                   help="1 only: data parallelism with ZeRO sharding (--model-parallel-size is Megatron's old name)")
    g.add_argument("--pipeline-model-parallel-size", type=_int, default=1, help="1 only: no pipeline parallelism")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="accepted for Megatron-DeepSpeed scripts; there is no pipeline parallelism anyway")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with GPUs, gloo on CPU")
    g.add_argument("--sharding", choices=["zero", "fsdp2"], default="zero",
                   help="zero: this application's ZeRO engine; fsdp2: torch's fully_shard with ZeRO++ as "
                        "its plug-in (zeropp/fsdp/apply.py), stage 3 only")
    g.add_argument("--data-parallel-replicate-degree", type=_int, default=1,
                   help="--sharding fsdp2 only: HSDP, the model sharded inside groups of world / this many "
                        "consecutive ranks (inside a node) and replicated across them (torchtitan's "
                        "data_parallel_replicate_degree); default 1: sharded over all ranks")
    g.add_argument("--ranks-per-node", type=_int, default=None,
                   help="emulate nodes of this many ranks (default: torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--local_rank", "--local-rank", type=_count, default=None,
                   help="set by the deepspeed launcher; torchrun's LOCAL_RANK is used instead")

    g = p.add_argument_group("ZeRO (DeepSpeed-compatible)")
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility; always on")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                   help="DeepSpeed-style JSON (.json or .config)")
    g.add_argument("--zero-stage", type=whole, default=None, choices=[0, 1, 2, 3],
                   help="zero_optimization.stage: 0 is DDP (default: the JSON's, else 0)")
    g.add_argument("--zero-hpz-size", type=_int, default=None, help="zero_hpz_partition_size")
    g.add_argument("--zero-quantized-weights", action="store_true", default=None,
                   help="qwZ: INT8 weight gathers (zero_quantized_weights)")
    g.add_argument("--zero-quantized-gradients", action="store_true", default=None,
                   help="qgZ: hierarchical INT4 gradient reduction (zero_quantized_gradients)")
    g.add_argument("--zero-quantized-gradients-bits", type=whole, choices=[4, 2], default=None,
                   help="bits of qgZ's gradients across nodes (zero_quantized_gradients_bits; default 4; "
                        "needs --zero-quantized-gradients)")
    g.add_argument("--zero-loco", action="store_true", default=None,
                   help="qgZ with error feedback (zeropp_loco_param with err_beta 0.8, 0.95 with "
                        "--zero-quantized-gradients-bits 2, reset_T 1024)")
    g.add_argument("--zero-quantized-weight-deltas", action="store_true", default=None,
                   help="send weights across nodes as INT4 differences from the copy hpZ keeps in each node "
                        "(zero_quantized_weight_deltas; needs --zero-hpz-size)")
    g.add_argument("--zero-quantized-weight-deltas-bits", type=whole, choices=[4, 2], default=None,
                   help="bits of the weight deltas across nodes (zero_quantized_weight_deltas_bits; default 4; "
                        "needs --zero-quantized-weight-deltas)")
    g.add_argument("--zero-hadamard-gradients", action="store_true", default=None,
                   help="rotate qgZ's INT4 gradient blocks by a Walsh-Hadamard transform before quantizing "
                        "(zero_hadamard_gradients; needs --zero-quantized-gradients)")
    g.add_argument("--zero-reduce-bucket-size", type=_int, default=None,
                   help="reduce_bucket_size, elements (default: from the model)")
    g.add_argument("--zero-allgather-bucket-size", type=_int, default=None,
                   help="allgather_bucket_size, elements (default: from the model)")
    g.add_argument("--zero-contigious-gradients", action="store_true", default=None,
                   help="contiguous_gradients (Megatron-DeepSpeed's spelling): always on")
    g.add_argument("--zero-reduce-scatter", action="store_true", default=None,
                   help="reduce_scatter: always on")
    g.add_argument("--overlap-grad-reduce", "--overlap-param-gather", dest="overlap_comm", action="store_true",
                   default=None, help="overlap the gradient reductions and weight gathers with compute "
                                      "(zero_optimization.overlap_comm; on by default at stage 3)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", "--fp32-allreduce", action="store_true", default=None,
                   help="reduce gradients in fp32 (communication_data_type fp32); they always accumulate in fp32")
    g.add_argument("--zeropp", type=_zeropp_mode, default=None, metavar="auto",
                   help="auto: set qwZ, hpZ and qgZ to \"auto\" (measure the links at start-up, let the "
                        "planner pick; planner/auto.py); an explicit per-technique flag keeps its value")

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=_int, default=None,
                   help="per rank (--batch-size is Megatron's old name)")
    g.add_argument("--global-batch-size", type=_int, default=None,
                   help="default: micro-batch-size x data-parallel size (no accumulation)")
    g.add_argument("--train-iters", type=_int, default=None, help="iterations to train (or --train-samples)")
    g.add_argument("--train-samples", type=_int, default=None,
                   help="train for this many samples instead of --train-iters (iterations = samples // "
                        "global batch size, as Megatron)")
    g.add_argument("--train-tokens", type=_int, default=None,
                   help="also stop once this many tokens are consumed (Megatron-DeepSpeed: global batch x "
                        "--seq-length tokens an iteration)")
    g.add_argument("--lr", type=_non_negative, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=_non_negative, default=0.0, help="the schedule decays to this")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear",
                   help="shape of the decay after warmup")
    g.add_argument("--lr-decay-iters", type=_int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=_int, default=None,
                   help="with --train-samples (default: --train-samples)")
    g.add_argument("--lr-decay-tokens", type=_int, default=None,
                   help="decay over this many tokens (Megatron-DeepSpeed; counted in iterations as --train-tokens)")
    g.add_argument("--lr-warmup-iters", "--warmup-iters", type=_count, default=0, help="linear warmup iterations")
    g.add_argument("--lr-warmup-samples", type=_count, default=0, help="with --train-samples")
    g.add_argument("--lr-warmup-tokens", type=_int, default=None,
                   help="warm up over this many tokens (Megatron-DeepSpeed; counted in iterations as --train-tokens)")
    g.add_argument("--lr-warmup-fraction", "--warmup", type=_fraction, default=None,
                   help="warmup as a fraction of the decay iterations (or samples); --warmup is Megatron's old name")
    g.add_argument("--override-lr-scheduler", "--override-opt_param-scheduler", action="store_true",
                   help="the schedule always follows the flags, never the checkpoint's (always on)")
    g.add_argument("--weight-decay", type=_non_negative, default=0.01, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=_below_one, default=0.9, help="Adam's beta1")
    g.add_argument("--adam-beta2", type=_below_one, default=0.999, help="Adam's beta2")
    g.add_argument("--adam-eps", type=_positive, default=1e-8, help="Adam's epsilon")
    g.add_argument("--clip-grad", type=_non_negative, default=None,
                   help="global gradient norm; 0 = off (default 1.0)")
    g.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam",
                   help="adam and adamw both decouple weight decay, as Megatron's adam")
    g.add_argument("--sgd-momentum", type=_below_one, default=0.9, help="momentum of --optimizer sgd")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 weights and compute, dynamic loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 weights and compute")
    g.add_argument("--loss-scale", type=_positive, default=None, help="static fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=_power_of_two, default=None, help="default 2**16")
    g.add_argument("--min-loss-scale", type=_positive, default=None, help="dynamic scaling's floor (default 1)")
    g.add_argument("--loss-scale-window", type=_int, default=None,
                   help="clean steps before the scale grows (default 1000)")
    g.add_argument("--hysteresis", type=_int, default=None, help="overflows before the scale halves (default 2)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="PREFIX, or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--data-impl", default=None,
                   help="accepted for Megatron scripts: mmap (or infer) only, the .bin/.idx format")
    g.add_argument("--split", default="969,30,1", help="train,validation,test weights")
    g.add_argument("--data-cache-path", default=None, help="where index .npy files go (default: beside the data)")
    g.add_argument("--num-workers", type=_count, default=0, help="data-loader worker processes")
    g.add_argument("--resume-dataloader", action="store_true",
                   help="the data loader resumes where the checkpoint stopped (always on)")
    g.add_argument("--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES),
                   help="the tokenizer the data was written with (default: GPT2BPETokenizer with --vocab-file "
                        "or --merge-file, as Megatron's pretrain_gpt; else SentencePieceTokenizer)")
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")

    g = p.add_argument_group("checkpointing, evaluation, stopping")
    g.add_argument("--save", default=None, help="directory for checkpoints")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=_int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--no-save-optim", action="store_true", help="save without the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="save without the random-number states")
    g.add_argument("--no-load-optim", action="store_true", help="load the weights, start a new optimizer")
    g.add_argument("--no-load-rng", action="store_true", help="keep fresh random-number states")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only and start at iteration 0 (= --no-load-optim --no-load-rng, "
                        "progress reset)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the checkpoint in --load, over the flags")
    g.add_argument("--keep-last", type=_int, default=None,
                   help="keep the K newest checkpoints in --save; older ones go once a newer one is complete")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let this run save into a --save directory that holds another run's checkpoints (or "
                        "newer ones than --load's): refused without it")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (torch.distributed.checkpoint.async_save) while "
                        "training goes on; each is completed before the next save and at exit")
    g.add_argument("--exit-interval", type=_int, default=None,
                   help="stop (saving a checkpoint with --save) after an iteration divisible by this, as Megatron")
    g.add_argument("--exit-duration-in-mins", type=_positive, default=None,
                   help="stop (saving a checkpoint with --save) after the first iteration that ends this many "
                        "minutes after start-up, as Megatron")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="SIGTERM saves and stops (always on)")
    g.add_argument("--max-nan-iters", type=_int, default=None,
                   help="stop (saving the last good state) after this many consecutive non-finite losses")
    g.add_argument("--eval-interval", type=_at_least(1, "; to turn evaluation off use --eval-iters 0"),
                   default=1000, help="evaluate every N iterations")
    g.add_argument("--eval-iters", type=_count, default=100, help="batches per evaluation; 0 turns evaluation off")
    g.add_argument("--seed", type=_seed, default=1234, help="weights, dropout and data order")

    g = p.add_argument_group("logging and TensorBoard (tags: docs/tensorboard.md)")
    g.add_argument("--log-interval", type=_int, default=100,
                   help="default: steps_per_print of --deepspeed_config if it sets it, else 100")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard events here (default: the JSON's tensorboard section, if enabled)")
    g.add_argument("--tensorboard-log-interval", type=_int, default=1,
                   help="write TensorBoard at the log lines of iterations divisible by this")
    g.add_argument("--tensorboard-queue-size", type=_int, default=1000,
                   help="events held before the writer flushes")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="write iteration-time")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write the validation perplexity")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true", help="batch-size (always written)")
    g.add_argument("--no-log-learning-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                   action="store_false", help="do not write learning-rate")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", help="do not write loss-scale")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="write world-size")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the CUDA allocator's memory statistics")
    g.add_argument("--log-params-norm", action="store_true",
                   help="compute the norm of the weights: in the log line and TensorBoard")

    g = p.add_argument_group("outer synchronization (streaming DiLoCo across groups of nodes)")
    g.add_argument("--outer-sync-interval", type=_int, default=None, metavar="H",
                   help="groups of --group-size nodes train apart and exchange each parameter every H inner "
                        "steps (off when absent; training/outer.py)")
    g.add_argument("--outer-lr", type=_positive, default=0.7, help="the outer Nesterov step's learning rate")
    g.add_argument("--outer-momentum", type=_below_one, default=0.9, help="Nesterov")
    g.add_argument("--outer-fragments", type=_int, default=1,
                   help="exchange each rank's shard in this many equal parts, at staggered steps")
    g.add_argument("--outer-quantization", choices=["none", "int4", "topk2"], default="none",
                   help="int4: outer gradients in INT4 blocks with error feedback; topk2: the largest of each "
                        "chunk of 2048 in 2 bits with their indices, the rest carried by error feedback")
    g.add_argument("--outer-topk-fraction", type=_topk_fraction, default=0.02, metavar="F",
                   help="topk2: the share of each chunk sent, in (0, 0.1] (SparseLoCo sends a few percent; "
                        "convergence: docs/results.md)")
    g.add_argument("--outer-sync-delay", type=_count, default=1, metavar="TAU",
                   help="inner steps an exchange overlaps before it is merged (below H; 0: wait for it at once)")
    g.add_argument("--outer-merge-alpha", type=_below_one, default=0.5, metavar="ALPHA",
                   help="a delayed merge keeps this share of the steps taken meanwhile: local <- ALPHA local + "
                        "(1 - ALPHA) global (torchft's fragment_update_alpha)")
    g.add_argument("--outer-warmup-iters", type=_count, default=0, metavar="N",
                   help="train the first N iterations as one synchronous job over every group (gradients "
                        "averaged across the groups each step), then apart")
    g.add_argument("--group-size", type=_int, default=1, help="nodes per group")
    g.add_argument("--lighthouse", default=None, metavar="URL",
                   help="each group is its own torchrun job, meeting the others through torchft's Lighthouse at "
                        "URL (e.g. http://host:29510): a group that fails never stops the others and heals from "
                        "them when it returns (scripts/launch_groups.sh)")
    g.add_argument("--group-id", type=_count, default=None, help="with --lighthouse: this job is group ID (0, 1, ...)")
    g.add_argument("--num-groups", type=_int, default=None,
                   help="with --lighthouse: the groups of the run (each reads 1/N of every global batch)")
    g.add_argument("--outer-timeout", type=_seconds, default=60.0, metavar="S",
                   help="with --lighthouse: seconds an exchange or a quorum waits for a group before going on "
                        "without it")
    g.add_argument("--outer-async", action="store_true",
                   help="with --lighthouse: groups never wait for each other: each offers its outer gradient when "
                        "its inner steps are done, the outer step takes whoever reported (weighted by tokens), and "
                        "each merges the global update when it arrives (docs/fault_tolerant_groups.md)")
    g.add_argument("--outer-min-groups", type=_int, default=1, metavar="M",
                   help="with --lighthouse: an exchange commits only with M groups (torchft's min_replica_size; "
                        "start the Lighthouse with --min_replicas M)")
    g.add_argument("--outer-max-staleness", type=_count, default=4, metavar="K",
                   help="with --outer-async: an outer gradient from more than K outer steps of its fragment ago is "
                        "dropped (its steps stay in the group's masters and go with its next one)")

    g = p.add_argument_group("planning")
    g.add_argument("--dry-run", action="store_true",
                   help="print the memory, communication and time plan for --cluster and exit (no training)")
    g.add_argument("--cluster", default=None, help="cluster description YAML for --dry-run (configs/clusters/)")

    add_compat_flags(p)
    return p
