"""This machine's rates for the planner's emulated cluster (configs/clusters/emulated_slow_link.yaml,
which divides compute rates by the ranks sharing a core), and the planner against the sweep's stored
step times (`python -m bench.slow_link calibrate` / `planner`).

calibrate, in one thread (a slow-link rank has one), on the sweep's model unsharded: forward + backward
in bf16 and fp32 (FLOP/s = model.flops_per_iteration / time) and AdamW (16 bytes per element of
optimizer work); block (de)quantization elements/s (INT8 block 256, INT4 block 128, bf16); gloo
all-gather over loopback with 2 ranks and with 4 on the cores (bandwidth, ring-hop latency); the sweep's
systems of ours on 4 ranks as 2 x 2 with no link (the planner takes each one's host overhead from it).
planner: each (system, rate) of results/slow_link{,_fp32}.json planned with the same model, dtype and
zero_optimization, the host work the model does not itemize fitted on the system's unthrottled cell
(step_overhead_ms); predicted against measured, |error| against TOLERANCE."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import torch

from bench import RESULTS, write_result

MODEL = dict(vocab_size=4096, num_layers=4, hidden_size=192, num_attention_heads=4, max_position_embeddings=16,
             hidden_dropout=0.0, attention_dropout=0.0)
RUN = dict(num_layers=4, hidden=192, heads=4, vocab=4096, seq=16, micro_batch=1, warmup=2, steps=8, seed=1234)
SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp"]
CLUSTER = "configs/clusters/emulated_slow_link.yaml"
TOLERANCE = 0.20


def add_args(p):
    p.add_argument("--repeats", type=int, default=3, help="rounds of every measurement; medians are kept")
    p.add_argument("--steps", type=int, default=20, help="timed steps of the one-thread model")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="over loopback, 4 ranks ('' to skip)")
    p.add_argument("--out", default=str(RESULTS / "calibrate_compute.json"))


def time_model(dtype, cfg=None, seq: int = 16, micro_batch: int = 1, steps: int = 20, warmup: int = 3) -> dict:
    """Forward + backward and AdamW of `cfg` (default the sweep's model) unsharded in one thread: medians."""
    from model import GPT, GPTConfig, flops_per_iteration
    cfg = cfg or GPTConfig(**MODEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(cfg).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
        fb, fb_cpu, st = [], [], []
        for i in range(warmup + steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            model(x[:, :-1], x[:, 1:]).backward()
            t1, c1 = time.perf_counter(), time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if i >= warmup:
                fb.append(t1 - t0)
                fb_cpu.append(c1 - c0)
                st.append(time.perf_counter() - t1)
    finally:
        torch.set_num_threads(threads)
    flops, params = flops_per_iteration(cfg, micro_batch, seq, recompute=False), sum(p.numel() for p in model.parameters())
    fwd_bwd, step = statistics.median(fb), statistics.median(st)
    return {"dtype": str(dtype).replace("torch.", ""), "flops_per_step": flops, "params": params,
            "fwd_bwd_ms": fwd_bwd * 1e3, "fwd_bwd_cpu_ms": statistics.median(fb_cpu) * 1e3, "optimizer_ms": step * 1e3,
            "flops_per_s": flops / fwd_bwd, "optimizer_bytes_per_s": 16 * params / step}


def time_quant(numel=4 * 2**20) -> dict:
    from zeropp.kernels.quant import dequantize, quantize
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = {}
    for bits, block in ((8, 256), (4, 128)):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            dequantize(quantize(x, bits, block), torch.bfloat16)
            ts.append(time.perf_counter() - t0)
        out[f"int{bits}_elements_per_s"] = 2 * x.numel() / statistics.median(ts)   # through each of the two kernels
    return out


def _gloo_rank(rank, world):
    import torch.distributed as dist
    from parallel.comm import all_gather_flat
    res = {}
    for name, numel in (("bandwidth", 2 * 2**20), ("latency", 2)):
        inp, out, ts = torch.zeros(numel, dtype=torch.bfloat16), torch.empty(numel * world, dtype=torch.bfloat16), []
        for _ in range(13):
            dist.barrier()
            t0 = time.perf_counter()
            all_gather_flat(out, inp)
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts[3:])
    if world == 2:   # a ring all-gather: each rank sends (world - 1) shards of 4 MiB; a tiny one takes world - 1 hops
        return {"loopback_bytes_per_s": 2 * 2**20 * 2 / res["bandwidth"], "latency_s": res["latency"]}
    return {"bytes_per_s": (world - 1) * 2 * 2**20 * 2 / res["bandwidth"], "hop_latency_s": res["latency"] / (world - 1)}


def _engine_rank(rank, world, system, dtype, steps):
    from bench.slow_link.ranks import run_rank
    return statistics.median(run_rank(rank, world, system, {**RUN, "steps": steps, "dtype": dtype,
                                                             "ranks_per_node": 2})["step_times_s"])


def _median_dicts(dicts: list[dict]) -> dict:
    return {k: statistics.median(d[k] for d in dicts) if isinstance(dicts[0][k], float) else dicts[0][k] for k in dicts[0]}


def run(args):
    from scenarios.harness.spawn import run_distributed
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rounds = [([time_model(torch.bfloat16, steps=args.steps), time_model(torch.float32, steps=args.steps)], time_quant(),
               {**run_distributed(_gloo_rank, 2)[0], **{f"{k}_4_ranks": v for k, v in run_distributed(_gloo_rank, 4)[0].items()}})
              for _ in range(args.repeats)]
    rows = [_median_dicts([r[0][i] for r in rounds]) for i in range(2)]
    quant, gloo = _median_dicts([r[1] for r in rounds]), _median_dicts([r[2] for r in rounds])
    loopback = {f"{s}/{dtype}": run_distributed(_engine_rank, 4, args=(s, dtype, RUN["steps"]),
                                                env={"LOCAL_WORLD_SIZE": "2"})[0]
                for dtype in ("bf16", "fp32") for s in args.systems.split(",") if s}
    for r in rows:
        print(f"{r['dtype']:>8}: forward+backward {r['fwd_bwd_ms']:.1f} ms = {r['flops_per_s'] / 1e9:.2f} GFLOP/s; "
              f"AdamW {r['optimizer_ms']:.1f} ms = {r['optimizer_bytes_per_s'] / 1e9:.2f} GB/s (16 B/param)")
    print(f"  quant (bf16): INT8 {quant['int8_elements_per_s'] / 1e6:.0f} M elements/s, INT4 "
          f"{quant['int4_elements_per_s'] / 1e6:.0f} M elements/s\n  gloo loopback, 2 ranks: "
          f"{gloo['loopback_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s per rank, latency {gloo['latency_s'] * 1e6:.0f} us; 4 ranks: "
          f"{gloo['bytes_per_s_4_ranks'] * 8 / 1e9:.2f} Gbit/s per rank, {gloo['hop_latency_s_4_ranks'] * 1e6:.0f} us per hop")
    if loopback:
        print("  systems on 2 x 2 ranks over loopback, median step ms: "
              + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in loopback.items()))
    print("wrote", write_result(args.out, {"repeats": args.repeats, "threads": 1, "loadavg_1min_before": load,
                                           "model": {**MODEL, "seq": RUN["seq"], "micro_batch": 1}, "rows": rows,
                                           "quant": quant, "gloo": gloo, "loopback_2x2_step_s": loopback}))


# ---- the planner against the sweep's stored step times
def add_args_planner(p):
    p.add_argument("--cluster", default=CLUSTER)
    p.add_argument("--results", default="slow_link.json,slow_link_fp32.json", help="sweep results under results/")
    p.add_argument("--out", default=str(RESULTS / "planner_calibration.json"))


def job_for(c: dict, system: str):
    import zeropp
    from model import GPTConfig
    from planner.plan import Job
    from planner.trace import trace_model
    dtype = c.get("dtype", "fp32")
    cfg = GPTConfig(vocab_size=c["vocab"], num_layers=c["num_layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                    max_position_embeddings=c["seq"], hidden_dropout=0.0, attention_dropout=0.0)
    ds = zeropp.DeepSpeedConfig.from_dict({"gradient_clipping": 1.0, "zero_optimization": c["zero_optimization"][system],
                                           **({dtype: {"enabled": True}} if dtype != "fp32" else {})})
    job = Job(cfg=cfg, ds=ds, optimizer=zeropp.OptimizerSettings(lr=1e-4), world=2 * c["ranks_per_node"],
              ranks_per_node=c["ranks_per_node"], micro_batch=c["micro_batch"], seq_length=c["seq"], accumulation=1)
    return job, trace_model(cfg, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype], c["micro_batch"], c["seq"],
                            ds.zero_optimization.stage3_param_persistence_threshold)


def plan_rows(bench: dict, cluster_path: str, with_overhead: bool = True):
    """Predicted vs measured per (system, rate); the host overhead per system found by iterating
    overhead += measured - predicted on its unthrottled cell (the veth at loopback speed)."""
    from planner.cluster import load_cluster
    from planner.plan import plan_config
    c, base = bench["config"], load_cluster(cluster_path)
    measured = {(r["system"], r["rate_mbit"]): r for r in bench["results"]}
    rows, info = [], []
    for system in SYSTEMS:
        job, trace = job_for(c, system)
        zero, unthrottled = job.ds.zero_optimization, measured[(system, 0)]["step_ms_median"]
        predict = lambda cl, gbps: plan_config(job, zero, trace, dataclasses.replace(cl, inter_node_gbps=gbps))  # noqa: E731
        at = lambda o: predict(dataclasses.replace(base, step_overhead_ms=o), base.intra_node_gbps).timing.iteration * 1e3  # noqa: E731
        modelled = overhead = at(0.0)
        overhead = unthrottled - modelled
        for _ in range(20):
            miss = unthrottled - at(overhead)
            if abs(miss) < 0.05:
                break
            overhead += miss
        info.append({"dtype": c.get("dtype", "fp32"), "system": system, "step_overhead_ms": overhead,
                     "unthrottled_measured_ms": unthrottled, "unthrottled_modelled_ms_without_overhead": modelled})
        cluster = dataclasses.replace(base, step_overhead_ms=overhead if with_overhead else 0.0)
        for mbit in c["rates_mbit"]:
            plan, got = predict(cluster, mbit / 1000 if mbit else base.intra_node_gbps), measured[(system, mbit)]
            t = plan.timing
            rows.append({"dtype": c.get("dtype", "fp32"), "system": system, "label": c["labels"][system], "rate_mbit": mbit,
                         "predicted_ms": t.iteration * 1e3, "measured_ms": got["step_ms_median"],
                         "error": t.iteration * 1e3 / got["step_ms_median"] - 1,
                         "predicted_compute_ms": (t.compute_fwd + t.compute_bwd) * 1e3, "predicted_quant_ms": t.quant * 1e3,
                         "predicted_exposed_comm_ms": t.exposed_comm * 1e3,
                         "predicted_comm_ms": {k: v * 1e3 for k, v in t.comm.items()},
                         "predicted_inter_node_bytes": sum(b[p][1] for b in plan.bytes_per_rank for p in b),
                         "counted_inter_node_bytes": got.get("counted_inter_bytes_per_step"),
                         "veth_bytes": got.get("link_bytes_per_step")})
    return rows, info


def run_planner(args):
    from bench.slow_link.report import md_table, rate_name
    from planner.cluster import load_cluster
    rows, infos, plain = [], [], []
    for name in args.results.split(","):
        bench = json.loads((RESULTS / name).read_text())
        r, info = plan_rows(bench, args.cluster)
        rows, infos, plain = rows + r, infos + info, plain + plan_rows(bench, args.cluster, with_overhead=False)[0]
    rates = sorted({r["rate_mbit"] for r in rows}, key=lambda m: m or 10**9)
    cell = {(r["dtype"], r["system"], r["rate_mbit"]): r for r in rows}
    table = md_table(["dtype", "system"] + [f"{rate_name(m)} pred / meas ms (err)" for m in rates],
                     [[d, cell[(d, s, rates[0])]["label"]] + [f"{cell[(d, s, m)]['predicted_ms']:.0f} / "
                                                              f"{cell[(d, s, m)]['measured_ms']:.0f} ({cell[(d, s, m)]['error']:+.0%})"
                                                              for m in rates]
                      for d in dict.fromkeys(r["dtype"] for r in rows) for s in SYSTEMS])
    errs = lambda rs: sorted(abs(r["error"]) for r in rs if r["rate_mbit"])  # noqa: E731 (unthrottled cells calibrate)
    e, e0 = errs(rows), errs(plain)
    summary = (f"|error| over the {len(e)} throttled cells: median {e[len(e) // 2]:.0%}, max {max(e):.0%} "
               f"({sum(x <= TOLERANCE for x in e)}/{len(e)} within the tolerance {TOLERANCE:.0%}); without "
               f"step_overhead_ms: median {e0[len(e0) // 2]:.0%}, max {max(e0):.0%}")
    speedups = [{"dtype": d, "rate_mbit": m, **{k: cell[(d, "zero3-reuse0", m)][f"{k}_ms"] / cell[(d, "zeropp", m)][f"{k}_ms"]
                                                for k in ("predicted", "measured")}}
                for d in dict.fromkeys(r["dtype"] for r in rows) for m in rates]
    summary += "\n\n" + "\n".join(f"- {x['dtype']} {rate_name(x['rate_mbit'])}: ZeRO++ / ZeRO-3 speedup predicted "
                                   f"{x['predicted']:.2f}x, measured {x['measured']:.2f}x" for x in speedups)
    over = "\n".join(f"- {i['dtype']} {i['system']}: {i['step_overhead_ms']:+.0f} ms (unthrottled measured "
                     f"{i['unthrottled_measured_ms']:.0f}, modelled without it {i['unthrottled_modelled_ms_without_overhead']:.0f})"
                     for i in infos)
    text = (f"Planner ({args.cluster}) vs the sweep's measured median steps\n\n{table}\n\n{summary}\n\nHost work the "
            f"model does not itemize, per system, fitted on its unthrottled cell:\n{over}\n")
    print(text)
    out = write_result(args.out, {"cluster": args.cluster, "cluster_values": dataclasses.asdict(load_cluster(args.cluster)),
                                  "rows": rows, "speedups": speedups, "summary": summary, "step_overhead": infos, "rows_without_overhead": plain})
    out.with_suffix(".md").write_text(text)
    print("wrote", out, "and .md")
