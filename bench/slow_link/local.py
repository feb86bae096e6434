"""The systems side by side on gloo ranks of one machine, no link (`python -m bench.slow_link local`):
our stages 0-3 next to PyTorch FSDP2 and DeepSpeed ZeRO (when installed), one GPT, seed, data stream,
fp32 and AdamW for all. Each system runs in its own fresh ranks (scenarios/harness/spawn.py, one thread each), so
peak RSS is its own; a system that fails or hangs is an error row. Per row: step time, peak RSS,
model-state bytes, bytes per step counted (our Communicator) and intercepted (wrappers on
torch.distributed, every system) beside the ring model's bytes (the limit), collectives per step,
first and last loss (equal first losses: the same initial weights). Then world size 1 against a plain loop.

`split`: where a step's time goes unthrottled, plain FSDP2 next to our ZeRO-3 and FSDP2 + the plug-in,
4 ranks as 2 emulated nodes x 2 over loopback. Per system (--repeats passes, odd ones reversed; medians
over passes): the median step; per torch.distributed function the ms per step inside the call (plain
FSDP2 on CPU issues every collective synchronously: its blocked time); on our Communicator the ms
blocked in Work.wait() by phase; compute = step - blocked; CPU time per rank per step (all threads).
Then each collective alone on one block's bf16 gradient: gloo's reduce_scatter_tensor (run as an
all-reduce) against all_reduce, all_to_all and all-gather."""
from __future__ import annotations

import os
import resource
import statistics
import time
import traceback

from bench import RESULTS, write_result
from bench.slow_link.report import fmt_table
from bench.slow_link.systems import (ALL_SYSTEMS, DEEPSPEED, DEFAULT_SYSTEMS, LABELS, OPTIM, PERSISTENCE_THRESHOLD, REUSE0,
                           REUSE0_PREFETCH_FRACTION, WORLD1_SYSTEMS, num_params, stage_of, zero_section)

MODEL = dict(num_layers=4, hidden=256, heads=4, vocab=4096, seq=128, micro_batch=4)


def add_args(p):
    for k, v in MODEL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--world", type=int, default=4, help="gloo ranks for the main table")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="measured steps after warm-up")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"from {','.join(ALL_SYSTEMS)}, or 'all'")
    p.add_argument("--world1-systems", default=",".join(WORLD1_SYSTEMS), help="at world size 1 ('' to skip)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per system before it is an error")
    p.add_argument("--out", default=str(RESULTS / "zero_bench.json"))


def model_bytes(system, psi, world, elt=4):
    """Ring model of bytes sent per rank per step: all-reduce or reduce-scatter + all-gather = 2 x P,
    ZeRO-3 / FSDP (gather forward, gather backward, reduce-scatter) = 3 x P, times (W-1)/W."""
    return 0 if world == 1 else int((3 if stage_of(system) == 3 else 2) * psi * elt * (world - 1) / world)


