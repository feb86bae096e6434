#!/usr/bin/env python
"""ZeRO benchmark: our engine's stages 0-3 next to PyTorch FSDP2 and DeepSpeed ZeRO.

    .venv/bin/python bench/zero_bench.py                       # default run, ~3-5 min on 2 cores
    .venv/bin/python bench/zero_bench.py --steps 20 --num-layers 6 --out /tmp/b.json

One GPT (model/gpt.py), one seed, one data stream, fp32, AdamW (lr 1e-4,
betas 0.9/0.95, eps 1e-8, weight decay 0.01 on matrices only) for every
system. Each system runs in its own fresh set of gloo ranks (spawned like
tests/distributed.py, torch.set_num_threads(1) per rank), so max RSS is that
system's own. A system that fails or hangs becomes an error row; the others
still run. See bench/README.md for what each column means and the caveats.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import queue as queue_mod
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also in the spawned ranks, which re-import this file
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.zero_systems import (ALL_SYSTEMS, COUNTER, DEEPSPEED, DEFAULT_SYSTEMS, LABELS, OPTIM, OURS,  # noqa: E402
                                 PERSISTENCE_THRESHOLD, WORLD1_SYSTEMS, make_model, run_rank)


# --------------------------------------------------------------------------------------
# Process harness (tests/distributed.py's approach, plus a timeout and no crash on failure).
# --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, system, a, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    if system in DEEPSPEED:
        os.environ["DS_ACCELERATOR"] = "cpu"
    torch.set_num_threads(1)  # the ranks share the machine's cores
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        COUNTER.install()  # before DeepSpeed binds torch.distributed functions
        if system not in DEEPSPEED:  # DeepSpeed joins through deepspeed.init_distributed
            dist.init_process_group("gloo", rank=rank, world_size=world)
        q.put((rank, "ok", pickle.dumps(run_rank(rank, world, system, a))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def launch(system, world, a, timeout):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, system, a, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, error = {}, None
    deadline = time.monotonic() + timeout
    while len(results) < world and error is None:
        try:
            rank, status, value = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_mod.Empty:
            error = f"timed out after {timeout:.0f} s (hung or too slow); got {len(results)}/{world} ranks"
            break
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            error = f"rank {rank}:\n{value}"
    for p in procs:
        p.join(timeout=5 if error else 30)
        if p.is_alive():
            p.kill()
            p.join()
    if error:
        return None, error
    return [results[r] for r in range(world)], None


# --------------------------------------------------------------------------------------
# Summaries and the table.
# --------------------------------------------------------------------------------------
def num_params(a):
    return sum(p.numel() for p in make_model(a).parameters())


def model_bytes(system, psi, world, elt=4):
    """Analytic bytes sent per rank per step (fp32), ring-style (N-1)/N factors:
    all-reduce = 2 x P, ZeRO-1/2 = reduce-scatter + all-gather = 2 x P,
    ZeRO-3/FSDP = all-gather fwd + all-gather bwd + reduce-scatter = 3 x P."""
    if world == 1:
        return 0
    f = (world - 1) / world
    stage = OURS.get(system, DEEPSPEED.get(system, 3 if system == "fsdp2" else 0))
    mult = 3 if stage == 3 else 2
    return int(mult * psi * elt * f)


def summarize(system, world, per_rank, a, psi):
    r0 = per_rank[0]
    steps = r0["step_times_s"][a["warmup"]:]
    row = {"system": system, "label": LABELS.get(system, system), "world_size": world,
           "step_ms_median": 1000 * statistics.median(steps),
           "step_ms_min": 1000 * min(steps), "step_ms_max": 1000 * max(steps),
           "step_ms_all": [1000 * s for s in r0["step_times_s"]],
           "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
           "base_rss_mb": max(r["base_rss_mb"] for r in per_rank),
           "loss_first": r0["losses"][0], "loss_last": r0["losses"][-1], "losses": r0["losses"],
           "bytes_per_step_model": model_bytes(system, psi, world),
           "error": None}
    mems = [r["mem"] for r in per_rank if r["mem"]]
    row["model_state_mb"] = (max(m["model_state_bytes"] for m in mems) / 2 ** 20) if mems else None
    row["model_state_detail_rank0"] = per_rank[0]["mem"]
    n = a["steps"]
    if r0["counted"] is not None:
        row["bytes_per_step_counted"] = statistics.mean(r["counted"]["bytes"] for r in per_rank) / n
        row["bytes_counted_by"] = r0["counted_source"]
        row["counted_by_op_rank0"] = {k: v / n for k, v in r0["counted"]["by_op"].items()}
    else:
        row["bytes_per_step_counted"] = None
        row["bytes_counted_by"] = None
    row["bytes_per_step_intercepted"] = statistics.mean(r["intercepted"]["bytes"] for r in per_rank) / n
    row["intercepted_by_op_rank0"] = {k: v / n for k, v in r0["intercepted"]["by_op"].items()}
    return row


def fmt_bytes(b):
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def print_table(rows, ref_name, title):
    ref = next((r for r in rows if r["system"] == ref_name and not r.get("error")), None)
    hdr = ["system", "step ms (median)", "min", f"x {ref_name}", "peak RSS MB", "RSS delta MB",
           "model-state MB", "bytes/step counted", "bytes/step intercepted", "bytes/step model",
           "loss@1", "loss@last"]
    lines = []
    for r in rows:
        if r.get("error"):
            first = r["error"].strip().splitlines()[-1][:110]
            lines.append([LABELS.get(r["system"], r["system"]), "ERROR: " + first])
            continue
        ratio = (r["step_ms_median"] / ref["step_ms_median"]) if ref else float("nan")
        ms = r["model_state_mb"]
        ms = "-" if ms is None else (f"~{ms:.2f}" if r["system"] in DEEPSPEED else f"{ms:.2f}")
        lines.append([r["label"], f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}", f"{ratio:.2f}",
                      f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f}",
                      ms,
                      fmt_bytes(r["bytes_per_step_counted"]),
                      fmt_bytes(r["bytes_per_step_intercepted"]),
                      fmt_bytes(r["bytes_per_step_model"]),
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
                        f"ZeRO-1/2, ~+90 s)")
    p.add_argument("--world1-systems", default=",".join(WORLD1_SYSTEMS),
                   help="comma list run with world size 1 for the engine-overhead table "
                        "('' to skip); 'plain' is the reference loop")
    p.add_argument("--timeout", type=float, default=240, help="seconds per system before it is an error")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "zero_bench.json"))
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
    t2 = ""
    if w1_rows:
        print()
        t2 = print_table(w1_rows, "plain", "== world size 1: engine overhead (ratio to a plain PyTorch "
                                           "loop) ==")
    print(f"\nZeRO-3 rows (ours and DeepSpeed): stage3_param_persistence_threshold = "
          f"{PERSISTENCE_THRESHOLD:.0e} (DeepSpeed's default). 'counted' = our Communicator; "
          f"'intercepted' = wrappers on torch.distributed collectives; 'model' = analytic (N-1)/N "
          f"ring formula; '~' = DeepSpeed model-state found through its optimizer's attributes "
          f"(best effort). Load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores. Total {time.monotonic() - t_start:.0f} s.")
    report = {"config": {**a, "world": args.world, "params": psi,
                         "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                         "optimizer": {"type": "AdamW", **OPTIM}, "dtype": "float32", "dropout": 0.0},
              "versions": versions(), "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
              "command": " ".join([sys.executable] + sys.argv), "results": main_rows, "world1_results": w1_rows,
              "table": t1, "world1_table": t2, "wall_s": time.monotonic() - t_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
