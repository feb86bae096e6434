"""Where train.py's resident memory goes at scale (`python -m bench.memory train`): its peak per
rank at a large GPT against a tiny one (the process itself: torch, gloo, the data loader, the
tokenizer), pool by pool.

Each variant runs `train.py` under torchrun on one node twice with the same flags and
DeepSpeed JSON (stage 3, buckets and live parameters --bucket, reuse distance 0), a tiny GPT
and the large one; rise = the large run's peak minus the tiny run's (train.py's "peak memory
per rank" line: rank 0's and the largest, VmHWM). Rank 0's rise is laid out against the whole
fp32 model (4 bytes a parameter): the model states and the engine's pools at their peaks
(train.py's own lines), the activations of one forward and backward (measured here,
bench/memory/bound.py `activation_probe`), and what is left: what the engine does not hold.

Variants: `train.py` as it runs (parallel/startup.py `unmap_freed_blocks`: every block of 64
KiB or more is its own mapping, returned to the kernel when freed); `glibc-32m`
(MALLOC_MMAP_THRESHOLD_=33554432, which train.py leaves as set: glibc's default threshold climbs
to the largest block freed, up to this, and freed blocks below it stay in the heap, mallopt(3)).
Beside them, gloo's staging (measured here on --nproc gloo ranks): the RSS rise of a gather
bucket's all_gather_into_tensor and a gradient bucket's all-to-all in flight together, over
their buffers, which the engine holds and counts: gloo's own copies, which NCCL does not make.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from bench import ROOT
from scenarios.harness.jobs import DATA_PREFIX, TOKENIZER, check_data, job_env, listed, torchrun

VARIANTS = {"train.py": {}, "glibc-32m": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}}
TINY = dict(num_layers=1, hidden=64, heads=4)
MB = 2**20


def train_argv(a, model: dict, ds_path: str) -> list[str]:
    return ["--num-layers", str(model["num_layers"]), "--hidden-size", str(model["hidden"]),
            "--num-attention-heads", str(model["heads"]), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.world), "--train-iters", str(a.steps), "--lr", "1e-4",
            "--data-path", DATA_PREFIX, "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", TOKENIZER, "--split", "949,50,1", "--eval-iters", "0",
            "--log-interval", "1", "--deepspeed_config", ds_path]


def run_train(a, model: dict, env: dict, ds_path: str) -> dict:
    """train.py's lines about memory, parsed (MB)."""
    cmd = [*torchrun(a.world), "train.py", *train_argv(a, model, ds_path)]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=job_env(**env), capture_output=True, text=True, timeout=a.timeout)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"train.py failed ({' '.join(cmd)}):\n{text[-3000:]}")
    peak = re.search(r"peak memory per rank: (\d+) MB on rank 0, at most (\d+) MB \(rank (\d+)\), at least (\d+)", text)
    states = re.search(r"model states per rank .*?total ([\d.]+) MB", text)
    pools = dict((k.replace(" ", "_"), float(v)) for k, v in
                 re.findall(r"(gradient buckets|optimizer scratch|gathered weights|gather buffers) ([\d.]+) MB", text))
    params = int(re.search(r"GPT: ([\d,]+) parameters", text).group(1).replace(",", ""))
    return {"parameters": params, "peak_rank0_mb": float(peak.group(1)), "peak_max_mb": float(peak.group(2)),
            "peak_max_rank": int(peak.group(3)), "peak_min_mb": float(peak.group(4)),
            "model_states_mb": float(states.group(1)), "pools_mb": pools, "seconds": round(time.time() - t0, 1)}


def activations_mb(a) -> float:
    """One forward + backward of the large GPT unsharded, each gradient dropped as it comes."""
    from bench.memory.bound import activation_probe
    probe = SimpleNamespace(vocab=4096, num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, seq=a.seq,
                            micro_batch=1, dtype="fp32", checkpoint_activations=False)
    return activation_probe(0, 1, probe)["activation_bytes"] / MB


