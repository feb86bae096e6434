#!/usr/bin/env python
"""The planner against a real link: predicted vs measured step times of bench/slow_link.py.

    .venv/bin/python -m bench.planner_calibration      # a few seconds; no network, no root

bench/slow_link.py measured our ZeRO-3 (reuse 0) and ZeRO++ (and each switch alone)
on 2 network namespaces x 2 gloo ranks joined by a veth limited by tc tbf to 100,
200, 1000 Mbit/s or unlimited (results in bench/results/slow_link.json, bf16, and
slow_link_fp32.json). This script describes that setup to the planner
(configs/clusters/emulated_slow_link.yaml: 2 "nodes" x 2 ranks, the link's rate,
this machine's compute, quantization and loopback rates from
bench/calibrate_compute.py), plans each (system, rate) with the same model, dtype
and zero_optimization keys the bench used, and compares the predicted iteration
time with the measured median step time. Each system's host work that the model
does not itemize (hooks, copies, Python around the quantizers) is calibrated on
its own unthrottled cell (measured - modelled, `step_overhead_ms`); the throttled
cells are then predictions of the link and overlap model, the engine's (planner/
timing.py: prefetched gathers under the forward, reductions under the backward).
Writes bench/results/planner_calibration.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from bench import RESULTS, ROOT

import zeropp
from model import GPTConfig
from planner.cluster import load_cluster
from planner.plan import Job, plan_config
from planner.trace import trace_model

CLUSTER = "configs/clusters/emulated_slow_link.yaml"
SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp"]
TOLERANCE = 0.20
NOTES = """
What the time model needs (each a property of the setup, measured or documented, not a knob
fitted to the throttled cells above):
1. gloo runs reduce_scatter as a full all-reduce: twice the ring's bytes on the wire
   (reduce_scatter_factor 2; the veth counters show it, bench/results/slow_link.md). Bytes
   *counted* stay the ring's: the planner's inter-node bytes equal the Communicator's count of
   every bench row exactly (predicted_inter_node_bytes = counted_inter_node_bytes in the JSON).
2. tbf meters whole frames: 1448 payload bytes per 1514 (link_efficiency 0.956).
3. The engine's overlap (`overlap: true`): forward gathers prefetched under the forward compute,
   backward gathers and gradient reductions (on their own process group, qgZ's second hop
   started as soon as the first is done) under the backward, the last reduction exposed.
4. Quantization costs per element, not per byte: the CPU's torch path is compute bound (fp32
   and bf16 inputs cost about the same per element); rates measured per bit width.
5. fp32 runs compute at peak_flops_fp32 (this CPU has no native bf16).
6. Host work per step that the model does not itemize (hooks, bucket copies, the Python around
   the quantizers): fitted to each system's unthrottled cell (step_overhead_ms), and counted as
   compute, which runs beside the collectives in flight (planner/timing.py).
