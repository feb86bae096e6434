"""What ZeRO++'s quantization costs on CPU ranks: each system's unthrottled step, with the
quantizers as they are and with them replaced by no-ops of the same shapes (wrong numbers,
so the second column is a diagnostic, never a result to train with).

    .venv/bin/python -m bench.quant_host_cost                  # bf16, ~2 min on 2 cores
    .venv/bin/python -m bench.quant_host_cost --dtype fp32

4 gloo ranks on this machine as 2 nodes x 2 (loopback: no link limit), the slow-link
benchmark's model and buckets (GPT 4 layers, hidden 192, seq 16, micro-batch 1, buckets of
1/8 of the model, reuse distance 0). The systems run in interleaved rounds in the same
processes, so the ratios compare like with like on a noisy machine. If the no-op column
of ZeRO++ is well below ZeRO-3's step, the loss ZeRO++ shows unthrottled is the
quantization arithmetic itself, not its communication or scheduling.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench import cpu_model, zero_systems as zs
from bench.system_catalog import LABELS
from parallel.spawn import run_distributed

SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-qgz", "zeropp"]


def _no_op_quantizers():
    """Replace the quantizers the quantized collectives call by no-ops of the same shapes."""
    import zeropp.techniques.qgz as qc
    from zeropp.kernels.format import Quantized

    def quantize(x, bits=8, block_size=None, backend="auto", out=None):
        return out if out is not None else Quantized.empty(x.numel(), bits, block_size, x.device)

    def dequantize(q, dtype=torch.float32, backend="auto", out=None):
        return out if out is not None else torch.empty(*q.data.shape[:-1], q.numel, dtype=dtype)

    def dequantize_reduce_requantize(st, bits_out=4, block_size_out=None, backend="auto", out=None):
        return out if out is not None else Quantized.empty(st.numel, bits_out, st.block_size, st.data.device)

    def dequantize_reduce(st, dtype=torch.float32, scale=1.0, backend="auto", out=None):
        return out if out is not None else torch.empty(st.numel, dtype=dtype)

    qc.quantize, qc.dequantize = quantize, dequantize
    qc.dequantize_reduce_requantize, qc.dequantize_reduce = dequantize_reduce_requantize, dequantize_reduce


def _rank(rank, world, systems, a, rounds, no_op):
    if no_op:
        _no_op_quantizers()
    built = {s: zs.build_system(rank, world, s, a) for s in systems}
    times = {s: [] for s in systems}
    for r in range(rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            times[s] += zs.timed_loop(rank, world, built[s], a)["step_times_s"]
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes over the systems")
    p.add_argument("--out", default="bench/results/quant_host_cost.json")
    args = p.parse_args(argv)
    a = dict(num_layers=4, hidden=192, heads=4, vocab=4096, seq=16, micro_batch=1, warmup=2, steps=6, seed=1234,
             dtype=args.dtype, bucket_fraction=8, ranks_per_node=2)
    env = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    medians = {}
    for no_op in (False, True):
        times = run_distributed(_rank, 4, (SYSTEMS, a, args.rounds, no_op), env=env, timeout=1200)[0]
        medians[no_op] = {s: statistics.median(t) * 1e3 for s, t in times.items()}
    cpu = cpu_model()
    print(f"{args.dtype}, 4 gloo ranks as 2 nodes x 2 on loopback, {cpu}, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; median ms per step over {args.rounds} x 6 steps")
    print("| system | step ms | x ZeRO-3 | step ms, quantizers no-ops | x ZeRO-3 |")
    print("|---|---|---|---|---|")
    base = {k: v["zero3-reuse0"] for k, v in medians.items()}
    for s in SYSTEMS:
        print(f"| {LABELS[s]} | {medians[False][s]:.1f} | {base[False] / medians[False][s]:.2f}x | "
              f"{medians[True][s]:.1f} | {base[True] / medians[True][s]:.2f}x |")
    with open(args.out, "w") as f:
        json.dump({"args": a, "cpu_model": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "torch": torch.__version__, "median_step_ms": {"real": medians[False], "no_op": medians[True]}},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
