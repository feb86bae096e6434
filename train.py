"""Pretrain a GPT-2 with ZeRO / ZeRO++ sharding.

    torchrun --nproc-per-node 4 train.py --config configs/demo.yaml
    torchrun ... train.py --num-layers 40 --hidden-size 6144 ... --deepspeed_config ds.json

Flags follow Megatron-LM (see training/args.py). This file wires the job
together: arguments, inputs, process group, data, model, engine, schedule, an
optional resume; training/trainer.py runs the loop (the engine owns precision,
gradient communication and the optimizer step) and training/checkpoint/ saves.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import zeropp
from common import forget_notes
from data.gpt_dataset import build_train_valid_test_datasets
from data.sampler import build_data_loader
from model import GPT, flops_per_iteration
from parallel.comm import Communicator
from parallel.launch import CHECK_ONLY, mark_worker, report_error_to_torchrun, report_user_error
from parallel.link_probe import LinkProbeError
from parallel.startup import init_distributed, print_rank0
from parallel.topology import topology_from_env
from planner.auto import resolve as resolve_auto
from training.args import parse_args
from training.checkpoint import (CheckpointError, Progress, check_checkpoint_dirs, make_checkpointer, preflight_save_dir,
                                 resume)
from training.logger import TensorBoardOptions, TrainingLogger
from training.lr_schedule import build_lr_schedule
from training.outer import attach_outer, engine_comm, join_groups
from training.preflight import check_inputs, check_job, job_shape
from training.report import print_job, print_summary
from training.signals import StopRequest
from training.trainer import LoopConfig, Trainer, TrainingDiverged


_UNFREED = []


def main(argv=None):
    _UNFREED.clear()   # a caller that runs main() again (tests) frees the last run's objects here
    forget_notes()     # and hears this run's notes
    args = parse_args(argv)
    if args.dry_run:  # the planner: no process group, no memory, no data
        from planner.auto import print_dry_run
        print_dry_run(args)   # with "auto" switches: the choice on --cluster, then the plan
        return
    check_checkpoint_dirs(args)     # a mistyped --load, a --save of another run: before any work
    tokenizer = check_inputs(args)  # data, split and tokenizer files, before any expensive work
    own_group = not dist.is_initialized()   # a caller's group (the tests' pooled ranks) stays the caller's
    device = init_distributed(args.distributed_backend)
    topology = topology_from_env(args.ranks_per_node)
    comm = engine_comm(args.groups, topology)   # the job's, or its group's with --outer-sync-interval
    data_rank, data_world, cfg = job_shape(args, topology, tokenizer)
    torch.manual_seed(args.seed)
    if args.ds_config.zero_optimization.auto_switches():  # measure the links, let the planner pick
        choice = resolve_auto(args.ds_config, cfg, comm, device, args.micro_batch_size, args.seq_length,
                              args.gradient_accumulation_steps, args.optimizer_settings)
        for line in choice.lines:
            print_rank0(line)
        args.ds_config = choice.config
    if args.save:  # before hours of training, not after
        preflight_save_dir(args, cfg)
    train_ds, valid_ds, test_ds = build_datasets(args)
    with torch.device("meta"):  # no memory: the engine creates each weight, keeping its shard
        model = GPT(cfg)
    engine = zeropp.initialize(model, args.ds_config, comm, device, args.optimizer_settings,
                               args.gradient_accumulation_steps, param_init=model.init_parameter,
                               sharding=args.sharding, replicas=args.data_parallel_replicate_degree)
    attach_outer(args.groups, engine)
    schedule = build_lr_schedule(args)
    print_job(args, topology, cfg, engine, device, tokenizer.vocab_size)
    progress = resume(args, engine, cfg) if args.load else Progress()
    progress.iteration = join_groups(engine, progress.iteration)   # --lighthouse: meet (and heal from) the others

    logger = TrainingLogger(args.tensorboard_dir, TensorBoardOptions.from_args(args, topology.world_size))
    train_batches = iter(build_data_loader(train_ds, progress.consumed_train_samples, args.micro_batch_size,
                                           data_rank, data_world, args.num_workers))
    checkpointer = make_checkpointer(args, engine, cfg, model, argv, progress.run) if args.save else None
    flops = flops_per_iteration(cfg, args.global_batch_size, args.seq_length, args.checkpoint_activations)
    trainer = Trainer(LoopConfig.from_args(args), engine, comm, device, schedule, logger, checkpointer, train_batches,
                      valid_ds, test_ds, flops, progress,
                      job_comm=Communicator(topology) if comm.topology.groups > 1 else comm)
    early_stop = trainer.run()
    if early_stop is None:
        print_summary(args, topology, trainer.cross_node, engine)
    logger.close()
    if own_group and dist.is_initialized():
        dist.destroy_process_group()
    _UNFREED.append(dict(locals()))   # torch's objects are left to os._exit (see exit_now)
    if early_stop is not None:
        early_stop.report()  # the signal's line (rank 0's, by torchrun's RANK: the group is gone) or TrainingDiverged


def check(argv=None):
    """main()'s checks, without a process group: `python -m parallel.launch` runs this (CHECK_ONLY)
    once before any worker starts, with the job's WORLD_SIZE and LOCAL_WORLD_SIZE."""
    args = parse_args(argv)   # the flags, the files they name and the job's shape
    if not args.dry_run:
        check_checkpoint_dirs(args)
        check_job(args)


def build_datasets(args):
    """Training, validation and test datasets sized for every sample the run reads."""
    eval_runs = args.train_iters // args.eval_interval + 1
    num_samples = (args.train_iters * args.global_batch_size,
                   eval_runs * args.eval_iters * args.global_batch_size,
                   args.eval_iters * args.global_batch_size)
    return build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, num_samples, args.seed, args.data_cache_path)


def run(argv=None) -> int:
    """main() for the command line: a user error (zeropp.ConfigError, which data, tokenizer and
    argument errors subclass) becomes one line on stderr and exit status 2, printed by rank 0 only
    (under torchrun every rank finds the same error; the others exit quietly). Any other
    exception is a bug and keeps its traceback."""
    mark_worker()   # for `python -m parallel.launch`: this worker started
    try:
        check(argv) if os.environ.get(CHECK_ONLY) else main(argv)
    except (zeropp.ConfigError, CheckpointError, TrainingDiverged, LinkProbeError) as e:
        # Checkpoint, divergence and link-probe errors: a clear line, exit 1.
        rank = int(os.environ.get("RANK", "0"))
        line = f"error: {' '.join(str(e).splitlines())}"
        report_error_to_torchrun(line)   # torchrun's failure summary shows this line
        if isinstance(e, zeropp.ConfigError):
            report_user_error(line, rank)
        else:  # a checkpoint error may be one rank's own
            print(f"[rank {rank}] {line}" if rank else line, file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2 if isinstance(e, zeropp.ConfigError) else 1
    finally:  # past the training loop a SIGTERM (torchrun stopping a failed job) must stop us at once
        StopRequest.restore_defaults()
    return 0


def exit_now(status: int):
    """Ends the process once run() is done: everything of ours is closed by then (checkpoints
    written and checked, TensorBoard closed, the process group destroyed), so the interpreter's
    own teardown has nothing left to do but destroy torch's C++ objects, and that can abort
    (gloo: "terminate called without an active exception", seen after a torchrun restart) or
    hang (a gloo group freed by a finalizer that holds the GIL). os._exit skips it."""
    sys.stdout.flush()
    sys.stderr.flush()
    mark_worker(status)
    os._exit(status)


if __name__ == "__main__":
    exit_now(run())