def gloo_staging(rank, world, elements: int) -> float:
    """MB of RSS above the buffers while the engine's two largest collectives are in flight."""
    import gc

    import torch
    import torch.distributed as dist

    from bench.memory.bound import PeakRSS, rss_mb
    from parallel.comm import all_gather_flat
    from parallel.startup import unmap_freed_blocks
    unmap_freed_blocks()   # as train.py
    per = elements // world
    full, part = torch.ones(per * world), torch.ones(per)
    rows, recv = torch.ones(per * world), torch.zeros(per * world)
    gc.collect()
    dist.barrier()
    before, probe = rss_mb("VmRSS"), PeakRSS().start()
    works = [all_gather_flat(full, part, async_op=True), dist.all_to_all_single(recv, rows, async_op=True)]
    for w in works:
        w.wait()
    return max(0.0, probe.stop() - before)


def run(a) -> dict:
    variants = listed(a.variants, VARIANTS, "--variants")
    check_data()
    ds_path = os.path.join(tempfile.mkdtemp(prefix="train_memory-"), "ds_config.json")
    with open(ds_path, "w") as f:   # the buckets, as a user's DeepSpeed JSON sets them
        json.dump({"zero_optimization": {"stage": 3, "reduce_bucket_size": a.bucket, "allgather_bucket_size": a.bucket,
                                         "stage3_prefetch_bucket_size": a.bucket,
                                         "stage3_max_live_parameters": a.bucket, "stage3_max_reuse_distance": 0}}, f)
    large = dict(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads)
    act = activations_mb(a)
    from scenarios.harness.spawn import run_distributed
    staging = None
    rows = {}
    for name in variants:
        tiny, big = (run_train(a, m, VARIANTS[name], ds_path) for m in (TINY, large))
        if staging is None:   # the buckets, capped by the model as the engine caps them
            elements = int(min(a.bucket, big["parameters"]))
            staging = max(run_distributed(gloo_staging, world_size=a.world, args=(elements,), timeout=600))
        model_mb = 4 * big["parameters"] / MB
        rise = big["peak_rank0_mb"] - tiny["peak_rank0_mb"]
        held = big["model_states_mb"] + sum(big["pools_mb"].values()) + act
        rows[name] = {"env": VARIANTS[name], "tiny": tiny, "large": big, "fp32_model_mb": model_mb,
                      "rise_rank0_mb": rise, "rise_max_mb": big["peak_max_mb"] - tiny["peak_max_mb"],
                      "rise_over_fp32_model": rise / model_mb, "activations_mb": act,
                      "engine_and_activations_mb": held, "outside_mb": rise - held, "gloo_staging_mb": staging,
                      "unaccounted_mb": rise - held - staging}
    os.remove(ds_path)
    os.rmdir(os.path.dirname(ds_path))
    print(f"train.py's peak RSS rise over a tiny run, {a.world} ranks on one node, fp32 AdamW, stage 3, buckets and "
          f"live parameters {a.bucket:.0e}, reuse distance 0")
    print("| variant | parameters | fp32 model MB | rise MB (rank 0 / largest) | rise / fp32 model | model states MB | "
          "pools MB (buckets, scratch, gathered, gather buffers) | activations MB | outside the engine MB | "
          "of it gloo's staging MB | unaccounted MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        b = r["large"]
        pools = ", ".join(f"{v:.0f}" for v in b["pools_mb"].values())
        print(f"| {name} | {b['parameters']:,} | {r['fp32_model_mb']:.0f} | {r['rise_rank0_mb']:.0f} / "
              f"{r['rise_max_mb']:.0f} | {r['rise_over_fp32_model']:.3f} (limit 0.95) | {b['model_states_mb']:.0f} | "
              f"{pools} | {r['activations_mb']:.0f} | {r['outside_mb']:.0f} | {r['gloo_staging_mb']:.0f} | "
              f"{r['unaccounted_mb']:.0f} |")
    return {"args": vars(a), "limit_rise_over_fp32_model": 0.95, "rows": rows}
