#!/usr/bin/env python
"""Where a step's time goes, unthrottled: plain FSDP2 next to our ZeRO-3 (and FSDP2 + the
plug-in), 4 ranks as 2 emulated nodes x 2 over loopback, the slow-link bench's model and data.

    .venv/bin/python -m bench.fsdp2_time_split --num-layers 4 --hidden 256 --heads 4 --vocab 4096 \
        --seq 128 --micro-batch 8 --dtype bf16

Per system (--repeats passes, odd ones in reverse order; medians over the passes): the median step, and per torch.distributed function the ms per step each rank's
main thread spent inside the call (bench/dist_counter.py; plain FSDP2 on CPU issues every
collective synchronously, so that is the time it is blocked), and for systems on our
Communicator the ms blocked in Work.wait() by phase (their collectives are asynchronous).
Compute = step - blocked; beside it the CPU time each rank used per step (all its threads:
a rank that waits for the others uses none). Then each collective alone on a transformer block's gradient
(bf16, 4 ranks): gloo's reduce_scatter_tensor against all_reduce and all_to_all_single.
"""
from __future__ import annotations

import argparse
import json
import resource
import os
import statistics
import time
from pathlib import Path

from bench import RESULTS, cpu_model

SYSTEMS = ["fsdp2", "zero3-reuse0", "fsdp2+zeropp"]


def rank_of_system(rank, world, system, a):
    import torch.distributed as dist

    from bench.zero_systems import COUNTER, build_system, timed_loop
    COUNTER.install()
    COUNTER.node_of = lambda r: r // a["ranks_per_node"]
    sysd = build_system(rank, world, system, a)
    waits = {}
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
    out = {"reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(numel // world, dtype=x.dtype), x),
           "all_reduce": lambda: dist.all_reduce(x),
           "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty_like(x),
                                                                         x[:numel // world].clone())}
    times = {}
    for name, fn in out.items():
        fn()
        dist.barrier()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        times[name] = 1000 * statistics.median(t)
    return times


def main(argv=None):
    import torch

    from bench.system_catalog import LABELS, make_model
    from parallel.spawn import spawn_ranks
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, d in (("num-layers", 4), ("hidden", 256), ("heads", 4), ("vocab", 4096), ("seq", 128), ("micro-batch", 8),
                 ("steps", 6), ("warmup", 2), ("seed", 1234), ("reps", 10), ("repeats", 2)):
        p.add_argument(f"--{k}", type=int, default=d)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=str(RESULTS / "fsdp2_time_split.json"))
    args = p.parse_args(argv)
    a = {"num_layers": args.num_layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
         "seq": args.seq, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
         "seed": args.seed, "dtype": args.dtype, "ranks_per_node": 2, "bucket_fraction": 8}
    env = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    systems = args.systems.split(",")
    loads, passes = [], {s: [] for s in systems}
    for i in range(args.repeats):   # odd passes in reverse order: load from elsewhere hits every system
        for s in systems if i % 2 == 0 else systems[::-1]:
            loads.append(os.getloadavg()[0])
            res, err = spawn_ranks(rank_of_system, 4, args=(s, a), env=env, timeout=900)
            if err:
                print(f"{s}: ERROR {err.strip().splitlines()[-1]}")
                continue
            mean = lambda key: {k: statistics.mean(r[key].get(k, 0.0) for r in res)   # noqa: B023
                                for k in sorted({k for r in res for k in r[key]})}   # noqa: B023
            passes[s].append({"step_ms": statistics.median(res[0]["step_ms"]),   # each step: its slowest rank's
                              "in_call_ms": mean("in_call_ms"), "wait_ms": mean("wait_ms"),
                              "calls_per_step_rank0": res[0]["calls"],
                              "cpu_ms": statistics.mean(r["cpu_ms"] for r in res)})
    rows = {}
    for s, got in passes.items():
        if not got:
            rows[s] = {"error": "every pass failed"}
            continue
        med = lambda key: {k: statistics.median(g[key].get(k, 0.0) for g in got) for k in got[0][key]}  # noqa: B023
        rows[s] = {"label": LABELS.get(s, s), "step_ms": statistics.median(g["step_ms"] for g in got),
                   "step_ms_passes": [g["step_ms"] for g in got], "in_call_ms": med("in_call_ms"),
                   "wait_ms": med("wait_ms"), "calls_per_step_rank0": got[0]["calls_per_step_rank0"],
                   "blocked_ms_passes": [sum((g["wait_ms"] or g["in_call_ms"]).values()) for g in got],
                   "cpu_ms": statistics.median(g["cpu_ms"] for g in got)}
    block = sum(q.numel() for q in make_model(a, meta=True).blocks[0].parameters())
    numel = -(-block // 4) * 4
    coll, err = spawn_ranks(rank_of_collectives, 4, args=(numel, args.reps), env=env, timeout=600)
    coll = {k: statistics.mean(r[k] for r in coll) for k in coll[0]} if coll else {"error": err}
    loads.append(os.getloadavg()[0])
    print(f"GPT {a['num_layers']} layers, hidden {a['hidden']}, seq {a['seq']}, micro-batch {a['micro_batch']}, "
          f"{a['dtype']}; 4 ranks as 2 x 2 over loopback (unthrottled), gloo, 1 thread each; "
          f"{cpu_model()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}; 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for s, r in rows.items():
        if "error" in r:
            continue
        blocked = statistics.median(r["blocked_ms_passes"])
        r["blocked_ms"], r["compute_ms"] = blocked, r["step_ms"] - blocked
        print(f"{r['label']}: step {r['step_ms']:.0f} ms (passes: "
              + ", ".join(f"{t:.0f}" for t in r["step_ms_passes"]) + f"), blocked in collectives {blocked:.0f} ms "
              f"({100 * blocked / r['step_ms']:.0f}%), the rest {r['step_ms'] - blocked:.0f} ms; CPU time per rank "
              f"(all its threads) {r['cpu_ms']:.0f} ms/step")
        print("   inside torch.distributed calls, ms/step: "
              + ", ".join(f"{k} {v:.0f} ({r['calls_per_step_rank0'].get(k, 0):.0f} calls)"
                          for k, v in r["in_call_ms"].items()))
        if r["wait_ms"]:
            print("   blocked in Work.wait() by phase, ms/step: " + ", ".join(f"{k} {v:.0f}" for k, v in r["wait_ms"].items()))
    print(f"One block's gradient ({numel:,} bf16 elements) on 4 ranks, median ms per call: "
          + ", ".join(f"{k} {v:.1f}" for k, v in coll.items() if k != "error"))
    Path(args.out).write_text(json.dumps({"config": a, "cpu": cpu_model(), "loadavg_1min": loads,
                                          "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                          "systems": rows, "collectives_ms": coll, "block_numel": numel}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
