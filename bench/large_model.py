#!/usr/bin/env python
"""A model larger than any rank may hold, built shard by shard and trained.

    .venv/bin/python bench/large_model.py                       # the 18B run's widths, 2 layers (~1.2 B)
    .venv/bin/python bench/large_model.py --num-layers 1 --hidden 2048 --vocab 8192 --steps 1

Each of --world gloo ranks builds the GPT on the meta device, lets ZeRO-3
create it one weight at a time (zeropp/init.py), then trains --steps steps on
random tokens. Per rank it reports the peak RSS (Linux VmHWM) after
construction and after training, next to what an unsharded build of the same
model would need per rank (weights, gradients and optimizer state in full),
and writes everything to --out as JSON.

Defaults fit 4 ranks in 24 GiB: bf16 weights with fp32 masters, SGD
without momentum (no optimizer state; Adam's two fp32 moments would add
8 bytes per parameter / N), no overlap_comm and no activation checkpointing
(each keeps more full-size tensors alive at once; activations of a short
sequence are small).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zeropp  # noqa: E402
from model import GPT, GPTConfig, num_parameters  # noqa: E402
from parallel.comm import Communicator  # noqa: E402
from parallel.topology import topology_from_env  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rank_main(rank, world, a):
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # return freed blocks to the kernel (see tests)
    cfg = GPTConfig(vocab_size=a.vocab, num_layers=a.num_layers, hidden_size=a.hidden,
                    num_attention_heads=a.heads, max_position_embeddings=a.seq,
                    hidden_dropout=0.0, attention_dropout=0.0,
                    checkpoint_activations=a.checkpoint_activations)
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": a.bucket,
                                 "stage3_prefetch_bucket_size": a.bucket,
                                 "stage3_max_live_parameters": a.max_live,
                                 "stage3_max_reuse_distance": 0, "overlap_comm": a.overlap}}
    if a.zeropp:  # qwZ, hpZ over each emulated node, qgZ
        raw["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True,
                                        zero_hpz_partition_size=a.ranks_per_node)
    if a.dtype != "fp32":
        raw[a.dtype] = {"enabled": True}
    ds = zeropp.DeepSpeedConfig.from_dict(raw)
    comm = Communicator(topology_from_env(a.ranks_per_node))
    start_rss = rss_mb("VmRSS")
    t0 = time.time()
    with torch.device("meta"):
        model = GPT(cfg)
    optim = zeropp.OptimizerSettings(type=a.optimizer, lr=1e-4, momentum=0.0)
    engine = zeropp.initialize(model, ds, comm, torch.device("cpu"), optim, param_init=model.init_parameter)
    construct_s = time.time() - t0
    after_construct = rss_mb("VmHWM")
    g = torch.Generator().manual_seed(rank)
    losses, step_s = [], []
    swap = rss_mb("VmSwap")
    for _ in range(a.steps):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)
        t = time.time()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        step_s.append(time.time() - t)
        losses.append(loss.item())
        swap = max(swap, rss_mb("VmSwap"))
    peaks = engine.peak_buffers()
    secondary = getattr(engine, "secondary_flat", None)
    peaks["hpz_secondary_bytes"] = 0 if secondary is None else secondary.untyped_storage().nbytes()
    return {"rank": rank, "start_rss_mb": start_rss, "peak_rss_after_construction_mb": after_construct,
            "peak_rss_mb": rss_mb("VmHWM"), "swap_after_steps_mb": swap, "construct_s": construct_s, "step_s": step_s,
            "losses": losses, "peaks": peaks, "num_parameters": num_parameters(cfg)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--bucket", type=float, default=5e7, help="reduce and prefetch bucket (elements)")
    p.add_argument("--max-live", type=float, default=3e8, help="stage3_max_live_parameters")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute blocks in backward (gathers a whole block at once)")
    p.add_argument("--overlap", action="store_true",
                   help="overlap_comm: keeps up to 3 gradient buckets alive")
    p.add_argument("--ranks-per-node", type=int, default=None, help="emulated node size (default: --world)")
    p.add_argument("--zeropp", action="store_true", help="ZeRO++: qwZ, hpZ (over --ranks-per-node), qgZ")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=str(ROOT / "bench/results/large_model.json"))
    a = p.parse_args()
    a.bucket, a.max_live = int(a.bucket), int(a.max_live)

    results = run_distributed(rank_main, world_size=a.world, args=(a,), timeout=a.timeout,
                              env={"OMP_NUM_THREADS": "1"})
    psi = results[0]["num_parameters"]
    w = 4 if a.dtype == "fp32" else 2
    master = 0 if a.dtype == "fp32" else 4
    k = master + (8 if a.optimizer == "adamw" else 0)
    unsharded_gb = psi * (w + 4 + k) / 2**30   # weights + fp32 gradient + optimizer, whole
    sharded_gb = psi * (w + 4 + k) / a.world / 2**30
    print(f"GPT {a.num_layers} layers, hidden {a.hidden}, vocab {a.vocab}: {psi:,} parameters "
          f"({psi * 4 / 2**30:.2f} GiB in fp32); {a.world} ranks, ZeRO-3{' + ZeRO++' if a.zeropp else ''}, "
          f"{a.dtype}, {a.optimizer}")
    print(f"model states per rank: unsharded {unsharded_gb:.2f} GiB, ZeRO-3 {sharded_gb:.2f} GiB")
    print(f"{'rank':>4} {'construct s':>11} {'RSS after build MB':>18} {'peak RSS MB':>11} "
          f"{'step s':>8} {'loss':>8} {'peak gathered MB':>16} {'peak grad bufs MB':>17} {'hpZ MB':>6} "
          f"{'swap MB':>7}")
    for r in results:
        print(f"{r['rank']:>4} {r['construct_s']:>11.1f} {r['peak_rss_after_construction_mb']:>18.0f} "
              f"{r['peak_rss_mb']:>11.0f} {r['step_s'][-1]:>8.1f} {r['losses'][-1]:>8.4f} "
              f"{r['peaks'].get('gathered_weights_peak', 0) / 2**20:>16.0f} "
              f"{r['peaks']['gradient_buckets_peak'] / 2**20:>17.0f} "
              f"{r['peaks']['hpz_secondary_bytes'] / 2**20:>6.0f} {r['swap_after_steps_mb']:>7.0f}")
    out = {"args": vars(a), "num_parameters": psi, "unsharded_model_states_gib_per_rank": unsharded_gb,
           "zero3_model_states_gib_per_rank": sharded_gb, "ranks": results,
           "command": " ".join(sys.argv)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
