#!/usr/bin/env python
"""Streaming DiLoCo against ZeRO-3 and ZeRO++ over the emulated slow link (issue 27).

    sudo .venv/bin/python -m bench.slow_link_diloco            # ~25 min on 2 quiet cores

The link, the ranks and the counting are bench/slow_link.py's (2 netns "nodes" x 2 ranks,
veth + tc tbf; bench/slow_link_sweep.py). The DiLoCo rows (bench/system_catalog.py DILOCO)
make a group of each node, built as train.py builds it (training/outer.py), INT4 outer
gradients. A DiLoCo step is an inner step; its throughput is taken over the whole timed
window's wall time (barriers and every delay an exchange causes included), which spans
--cycles x H inner steps, so that it holds each fragment's exchange --cycles times. First
the fragments: F in --fragments at --fragments-rate Mbit/s with H = 16 (one cycle each);
the fastest F is used for every DiLoCo row. The per-step systems time --steps steps, fewer
where a step is slow (--steps-at). Then the issue's goals at the lowest rate, and the
planner's predicted inner step (train.py --dry-run) beside the measured one at each throttled
rate: its compute rate measured here, on this model (calibrate), its link the emulated one
(rate and tc tbf burst); its exposed exchange against the window's excess over the unthrottled.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT
from bench.netns import NS, netns_down, netns_up, sh
from bench.slow_link_report import fmt_table, md_table, rate_name
from bench.slow_link_sweep import run_system, summarize

SPEEDUP_MIN, BYTES_MAX = 10.0, 0.01   # issue 27's done-when, at the lowest rate
PLANNED = re.compile(r"inner step ([\d.]+) s \+ ([\d.]+) s exposed")   # planner/outer.py's line


def calibrate(a) -> dict:
    """This machine's compute rate per rank on the bench's own model and dtype, for the planner:
    forward + backward in one process with one thread (bench/calibrate_compute.py's time_model),
    divided by the ranks sharing a core, as configs/clusters/emulated_slow_link.yaml does (its
    rates were measured on another CPU and another model: small matmuls run far below these)."""
    import torch
    from bench.calibrate_compute import time_model
    from bench.slow_link import versions
    from bench.system_catalog import model_config
    dtype = torch.bfloat16 if a["dtype"] == "bf16" else torch.float32
    r = time_model(dtype, model_config(a), a["seq"], a["micro_batch"])
    ranks, cores = 2 * a["ranks_per_node"], len(os.sched_getaffinity(0))
    share = max(1.0, ranks / cores)
    return {**r, "model": {k: a[k] for k in ("num_layers", "hidden", "heads", "vocab", "seq", "micro_batch")},
            "cpu_model": versions().get("cpu_model"), "ranks_per_core": share, "peak_flops": r["flops_per_s"] / share,
            "cluster_key": "peak_flops" if a["dtype"] == "bf16" else "peak_flops_fp32",
            "loadavg_1min": os.getloadavg()[0]}


def calibration_line(c: dict) -> str:
    m = c["model"]
    return (f"Calibration ({c['cpu_model']}): {c['dtype']} forward+backward of GPT {m['num_layers']} layers, hidden "
            f"{m['hidden']}, seq {m['seq']}, vocab {m['vocab']}, micro-batch {m['micro_batch']} in one thread: "
            f"{c['fwd_bwd_ms']:.0f} ms ({c['fwd_bwd_cpu_ms']:.0f} ms CPU) = {c['flops_per_s'] / 1e9:.1f} GFLOP/s, / "
            f"{c['ranks_per_core']:g} ranks per core = {c['cluster_key']} {c['peak_flops'] / 1e9:.1f} GFLOP/s per "
            f"rank for the planner (load {c['loadavg_1min']:.1f})")


def predicted_step(a, H, F, rate, tokenizer, calibration: dict) -> dict:
    """The planner's inner step at `rate` Mbit/s: emulated_slow_link.yaml with this link's rate and
    tc tbf burst (bench/netns.py) and this machine's compute rate on this model (`calibration`)."""
    from bench.netns import tbf_burst
    text = (ROOT / "configs" / "clusters" / "emulated_slow_link.yaml").read_text()
    for key, value in (("inter_node_gbps", rate / 1000), ("inter_node_burst_kib", tbf_burst(rate) / 1024),
                       (calibration["cluster_key"], calibration["peak_flops"])):
        text, n = re.subn(rf"(?m)^{key}: *\S+", f"{key}: {value:.6g}", text)
        text += "" if n else f"\n{key}: {value:.6g}\n"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cluster:
        cluster.write(text)
        cluster.flush()
        cmd = [sys.executable, "train.py", "--dry-run", "--cluster", cluster.name, "--tokenizer-model", tokenizer,
               "--num-layers", str(a["num_layers"]), "--hidden-size", str(a["hidden"]), "--num-attention-heads",
               str(a["heads"]), "--seq-length", str(a["seq"]), "--max-position-embeddings", str(a["seq"]),
               "--micro-batch-size", str(a["micro_batch"]), "--global-batch-size", str(4 * a["micro_batch"]),
               "--lr", "1e-4", "--zero-stage", "3", "--outer-sync-interval", str(H), "--outer-fragments", str(F),
               "--outer-quantization", "int4", "--outer-sync-delay", str(a.get("outer_sync_delay", 1))
               ] + (["--bf16"] if a["dtype"] == "bf16" else [])
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [l.strip() for l in r.stdout.splitlines() if "across groups per inner step" in l or "inner step " in l]
    ok = r.returncode == 0 and PLANNED.search(r.stdout)
    return {"H": H, "F": F, "rate_mbit": rate,
            "line": " / ".join(lines) if ok else f"dry run failed: {(r.stderr or r.stdout)[-300:]}"}


def sweep(system, rates, a, port, args, logdir):
    runs = run_system(system, rates, a, port, args.setup_timeout, args.timeout, logdir)
    rows = [summarize(system, r, [run], a) for r, run in zip(rates, runs)]
    for x in rows:
        x["config"] = {k: a[k] for k in ("steps", "steps_at", "warmup", "outer_fragments") if k in a}
        print(f"  {x['label']} @ {rate_name(x['rate_mbit'])}: " + (f"ERROR {x['error'].splitlines()[-1][:160]}"
              if x.get("error") else f"{x['samples_per_s']:.2f} samples/s (median), {x['samples_per_s_window']:.2f}"
              f" (window), veth {x['link_bytes_per_step'] / 1e6:.3f} MB/step over {x['timed_steps']} steps"),
              flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,20,50,100,0", help="Mbit/s, comma separated; 0 = no qdisc")
    p.add_argument("--baselines", default="zero3,zeropp-loco")
    p.add_argument("--diloco", default="diloco-h16,diloco-h64")
    p.add_argument("--fragments", default="1,2,4")
    p.add_argument("--fragments-rate", type=int, default=20)
    p.add_argument("--cycles", type=int, default=2, help="DiLoCo: timed inner steps = this x H")
    p.add_argument("--steps", type=int, default=4, help="per-step systems: timed steps")
    p.add_argument("--steps-at", default="10:2,20:2", help="per-step systems: RATE:STEPS where a step is slow")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--outer-sync-delay", type=int, default=1, help="DiLoCo: inner steps an exchange overlaps")
    p.add_argument("--tokenizer-model", default=str(ROOT / "work_dir" / "kjv_sp.model"),
                   help="for the planner's vocabulary (--vocab entries)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--setup-timeout", type=float, default=300)
    p.add_argument("--out", default=str(RESULTS / "slow_link_diloco.json"))
    p.add_argument("--from-json", default=None, help="run nothing: render this results file again into --out")
    args = p.parse_args(argv)
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), Path(args.out))
        return 0
    if os.geteuid() != 0:
        print("slow_link_diloco: SKIPPED (not root): the emulated link needs network namespaces")
        return 0
    taken = [ns for ns in sh("ip", "netns", "list", check=False).stdout.split() if ns in NS]
    if taken:   # netns_up would remove another run's namespaces
        print(f"slow_link_diloco: namespaces {', '.join(taken)} exist (another slow-link run?); wait for it "
              f"or remove them with `ip netns del`")
        return 2
    from bench.slow_link import versions
    from bench.system_catalog import outer_interval
    rates = [int(r) for r in args.rates.split(",")]
    a = {"num_layers": args.num_layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
         "seq": args.seq, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
         "seed": 1234, "dtype": args.dtype, "ranks_per_node": 2, "repeats": 1, "bucket_fraction": 8,
         "profile": False, "outer_sync_delay": args.outer_sync_delay}
    steps_at = {r: int(n) for r, n in (x.split(":") for x in args.steps_at.split(",") if x)}
    logdir = Path(tempfile.mkdtemp(prefix="slow_link_diloco_"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the namespaces go in `finally`
    t0, port, rows, search = time.monotonic(), 29600, [], []
    uptime = [sh("uptime").stdout.strip()]
    try:
        netns_up()
        for F in [int(f) for f in args.fragments.split(",")]:
            port += 1
            print(f"fragments: F = {F}, H = 16 at {args.fragments_rate} Mbit/s", flush=True)
            search += sweep("diloco-h16", [args.fragments_rate], {**a, "steps": 16, "outer_fragments": F},
                            port, args, logdir)
        ok = [x for x in search if not x.get("error")]
        best = max(ok, key=lambda x: x["samples_per_s_window"])["config"]["outer_fragments"] if ok else 1
        print(f"best F = {best}", flush=True)
        for s in args.baselines.split(",") + args.diloco.split(","):
            port += 1
            H = outer_interval(s)
            mine = ({**a, "steps": args.cycles * H, "outer_fragments": best} if H else {**a, "steps_at": steps_at})
            print(f"{s}:", flush=True)
            rows += sweep(s, rates, mine, port, args, logdir)
            uptime.append(sh("uptime").stdout.strip())
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(rows, default=str))
    finally:
        netns_down()
    report = {"config": {**a, "rates_mbit": rates, "cycles": args.cycles, "steps_at": steps_at,
                         "best_fragments": best, "fragments_rate": args.fragments_rate},
              "versions": versions(), "uptime": uptime, "fragment_search": search, "results": rows,
              "command": " ".join([sys.executable, "-m", "bench.slow_link_diloco"] + (argv or sys.argv[1:])),
              "wall_s": time.monotonic() - t0}
    report["calibration"] = calibrate(a)   # the ranks are gone: the machine is as quiet as for the sweep
    report["planner"] = [predicted_step(a, H, best, r, args.tokenizer_model, report["calibration"])
                         for H in map(outer_interval, args.diloco.split(",")) for r in rates if r]
    render(report, Path(args.out))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    return 0


def throughput(x) -> float:
    """DiLoCo: over the whole window (its exchanges included); the others: the median step."""
    return x["samples_per_s_window"] if "outer_fragments" in x["config"] else x["samples_per_s"]


def render(report, out: Path):
    ms = lambda x: 1000 * 4 * report["config"]["micro_batch"] / throughput(x)   # noqa: E731 (4 ranks)
    from bench.system_catalog import LABELS
    rows, rates = report["results"], report["config"]["rates_mbit"]
    by = {(x["system"], x["rate_mbit"]): x for x in rows if not x.get("error")}
    systems = list(dict.fromkeys(x["system"] for x in rows))
    hdr = ["system"] + [f"{rate_name(r)} samples/s (ms/step, x ZeRO++)" for r in rates] + [
        "veth MB/inner step (lowest rate)", "counted MB/step", "x ZeRO-3 bytes"]
    lines = []
    z3 = by.get(("zero3", rates[0]))
    for s in systems:
        cells = [LABELS.get(s, s)]
        for r in rates:
            x, zpp = by.get((s, r)), by.get(("zeropp-loco", r))
            cells.append("ERROR" if x is None else f"{throughput(x):.2f} ({ms(x):.0f} ms"
                         + (f", {throughput(x) / throughput(zpp):.2f}x" if zpp else "") + ")")
        x = by.get((s, rates[0]))
        cells += ["-", "-", "-"] if x is None else [
            f"{x['link_bytes_per_step'] / 1e6:.4f}", f"{x['counted_inter_bytes_per_step'] / 1e6:.4f}",
            f"{x['link_bytes_per_step'] / z3['link_bytes_per_step']:.4f} veth, "
            f"{x['counted_inter_bytes_per_step'] / z3['counted_inter_bytes_per_step']:.4f} counted" if z3 else "-"]
        lines.append(cells)
    goals = []
    zpp = by.get(("zeropp-loco", rates[0]))
    for s in systems:
        x = by.get((s, rates[0]))
        if x is None or "outer_fragments" not in x["config"] or not (zpp and z3):
            continue
        sp = throughput(x) / throughput(zpp)
        bv = x["link_bytes_per_step"] / z3["link_bytes_per_step"]
        bc = x["counted_inter_bytes_per_step"] / z3["counted_inter_bytes_per_step"]
        goals.append(f"{LABELS.get(s, s)} at {rate_name(rates[0])}: {sp:.1f}x ZeRO++ "
                     f"({'PASS' if sp >= SPEEDUP_MIN else 'FAIL'} >= {SPEEDUP_MIN:g}x); bytes across groups per "
                     f"inner step {bv:.4f} (veth) / {bc:.4f} (counted) of ZeRO-3's "
                     f"({'PASS' if max(bv, bc) <= BYTES_MAX else 'FAIL'} <= {BYTES_MAX:g})")
    c, v = report["config"], report["versions"]
    fr = "; ".join(f"F={x['config']['outer_fragments']}: "
                   + ("ERROR" if x.get("error") else f"{x['samples_per_s_window']:.2f} samples/s")
                   for x in report["fragment_search"])
    text = [f"GPT {c['num_layers']} layers, hidden {c['hidden']}, {c['heads']} heads, vocab {c['vocab']}, seq "
            f"{c['seq']}, micro-batch {c['micro_batch']}/rank, {c['dtype']}; 2 netns nodes x 2 gloo ranks "
            f"(DiLoCo: a group per node, INT4 outer gradients, F = {c['best_fragments']}). CPU {v.get('cpu_model')}, "
            f"torch CPU capability {v.get('cpu_capability')}, {v.get('cpus')} cores.",
            f"Timed: per-step systems {c['warmup']} warm-up + {c['steps']} steps (at "
            + ", ".join(f"{k} Mbit/s: {n}" for k, n in c["steps_at"].items())
            + f"), median step; DiLoCo {c['warmup']} warm-up + {c['cycles']} x H inner steps, samples/s over the "
            f"whole timed window (outer exchanges included).",
            f"Fragments at {c['fragments_rate']} Mbit/s, H = 16: {fr} -> F = {c['best_fragments']}.",
            "Load (uptime) at the start and after each system: " + " | ".join(report["uptime"]), "",
            fmt_table(hdr, lines), "", *goals, ""]
    plans = [calibration_line(report["calibration"])] if "calibration" in report else []
    # older reports: the planner at 20 Mbit/s only, uncalibrated
    planner = report.get("planner") or [{**x, "rate_mbit": 20} for x in report.get("planner_20mbit", [])]
    for H in dict.fromkeys(x["H"] for x in planner):
        mine = [x for x in planner if x["H"] == H]
        plans.append(f"Planner (--dry-run, H = {H}, F = {mine[0]['F']}, {rate_name(mine[0]['rate_mbit'])}): "
                     f"{mine[0]['line']}")
        free = by.get((f"diloco-h{H}", 0))
        cells = []
        for x in mine:
            m, p = by.get((f"diloco-h{H}", x["rate_mbit"])), PLANNED.search(x["line"])
            cells.append(f"{rate_name(x['rate_mbit'])}: planner " + (
                f"{1000 * float(p[1]):.0f} + {1000 * float(p[2]):.0f}" if p else "-")
                + (f", measured {ms(m):.0f}" if m else "")
                + (f" = {ms(free):.0f} unthrottled {ms(m) - ms(free):+.0f}" if m and free else ""))
        plans.append(f"Inner step H = {H}, ms (planner: step + exposed exchange; measured: window mean): "
                     + "; ".join(cells))
    text += plans
    print("\n".join(text), flush=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    md = text[:4] + ["", md_table(hdr, lines), ""] + [f"- {g}" for g in goals] + [""] + [f"- {l}" for l in plans]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