def summarize(system, world, per_rank, a, psi):
    r0, n = per_rank[0], a["steps"]
    steps = r0["step_times_s"][a["warmup"]:]
    mean = lambda f: statistics.mean(f(r) for r in per_rank) / n  # noqa: E731
    mems = [r["mem"] for r in per_rank if r["mem"]]
    peaks = [m.get("peaks") or {} for m in mems]
    peaks = {k: max(p[k] for p in peaks if k in p) for k in sorted({k for p in peaks for k in p})} or None
    row = {"system": system, "label": LABELS.get(system, system), "world_size": world, "error": None,
           "step_ms_median": 1000 * statistics.median(steps), "step_ms_min": 1000 * min(steps),
           "step_ms_max": 1000 * max(steps), "step_ms_all": [1000 * s for s in r0["step_times_s"]],
           "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank), "base_rss_mb": max(r["base_rss_mb"] for r in per_rank),
           "loss_first": r0["losses"][0], "loss_last": r0["losses"][-1], "losses": r0["losses"],
           "bytes_per_step_model": model_bytes(system, psi, world),
           "model_state_mb": max(m["model_state_bytes"] for m in mems) / 2 ** 20 if mems else None,
           "model_state_detail_rank0": r0["mem"], "peaks_max_over_ranks": peaks,
           "gathered_weights_peak_bytes": (peaks or {}).get("gathered_weights_peak"),
           "bytes_per_step_intercepted": mean(lambda r: r["intercepted"]["bytes"]),
           "calls_per_step_intercepted": r0["intercepted"]["calls"] / n,
           "intercepted_by_op_rank0": {k: v / n for k, v in r0["intercepted"]["by_op"].items()},
           "intercepted_calls_by_op_rank0": {k: v / n for k, v in r0["intercepted"]["calls_by_op"].items()},
           "bytes_per_step_counted": None, "calls_per_step_counted": None, "bytes_counted_by": None}
    if stage_of(system) == 3 and system != "fsdp2":
        row["zero_optimization"] = zero_section(system, a)
    if r0["counted"] is not None:
        phases = sorted({k for r in per_rank for k in r["counted"]["by_phase"]})
        row.update(bytes_per_step_counted=mean(lambda r: r["counted"]["bytes"]),
                   calls_per_step_counted=r0["counted"]["calls"] / n, bytes_counted_by=r0["counted_source"],
                   counted_by_op_rank0={k: v / n for k, v in r0["counted"]["by_op"].items()},
                   bytes_per_step_by_phase={k: mean(lambda r: r["counted"]["by_phase"].get(k, 0))  # noqa: B023
                                            for k in phases},
                   calls_per_step_by_phase={k: v / n for k, v in r0["counted"]["calls_by_phase"].items()})
    return row


def fmt_bytes(b):
    if b is None:
        return "-"
    return next((f"{b / d:.2f} {u}" for u, d in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if b >= d), f"{b:.0f} B")


def table(rows, ref_name, title):
    ref = next((r for r in rows if r["system"] == ref_name and not r.get("error")), None)
    hdr = ["system", "step ms (median)", "min", f"x {ref_name}", "peak RSS MB", "RSS delta MB", "model-state MB",
           "peak gathered MB", "bytes/step counted", "bytes/step intercepted", "bytes/step model (limit)",
           "colls/step", "loss@1", "loss@last"]
    lines = []
    for r in rows:
        if r.get("error"):
            lines.append([r["label"], "ERROR: " + r["error"].strip().splitlines()[-1][:110]])
            continue
        ms, g = r["model_state_mb"], r.get("gathered_weights_peak_bytes")
        calls = r["calls_per_step_counted"] if r["calls_per_step_counted"] is not None else r["calls_per_step_intercepted"]
        lines.append([r["label"], f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}",
                      f"{r['step_ms_median'] / ref['step_ms_median']:.2f}" if ref else "-", f"{r['peak_rss_mb']:.0f}",
                      f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f}",
                      "-" if ms is None else ("~" if r["system"] in DEEPSPEED else "") + f"{ms:.2f}",
                      "-" if g is None else f"{g / 2 ** 20:.2f}", fmt_bytes(r["bytes_per_step_counted"]),
                      fmt_bytes(r["bytes_per_step_intercepted"]), fmt_bytes(r["bytes_per_step_model"]),
                      f"{calls:.1f}", f"{r['loss_first']:.6f}", f"{r['loss_last']:.6f}"])
    return title + "\n" + fmt_table(hdr, lines)


