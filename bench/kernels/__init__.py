#!/usr/bin/env python
"""Quantization kernels: throughput and host cost (one entry point).

    .venv/bin/python -m bench.kernels quant [--device cuda] [--numel N]   # ~1 min on CPU (16M elements)
    .venv/bin/python -m bench.kernels hadamard                            # seconds (19532 blocks of 128 fp32)
    .venv/bin/python -m bench.kernels host-cost [--dtype fp32]            # ~2 min on 2 cores

quant: quantize / dequantize / fused dequantize-sum-requantize (qgZ's middle hop) GB/s of input bytes,
  beside the limit: dst.copy_(src) of the same bytes on the same device. CPU: the torch path and the
  compiled kernels, one thread; CUDA: the torch path and Triton. Writes results/quant_bench{,_cuda}.json.
hadamard: qgZ's Hadamard smoothing (forward, inverse) against one INT4 quantize and dequantize of the
  same tensor (blocks of 128), medians at 1 thread and torch's default. Writes results/hadamard_host_cost.json.
host-cost: each system's unthrottled step (4 gloo ranks as 2 x 2 on loopback, the sweep's model and
  buckets) with the quantizers as they are and replaced by no-ops of the same shapes (wrong numbers: a
  diagnostic), interleaved rounds in the same processes; x ZeRO-3 beside each. Writes
  results/quant_host_cost{,_fp32}.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import RESULTS, cpu_model, write_result


def best_s(fn, repeats, device=None, median=False):
    """Min (or median) wall time of fn over `repeats`, after one warm-up (and Triton compilation)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device is not None and device.type == "cuda" else (lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) if median else min(ts)


