"""The systems side by side over the emulated slow link, swept over link rates: the driver
(`add_args`, `run`), the segments cut from the ranks' results, and the rows summarized per
(system, rate). `--repeats` passes over the systems, odd ones in reverse order (systems and
rates), each system freshly launched per pass; a row pools its segments' timed steps."""
from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS
from scenarios.harness.netns import IF, RANKS_PER_NODE, TBF_LATENCY, missing, netns_down, netns_up, tbf_burst
from bench.slow_link.report import mb, rate_name, render
from bench.slow_link.run import run_system

DEFAULT_RATES = [100, 200, 1000, 0]  # Mbit/s; 0 = no qdisc (the veth's own speed)
DEFAULT_SYSTEMS = ["zero3-reuse0", "zero3", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "auto", "fsdp2",
                   "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz"]
MODEL = dict(num_layers=4, hidden=192, heads=4, vocab=4096, seq=16, micro_batch=1)


def add_model_args(p, model: dict, steps: int, warmup: int):
    for k, v in model.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per segment, after its warm-up")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps at the start of each segment")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])


def add_args(p):
    add_model_args(p, MODEL, 6, 2)
    p.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)), help="Mbit/s, comma separated; 0 = no qdisc")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="names from bench/slow_link/systems.py")
    p.add_argument("--repeats", type=int, default=2, help="passes over the systems (odd ones reversed)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bucket-fraction", type=int, default=8,
                   help="prefetch and reduce buckets = parameters // this (ours, DeepSpeed); 0: each system's default")
    p.add_argument("--profile", action="store_true", help="ours: ms per step blocked in Work.wait(), by phase")
    p.add_argument("--timeout", type=float, default=240, help="seconds per (system, rate) before it is an error")
    p.add_argument("--setup-timeout", type=float, default=240, help="seconds for a system's ranks to build it")
    p.add_argument("--quick", action="store_true", help="rates 200,0; ZeRO-3 and ZeRO++; 1 warm-up + 3 steps, 1 pass")
    p.add_argument("--out", default=None, help="JSON (.md, .png beside it); default results/slow_link.json")
    p.add_argument("--plot", default=None, help="default: --out with .png")
    p.add_argument("--from-json", default=None, help="run nothing: render this results file again into --out")


def run(args) -> int:
    import json
    from bench.slow_link.systems import DEEPSPEED, LABELS, SLOW_LINK_SYSTEMS, block_params, num_params, zero_section
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "slow_link_quick.json") if args.quick else str(RESULTS / "slow_link.json")
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), Path(args.out), Path(args.plot) if args.plot else None)
        return 0
    if missing():
        print(f"slow_link: SKIPPED ({missing()}): the emulated link needs root and iproute2 (ip, tc)")
        return 0
    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    systems = [s for s in args.systems.split(",") if s]
    if args.quick:
        rates, systems = [200, 0], ["zero3-reuse0", "zeropp"]
        args.steps, args.warmup, args.repeats = 3, 1, 1
    unknown = [s for s in systems if s not in SLOW_LINK_SYSTEMS]
    if unknown:
        sys.exit(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SLOW_LINK_SYSTEMS)}")
    notes = []
    if any(s in DEEPSPEED for s in systems) and importlib.util.find_spec("deepspeed") is None:
        notes.append("DeepSpeed rows skipped: deepspeed is not installed")
        systems = [s for s in systems if s not in DEEPSPEED]
    if any(s in DEEPSPEED for s in systems):
        notes.append("DeepSpeed's qwZ and qgZ need CUDA (its quantizer kernels); only its hpZ runs on CPU")
    a = {k: getattr(args, k) for k in (*MODEL, "warmup", "steps", "seed", "dtype", "repeats", "bucket_fraction",
                                       "profile")}
    a["ranks_per_node"] = RANKS_PER_NODE
    psi, block = num_params(a), block_params(a)
    head = (f"GPT {a['num_layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, seq "
            f"{a['seq']}: {psi:,} parameters ({psi * (2 if a['dtype'] == 'bf16' else 4) / 1e6:.2f} MB in "
            f"{a['dtype']}); micro-batch {a['micro_batch']} per rank, 2 nodes x {RANKS_PER_NODE} ranks; "
            f"{a['repeats']} pass(es), each (system, rate) {a['warmup']} warm-up + {a['steps']} timed steps per pass, "
            f"median over the pooled timed steps; AdamW, gloo on CPU, 1 thread per rank, {os.cpu_count()} cores. "
            f"Buckets (ours, DeepSpeed): " + (f"{psi // a['bucket_fraction']:,} elements (1/{a['bucket_fraction']})"
                                              if a["bucket_fraction"] else "each system's default")
            + f", reuse distance 0; FSDP2: one block ({block:,} parameters)")
    print(head, *("NOTE: " + n for n in notes), sep="\n", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="slow_link_logs_"))
    atexit.register(netns_down)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    schedule = [(i, s, rates if i % 2 == 0 else rates[::-1]) for i in range(args.repeats)
                for s in (systems if i % 2 == 0 else systems[::-1])]
    segs, rows, t_start, load_before, port = {}, [], time.monotonic(), os.getloadavg()[0], 29500
    try:
        netns_up()
        for i, s, order in schedule:
            port += 1
            print(f"pass {i + 1}/{args.repeats}: {LABELS.get(s, s)} ({s}):", flush=True)

            def on_rate(rate, run, s=s):
                segs.setdefault((s, rate), []).append(run)
                if run.get("error"):
                    print(f"  [{rate_name(rate)}] ERROR: {run['error'].strip().splitlines()[-1][:200]}", flush=True)
                else:
                    sg = segment(run, a)
                    print(f"  [{rate_name(rate)}] {1000 * statistics.median(sg['times']):.0f} ms/step; link "
                          f"{mb((sg['tx_a'] + sg['tx_b'] - sg['overhead']) / sg['n'])} MB/step ({run['wall_s']:.0f} s, "
                          f"load {sg['loadavg']:.1f})", flush=True)

            run_system(s, order, a, port, args.setup_timeout, args.timeout, logdir, on_rate=on_rate)
        rows = [summarize(s, rate, segs.get((s, rate), []), a) for s in systems for rate in rates]
    except KeyboardInterrupt:
        print("\ninterrupted: ranks stopped, namespaces removed; nothing written", flush=True)
        return 130
    finally:
        netns_down()
    report = {"config": {**a, "params": psi, "rates_mbit": rates, "systems": systems, "head": head,
                         "schedule": schedule, "labels": {s: LABELS.get(s, s) for s in systems},
                         "tbf": {"latency": TBF_LATENCY, "burst_bytes": {r: tbf_burst(r) for r in rates if r}},
                         "buckets": {"ours_and_deepspeed_elements": psi // a["bucket_fraction"] if a["bucket_fraction"]
                                     else None, "fsdp2": f"one transformer block ({block} parameters), then the root"},
                         "zero_optimization": {s: zero_section(s, a) for s in systems if not s.startswith("fsdp")}},
              "notes": notes, "loadavg_1min_before_after": [load_before, os.getloadavg()[0]], "results": rows,
              "logs": str(logdir), "wall_s": time.monotonic() - t_start}
    render(report, Path(args.out), Path(args.plot) if args.plot else None)
    return 0