def checks(rows, pairs, tol=1e-5):
    """Ratio lines (ours / reference) and the checks: equal first losses, counted == intercepted."""
    ok = {r["system"]: r for r in rows if not r.get("error")}
    out, data = [], []
    for mine, ref in pairs:
        if mine in ok and ref in ok:
            m, f = ok[mine], ok[ref]
            d = {"ours": mine, "reference": ref, **{name: m[k] / f[k] if f[k] else None for name, k in (
                ("step_ms_median", "step_ms_median"), ("step_ms_min", "step_ms_min"),
                ("bytes_per_step", "bytes_per_step_intercepted"), ("calls_per_step", "calls_per_step_intercepted"),
                ("peak_rss", "peak_rss_mb"))}}
            data.append(d)
            out.append(f"  {m['label']} / {f['label']}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()
                                                                       if isinstance(v, float)))
    first = [r["loss_first"] for r in ok.values()]
    same = not first or max(first) - min(first) <= tol
    out.append(f"  loss@1 {'equal' if same else 'DIFFERS'} in {len(first)} rows (max |diff| "
               f"{(max(first) - min(first)) if first else 0:.1e}, tolerance {tol:.0e})")
    ours = [r for r in ok.values() if r["bytes_per_step_counted"] is not None]
    bad = [r["label"] for r in ours if abs(r["bytes_per_step_counted"] - r["bytes_per_step_intercepted"]) > 0.5
           or r["calls_per_step_counted"] != r["calls_per_step_intercepted"]]
    if ours:
        out.append("  COUNTED != INTERCEPTED for: " + ", ".join(bad) if bad else
                   f"  counted == intercepted (bytes and collectives) in all {len(ours)} rows of ours")
    return out, data, same


def run(args):
    from bench.slow_link.ranks import bench_rank
    from scenarios.harness.spawn import spawn_ranks
    a = {k: getattr(args, k) for k in (*MODEL, "warmup", "steps", "seed")}
    systems = ALL_SYSTEMS if args.systems == "all" else [s for s in args.systems.split(",") if s]
    world1 = [s for s in args.world1_systems.split(",") if s]
    unknown = [s for s in systems + world1 if s not in ALL_SYSTEMS + ["plain"]]
    if unknown:
        raise SystemExit(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(ALL_SYSTEMS + ['plain'])}")
    psi = num_params(a)
    print(f"GPT {a['num_layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, seq {a['seq']}, "
          f"micro-batch {a['micro_batch']}/rank: {psi:,} parameters; {a['warmup']} warm-up + {a['steps']} steps", flush=True)

    def group(names, world):
        rows = []
        for s in names:
            t0 = time.monotonic()
            env = {"LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **({"DS_ACCELERATOR": "cpu"} if s in DEEPSPEED else {})}
            try:
                per_rank, err = spawn_ranks(bench_rank, world, args=(s, a), env=env, timeout=args.timeout,
                                            init_process_group=False)
            except Exception:  # noqa: BLE001 (a system that fails is a row)
                per_rank, err = None, traceback.format_exc()
            rows.append({"system": s, "label": LABELS.get(s, s), "world_size": world, "error": err} if err
                        else summarize(s, world, per_rank, a, psi))
            print(f"[{world} rank(s)] {s}: " + (f"ERROR {err.strip().splitlines()[-1][:200]}" if err else
                                                 f"{rows[-1]['step_ms_median']:.1f} ms/step")
                  + f" ({time.monotonic() - t0:.0f} s)", flush=True)
        return rows

    t_start, load_before = time.monotonic(), os.getloadavg()[0]
    main_rows, w1_rows = group(systems, args.world), group(world1, 1)
    t1 = table(main_rows, "ddp", f"== {args.world} gloo ranks (ratio to our stage 0 / DDP) ==")
    lines, ratios, same = checks(main_rows, [(m, r) for m in ("zero3", "zero3-reuse0")
                                             for r in ("fsdp2", "deepspeed-z3", "deepspeed-z3-reuse0")])
    under = "\n".join(["Ratios (ours / reference; < 1 = ours smaller or faster):"] + lines)
    t2, lines1, ratios1, same1 = "", [], [], True
    if w1_rows:
        t2 = table(w1_rows, "plain", "== world size 1: engine overhead (ratio to a plain PyTorch loop) ==")
        lines1, ratios1, same1 = checks(w1_rows, [(m, "plain") for m in ("ddp", "zero3")])
    reuse0 = zero_section("zero3-reuse0", a)
    note = (f"ZeRO-3 rows: persistence threshold {PERSISTENCE_THRESHOLD:.0e}; '(reuse 0)': weights re-gathered in backward, "
            f"prefetch bucket {reuse0['stage3_prefetch_bucket_size']:,} (1/{REUSE0_PREFETCH_FRACTION} of the model). "
            f"'counted' = our Communicator, 'intercepted' = wrappers on torch.distributed (same ring rule), 'model' = "
            f"the ring formula; '~' = DeepSpeed's model state, best effort. Load {load_before:.1f} / {os.getloadavg()[0]:.1f}"
            f" on {os.cpu_count()} cores; {time.monotonic() - t_start:.0f} s.")
    print("\n".join([t1, under, t2, *lines1, note]), flush=True)
    report = {"config": {**a, "world": args.world, "params": psi, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                         "reuse0_zero_optimization": reuse0, "reuse0_systems": list(REUSE0),
                         "optimizer": {"type": "AdamW", **OPTIM}, "dtype": "float32", "dropout": 0.0},
              "loadavg_1min_before_after": [load_before, os.getloadavg()[0]], "results": main_rows,
              "world1_results": w1_rows, "ratios": ratios, "world1_ratios": ratios1,
              "loss_first_equal": {"main": same, "world1": same1}, "table": t1 + "\n" + under,
              "world1_table": t2 + "\n" + "\n".join(lines1), "wall_s": time.monotonic() - t_start}
    print("wrote", write_result(args.out, report))
    return 0 if same and same1 else 1


# ---- split: where the time goes
SPLIT_SYSTEMS = ["fsdp2", "zero3-reuse0", "fsdp2+zeropp"]
SPLIT_MODEL = {**MODEL, "micro_batch": 8}


def add_args_split(p):
    for k, d in (*SPLIT_MODEL.items(), ("steps", 6), ("warmup", 2), ("seed", 1234), ("reps", 10), ("repeats", 2)):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=d)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--systems", default=",".join(SPLIT_SYSTEMS))
    p.add_argument("--out", default=str(RESULTS / "fsdp2_time_split.json"))