def quant(a):
    from zeropp.kernels import cpu_quant
    from zeropp.kernels import quant as q
    device = torch.device(a.device)
    if device.type == "cuda":
        backends = ["torch", "triton"] if q.triton_available() else ["torch"]
    else:
        torch.set_num_threads(1)
        backends = ["torch", "cpu"] if cpu_quant.available() else ["torch"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(a.numel, device=device).to(dtype)
        nbytes, dst = x.numel() * x.element_size(), torch.empty_like(x)
        t_copy = best_s(lambda: dst.copy_(x), a.repeats, device)  # noqa: B023
        for bits in (8, 4):
            for backend in backends:
                qx = q.quantize(x, bits, backend=backend)
                row = dict(dtype=str(dtype).replace("torch.", ""), bits=bits, backend=backend, block_size=qx.block_size,
                           numel=a.numel, input_bytes=nbytes, wire_bytes=qx.nbytes(), copy_GBps=nbytes / t_copy / 1e9,
                           quantize_GBps=nbytes / best_s(lambda: q.quantize(x, bits, backend=backend), a.repeats, device) / 1e9,  # noqa: B023
                           dequantize_GBps=nbytes / best_s(lambda: q.dequantize(qx, dtype, backend=backend), a.repeats,  # noqa: B023
                                                           device) / 1e9, fused_GBps=None)
                if bits == 4:  # k parts in, one requantized part out
                    parts = q.Quantized.stack([qx] * a.parts)
                    row["fused_GBps"] = a.parts * a.numel * 4 / best_s(
                        lambda: q.dequantize_reduce_requantize(parts, 4, backend=backend), a.repeats, device) / 1e9  # noqa: B023
                rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    print(f"device {device} ({name}), {a.numel} elements; GB/s of input bytes; limit: copy = dst.copy_(src) of the same bytes")
    print(f"{'dtype':9} {'bits':>4} {'backend':>7} {'block':>5} {'wire/in':>7} {'copy GB/s':>10} {'quant GB/s':>10} "
          f"{'x copy':>6} {'dequant GB/s':>12} {'x copy':>6} {'fused dqrq GB/s':>15}")
    for r in rows:
        print(f"{r['dtype']:9} {r['bits']:4d} {r['backend']:>7} {r['block_size']:5d} {r['wire_bytes'] / r['input_bytes']:7.3f} "
              f"{r['copy_GBps']:10.2f} {r['quantize_GBps']:10.2f} {r['quantize_GBps'] / r['copy_GBps']:6.2f} "
              f"{r['dequantize_GBps']:12.2f} {r['dequantize_GBps'] / r['copy_GBps']:6.2f} "
              + (f"{r['fused_GBps']:15.2f}" if r["fused_GBps"] else f"{'-':>15}"))
    out = a.out or RESULTS / ("quant_bench.json" if device.type == "cpu" else f"quant_bench_{device.type}.json")
    print("wrote", write_result(out, dict(device=str(device), device_name=name, threads=torch.get_num_threads(), rows=rows)))


def hadamard(a):
    from zeropp.kernels import cpu_quant
    from zeropp.kernels.hadamard import hadamard as transform
    from zeropp.kernels.quant import dequantize, quantize
    default_threads, result = torch.get_num_threads(), {}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        x = torch.randn(a.numel)
        work, deq = x.clone(), torch.empty(a.numel)
        qx = quantize(x, 4, a.block)
        ops = {"hadamard_forward": lambda: transform(work, a.block),  # noqa: B023
               "hadamard_inverse": lambda: transform(work, a.block, inverse=True),  # noqa: B023
               "hadamard_forward_into_out": lambda: transform(x, a.block, out=work),  # noqa: B023
               "quantize_int4": lambda: quantize(x, 4, a.block, out=qx),  # noqa: B023
               "dequantize_int4": lambda: dequantize(qx, torch.float32, out=deq)}  # noqa: B023
        m = {k: round(1e3 * best_s(fn, a.reps, median=True), 3) for k, fn in ops.items()}
        m["forward_over_quantize"] = round(m["hadamard_forward"] / m["quantize_int4"], 2)
        result[f"{threads}_threads"] = m
        print(f"{threads} thread(s), {a.numel:,} fp32 elements, blocks of {a.block}, median ms: "
              + ", ".join(f"{k} {v}" for k, v in m.items()))
    torch.set_num_threads(default_threads)
    print("wrote", write_result(a.out or RESULTS / "hadamard_host_cost.json", {
        "numel": a.numel, "block": a.block, "reps": a.reps, "cpu": cpu_model(), "ms": result,
        "quant_backend": "cpu (compiled)" if cpu_quant.supports(a.block) else "torch"}))


HOST_SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-qgz", "zeropp"]


def _no_op_quantizers():
    """Replace the quantizers the quantized collectives call by no-ops of the same shapes."""
    import zeropp.techniques.qgz as qc
    from zeropp.kernels.format import Quantized
    qc.quantize = lambda x, bits=8, block_size=None, backend="auto", out=None: (
        out if out is not None else Quantized.empty(x.numel(), bits, block_size, x.device))
    qc.dequantize = lambda q, dtype=torch.float32, backend="auto", out=None: (
        out if out is not None else torch.empty(*q.data.shape[:-1], q.numel, dtype=dtype))
    qc.dequantize_reduce_requantize = lambda st, bits_out=4, block_size_out=None, backend="auto", out=None: (
        out if out is not None else Quantized.empty(st.numel, bits_out, st.block_size, st.data.device))
    qc.dequantize_reduce = lambda st, dtype=torch.float32, scale=1.0, backend="auto", out=None: (
        out if out is not None else torch.empty(st.numel, dtype=dtype))


def _host_rank(rank, world, systems, a, rounds, no_op):
    from bench.slow_link.ranks import build_system, timed_loop
    if no_op:
        _no_op_quantizers()
    built = {s: build_system(rank, world, s, a) for s in systems}
    times = {s: [] for s in systems}
    for r in range(rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            times[s] += timed_loop(rank, world, built[s], a)["step_times_s"]
    return times


def host_cost(args):
    from bench.slow_link.systems import LABELS
    from scenarios.harness.spawn import run_distributed
    a = dict(num_layers=args.num_layers, hidden=args.hidden, heads=4, vocab=4096, seq=args.seq, micro_batch=1,
             warmup=2, steps=args.steps, seed=1234, dtype=args.dtype, bucket_fraction=8, ranks_per_node=2)
    medians = {}
    for no_op in (False, True):
        times = run_distributed(_host_rank, 4, (HOST_SYSTEMS, a, args.rounds, no_op),
                                env={"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, timeout=1200)[0]
        medians["no_op" if no_op else "real"] = {s: statistics.median(t) * 1e3 for s, t in times.items()}
    print(f"{args.dtype}, 4 gloo ranks as 2 nodes x 2 on loopback; median ms per step over {args.rounds} x "
          f"{args.steps} steps\n| system | step ms | x ZeRO-3 | step ms, quantizers no-ops | x ZeRO-3 |\n|---|---|---|---|---|")
    base = {k: v["zero3-reuse0"] for k, v in medians.items()}
    for s in HOST_SYSTEMS:
        print(f"| {LABELS[s]} | " + " | ".join(f"{medians[k][s]:.1f} | {base[k] / medians[k][s]:.2f}x" for k in medians) + " |")
    out = args.out or RESULTS / ("quant_host_cost.json" if args.dtype == "bf16" else f"quant_host_cost_{args.dtype}.json")
    print("wrote", write_result(out, {"args": a, "median_step_ms": medians}))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quant", help="quantize/dequantize/fused GB/s against a copy of the same bytes")
    q.add_argument("--numel", type=int, default=1 << 24)
    q.add_argument("--repeats", type=int, default=5)
    q.add_argument("--device", default="cpu")
    q.add_argument("--parts", type=int, default=4, help="k parts in the fused reduce (qgZ's ranks per node)")
    h = sub.add_parser("hadamard", help="Hadamard transform against one INT4 quantize/dequantize, ms")
    h.add_argument("--numel", type=int, default=19532 * 128)
    h.add_argument("--block", type=int, default=128)
    h.add_argument("--reps", type=int, default=30)
    c = sub.add_parser("host-cost", help="each system's step with quantizers real and no-ops (a diagnostic)")
    c.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    c.add_argument("--rounds", type=int, default=3, help="interleaved passes over the systems")
    for k, d in (("num-layers", 4), ("hidden", 192), ("seq", 16), ("steps", 6)):
        c.add_argument(f"--{k}", type=int, default=d)
    for sp in (q, h, c):
        sp.add_argument("--out", default=None, help="default under results/")
    a = p.parse_args(argv)
    {"quant": quant, "hadamard": hadamard, "host-cost": host_cost}[a.command](a)