def segment(run, a):
    """The numbers of one timed segment (one rate, once) from the ranks' results."""
    pr, w = run["per_rank"], a["warmup"]
    n = len(pr[0]["step_times_s"]) - w
    heads = [x for x in pr if x["local_rank"] == 0]   # node A's local rank 0 read vA, node B's vB
    a_end, b_end = (next(x for x in heads if x["ifname"] == i) for i in IF)
    la, lb, cal = a_end["link"], b_end["link"], a_end["calib"]
    d = lambda l, k: l["end"][k] - l["start"][k]  # noqa: E731
    window = la["end"]["t"] - la["start"]["t"]
    counted = pr[0].get("counted")
    # besides the steps: 2 hook barriers, a per-step one (inside a node for DiLoCo), idle traffic
    crossing = 2 + (0 if pr[0].get("step_barrier") == "group" else n)
    return {"n": n, "times": pr[0]["step_times_s"][w:], "all_times": pr[0]["step_times_s"], "losses": pr[0]["losses"],
            "tx_a": d(la, "tx_bytes"), "tx_b": d(lb, "tx_bytes"), "rx_a": d(la, "rx_bytes"), "rx_b": d(lb, "rx_bytes"),
            "window": window, "barrier": cal["barrier_bytes"], "idle": cal["idle_bytes_per_s"],
            "overhead": crossing * cal["barrier_bytes"] + cal["idle_bytes_per_s"] * window,
            "intercepted": sum(x["intercepted"]["inter_bytes"] for x in pr),
            "intercepted_calls_rank0": pr[0]["intercepted"]["calls"], "intercepted_by_op_rank0": pr[0]["intercepted"]["by_op"],
            "counted": sum(x["counted"]["inter_bytes"] for x in pr) if counted else None,
            "counted_source": pr[0].get("counted_source"),
            "counted_by_phase": {k: sum(x["counted"]["inter_by_phase"].get(k, 0) for x in pr)
                                 for k in sorted({k for x in pr for k in x["counted"]["inter_by_phase"]})} if counted else None,
            "counted_calls_rank0": counted["calls"] if counted else None,
            "issued": sum(x["counted"]["issued_inter_bytes"] for x in pr) if counted else None,
            "peak_rss_mb": max(x["peak_rss_mb"] for x in pr), "build_s": max(x["build_s"] for x in pr),
            "loadavg": pr[0]["loadavg"], "whole_rate_link_bytes": run["whole_rate_link_bytes"],
            "auto": pr[0].get("auto"), "waits": [x.get("wait_seconds") for x in pr], "qdisc": run["qdisc"]}


