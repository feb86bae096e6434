"""Pretrain a GPT-2 with ZeRO / ZeRO++ sharding.

    torchrun --nproc-per-node 4 train.py --config configs/demo.yaml
    torchrun ... train.py --num-layers 40 --hidden-size 6144 ... --deepspeed_config ds.json

Flags follow Megatron-LM (see training/args.py). The loop is plain: the engine
owns precision, gradient communication and the optimizer step.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import zeropp
from zeropp.memory import memory_report
from data.gpt_dataset import build_train_valid_test_datasets
from data.sampler import build_data_loader
from data.stats import unigram_entropy
from model import GPT, GPTConfig, flops_per_iteration, num_parameters
from parallel.comm import Communicator
from parallel.launch import init_distributed, print_rank0
from parallel.topology import topology_from_env
from training.args import parse_args, resolve_batch
from training.checkpoint import (CheckpointError, PendingSave, check_save_dir, checkpoint_bytes, iteration_dir,
                                 load_checkpoint, save_checkpoint)
from training.logger import TrainingLogger, peak_memory_mb
from training.lr_schedule import build_lr_schedule
from training.preflight import check_inputs
from training.signals import StopRequest


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite: training stopped after saving the last good state."""


def model_config(args, vocab_size: int, seed: int) -> GPTConfig:
    return GPTConfig(init_seed=seed,
        vocab_size=vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        checkpoint_activations=args.checkpoint_activations,
        recompute_attention=args.recompute_granularity == "selective")


def mean_over_ranks(comm: Communicator, values, device: torch.device):
    """The mean over ranks of a number, or of each number in a list."""
    t = torch.tensor(values if isinstance(values, list) else [values], dtype=torch.float64,
                     device=device)  # NCCL reduces GPU tensors only
    comm.all_reduce(t, phase="other")
    t /= comm.topology.world_size
    return t.tolist() if isinstance(values, list) else t.item()


def evaluate(engine, dataset, args, comm, device) -> float:
    """Mean loss over `eval_iters` global batches, always the same ones."""
    engine.eval()
    loader = iter(build_data_loader(dataset, 0, args.micro_batch_size, comm.topology.rank,
                                    comm.topology.world_size))
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(args.eval_iters * args.gradient_accumulation_steps):
            batch = next(loader, None)
            if batch is None:
                break
            batch = batch.to(device)
            total += engine(batch[:, :-1], batch[:, 1:]).item()
            count += 1
    engine.train()
    return mean_over_ranks(comm, total / max(count, 1), device)


