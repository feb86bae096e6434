"""The lines a training run prints about itself: what it runs (start) and what it sent
(end), each built from the parts that know it (the technique registry, the engine's parts)."""
from __future__ import annotations

import os

import torch.distributed as dist

from data.stats import unigram_entropy
from model import num_parameters
from parallel.startup import print_rank0
from training.logger import peak_memory_mb
from training.trainer import CrossNodeTraffic
from zeropp import techniques
from zeropp.bucket_sizing import describe as describe_buckets


def print_job(args, topology, cfg, engine, device, vocab_size: int):
    world = topology.world_size
    label = zeropp_label(args.ds_config.zero_optimization, args.sharding, args.data_parallel_replicate_degree)
    if world == 1 and label != "ZeRO stage 0":   # one process runs unsharded (zeropp.initialize)
        label = f"unsharded (one process; {label} acts from 2 ranks on)"
    print_rank0(f"> {world} ranks on {topology.num_nodes} node(s) x {topology.ranks_per_node}, "
                f"{label}, {engine.dtype}, device {device}")
    print_rank0(f"> GPT: {num_parameters(cfg):,} parameters, vocab {vocab_size} "
                f"(padded {cfg.padded_vocab_size}); global batch {args.global_batch_size} = micro "
                f"{args.micro_batch_size} x {world} ranks x {args.gradient_accumulation_steps} accumulation")
    buckets = args.sharding == "zero" and describe_buckets(args.ds_config.zero_optimization,
                                                           engine.config.zero_optimization, num_parameters(cfg))
    if buckets and world > 1:   # one process has no buckets; FSDP2's unit is a block
        print_rank0(buckets)
    if topology.rank == 0 and len(args.data_path) == 1 and os.path.getsize(args.data_path[0] + ".bin") < 2**30:
        # A baseline for the loss; skipped on corpora too big to count in a moment.
        print_rank0(f"> unigram entropy of the corpus: {unigram_entropy(args.data_path[0]):.4f} nats "
                    f"(the loss of a context-free model)")


def peak_memory_line() -> str:
    """Every rank's peak (GPU memory allocated, or resident memory on CPU): rank 0's, the largest
    and the smallest (collective over the job)."""
    mine = peak_memory_mb()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return f"> peak memory per rank: {mine:.0f} MB"
    peaks = [0.0] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    top = max(range(len(peaks)), key=peaks.__getitem__)
    return (f"> peak memory per rank: {peaks[0]:.0f} MB on rank 0, at most {peaks[top]:.0f} MB (rank {top}), "
            f"at least {min(peaks):.0f} MB")


def zeropp_label(zero, sharding: str = "zero", replicas: int = 1) -> str:
    on = techniques.names(zero)
    if sharding == "fsdp2":
        name = f"FSDP2 HSDP ({replicas} replicas)" if replicas > 1 else "FSDP2"
        on = [n for n in on if replicas == 1 or n not in ("qwZ", "hpZ")]   # HSDP's weights stay in the node
        return f"{name} + ZeRO++ plug-in ({', '.join(on)})" if on else name
    return f"ZeRO-3 + ZeRO++ ({', '.join(on)})" if on else f"ZeRO stage {zero.stage}"


def print_summary(args, topology, cross_node: CrossNodeTraffic, engine):
    print_rank0(peak_memory_line())
    if topology.num_nodes > 1 and cross_node.iterations:
        sent, plain = (total / cross_node.iterations / 2**20
                       for total in (cross_node.sent_bytes, cross_node.plain_zero3_bytes))
        if getattr(args, "outer_sync_interval", None):   # the plain equivalent would count the exchange as is
            print_rank0(f"> cross-node bytes per iteration (mean over ranks): {sent:.2f} MB, the groups' engines "
                        f"and the outer exchange between them (--dry-run compares them with ZeRO-3 over the job)")
        else:
            replicas = args.data_parallel_replicate_degree
            without = ("plain HSDP" if replicas > 1 else "FSDP2 without the plug-in" if args.sharding == "fsdp2"
                       else "ZeRO-3 without ZeRO++")
            print_rank0(f"> cross-node bytes per iteration (mean over ranks): {sent:.2f} MB with "
                        f"{zeropp_label(args.ds_config.zero_optimization, args.sharding, replicas)}; {without} "
                        f"would send {plain:.2f} MB ({sent / plain if plain else 1.0:.3f}x)")
    for line in engine.summary():
        print_rank0(f"> {line}")
