"""Where a step's time goes unthrottled (`python -m bench.slow_link split`): plain FSDP2 next to our
ZeRO-3 and FSDP2 + the plug-in, 4 ranks as 2 emulated nodes x 2 over loopback. Per system (--repeats
passes, odd ones reversed; medians over passes): the median step; per torch.distributed function the
ms per step inside the call (plain FSDP2 on CPU issues every collective synchronously: its blocked
time); on our Communicator the ms blocked in Work.wait() by phase; compute = step - blocked; the CPU
time per rank per step (all threads). Then each collective alone on one block's bf16 gradient:
gloo's reduce_scatter_tensor (run as an all-reduce) against all_reduce, all_to_all and all-gather."""
from __future__ import annotations

import os
import resource
import statistics
import time

from bench import RESULTS, write_result

SYSTEMS = ["fsdp2", "zero3-reuse0", "fsdp2+zeropp"]
MODEL = dict(num_layers=4, hidden=256, heads=4, vocab=4096, seq=128, micro_batch=8)


def add_args(p):
    for k, d in (*MODEL.items(), ("steps", 6), ("warmup", 2), ("seed", 1234), ("reps", 10), ("repeats", 2)):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=d)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=str(RESULTS / "fsdp2_time_split.json"))


def rank_of_system(rank, world, system, a):
    import torch.distributed as dist
    from bench.ranks import COUNTER, build_system, timed_loop
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


def run(args):
    from bench.systems import LABELS, block_params
    from parallel.spawn import spawn_ranks
    a = {**{k: getattr(args, k) for k in (*MODEL, "warmup", "steps", "seed", "dtype")}, "ranks_per_node": 2,
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
