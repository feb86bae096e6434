"""Bounded memory in every precision, optimizer and budget (issue 24): the check of
bench/memory_bound.py (peak RSS rise per rank <= 1.15 x (model states + buffer
bounds + activations), every pool within its bound) for each of

    precision x optimizer x system x budget
    --dtypes fp32,bf16,fp16  --optimizers adamw,sgd  --systems zero3,zeropp  --budgets small,default

    python -m bench.large_model --matrix --num-layers 8 --hidden 2048 --heads 16 --vocab 4096 \\
        --seq 32 --world 8 --steps 1

Budgets (reduce and prefetch bucket, stage3_max_live_parameters, elements):
"small" 3e7 and 3e7 (issue 24's: the live bound is about one block), "default"
bench/memory_bound.py's DEFAULTS (3e7 and 1.5e8). Each cell runs in freshly
spawned ranks; activations are measured once per precision (memory_bound's
activation_probe), gloo's staging in each cell (memory_bound.staging_probe). Prints
one row per cell: the worst rank's rise, its gloo staging, its budget, the ratio
against the limit, and every pool's worst peak / bound; JSON to --out
(default bench/results/large_model_bound_matrix.json).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from bench import memory_bound
from bench.memory_bound import (DTYPES, MB, NAMES, RSS_LIMIT, activation_probe, bound_rank, cpu_info, judge, listed,
                                model_config)
from model import num_parameters
from parallel.spawn import run_distributed

BUDGETS = {"small": {"bucket": 30_000_000, "max_live": 30_000_000},
           "default": {"bucket": int(memory_bound.DEFAULTS["bucket"]),
                       "max_live": int(memory_bound.DEFAULTS["max_live"])}}


def cell(ranks: list[dict]) -> dict:
    """One row: the worst rank's ratio, and each pool's worst peak / bound over the ranks."""
    worst = max(ranks, key=lambda r: r["judge"]["ratio"])
    pools = {}
    for r in ranks:
        for name, b in r["memory_report"]["buffers"].items():
            frac = (b["peak"] or 0) / b["bound"] if b["bound"] else float("inf")
            if name not in pools or frac > pools[name]["peak_over_bound"]:
                pools[name] = {**b, "peak_over_bound": frac}
    return {"rise_bytes": worst["rise_bytes"], "budget_bytes": worst["judge"]["budget_bytes"],
            "states_bytes": worst["model_states_bytes"], "bounds_bytes": worst["bounds_bytes"],
            "gloo_staging_bytes": worst["gloo_staging_bytes"],
            "ratio": worst["judge"]["ratio"], "limit": RSS_LIMIT,
            "rss_pass": all(r["judge"]["rss_pass"] for r in ranks), "pools": pools,
            "pools_pass": all(r["judge"]["buffers_pass"] for r in ranks),
            "step_s": worst["step_s"], "losses": worst["losses"],
            "ranks": [{k: r[k] for k in ("rank", "base_rss_mb", "rss_before_steps_mb", "peak_rss_mb", "rise_bytes",
                                         "model_states_bytes", "bounds_bytes", "gloo_staging_bytes",
                                         "hpz_secondary_bytes")}
                      | {"ratio": r["judge"]["ratio"]} for r in ranks]}


def print_row(row: dict):
    pools = "  ".join(f"{n} {p['peak'] / MB:.0f}/{p['bound'] / MB:.0f}" + ("" if p["within"] else "!")
                      for n, p in sorted(row["pools"].items()) if p["peak"] is not None and p["bound"])
    ok = row["rss_pass"] and row["pools_pass"]
    print(f"{row['dtype']:<5} {row['optimizer']:<6} {row['system']:<7} {row['budget']:<8} "
          f"{row['rise_bytes'] / MB:>7.0f} {row['gloo_staging_bytes'] / MB:>5.0f} {row['budget_bytes'] / MB:>7.0f} "
          f"{row['ratio']:>6.3f} "
          f"{row['limit']:>5.2f} {'PASS' if ok else 'FAIL':>4}  {pools}", flush=True)


def run(a) -> dict:
    dtypes, optimizers = listed(a.dtypes, DTYPES, "--dtypes"), listed(a.optimizers, ("adamw", "sgd"), "--optimizers")
    systems, budgets = listed(a.systems, NAMES, "--systems"), listed(a.budgets, BUDGETS, "--budgets")
    info = cpu_info()
    psi = num_parameters(model_config(a))
    print(f"{info['cpu_model']}, torch {info['torch']} ({info['cpu_capability']}); GPT {a.num_layers} x {a.hidden}, "
          f"vocab {a.vocab}, seq {a.seq}: {psi / 1e6:.0f} M parameters; {a.world} ranks ({a.ranks_per_node} per "
          f"node), {a.steps} step(s); budgets " + ", ".join(f"{k} {v['bucket']:.3g}/{v['max_live']:.3g}"
                                                           for k, v in BUDGETS.items() if k in budgets))
    print("rise, gloo staging, budget (states + bounds + activations + gloo staging): MB, worst rank; "
          "pools: peak/bound MB, worst rank (! = beyond its bound)")
    print(f"{'dtype':<5} {'optim':<6} {'system':<7} {'budget':<8} {'rise':>7} {'gloo':>5} {'budget':>7} {'ratio':>6} "
          f"{'limit':>5} {'':>4}  pools", flush=True)
    out = {"command": "python -m bench.large_model " + " ".join(sys.argv[1:]), **info, "args": vars(a),
           "num_parameters": psi, "budgets": {k: BUDGETS[k] for k in budgets}, "limit": RSS_LIMIT,
           "activation_probes": {}, "rows": []}
    for dtype in dtypes:
        b = copy.copy(a)
        b.dtype = dtype
        act = run_distributed(activation_probe, world_size=1, args=(b,), timeout=a.timeout,
                              env={"OMP_NUM_THREADS": "1"})[0]
        out["activation_probes"][dtype] = act
        for optimizer in optimizers:
            for budget in budgets:
                for system in systems:
                    c = copy.copy(b)
                    c.optimizer, c.bucket, c.max_live = (optimizer, BUDGETS[budget]["bucket"],
                                                         BUDGETS[budget]["max_live"])
                    ranks = run_distributed(bound_rank, world_size=a.world, args=(c, system), timeout=a.timeout,
                                            env={"OMP_NUM_THREADS": "1"})
                    for r in ranks:
                        r["judge"] = judge(r, act["activation_bytes"])
                    row = {"dtype": dtype, "optimizer": optimizer, "system": system, "budget": budget,
                           "activation_bytes": act["activation_bytes"], **cell(ranks)}
                    out["rows"].append(row)
                    print_row(row)
                    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.out).write_text(json.dumps(out, indent=2, default=str))   # partial results survive
    out["pass"] = all(r["rss_pass"] and r["pools_pass"] for r in out["rows"])
    print(f"bounded memory in every cell: {'PASS' if out['pass'] else 'FAIL'} "
          f"({sum(r['rss_pass'] and r['pools_pass'] for r in out['rows'])}/{len(out['rows'])})")
    Path(a.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {a.out}")
    return out