def zeropp_label(zero) -> str:
    on = [name for name, enabled in (("qwZ", zero.zero_quantized_weights),
                                     ("hpZ", zero.zero_hpz_partition_size > 1),
                                     ("qgZ", zero.zero_quantized_gradients)) if enabled]
    return f"ZeRO-3 + ZeRO++ ({', '.join(on)})" if on else f"ZeRO stage {zero.stage}"


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the planner: no process group, no memory, no data
        from planner import print_plan
        print_plan(args)
        return
    tokenizer = check_inputs(args)  # data, split and tokenizer files, before any expensive work
    device = init_distributed(args.distributed_backend)
    topology = topology_from_env(args.ranks_per_node)
    comm = Communicator(topology)
    world = topology.world_size
    resolve_batch(args, world)
    torch.manual_seed(args.seed)

    cfg = model_config(args, tokenizer.vocab_size, args.seed)
    if args.save:  # before hours of training, not after
        moments = {"sgd": int(args.optimizer_settings.momentum > 0)}.get(args.optimizer_settings.type, 2)
        warning = check_save_dir(args.save, checkpoint_bytes(num_parameters(cfg), moments))
        if warning:
            print_rank0(f"> warning: {warning}")
    eval_runs = args.train_iters // args.eval_interval + 1
    num_samples = (args.train_iters * args.global_batch_size,
                   eval_runs * args.eval_iters * args.global_batch_size,
                   args.eval_iters * args.global_batch_size)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, num_samples, args.seed, args.data_cache_path)

    with torch.device("meta"):  # no memory: the engine creates each weight, keeping its shard
        model = GPT(cfg)
    engine = zeropp.initialize(model, args.ds_config, comm, device, args.optimizer_settings,
                               args.gradient_accumulation_steps, param_init=model.init_parameter)
    schedule = build_lr_schedule(args)

    print_rank0(f"> {world} ranks on {topology.num_nodes} node(s) x {topology.ranks_per_node}, "
                f"{zeropp_label(args.ds_config.zero_optimization)}, {engine.dtype}, device {device}")
    print_rank0(f"> GPT: {num_parameters(cfg):,} parameters, vocab {tokenizer.vocab_size} "
                f"(padded {cfg.padded_vocab_size}); global batch {args.global_batch_size} = micro "
                f"{args.micro_batch_size} x {world} ranks x {args.gradient_accumulation_steps} accumulation")
    if topology.rank == 0 and len(args.data_path) == 1 and os.path.getsize(args.data_path[0] + ".bin") < 2**30:
        # A baseline for the loss; skipped on corpora too big to count in a moment.
        print_rank0(f"> unigram entropy of the corpus: {unigram_entropy(args.data_path[0]):.4f} nats "
                    f"(the loss of a context-free model)")

    iteration, consumed = 0, 0
    if args.load:
        start = time.time()
        meta = load_checkpoint(args.load, engine, not args.no_load_optim, not args.no_load_rng,
                               model_config=dataclasses.asdict(cfg))
        if meta is not None:
            iteration, consumed = meta["iteration"], meta["consumed_train_samples"]
            print_rank0(f"> resumed from {args.load} at iteration {iteration}, {consumed} samples consumed "
                        f"(saved by {meta['world_size']} ranks; loaded in {time.time() - start:.2f} s)")
        else:
            print_rank0(f"> no checkpoint in {args.load}; starting from scratch")

    meta = {"model_config": dataclasses.asdict(cfg),
            "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
            "tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
            "vocab_file": args.vocab_file, "merge_file": args.merge_file, "zero_stage": args.zero_stage,
            "argv": sys.argv[1:] if argv is None else argv}
    logger = TrainingLogger(args.tensorboard_dir)
    loader = iter(build_data_loader(train_ds, consumed, args.micro_batch_size, topology.rank, world,
                                    args.num_workers))
    flops = flops_per_iteration(cfg, args.global_batch_size, args.seq_length, args.checkpoint_activations)

    def new_window():  # what the next log line averages over
        return {"loss": 0.0, "steps": 0, "iters": 0, "skipped": 0, "nan": 0, "start": time.time()}

    # --async-save: checkpoints get a gloo group of their own, so the background writer's
    # collectives never interleave with training's.
    async_group = dist.new_group(backend="gloo") if args.async_save and dist.is_initialized() else None
    pending = []   # the background save in flight, if any

    def report(result):
        print_rank0(f"> saved checkpoint at iteration {result.iteration} to {result.path} in "
                    f"{result.seconds:.2f} s: {result.bytes_total / 2**20:.1f} MB written, "
                    f"{result.bytes_max_rank / 2**20:.1f} MB by the largest rank")

    def finish_pending():
        if pending:
            report(pending.pop().finish())

    def save(iteration, wait=False):
        finish_pending()
        result = save_checkpoint(args.save, iteration, engine, consumed, meta, keep_last=args.keep_last,
                                 async_group=async_group)
        if isinstance(result, PendingSave):
            pending.append(result)
            print_rank0(f"> writing checkpoint at iteration {iteration} in the background (training paused "
                        f"{result.blocked_seconds:.2f} s to copy it)")
            if wait:
                finish_pending()
        else:
            report(result)
        return iteration_dir(args.save, iteration)

    # fp16 skips overflowing steps and backs off its loss scale; in fp32/bf16 one bad step stops.
    nan_limit = args.max_nan_iters or (None if engine.dtype == torch.float16 else 1)
    bad_streak, diverged, signalled = 0, False, False
    stop = StopRequest()
    window = new_window()
    crossing = {"iters": 0, "inter": 0.0, "plain_inter": 0.0}  # for the summary at the end
    comm.reset_stats()
    engine.train()
    first_iteration = iteration
    while iteration < args.train_iters:
        lr = schedule(iteration)
        engine.set_lr(lr)
        step_loss = 0.0
        for _ in range(args.gradient_accumulation_steps):
            batch = next(loader).to(device)
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            step_loss += loss.item() / args.gradient_accumulation_steps
        if iteration == first_iteration + 1:  # Adam's state exists after one step; gradients until step()
            logger.memory_line(memory_report(engine))
        result = engine.step()
        iteration += 1
        consumed += args.global_batch_size
        window["skipped"] += int(result.skipped)
        if math.isfinite(step_loss):
            window["loss"] += step_loss
            window["steps"] += 1
        else:
            window["nan"] += 1

        window["iters"] += 1
        bad_streak = bad_streak + 1 if (result.skipped or not math.isfinite(step_loss)) else 0
        diverged = nan_limit is not None and bad_streak >= nan_limit
        signalled = stop.agreed(comm, device)

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.time() - window["start"]) / window["iters"]
            stats = comm.reset_stats()
            # Bytes: the mean over ranks (in a ring some ranks send across nodes, others do not).
            loss_avg, intra, inter, plain_inter = mean_over_ranks(
                comm, [window["loss"] / max(window["steps"], 1), stats.intra_node_bytes,
                       stats.inter_node_bytes, stats.plain_inter_node_bytes], device)
            crossing["iters"] += window["iters"]
            crossing["inter"] += inter
            crossing["plain_inter"] += plain_inter
            samples_per_s = args.global_batch_size / elapsed
            logger.training_line(iteration, args.train_iters, {
                "consumed": consumed, "iter_ms": elapsed * 1000, "lr": lr,
                "global_batch": args.global_batch_size, "loss": loss_avg,
                "loss_scale": result.loss_scale, "grad_norm": None if result.skipped else result.grad_norm,
                "skipped": window["skipped"], "nan": window["nan"], "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * args.seq_length,
                "tflops": flops / elapsed / world / 1e12,
                "intra_mb": intra / window["iters"] / 2**20,
                "inter_mb": inter / window["iters"] / 2**20})
            window = new_window()
        if diverged or signalled:
            break

        if valid_ds is not None and args.eval_interval and iteration % args.eval_interval == 0:
            logger.validation_line(iteration, "validation", evaluate(engine, valid_ds, args, comm, device))
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save(iteration)
        if window["iters"] == 0:
            window["start"] = time.time()  # evaluation and saving are not training time

    stop.restore()
    if diverged or signalled:
        path = save(iteration, wait=True) if args.save else None
        logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if signalled:
            print_rank0(f"> {stop.name} received: stopped after iteration {iteration}; " + (
                f"checkpoint {path}; resume with --load {args.save}" if path else "nothing saved (no --save)"))
            return
        raise TrainingDiverged(
            f"the loss or gradient was not finite for {bad_streak} consecutive iteration(s), the last at "
            f"iteration {iteration}; those steps were skipped, so the weights are the last good ones" +
            (f", saved to {path}" if path else " (not saved: no --save)") +
            "; lower --lr, check the data" + (", or raise --max-nan-iters" if args.max_nan_iters else ""))

    if valid_ds is not None and iteration % args.eval_interval != 0:
        logger.validation_line(iteration, "validation", evaluate(engine, valid_ds, args, comm, device),
                               end_of_training=True)
    if test_ds is not None:
        logger.validation_line(iteration, "test", evaluate(engine, test_ds, args, comm, device))
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save(iteration)
    finish_pending()
    print_rank0(f"> peak memory per rank: {peak_memory_mb():.0f} MB")
    if topology.num_nodes > 1 and crossing["iters"]:
        sent, plain = (crossing[k] / crossing["iters"] / 2**20 for k in ("inter", "plain_inter"))
        print_rank0(f"> cross-node bytes per iteration (mean over ranks): {sent:.2f} MB with "
                    f"{zeropp_label(args.ds_config.zero_optimization)}; ZeRO-3 without ZeRO++ would send "
                    f"{plain:.2f} MB ({sent / plain if plain else 1.0:.3f}x)")
    logger.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(argv=None) -> int:
    """main() for the command line: a user error (zeropp.ConfigError, which data, tokenizer and
    argument errors subclass) becomes one line on stderr and exit status 2, printed by rank 0 only
    (under torchrun every rank finds the same error; the others exit quietly). Any other
    exception is a bug and keeps its traceback."""
    try:
        main(argv)
    except (zeropp.ConfigError, CheckpointError, TrainingDiverged) as e:
        # Checkpoint and divergence errors reach every rank alike too: a clear line, exit 1.
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(e, zeropp.ConfigError):  # a checkpoint error may be one rank's own
            prefix = f"[rank {rank}] " if rank else ""
            print(f"{prefix}error: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2 if isinstance(e, zeropp.ConfigError) else 1
    finally:  # past the training loop a SIGTERM (torchrun stopping a failed job) must stop us at once
        StopRequest.restore_defaults()
    return 0


if __name__ == "__main__":
    sys.exit(run())
