"""Checks of the input files before any expensive work (process group, index building, model);
--load and --save are checked first, by training/checkpoint/preflight.py.

    tokenizer = check_inputs(args)   # raises a ConfigError subclass on a user error
    data_rank, data_world, model_cfg = job_shape(args, topology, tokenizer)   # the same, against the job's shape

Every rank runs the same checks on the same files, so every rank fails the same
way and none is left waiting at a barrier. Each check reads little: the .idx
headers and arrays (memory-mapped), the tokenizer file, and the .bin's token ids
(all of a file up to 1 GiB, a sample of a bigger one; see IndexedDataset.token_range).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from common import ConfigError, check_writable_dir
from data.gpt_dataset import parse_data_path, parse_split
from data.indexed_dataset import DataError, IndexedDataset
from data.tokenizer import build_tokenizer
from parallel.startup import check_devices
from parallel.topology import Topology, expected_topology
from training.args import resolve_batch
from training.model_args import model_config
from training.outer import data_partition
from zeropp.kernels import quant, cpu_quant


def check_inputs(args):
    """The tokenizer, once --data-path, --split and the tokenizer files have been checked
    against each other (every token id of the data must exist in the vocabulary); also the
    quantization backend the environment forces and --tensorboard-dir."""
    check_quant_backend()
    zero = args.ds_config.zero_optimization
    quantizes = zero.zero_quantized_weights or zero.zero_quantized_gradients or zero.zero_quantized_weight_deltas
    if quantizes and not torch.cuda.is_available() and quant.forced_backend() != "torch":
        cpu_quant.available()   # builds or checks the cached kernels now: a cache others can write is refused here
    for flag, path in (("--tensorboard-dir", args.tensorboard_dir), ("--data-cache-path", args.data_cache_path)):
        if path:
            check_writable_dir(path, flag)
    prefixes, _ = parse_data_path(args.data_path)
    parse_split(args.split)
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                vocab_file=args.vocab_file, merge_file=args.merge_file)
    for dataset in datasets:
        check_token_ids(dataset, tokenizer)
    return tokenizer


def job_shape(args, topology: Topology, tokenizer):
    """(this rank's part of the data, the number of parts, the model config): the batch arithmetic
    and the model's settings checked against the job's shape."""
    data_rank, data_world = data_partition(args.groups, topology)   # with --lighthouse: this group's part of the job's
    resolve_batch(args, data_world)
    return data_rank, data_world, model_config(args, tokenizer.vocab_size, args.seed)


def check_job(args):
    """What a worker checks before training (check_inputs, the node's GPUs, job_shape), for the job
    torchrun's environment describes, without a process group: train.check, which
    `python -m parallel.launch` runs once before any worker starts."""
    tokenizer = check_inputs(args)
    check_devices(args.distributed_backend)
    job_shape(args, expected_topology(args.ranks_per_node), tokenizer)


def check_token_ids(dataset: IndexedDataset, tokenizer):
    if not np.issubdtype(dataset.dtype, np.integer):
        raise DataError(f"{dataset.prefix}.idx stores {dataset.dtype} tokens; token ids must be integers, "
                        f"re-run data.preprocess")
    if np.iinfo(dataset.dtype).max < tokenizer.vocab_size and np.iinfo(dataset.dtype).min >= 0:
        return  # e.g. uint16 data and a vocabulary of 65536 or more: every id fits
    found = dataset.token_range()
    if found is None:
        return
    low, high, whole = found
    how = "" if whole else " (in a sample of the file)"
    files = (f"--tokenizer-model {tokenizer.model_file}" if hasattr(tokenizer, "model_file")
             else "--vocab-file/--merge-file")
    if high >= tokenizer.vocab_size:
        raise DataError(f"{dataset.prefix}.bin holds token id {high}{how}, but the tokenizer ({files}) has "
                        f"{tokenizer.vocab_size} tokens: the data was made with another tokenizer; pass the "
                        f"one data.preprocess used, or re-run data.preprocess with this one")
    if low < 0:
        raise DataError(f"{dataset.prefix}.bin holds a negative token id ({low}){how}; the file is corrupt, "
                        f"re-run data.preprocess")


def check_quant_backend():
    """ZEROPP_QUANT_BACKEND names a backend this machine has (else the first gather would fail)."""
    try:
        backend = quant.forced_backend()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if backend == "triton" and not (quant.triton_available() and torch.cuda.is_available()):
        raise ConfigError("ZEROPP_QUANT_BACKEND=triton needs CUDA GPUs and triton; unset it (the CPU kernels "
                          "or torch are picked by themselves)")
    if backend == "cpu" and not cpu_quant.available():
        raise ConfigError(f"ZEROPP_QUANT_BACKEND=cpu: the CPU kernels cannot be built here "
                          f"({cpu_quant.why_not()}); unset it or set it to torch")


def missing_inputs(args) -> list[str]:
    """The input files the flags name that are not there, each as `--flag path (what is missing)`:
    what the dry run checks (it reads none of them), so that a plan made on the machine that will
    train says so before the job is queued. --load may be absent when it is --save (a first run)."""
    missing = []
    if args.data_path:
        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            absent = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if absent:
                missing.append(f"--data-path {prefix} (no {' or '.join(absent)})")
    for dest in ("tokenizer_model", "vocab_file", "merge_file"):
        path = getattr(args, dest)
        if path and not os.path.isfile(path):
            missing.append(f"--{dest.replace('_', '-')} {path} (no such file)")
    if args.load and not os.path.exists(args.load) and not (
            args.save and os.path.abspath(args.load) == os.path.abspath(args.save)):
        missing.append(f"--load {args.load} (no such directory)")
    return missing
