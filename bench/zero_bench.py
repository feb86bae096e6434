#!/usr/bin/env python
"""ZeRO benchmark: our engine's stages 0-3 next to PyTorch FSDP2 and DeepSpeed ZeRO.

    .venv/bin/python -m bench.zero_bench                       # default run, ~5 min on 2 cores
    .venv/bin/python -m bench.zero_bench --steps 20 --num-layers 6 --out /tmp/b.json

One GPT (model/gpt.py), one seed, one data stream, fp32, AdamW (lr 1e-4,
betas 0.9/0.95, eps 1e-8, weight decay 0.01 on matrices only) for every
system. Each system runs in its own fresh set of gloo ranks (parallel/spawn.py,
torch.set_num_threads(1) per rank), so max RSS is that system's own. A system that fails or hangs becomes an error row; the others
still run. See bench/README.md for what each column means and the caveats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import RESULTS

from bench.system_catalog import (ALL_SYSTEMS, DEEPSPEED, DEFAULT_SYSTEMS, LABELS, OPTIM, PERSISTENCE_THRESHOLD,
                                  REUSE0, REUSE0_PREFETCH_FRACTION, WORLD1_SYSTEMS, num_params, stage_of,
                                  zero_section)
from bench.zero_systems import bench_rank
from parallel.spawn import spawn_ranks


def launch(system, world, a, timeout):
    """(per-rank results, None) or (None, error): a system that fails or hangs becomes a row."""
    env = {"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    if system in DEEPSPEED:
        env["DS_ACCELERATOR"] = "cpu"
    return spawn_ranks(bench_rank, world, args=(system, a), env=env, timeout=timeout, init_process_group=False)


# --------------------------------------------------------------------------------------
# Summaries and the table.
# --------------------------------------------------------------------------------------
def model_bytes(system, psi, world, elt=4):
    """Analytic bytes sent per rank per step (fp32), ring-style (N-1)/N factors:
    all-reduce = 2 x P, ZeRO-1/2 = reduce-scatter + all-gather = 2 x P,
    ZeRO-3/FSDP = all-gather fwd + all-gather bwd + reduce-scatter = 3 x P."""
    if world == 1:
        return 0
    f = (world - 1) / world
    mult = 3 if stage_of(system) == 3 else 2
    return int(mult * psi * elt * f)


def summarize(system, world, per_rank, a, psi):
    r0 = per_rank[0]
    steps = r0["step_times_s"][a["warmup"]:]
    n = a["steps"]
    row = {"system": system, "label": LABELS.get(system, system), "world_size": world,
           "step_ms_median": 1000 * statistics.median(steps),
           "step_ms_min": 1000 * min(steps), "step_ms_max": 1000 * max(steps),
           "step_ms_all": [1000 * s for s in r0["step_times_s"]],
           "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
           "base_rss_mb": max(r["base_rss_mb"] for r in per_rank),
           "loss_first": r0["losses"][0], "loss_last": r0["losses"][-1], "losses": r0["losses"],
           "bytes_per_step_model": model_bytes(system, psi, world),
           "error": None}
    if stage_of(system) == 3 and system != "fsdp2":
        row["zero_optimization"] = zero_section(system, a)
    mems = [r["mem"] for r in per_rank if r["mem"]]
    row["model_state_mb"] = (max(m["model_state_bytes"] for m in mems) / 2 ** 20) if mems else None
    row["model_state_detail_rank0"] = per_rank[0]["mem"]
    # Buffer peaks our engine measured (memory_report(engine)["peaks"]), max over ranks.
    peaks = [m.get("peaks") or {} for m in mems]
    row["peaks_max_over_ranks"] = {k: max(p[k] for p in peaks if k in p)
                                   for k in sorted({k for p in peaks for k in p})} or None
    row["gathered_weights_peak_bytes"] = (row["peaks_max_over_ranks"] or {}).get("gathered_weights_peak")
    if r0["counted"] is not None:
        row["bytes_per_step_counted"] = statistics.mean(r["counted"]["bytes"] for r in per_rank) / n
        row["calls_per_step_counted"] = r0["counted"]["calls"] / n
        row["bytes_counted_by"] = r0["counted_source"]
        row["counted_by_op_rank0"] = {k: v / n for k, v in r0["counted"]["by_op"].items()}
        phases = sorted({k for r in per_rank for k in r["counted"]["by_phase"]})
        row["bytes_per_step_by_phase"] = {
            k: statistics.mean(r["counted"]["by_phase"].get(k, 0) for r in per_rank) / n for k in phases}
        row["calls_per_step_by_phase"] = {k: v / n for k, v in r0["counted"]["calls_by_phase"].items()}
    else:
        row["bytes_per_step_counted"] = None
        row["calls_per_step_counted"] = None
        row["bytes_counted_by"] = None
    row["bytes_per_step_intercepted"] = statistics.mean(r["intercepted"]["bytes"] for r in per_rank) / n
    row["calls_per_step_intercepted"] = r0["intercepted"]["calls"] / n
    row["intercepted_by_op_rank0"] = {k: v / n for k, v in r0["intercepted"]["by_op"].items()}
    row["intercepted_calls_by_op_rank0"] = {k: v / n for k, v in r0["intercepted"]["calls_by_op"].items()}
    return row


def fmt_bytes(b):
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_calls(c):
    return "-" if c is None else (f"{c:.0f}" if c == int(c) else f"{c:.1f}")


def print_table(rows, ref_name, title):
    ref = next((r for r in rows if r["system"] == ref_name and not r.get("error")), None)
    hdr = ["system", "step ms (median)", "min", f"x {ref_name}", "peak RSS MB", "RSS delta MB",
           "model-state MB", "peak gathered MB", "bytes/step counted", "bytes/step intercepted",
           "bytes/step model", "colls/step", "loss@1", "loss@last"]
    lines = []
    for r in rows:
        if r.get("error"):
            first = r["error"].strip().splitlines()[-1][:110]
            lines.append([LABELS.get(r["system"], r["system"]), "ERROR: " + first])
            continue
        ratio = (r["step_ms_median"] / ref["step_ms_median"]) if ref else float("nan")
        ms = r["model_state_mb"]
        ms = "-" if ms is None else (f"~{ms:.2f}" if r["system"] in DEEPSPEED else f"{ms:.2f}")
        gathered = r.get("gathered_weights_peak_bytes")
        # Collectives per step: our Communicator's count for our rows, else the interception's.
        calls = r["calls_per_step_counted"] if r.get("calls_per_step_counted") is not None \
            else r["calls_per_step_intercepted"]
        lines.append([r["label"], f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}", f"{ratio:.2f}",
                      f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f}",
                      ms,
                      "-" if gathered is None else f"{gathered / 2 ** 20:.2f}",
                      fmt_bytes(r["bytes_per_step_counted"]),
                      fmt_bytes(r["bytes_per_step_intercepted"]),
                      fmt_bytes(r["bytes_per_step_model"]),
                      fmt_calls(calls),
                      f"{r['loss_first']:.6f}", f"{r['loss_last']:.6f}"])
    widths = [max([len(h)] + [len(l[i]) for l in lines if len(l) > 2]) for i, h in enumerate(hdr)]
    out = [title, " | ".join(h.ljust(w) for h, w in zip(hdr, widths)),
           "-+-".join("-" * w for w in widths)]
    for l in lines:
        if len(l) == 2:
            out.append(l[0].ljust(widths[0]) + " | " + l[1])
        else:
            out.append(" | ".join(c.ljust(w) for c, w in zip(l, widths)))
    text = "\n".join(out)
    print(text, flush=True)
    return text


def ratio_lines(rows, pairs):
    """'A / B' lines for the pairs (ours, reference) that both ran: step time (median and
    min), bytes per step (intercepted, the same rule for every system), collectives per
    step and peak RSS."""
    ok = {r["system"]: r for r in rows if not r.get("error")}
    out, data = [], []
    for mine, ref in pairs:
        if mine not in ok or ref not in ok:
            continue
        m, f = ok[mine], ok[ref]
        d = {"ours": mine, "reference": ref,
             "step_ms_median": m["step_ms_median"] / f["step_ms_median"],
             "step_ms_min": m["step_ms_min"] / f["step_ms_min"],
             "bytes_per_step": (m["bytes_per_step_intercepted"] / f["bytes_per_step_intercepted"]
                                if f["bytes_per_step_intercepted"] else None),
             "calls_per_step": (m["calls_per_step_intercepted"] / f["calls_per_step_intercepted"]
                                if f["calls_per_step_intercepted"] else None),
             "peak_rss": m["peak_rss_mb"] / f["peak_rss_mb"]}
        data.append(d)
        opt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        out.append(f"  {m['label']} / {f['label']}: time {d['step_ms_median']:.2f} (median), "
                   f"{d['step_ms_min']:.2f} (min); bytes {opt(d['bytes_per_step'])}; "
                   f"collectives {opt(d['calls_per_step'])}; peak RSS {d['peak_rss']:.2f}")
    return out, data


def count_check(rows):
    """Our rows: the Communicator's bytes and collectives must equal what the wrappers on
    torch.distributed saw (no collective bypasses the Communicator or is miscounted)."""
    ours = [r for r in rows if not r.get("error") and r.get("bytes_per_step_counted") is not None]
    if not ours:
        return ""
    bad = [r["label"] for r in ours if abs(r["bytes_per_step_counted"] - r["bytes_per_step_intercepted"]) > 0.5
           or r["calls_per_step_counted"] != r["calls_per_step_intercepted"]]
    if bad:
        return "  COUNTED != INTERCEPTED (bytes or collectives) for: " + ", ".join(bad)
    return f"  counted == intercepted (bytes and collectives) in all {len(ours)} rows of ours"


def loss_check(rows, tol=1e-5):
    """Every row must start from the same weights: equal first-step losses."""
    ok = [r for r in rows if not r.get("error")]
    if len(ok) < 2:
        return "", True
    ref = ok[0]
    bad = [r for r in ok if abs(r["loss_first"] - ref["loss_first"]) > tol]
    if not bad:
        return (f"  loss@1 equal in all {len(ok)} rows (max |diff| "
                f"{max(abs(r['loss_first'] - ref['loss_first']) for r in ok):.1e} <= {tol:.0e}): same "
                f"initial weights (ours built on the meta device, the others whole)"), True
    return ("  LOSS@1 MISMATCH vs " + ref["label"] + ": "
            + ", ".join(f"{r['label']} {r['loss_first'] - ref['loss_first']:+.2e}" for r in bad)), False


def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
         "cpus": os.cpu_count()}
    try:
        from importlib.metadata import version
        v["deepspeed"] = version("deepspeed")
    except Exception:
        v["deepspeed"] = None
    return v


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--world", type=int, default=4, help="gloo ranks for the main table")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="measured steps after warmup")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list from {','.join(ALL_SYSTEMS)}, or 'all' (adds DeepSpeed "
                        f"ZeRO-1/2 and ZeRO-3 (reuse 0), ~+2 min)")
    p.add_argument("--world1-systems", default=",".join(WORLD1_SYSTEMS),
                   help="comma list run with world size 1 for the engine-overhead table "
                        "('' to skip); 'plain' is the reference loop")
    p.add_argument("--timeout", type=float, default=240, help="seconds per system before it is an error")
    p.add_argument("--out", default=str(RESULTS / "zero_bench.json"))
    args = p.parse_args(argv)
    a = {k: getattr(args, k) for k in ("num_layers", "hidden", "heads", "vocab", "seq", "micro_batch",
                                        "warmup", "steps", "seed")}
    systems = ALL_SYSTEMS if args.systems == "all" else [s for s in args.systems.split(",") if s]
    world1 = [s for s in args.world1_systems.split(",") if s]
    for s in systems + world1:
        if s not in ALL_SYSTEMS + ["plain"]:
            p.error(f"unknown system {s!r}; choose from {', '.join(ALL_SYSTEMS + ['plain'])}")
    psi = num_params(a)
    print(f"GPT {a['num_layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, "
          f"seq {a['seq']}, micro-batch {a['micro_batch']}/rank: {psi:,} parameters "
          f"({psi * 4 / 2 ** 20:.1f} MiB fp32); {a['warmup']} warmup + {a['steps']} measured steps; "
          f"torch {torch.__version__}", flush=True)

    def run_group(names, world):
        rows = []
        for s in names:
            t0 = time.monotonic()
            print(f"[{world} rank(s)] {s} ...", end=" ", flush=True)
            try:
                per_rank, err = launch(s, world, a, args.timeout)
            except Exception:
                per_rank, err = None, traceback.format_exc()
            if err:
                rows.append({"system": s, "label": LABELS.get(s, s), "world_size": world, "error": err})
                print(f"ERROR ({time.monotonic() - t0:.0f} s): {err.strip().splitlines()[-1][:200]}",
                      flush=True)
            else:
                rows.append(summarize(s, world, per_rank, a, psi))
                print(f"{rows[-1]['step_ms_median']:.1f} ms/step ({time.monotonic() - t0:.0f} s)",
                      flush=True)
        return rows

    t_start = time.monotonic()
    load_before = os.getloadavg()
    main_rows = run_group(systems, args.world)
    w1_rows = run_group(world1, 1) if world1 else []
    print()
    t1 = print_table(main_rows, "ddp", f"== {args.world} gloo ranks (ratio to our stage 0 / DDP) ==")
    pairs = [(m, r) for m in ("zero3", "zero3-reuse0") for r in ("fsdp2", "deepspeed-z3", "deepspeed-z3-reuse0")]
    lines, ratios = ratio_lines(main_rows, pairs)
    check, losses_ok = loss_check(main_rows)
    checks = [c for c in (check, count_check(main_rows)) if c]
    under = "\n".join((["Ratios (ours / reference; < 1 = ours smaller or faster):"] + lines if lines else [])
                      + checks)
    print(under, flush=True)
    t2, under2, ratios1, losses1_ok = "", "", [], True
    if w1_rows:
        print()
        t2 = print_table(w1_rows, "plain", "== world size 1: engine overhead (ratio to a plain PyTorch "
                                           "loop; every stage is the DDPEngine short path) ==")
        lines1, ratios1 = ratio_lines(w1_rows, [(m, "plain") for m in ("ddp", "zero3")])
        check1, losses1_ok = loss_check(w1_rows)
        under2 = "\n".join(["Ratios (target: within 1.05 of the plain loop):"] + lines1 + [check1])
        print(under2, flush=True)
    reuse0 = zero_section("zero3-reuse0", a)
    print(f"\nZeRO-3 rows (ours and DeepSpeed): stage3_param_persistence_threshold = "
          f"{PERSISTENCE_THRESHOLD:.0e} (DeepSpeed's default). '(reuse 0)' rows: "
          f"stage3_max_reuse_distance = 0 and stage3_prefetch_bucket_size = "
          f"{reuse0['stage3_prefetch_bucket_size']:,} (1/{REUSE0_PREFETCH_FRACTION} of the model), weights "
          f"re-gathered in backward (DeepSpeed's prefetcher may keep some anyway: see its bytes); FSDP2 "
          f"reshards after forward (root included) and re-gathers in backward too. 'counted' = our Communicator (ring model, bytes each rank sends); 'intercepted' = the same "
          f"rule applied by wrappers on torch.distributed; 'model' = analytic ring formula; 'colls/step' = "
          f"collectives per step per rank; 'peak gathered' = most bytes of gathered stage-3 weights alive at "
          f"once (our engine's own measurement); '~' = DeepSpeed model-state found through its optimizer's "
          f"attributes (best effort). Load average before/after: {load_before[0]:.1f} / "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. Total {time.monotonic() - t_start:.0f} s.")
    report = {"config": {**a, "world": args.world, "params": psi,
                         "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                         "reuse0_zero_optimization": reuse0, "reuse0_systems": list(REUSE0),
                         "fsdp2": "fully_shard(block, reshard_after_forward=True) per block, then the root "
                                  "with reshard_after_forward=True",
                         "optimizer": {"type": "AdamW", **OPTIM}, "dtype": "float32", "dropout": 0.0},
              "versions": versions(), "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
              "command": " ".join([sys.executable] + sys.argv), "results": main_rows, "world1_results": w1_rows,
              "ratios": ratios, "world1_ratios": ratios1,
              "loss_first_equal": {"main": losses_ok, "world1": losses1_ok},
              "table": t1 + "\n" + under, "world1_table": t2 + ("\n" + under2 if under2 else ""),
              "wall_s": time.monotonic() - t_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
