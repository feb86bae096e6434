#!/usr/bin/env python
"""This machine's compute rate, for the planner's emulated cluster file.

    .venv/bin/python -m bench.calibrate_compute            # ~3 min on 2 cores

Times, in one process with one thread (each rank of bench/slow_link.py has one
thread), the bench's own model (GPT 4 layers, hidden 192, vocab 4096, seq 16,
micro-batch 1) without any sharding:
- forward + backward, in bf16 and fp32: FLOP/s = Megatron's FLOPs per
  iteration (model.flops_per_iteration) / time;
- the AdamW step over all parameters: bytes/s = 16 bytes per element
  (read weight, gradient, two moments; write weight, two moments: about 28
  bytes of traffic, stated as 16 bytes per element of "optimizer work").
- zeropp.kernels.quant's block (de)quantization of 4M bf16 elements (torch path, as
  the CPU runs it): elements per second through one quantize or dequantize,
  INT8 block 256 and INT4 block 128;
- gloo between 2 local processes (loopback TCP, what two ranks of one emulated
  node use): all-gather of 4 MiB per rank (bytes sent per rank / time); then
  the same with the bench's 4 ranks on the 2 cores (a ring: 3 x 4 MiB sent per
  rank), and the latency of one ring hop there (a 4-byte all-gather, 3 hops);
- bench/slow_link.py's five systems of ours on 4 ranks as 2 emulated nodes x 2
  with no link (loopback only): median step times, from which
  bench/planner_calibration.py takes each system's host overhead.
(time_model takes any model: bench/slow_link_diloco.py times its own with it.)
Writes bench/results/calibrate_compute.json. The planner's cluster file
(configs/clusters/emulated_slow_link.yaml) divides the compute rates by the
ranks sharing a core (4 ranks on 2 cores: 2).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench import RESULTS, ROOT

from model import GPT, GPTConfig, flops_per_iteration

BENCH_MODEL = dict(vocab_size=4096, num_layers=4, hidden_size=192, num_attention_heads=4,
                   max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
SEQ, STEPS, WARMUP = 16, 20, 3


def time_model(dtype: torch.dtype, cfg: GPTConfig | None = None, seq: int = SEQ, micro_batch: int = 1,
               steps: int = STEPS) -> dict:
    """Forward + backward and the AdamW step of `cfg` (default BENCH_MODEL) on micro_batch x seq
    tokens, unsharded, in one thread (a rank of the slow-link benches has one): medians of `steps`
    wall times; fwd_bwd_cpu_ms is the thread's CPU time (well under the wall time: other load)."""
    cfg = cfg or GPTConfig(**BENCH_MODEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(cfg).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
        fb, fb_cpu, st = [], [], []
        for i in range(WARMUP + steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            model(x[:, :-1], x[:, 1:]).backward()
            t1, c1 = time.perf_counter(), time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=False)
            t2 = time.perf_counter()
            if i >= WARMUP:
                fb.append(t1 - t0)
                fb_cpu.append(c1 - c0)
                st.append(t2 - t1)
    finally:
        torch.set_num_threads(threads)
    flops = flops_per_iteration(cfg, micro_batch, seq, recompute=False)
    params = sum(p.numel() for p in model.parameters())
    fwd_bwd, step = statistics.median(fb), statistics.median(st)
    return {"dtype": str(dtype).replace("torch.", ""), "flops_per_step": flops, "params": params,
            "fwd_bwd_ms": fwd_bwd * 1e3, "fwd_bwd_cpu_ms": statistics.median(fb_cpu) * 1e3, "optimizer_ms": step * 1e3,
            "flops_per_s": flops / fwd_bwd, "optimizer_bytes_per_s": 16 * params / step}


def time_quant() -> dict:
    from zeropp.kernels.quant import dequantize, quantize
    x = torch.randn(4 * 2**20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = {}
    for bits, block in ((8, 256), (4, 128)):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            dequantize(quantize(x, bits, block), torch.bfloat16)
            ts.append(time.perf_counter() - t0)
        # elements through one kernel per second: quantize and dequantize each pass x.numel()
        out[f"int{bits}_elements_per_s"] = 2 * x.numel() / statistics.median(ts)
    return out


def _gloo_worker(rank, world):
    import torch.distributed as dist
    from parallel.comm import all_gather_flat
    res = {}
    for name, numel in (("bandwidth", 2 * 2**20), ("latency", 2)):
        inp = torch.zeros(numel, dtype=torch.bfloat16)
        out = torch.empty(numel * world, dtype=torch.bfloat16)
        ts = []
        for i in range(13):
            dist.barrier()
            t0 = time.perf_counter()
            all_gather_flat(out, inp)
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts[3:])
    # a ring all-gather: each rank sends (world - 1) shards of 4 MiB; a small one takes world - 1 hops
    if world == 2:
        return {"loopback_bytes_per_s": 2 * 2**20 * 2 / res["bandwidth"], "latency_s": res["latency"]}
    return {"bytes_per_s": (world - 1) * 2 * 2**20 * 2 / res["bandwidth"],
            "hop_latency_s": res["latency"] / (world - 1)}


BENCH_RUN = dict(num_layers=4, hidden=192, heads=4, vocab=4096, seq=16, micro_batch=1, warmup=2, steps=8,
                 seed=1234)


ENGINE_SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp"]


def _engine_worker(rank, world, system, dtype):
    from bench.zero_systems import run_rank
    out = run_rank(rank, world, system, {**BENCH_RUN, "dtype": dtype, "ranks_per_node": 2})
    return statistics.median(out["step_times_s"])


def engine_loopback() -> dict:
    """bench/slow_link.py's systems on 4 gloo ranks as 2 emulated nodes x 2 with no link
    at all (every byte over loopback): their median step times. Against the planner's
    prediction for the same setup, the difference is host work the time model does not
    itemize (hooks, bucket copies, Python around the quantizers): step_overhead_ms."""
    from parallel.spawn import run_distributed
    return {f"{system}/{dtype}": run_distributed(_engine_worker, 4, args=(system, dtype),
                                                 env={"LOCAL_WORLD_SIZE": "2"})[0]
            for dtype in ("bf16", "fp32") for system in ENGINE_SYSTEMS}


def time_gloo() -> dict:
    from parallel.spawn import run_distributed
    return {**run_distributed(_gloo_worker, 2)[0], **{f"{k}_4_ranks": v for k, v in
                                                       run_distributed(_gloo_worker, 4)[0].items()}}


def _median_dicts(dicts: list[dict]) -> dict:
    return {k: (statistics.median(d[k] for d in dicts) if isinstance(dicts[0][k], float) else dicts[0][k])
            for k in dicts[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds of every measurement; medians are kept")
    a = p.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rounds = [([time_model(torch.bfloat16), time_model(torch.float32)], time_quant(), time_gloo())
              for _ in range(a.repeats)]
    rows = [_median_dicts([r[0][i] for r in rounds]) for i in range(2)]
    quant = _median_dicts([r[1] for r in rounds])
    gloo = _median_dicts([r[2] for r in rounds])
    loopback = engine_loopback()   # one round: 10 runs of 4 ranks
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                       "cpus": os.cpu_count(), "threads": 1,
                       "loadavg_1min_before": load, "repeats": a.repeats},
           "model": {**BENCH_MODEL, "seq": SEQ, "micro_batch": 1}, "rows": rows, "quant": quant, "gloo": gloo,
           "loopback_2x2_step_s": loopback}
    for r in rows:
        print(f"{r['dtype']:>8}: forward+backward {r['fwd_bwd_ms']:.1f} ms = {r['flops_per_s'] / 1e9:.2f} GFLOP/s; "
              f"AdamW step {r['optimizer_ms']:.1f} ms = {r['optimizer_bytes_per_s'] / 1e9:.2f} GB/s (16 B/param)")
    print(f"  quant (bf16): INT8 {quant['int8_elements_per_s'] / 1e6:.0f} M elements/s, "
          f"INT4 {quant['int4_elements_per_s'] / 1e6:.0f} M elements/s")
    print(f"  gloo loopback, 2 ranks: {gloo['loopback_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s per rank, "
          f"latency {gloo['latency_s'] * 1e6:.0f} us; 4 ranks on 2 cores: "
          f"{gloo['bytes_per_s_4_ranks'] * 8 / 1e9:.2f} Gbit/s per rank, {gloo['hop_latency_s_4_ranks'] * 1e6:.0f} us "
          f"per ring hop")
    print("  the bench's systems on 2 x 2 ranks over loopback (no link), median step ms: "
          + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in loopback.items()))
    path = RESULTS / "calibrate_compute.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