def rank_of_system(rank, world, system, a):
    import torch.distributed as dist
    from bench.slow_link.ranks import COUNTER, build_system, timed_loop
    COUNTER.install()
    COUNTER.node_of = lambda r: r // a["ranks_per_node"]
    sysd, waits = build_system(rank, world, system, a), {}
    comm = sysd.get("comm")

    def hook(event):
        waits[event] = dict(comm.wait_seconds) if comm is not None else {}
        use = resource.getrusage(resource.RUSAGE_SELF)
        waits[event + "_cpu"] = use.ru_utime + use.ru_stime   # every thread of the rank
    res = timed_loop(rank, world, sysd, a, hook=hook)
    cpu = waits.pop("end_cpu") - waits.pop("start_cpu")
    dist.barrier()
    n = a["steps"]
    return {"step_ms": [1000 * t for t in res["step_times_s"][a["warmup"]:]],
            "in_call_ms": {k: 1000 * v / n for k, v in res["intercepted"]["seconds_by_op"].items()},
            "calls": {k: v / n for k, v in res["intercepted"]["calls_by_op"].items()},
            "wait_ms": {k: 1000 * (v - waits["start"].get(k, 0.0)) / n for k, v in waits["end"].items()},
            "cpu_ms": 1000 * cpu / n}


