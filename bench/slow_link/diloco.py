"""Streaming DiLoCo against ZeRO-3 and ZeRO++ + LoCo over the emulated slow link
(`python -m bench.slow_link diloco`). The link, ranks and counting are the sweep's; the DiLoCo rows
(bench/slow_link/systems.py DILOCO) make a group of each node, built as train.py builds it, INT4 outer
gradients. A DiLoCo step is an inner step; its throughput is taken over the whole timed window
(--cycles x H inner steps, every exchange and the delay it causes included). First F in --fragments
at --fragments-rate with H = 16; the fastest F serves every DiLoCo row. Then the targets at the lowest
rate (SPEEDUP_MIN x ZeRO++, bytes across groups <= BYTES_MAX of ZeRO-3's), and the planner's inner step
(train.py --dry-run, this machine's compute rate on this model, the emulated link) beside the measured."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT, cpu_model, write_result
from scenarios.harness.netns import NS, missing, netns_down, netns_up, sh, tbf_burst
from bench.slow_link.report import fmt_table, md_table, rate_name
from bench.slow_link.run import run_system
from bench.slow_link.sweep import add_model_args, summarize

SPEEDUP_MIN, BYTES_MAX = 10.0, 0.01   # at the lowest rate
PLANNED = re.compile(r"inner step ([\d.]+) s \+ ([\d.]+) s exposed")   # planner/outer.py's line
MODEL = dict(num_layers=4, hidden=256, heads=4, vocab=4096, seq=128, micro_batch=8)


def add_args(p):
    add_model_args(p, MODEL, 4, 1)
    p.add_argument("--rates", default="10,20,50,100,0", help="Mbit/s, comma separated; 0 = no qdisc")
    p.add_argument("--baselines", default="zero3,zeropp-loco")
    p.add_argument("--diloco", default="diloco-h16,diloco-h64")
    p.add_argument("--fragments", default="1,2,4")
    p.add_argument("--fragments-rate", type=int, default=20)
    p.add_argument("--cycles", type=int, default=2, help="DiLoCo: timed inner steps = this x H")
    p.add_argument("--steps-at", default="10:2,20:2", help="per-step systems: RATE:STEPS where a step is slow")
    p.add_argument("--outer-sync-delay", type=int, default=1, help="DiLoCo: inner steps an exchange overlaps")
    p.add_argument("--tokenizer-model", default=str(ROOT / "work_dir" / "kjv_sp.model"), help="for the planner")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--setup-timeout", type=float, default=300)
    p.add_argument("--out", default=str(RESULTS / "slow_link_diloco.json"))
    p.add_argument("--from-json", default=None, help="run nothing: render this results file again into --out")


def calibrate(a) -> dict:
    """This machine's compute rate per rank on the bench's model and dtype for the planner: forward +
    backward in one thread, divided by the ranks sharing a core."""
    import torch
    from bench.slow_link.calibrate import time_model
    from bench.slow_link.systems import model_config
    r = time_model(torch.bfloat16 if a["dtype"] == "bf16" else torch.float32, model_config(a), a["seq"], a["micro_batch"])
    share = max(1.0, 2 * a["ranks_per_node"] / len(os.sched_getaffinity(0)))
    return {**r, "model": {k: a[k] for k in MODEL}, "cpu_model": cpu_model(), "ranks_per_core": share,
            "peak_flops": r["flops_per_s"] / share, "loadavg_1min": os.getloadavg()[0],
            "cluster_key": "peak_flops" if a["dtype"] == "bf16" else "peak_flops_fp32"}


def predicted_step(a, H, F, rate, tokenizer, calibration: dict) -> dict:
    """The planner's inner step at `rate`: emulated_slow_link.yaml with this link's rate and tbf burst
    and the calibrated compute rate."""
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
               "--outer-quantization", "int4", "--outer-sync-delay", str(a["outer_sync_delay"]),
               *(["--bf16"] if a["dtype"] == "bf16" else [])]
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
              f" (window), veth {x['link_bytes_per_step'] / 1e6:.3f} MB/step over {x['timed_steps']} steps"), flush=True)
    return rows


def run(args) -> int:
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), Path(args.out))
        return 0
    if missing():
        print(f"slow_link diloco: SKIPPED ({missing()}): the emulated link needs root and iproute2 (ip, tc)")
        return 0
    taken = [ns for ns in sh("ip", "netns", "list", check=False).stdout.split() if ns in NS]
    if taken:   # netns_up would remove another run's namespaces
        print(f"slow_link diloco: namespaces {', '.join(taken)} exist (another run?); wait or `ip netns del` them")
        return 2
    from bench.slow_link.systems import outer_interval
    rates = [int(r) for r in args.rates.split(",")]
    a = {**{k: getattr(args, k) for k in (*MODEL, "warmup", "steps", "dtype", "outer_sync_delay")}, "seed": 1234,
         "ranks_per_node": 2, "repeats": 1, "bucket_fraction": 8, "profile": False}
    steps_at = {r: int(n) for r, n in (x.split(":") for x in args.steps_at.split(",") if x)}
    logdir = Path(tempfile.mkdtemp(prefix="slow_link_diloco_"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the namespaces go in `finally`
    t0, port, rows, search, uptime = time.monotonic(), 29600, [], [], [sh("uptime").stdout.strip()]
    try:
        netns_up()
        for F in [int(f) for f in args.fragments.split(",")]:
            port += 1
            print(f"fragments: F = {F}, H = 16 at {args.fragments_rate} Mbit/s", flush=True)
            search += sweep("diloco-h16", [args.fragments_rate], {**a, "steps": 16, "outer_fragments": F}, port, args,
                            logdir)
        ok = [x for x in search if not x.get("error")]
        best = max(ok, key=lambda x: x["samples_per_s_window"])["config"]["outer_fragments"] if ok else 1
        print(f"best F = {best}", flush=True)
        for s in args.baselines.split(",") + args.diloco.split(","):
            port += 1
            H = outer_interval(s)
            print(f"{s}:", flush=True)
            rows += sweep(s, rates, {**a, "steps": args.cycles * H, "outer_fragments": best} if H
                          else {**a, "steps_at": steps_at}, port, args, logdir)
            uptime.append(sh("uptime").stdout.strip())
    finally:
        netns_down()
    report = {"config": {**a, "rates_mbit": rates, "cycles": args.cycles, "steps_at": steps_at,
                         "best_fragments": best, "fragments_rate": args.fragments_rate},
              "uptime": uptime, "fragment_search": search, "results": rows, "wall_s": time.monotonic() - t0}
    report["calibration"] = calibrate(a)   # the ranks are gone: the machine is as quiet as for the sweep
    report["planner"] = [predicted_step(a, H, best, r, args.tokenizer_model, report["calibration"])
                         for H in map(outer_interval, args.diloco.split(",")) for r in rates if r]
    render(report, Path(args.out))
    return 0


def throughput(x) -> float:
    """DiLoCo: over the whole window (its exchanges included); the others: the median step."""
    return x["samples_per_s_window"] if "outer_fragments" in x["config"] else x["samples_per_s"]


def render(report, out: Path):
    from bench.slow_link.systems import LABELS
    ms = lambda x: 1000 * 4 * report["config"]["micro_batch"] / throughput(x)   # noqa: E731 (4 ranks)
    rows, rates, c = report["results"], report["config"]["rates_mbit"], report["config"]
    by = {(x["system"], x["rate_mbit"]): x for x in rows if not x.get("error")}
    systems = list(dict.fromkeys(x["system"] for x in rows))
    hdr = ["system"] + [f"{rate_name(r)} samples/s (ms/step, x ZeRO++)" for r in rates] + [
        "veth MB/inner step (lowest rate)", "counted MB/step", "x ZeRO-3 bytes"]
    lines, goals = [], []
    z3, zpp0 = by.get(("zero3", rates[0])), by.get(("zeropp-loco", rates[0]))
    for s in systems:
        cells = [LABELS.get(s, s)]
        for r in rates:
            x, zpp = by.get((s, r)), by.get(("zeropp-loco", r))
            cells.append("ERROR" if x is None else f"{throughput(x):.2f} ({ms(x):.0f} ms"
                         + (f", {throughput(x) / throughput(zpp):.2f}x" if zpp else "") + ")")
        x = by.get((s, rates[0]))
        bv, bc = ((x["link_bytes_per_step"] / z3["link_bytes_per_step"],
                   x["counted_inter_bytes_per_step"] / z3["counted_inter_bytes_per_step"]) if x and z3 else (None, None))
        cells += ["-"] * 3 if x is None else [f"{x['link_bytes_per_step'] / 1e6:.4f}",
                                              f"{x['counted_inter_bytes_per_step'] / 1e6:.4f}",
                                              f"{bv:.4f} veth, {bc:.4f} counted" if z3 else "-"]
        lines.append(cells)
        if x is not None and "outer_fragments" in x["config"] and zpp0 and z3:
            sp = throughput(x) / throughput(zpp0)
            goals.append(f"{LABELS.get(s, s)} at {rate_name(rates[0])}: {sp:.1f}x ZeRO++ ({'PASS' if sp >= SPEEDUP_MIN else 'FAIL'}"
                         f" >= {SPEEDUP_MIN:g}x); bytes across groups per inner step {bv:.4f} (veth) / {bc:.4f} "
                         f"(counted) of ZeRO-3's ({'PASS' if max(bv, bc) <= BYTES_MAX else 'FAIL'} <= {BYTES_MAX:g})")
    fr = "; ".join(f"F={x['config']['outer_fragments']}: " + ("ERROR" if x.get("error") else
                                                              f"{x['samples_per_s_window']:.2f} samples/s")
                   for x in report["fragment_search"])
    text = [f"GPT {c['num_layers']} layers, hidden {c['hidden']}, {c['heads']} heads, vocab {c['vocab']}, seq "
            f"{c['seq']}, micro-batch {c['micro_batch']}/rank, {c['dtype']}; 2 netns nodes x 2 gloo ranks (DiLoCo: a "
            f"group per node, INT4 outer gradients, F = {c['best_fragments']}).",
            f"Timed: per-step systems {c['warmup']} warm-up + {c['steps']} steps (at " + ", ".join(
                f"{k} Mbit/s: {n}" for k, n in c["steps_at"].items()) + f"), median step; DiLoCo {c['warmup']} warm-up "
            f"+ {c['cycles']} x H inner steps, samples/s over the whole timed window (outer exchanges included).",
            f"Fragments at {c['fragments_rate']} Mbit/s, H = 16: {fr} -> F = {c['best_fragments']}.",
            "Load (uptime) at the start and after each system: " + " | ".join(report["uptime"]), "",
            fmt_table(hdr, lines), "", *goals, ""]
    plans = []
    if "calibration" in report:
        k = report["calibration"]
        plans.append(f"Calibration ({k['cpu_model']}): {k['dtype']} forward+backward in one thread {k['fwd_bwd_ms']:.0f} ms "
                     f"= {k['flops_per_s'] / 1e9:.1f} GFLOP/s, / {k['ranks_per_core']:g} ranks per core = "
                     f"{k['cluster_key']} {k['peak_flops'] / 1e9:.1f} GFLOP/s per rank for the planner")
    planner = report.get("planner") or []
    for H in dict.fromkeys(x["H"] for x in planner):
        mine, free = [x for x in planner if x["H"] == H], by.get((f"diloco-h{H}", 0))
        plans.append(f"Planner (--dry-run, H = {H}, F = {mine[0]['F']}): {mine[0]['line']}")
        cells = []
        for x in mine:
            m, p = by.get((f"diloco-h{H}", x["rate_mbit"])), PLANNED.search(x["line"])
            cells.append(f"{rate_name(x['rate_mbit'])}: planner " + (f"{1000 * float(p[1]):.0f} + {1000 * float(p[2]):.0f}"
                                                                     if p else "-")
                         + (f", measured {ms(m):.0f}" if m else "")
                         + (f" = {ms(free):.0f} unthrottled {ms(m) - ms(free):+.0f}" if m and free else ""))
        plans.append(f"Inner step H = {H}, ms (planner: step + exposed exchange; measured: window mean): " + "; ".join(cells))
    print("\n".join(text + plans), flush=True)
    report.pop("provenance", None)
    write_result(out, report)
    md = text[:4] + ["", md_table(hdr, lines), ""] + [f"- {g}" for g in goals] + [""] + [f"- {l}" for l in plans]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