def summarize(system, rate, runs, a):
    """One row: the segments run at `rate` pooled."""
    from bench.slow_link.systems import LABELS
    world = 2 * RANKS_PER_NODE
    row = {"system": system, "label": LABELS.get(system, system), "rate_mbit": rate,
           "wall_s": sum(r["wall_s"] for r in runs)}
    bad = [r for r in runs if r.get("error")] or ([] if runs else [{"error": "not run"}])
    if bad:
        return {**row, "error": bad[0]["error"], "log_tail": bad[0].get("log_tail")}
    segs = [segment(r, a) for r in runs]
    times = [t for sg in segs for t in sg["times"]]
    n, med = sum(sg["n"] for sg in segs), statistics.median(times)
    tot = lambda k: sum(sg[k] for sg in segs)  # noqa: E731
    raw, window, busier = tot("tx_a") + tot("tx_b"), tot("window"), max(tot("tx_a"), tot("tx_b"))
    per0 = lambda d: {k: v / segs[0]["n"] for k, v in d.items()}  # noqa: E731
    row.update(step_ms_median=1000 * med, step_ms_min=1000 * min(times), step_ms_max=1000 * max(times),
               step_ms_mean=1000 * statistics.mean(times),
               segment_medians_ms=[1000 * statistics.median(sg["times"]) for sg in segs],
               step_ms_all=[[1000 * t for t in sg["all_times"]] for sg in segs], timed_steps=n, segments=len(segs),
               samples_per_s=world * a["micro_batch"] / med, tokens_per_s=world * a["micro_batch"] * a["seq"] / med,
               # over the timed windows' wall time: per-step barriers and any exchange overlapping steps (DiLoCo)
               samples_per_s_window=world * a["micro_batch"] * n / window,
               loss_first=segs[0]["losses"][0], losses=[sg["losses"] for sg in segs],
               peak_rss_mb=max(sg["peak_rss_mb"] for sg in segs),
               link_bytes_per_step_raw=raw / n, link_bytes_per_step=(raw - tot("overhead")) / n,
               link_tx_per_step={"A->B": tot("tx_a") / n, "B->A": tot("tx_b") / n},
               link_busier_bytes_per_step=(busier - tot("overhead") / 2) / n,   # overhead: half each way
               link_crosscheck_rx={"A->B seen at vB": tot("rx_b") / n, "B->A seen at vA": tot("rx_a") / n},
               barrier_link_bytes=statistics.mean(sg["barrier"] for sg in segs),
               idle_link_bytes_per_s=statistics.mean(sg["idle"] for sg in segs), timed_window_s=window,
               link_busy_fraction=busier * 8 / (rate * 1e6) / window if rate else None,
               whole_rate_link_bytes=[sg["whole_rate_link_bytes"] for sg in segs], qdisc=segs[-1]["qdisc"],
               build_s=segs[0]["build_s"], loadavg_1min=statistics.mean(sg["loadavg"] for sg in segs),
               loadavg_1min_segments=[sg["loadavg"] for sg in segs],
               intercepted_inter_bytes_per_step=tot("intercepted") / n,
               intercepted_calls_per_step_rank0=tot("intercepted_calls_rank0") / n,
               intercepted_by_op_rank0=per0(segs[0]["intercepted_by_op_rank0"]))
    if segs[0]["counted_source"] == "Communicator" and segs[0]["counted"] is not None:   # ours, FSDP2 + plug-in
        row.update(counted_inter_bytes_per_step=tot("counted") / n, counted_source="Communicator",
                   counted_inter_by_phase_per_step=per0(segs[0]["counted_by_phase"]),
                   counted_calls_per_step_rank0=tot("counted_calls_rank0") / n,
                   issued_inter_bytes_per_step=tot("issued") / n)   # on gloo ZeRO-3's reduce-scatter is an all-to-all
        row["counted_equals_intercepted"] = abs(row["issued_inter_bytes_per_step"]
                                                - row["intercepted_inter_bytes_per_step"]) < 1
    else:
        row.update(counted_inter_bytes_per_step=row["intercepted_inter_bytes_per_step"],
                   counted_source="torch.distributed wrappers")
    if any(sg["auto"] for sg in segs):  # what planner.auto chose in each segment, and why
        row["auto"] = [sg["auto"] for sg in segs]
    waits = [(sg["waits"], sg["n"]) for sg in segs if all(w is not None for w in sg["waits"])]
    if waits:  # --profile: ms per step blocked in Work.wait(), by phase, mean and max over ranks
        steps = sum(m for _, m in waits)
        per_rank = {k: [sum(ws[r].get(k, 0.0) for ws, _ in waits) * 1000 / steps for r in range(len(waits[0][0]))]
                    for k in sorted({k for ws, _ in waits for w in ws for k in w})}
        row["wait_ms_per_step_by_phase"] = {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in per_rank.items()}
    c = row["counted_inter_bytes_per_step"]
    row["veth_over_counted"] = row["link_bytes_per_step"] / c if c else None
    return row