def rank_of_collectives(rank, world, numel, reps):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    x = torch.randn(numel, dtype=torch.bfloat16)
    ops = {"reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(numel // world, dtype=x.dtype), x),
           "all_reduce": lambda: dist.all_reduce(x),
           "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty_like(x), x[:numel // world].clone())}
    times = {}
    for name, fn in ops.items():
        fn()
        dist.barrier()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        times[name] = 1000 * statistics.median(t)
    return times


def run_split(args):
    from bench.slow_link.systems import block_params
    from scenarios.harness.spawn import spawn_ranks
    a = {**{k: getattr(args, k) for k in (*SPLIT_MODEL, "warmup", "steps", "seed", "dtype")}, "ranks_per_node": 2,
         "bucket_fraction": 8}
    env, systems = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, args.systems.split(",")
    loads, passes = [], {s: [] for s in systems}
    for i in range(args.repeats):   # odd passes reversed: load from elsewhere hits every system
        for s in systems if i % 2 == 0 else systems[::-1]:
            loads.append(os.getloadavg()[0])
            res, err = spawn_ranks(rank_of_system, 4, args=(s, a), env=env, timeout=900)
            if err:
                print(f"{s}: ERROR {err.strip().splitlines()[-1]}")
                continue
            mean = lambda key: {k: statistics.mean(r[key].get(k, 0.0) for r in res)  # noqa: E731, B023
                                for k in sorted({k for r in res for k in r[key]})}  # noqa: B023
            passes[s].append({"step_ms": statistics.median(res[0]["step_ms"]), "in_call_ms": mean("in_call_ms"),
                              "wait_ms": mean("wait_ms"), "calls_per_step_rank0": res[0]["calls"],
                              "cpu_ms": statistics.mean(r["cpu_ms"] for r in res)})
    rows = {}
    for s, got in passes.items():
        if not got:
            rows[s] = {"error": "every pass failed"}
            continue
        med = lambda key: {k: statistics.median(g[key].get(k, 0.0) for g in got) for k in got[0][key]}  # noqa: E731, B023
        blocked = [sum((g["wait_ms"] or g["in_call_ms"]).values()) for g in got]
        step = statistics.median(g["step_ms"] for g in got)
        rows[s] = {"label": LABELS.get(s, s), "step_ms": step, "step_ms_passes": [g["step_ms"] for g in got],
                   "in_call_ms": med("in_call_ms"), "wait_ms": med("wait_ms"), "blocked_ms_passes": blocked,
                   "calls_per_step_rank0": got[0]["calls_per_step_rank0"], "blocked_ms": statistics.median(blocked),
                   "compute_ms": step - statistics.median(blocked), "cpu_ms": statistics.median(g["cpu_ms"] for g in got)}
    numel = -(-block_params(a) // 4) * 4
    coll, err = spawn_ranks(rank_of_collectives, 4, args=(numel, args.reps), env=env, timeout=600)
    coll = {k: statistics.mean(r[k] for r in coll) for k in coll[0]} if coll else {"error": err}
    loads.append(os.getloadavg()[0])
    print(f"GPT {a['num_layers']} layers, hidden {a['hidden']}, seq {a['seq']}, micro-batch {a['micro_batch']}, {a['dtype']}; "
          f"4 ranks as 2 x 2 over loopback, gloo, 1 thread each; 1-min load {min(loads):.1f}-{max(loads):.1f}")
    for r in rows.values():
        if "error" not in r:
            print(f"{r['label']}: step {r['step_ms']:.0f} ms, blocked in collectives {r['blocked_ms']:.0f} ms "
                  f"({100 * r['blocked_ms'] / r['step_ms']:.0f}%), the rest {r['compute_ms']:.0f} ms; CPU per rank "
                  f"{r['cpu_ms']:.0f} ms/step\n   inside torch.distributed, ms/step: " + ", ".join(
                      f"{k} {v:.0f} ({r['calls_per_step_rank0'].get(k, 0):.0f} calls)" for k, v in r["in_call_ms"].items())
                  + ("\n   blocked in Work.wait() by phase, ms/step: " + ", ".join(
                      f"{k} {v:.0f}" for k, v in r["wait_ms"].items()) if r["wait_ms"] else ""))
    print(f"One block's gradient ({numel:,} bf16 elements) on 4 ranks, median ms per call: "
          + ", ".join(f"{k} {v:.1f}" for k, v in coll.items() if k != "error"))
    print("wrote", write_result(args.out, {"config": a, "loadavg_1min": loads, "systems": rows, "collectives_ms": coll,
                                           "block_numel": numel}))
