#!/usr/bin/env python
"""Loss against tokens and against wall-clock time on a given link, from convergence runs
(bench/convergence.py JSON) and the step times the slow-link bench measured for the same model
(bench/slow_link.py JSON): wall-clock = iterations x that system's median step at the rate.

    .venv/bin/python -m bench.convergence_wallclock --rate 20 \\
        --slow-link bench/results/slow_link_diloco_convergence_model.json \\
        --run "ZeRO-3=zero3" --run "DiLoCo H=16=diloco-h16" \\
        bench/results/convergence_diloco_h16_1234.json bench/results/convergence_diloco_h16_1235.json \\
        --out bench/results/convergence_diloco_wallclock

Writes OUT.{json,md,png}: per run and seed the final validation loss, the tokens seen and the
hours the run takes at the rate.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def step_ms(slow_link: dict, system: str, rate: int) -> float:
    """The system's time per step at `rate`: over the whole timed window where the bench took one
    (DiLoCo: its exchanges included), else the median step."""
    for r in slow_link["results"]:
        if r["system"] == system and r["rate_mbit"] == rate:
            window = r.get("samples_per_s_window")
            samples_per_step = r["samples_per_s"] * r["step_ms_median"] / 1000
            return 1000 * samples_per_step / window if window else r["step_ms_median"]
    raise SystemExit(f"error: {system} at {rate} Mbit/s is not in the slow-link results; run it there first")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("convergence", nargs="+", help="bench/convergence.py JSON files (one per seed)")
    p.add_argument("--slow-link", required=True, help="bench/slow_link.py JSON with the same model")
    p.add_argument("--rate", type=int, required=True, help="Mbit/s")
    p.add_argument("--run", action="append", required=True, metavar="NAME=SYSTEM",
                   help="a convergence run's name and the slow-link system that times it")
    p.add_argument("--out", required=True, help="output path without suffix")
    a = p.parse_args(argv)
    systems = dict(item.rsplit("=", 1) for item in a.run)
    link = json.loads(Path(a.slow_link).read_text())
    rows, curves, seen = [], [], set()
    for path in a.convergence:
        data = json.loads(Path(path).read_text())
        setup = data["setup"]
        tokens_per_iter = setup["global_batch"] * setup["model"]["seq_length"]
        for name, run in data["runs"].items():
            if name not in systems or run["error"] or (name, setup["seed"]) in seen:
                continue   # a baseline run in several files is drawn once
            seen.add((name, setup["seed"]))
            ms = step_ms(link, systems[name], a.rate)
            val = run["validation"]
            curves.append({"name": name, "seed": setup["seed"],
                           "tokens": [v["iteration"] * tokens_per_iter for v in val],
                           "hours": [v["iteration"] * ms / 3.6e6 for v in val], "loss": [v["loss"] for v in val]})
            rows.append({"run": name, "seed": setup["seed"], "final_validation_loss": val[-1]["loss"],
                         "tokens": setup["iters"] * tokens_per_iter, "step_ms_at_rate": round(ms, 1),
                         "hours_at_rate": round(setup["iters"] * ms / 3.6e6, 3)})
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"rate_mbit": a.rate, "slow_link": a.slow_link,
                                                    "convergence": a.convergence, "rows": rows,
                                                    "curves": curves}, indent=1) + "\n")
    md = [f"Validation loss against tokens and against wall-clock at {a.rate} Mbit/s (iterations x the "
          f"step measured on the emulated link, over its whole timed window where the bench took one, "
          f"`{a.slow_link}`):", "",
          "| run | seed | final val loss | tokens | step ms at the rate | hours for the run |", "|---|---|---|---|---|---|"]
    md += [f"| {r['run']} | {r['seed']} | {r['final_validation_loss']:.4f} | {r['tokens']:,} | "
           f"{r['step_ms_at_rate']:.0f} | {r['hours_at_rate']:.3f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for c in curves:
            style = "-" if c["seed"] == min(x["seed"] for x in curves) else "--"
            ax.plot(c["tokens"], c["loss"], style, marker=".", label=f"{c['name']} seed {c['seed']}")
            ax2.plot(c["hours"], c["loss"], style, marker=".", label=f"{c['name']} seed {c['seed']}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("validation loss (nats)")
        ax2.set_xlabel(f"hours at {a.rate} Mbit/s")
        for x in (ax, ax2):
            x.grid(alpha=0.3)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError as e:   # the numbers matter more than the figure
        print(f"warning: no plot ({e!r})")


if __name__ == "__main__":
    main()