"""


def rate_name(mbit: int) -> str:
    return "unlimited" if mbit == 0 else (f"{mbit // 1000} Gbit/s" if mbit >= 1000 else f"{mbit} Mbit/s")


def job_for(c: dict, system: str, world: int, ranks_per_node: int):
    dtype = c.get("dtype", "fp32")
    cfg = GPTConfig(vocab_size=c["vocab"], num_layers=c["num_layers"], hidden_size=c["hidden"],
                    num_attention_heads=c["heads"], max_position_embeddings=c["seq"], hidden_dropout=0.0,
                    attention_dropout=0.0)
    raw = {"gradient_clipping": 1.0, "zero_optimization": c["zero_optimization"][system]}
    if dtype != "fp32":
        raw[dtype] = {"enabled": True}
    ds = zeropp.DeepSpeedConfig.from_dict(raw)
    job = Job(cfg=cfg, ds=ds, optimizer=zeropp.OptimizerSettings(lr=1e-4), world=world,
              ranks_per_node=ranks_per_node, micro_batch=c["micro_batch"], seq_length=c["seq"], accumulation=1)
    trace = trace_model(cfg, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype], c["micro_batch"], c["seq"],
                        ds.zero_optimization.stage3_param_persistence_threshold)
    return job, trace


def step_overhead_ms(c: dict, cluster, system: str, unthrottled_ms: float) -> tuple[float, float]:
    """Host time per step the model does not itemize, for `system`: the step_overhead_ms with
    which the model predicts its unthrottled step in the same sweep (the veth at loopback speed).
    Host work counts as compute (planner/timing.py), so part of it can hide under the
    collectives: found by iterating overhead += measured - predicted, which converges since the
    prediction grows by at most as much as the overhead. Returns (overhead, modelled without it)."""
    job, trace = job_for(c, system, 2 * c["ranks_per_node"], c["ranks_per_node"])
    loopback = dataclasses.replace(cluster, inter_node_gbps=cluster.intra_node_gbps)

    def predict(overhead: float) -> float:
        return plan_config(job, job.ds.zero_optimization, trace,
                           dataclasses.replace(loopback, step_overhead_ms=overhead)).timing.iteration * 1e3
    modelled = predict(0.0)
    overhead = unthrottled_ms - modelled
    for _ in range(20):
        miss = unthrottled_ms - predict(overhead)
        if abs(miss) < 0.05:
            break
        overhead += miss
    return overhead, modelled


def calibrate(bench_json: Path, cluster_path: str, with_overhead: bool = True) -> tuple[list[dict], dict]:
    bench = json.loads(bench_json.read_text())
    c = bench["config"]
    dtype = c.get("dtype", "fp32")
    base = load_cluster(cluster_path)
    info = []
    world = 2 * c["ranks_per_node"]
    rows = []
    measured = {(r["system"], r["rate_mbit"]): r for r in bench["results"]}
    for system in SYSTEMS:
        job, trace = job_for(c, system, world, c["ranks_per_node"])
        zero = job.ds.zero_optimization
        unthrottled = measured[(system, 0)]["step_ms_median"]
        overhead, modelled = step_overhead_ms(c, base, system, unthrottled)
        cluster = dataclasses.replace(base, step_overhead_ms=overhead if with_overhead else 0.0)
        info.append({"dtype": dtype, "system": system, "step_overhead_ms": overhead,
                     "unthrottled_measured_ms": unthrottled, "unthrottled_modelled_ms_without_overhead": modelled})
        for mbit in c["rates_mbit"]:
            # unlimited: no qdisc, the veth runs at the kernel's TCP speed, as loopback does
            rate_gbps = mbit / 1000 if mbit else base.intra_node_gbps
            plan = plan_config(job, zero, trace, dataclasses.replace(cluster, inter_node_gbps=rate_gbps))
            got = measured[(system, mbit)]
            t = plan.timing
            inter = sum(b[p][1] for b in plan.bytes_per_rank for p in b)
            rows.append({"dtype": dtype, "system": system, "label": c["labels"][system], "rate_mbit": mbit,
                         "predicted_ms": t.iteration * 1e3, "measured_ms": got["step_ms_median"],
                         "error": t.iteration * 1e3 / got["step_ms_median"] - 1,
                         "predicted_compute_ms": (t.compute_fwd + t.compute_bwd) * 1e3,
                         "predicted_quant_ms": t.quant * 1e3,
                         "predicted_comm_ms": {k: v * 1e3 for k, v in t.comm.items()},
                         "predicted_exposed_comm_ms": t.exposed_comm * 1e3,
                         "predicted_inter_node_bytes": inter,
                         "counted_inter_node_bytes": got.get("counted_inter_bytes_per_step"),
                         "veth_bytes": got.get("link_bytes_per_step")})
    return rows, info


def table(rows: list[dict]) -> str:
    rates = sorted({r["rate_mbit"] for r in rows}, key=lambda m: m or 10**9)
    lines = ["| dtype | system | " + " | ".join(f"{rate_name(m)} pred / meas ms (err)" for m in rates) + " |",
             "|---|---|" + "---|" * len(rates)]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for system in SYSTEMS:
            cells = []
            for m in rates:
                r = next(x for x in rows if x["dtype"] == dtype and x["system"] == system and x["rate_mbit"] == m)
                cells.append(f"{r['predicted_ms']:.0f} / {r['measured_ms']:.0f} ({r['error']:+.0%})")
            label = next(x["label"] for x in rows if x["system"] == system)
            lines.append(f"| {dtype} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default=CLUSTER)
    a = p.parse_args()
    rows, infos, plain = [], [], []
    for name in ("slow_link.json", "slow_link_fp32.json"):
        r, info = calibrate(RESULTS / name, a.cluster)
        rows += r
        infos.append(info)
        plain += calibrate(RESULTS / name, a.cluster, with_overhead=False)[0]
    plain_errors = [abs(r["error"]) for r in plain if r["rate_mbit"]]
    throttled = [r for r in rows if r["rate_mbit"]]   # the unthrottled cells calibrate the host work
    errors = [abs(r["error"]) for r in throttled]
    zz = [abs(r["error"]) for r in throttled if r["system"] in ("zero3-reuse0", "zeropp")]
    speedups = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for m in dict.fromkeys(r["rate_mbit"] for r in rows):
            z3, zpp = (next(r for r in rows if r["dtype"] == dtype and r["system"] == s and r["rate_mbit"] == m)
                       for s in ("zero3-reuse0", "zeropp"))
            speedups.append({"dtype": dtype, "rate_mbit": m,
                             "predicted": z3["predicted_ms"] / zpp["predicted_ms"],
                             "measured": z3["measured_ms"] / zpp["measured_ms"]})
    summary = (f"|error| over the {len(throttled)} throttled cells: median {sorted(errors)[len(errors) // 2]:.0%}, "
               f"max {max(errors):.0%} ({sum(e <= TOLERANCE for e in errors)}/{len(errors)} within "
               f"{TOLERANCE:.0%}); ZeRO-3 and ZeRO++ rows: max {max(zz):.0%} "
               f"({sum(e <= TOLERANCE for e in zz)}/{len(zz)} within {TOLERANCE:.0%})")
    sp = "\n".join(f"- {s['dtype']} {rate_name(s['rate_mbit'])}: ZeRO++ / ZeRO-3 speedup predicted "
                   f"{s['predicted']:.2f}x, measured {s['measured']:.2f}x" for s in speedups)
    over = "\n".join(
        f"- {i['dtype']} {i['system']}: {i['step_overhead_ms']:+.0f} ms (unthrottled: measured "
        f"{i['unthrottled_measured_ms']:.0f} ms, model without it {i['unthrottled_modelled_ms_without_overhead']:.0f} ms)"
        for info in infos for i in info)
    summary += (f"\n\nWithout the step_overhead_ms term: |error| median "
                f"{sorted(plain_errors)[len(plain_errors) // 2]:.0%}, max {max(plain_errors):.0%}.")
    text = (f"Planner (`train.py --dry-run` model, {a.cluster}) vs bench/slow_link.py's measured median step "
            f"times: 2 emulated nodes x 2 gloo ranks, GPT 4 layers, hidden 192, seq 16. "
            f"`.venv/bin/python -m bench.planner_calibration`\n\n{table(rows)}\n\n{summary}\n\n{sp}\n\n"
            f"Host work the model does not itemize, per system, from its own unthrottled cell (measured - "
            f"modelled), added to its throttled predictions (step_overhead_ms):\n{over}\n")
    text += NOTES
    print(text)
    (RESULTS / "planner_calibration.md").write_text(text)
    (RESULTS / "planner_calibration.json").write_text(json.dumps(
        {"cluster": a.cluster, "cluster_values": dataclasses.asdict(load_cluster(a.cluster)), "rows": rows,
         "speedups": speedups, "summary": summary, "step_overhead": infos,
         "rows_without_overhead": plain}, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}/planner_calibration.json and .md")


if __name__ == "__main__":
    main()
