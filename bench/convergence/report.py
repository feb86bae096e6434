"""The convergence benchmark's reading of train.py's log (Megatron's iteration and validation
lines, as training/logger.py writes them), its verdict, table, notes and plots, and the
wall-clock view of runs on a link whose step time the slow-link bench measured."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from bench import write_result

TRAIN_RE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|.*?"
    r"\| lm loss: ([-+\d.eE]+|nan|inf) \|.*?"
    r"intra-node MB: ([\d.]+) \| inter-node MB: ([\d.]+) \|")
GRAD_RE = re.compile(r"\| grad norm: ([-+\d.eEnaif]+) \|")  # absent after a skipped step, as in Megatron
# Megatron's wording: "validation loss at iteration N [on validation set | on test set] | lm loss value: X"
EVAL_RE = re.compile(r"validation loss at iteration (\d+)(?: on (validation|test) set)? \| "
                     r"lm loss value: ([-+\d.eE]+|nan|inf)")
COLORS = {"ZeRO-3": "tab:blue", "ZeRO++": "tab:orange", "ZeRO++ + LoCo": "tab:green", "ZeRO-3 (seed+1)": "tab:gray",
          "ZeRO++ + deltas": "tab:red", "ZeRO++ + LoCo + deltas": "tab:purple", "FSDP2": "tab:blue",
          "FSDP2 + ZeRO++": "tab:orange"}


def parse_log(text: str) -> dict:
    """{"train": [per logged iteration], "validation": [...], "test": {...} or None}."""
    train, valid, test = [], [], None
    for line in text.splitlines():
        if m := TRAIN_RE.search(line):
            train.append({"iteration": int(m[1]), "iter_ms": float(m[3]), "loss": float(m[4]),
                          "grad_norm": float(g[1]) if (g := GRAD_RE.search(line)) else math.nan,
                          "intra_mb": float(m[5]), "inter_mb": float(m[6])})
        elif m := EVAL_RE.search(line):
            if m[2] == "test":
                test = {"iteration": int(m[1]), "loss": float(m[3])}
            elif not valid or valid[-1]["iteration"] != int(m[1]):
                valid.append({"iteration": int(m[1]), "loss": float(m[3])})
    return {"train": train, "validation": valid, "test": test}


def summarize(r: dict) -> dict:
    steady = r["train"][1:] or r["train"]   # the first window holds start-up
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    last = lambda xs, k: xs[-1][k] if xs else None  # noqa: E731
    return {"final_validation_loss": last(r["validation"], "loss"),
            "final_validation_iteration": last(r["validation"], "iteration"),
            "final_train_loss": last(r["train"], "loss"), "test_loss": r["test"]["loss"] if r["test"] else None,
            "inter_node_mb_per_iter": round(mean([t["inter_mb"] for t in steady]), 3),
            "intra_node_mb_per_iter": round(mean([t["intra_mb"] for t in steady]), 3),
            "ms_per_iter": round(mean([t["iter_ms"] for t in steady]), 1), "wall_s": r["wall_s"]}


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def table(runs: dict, summary: dict) -> str:
    rows = [("run", "final val loss", "test loss", "final train loss", "inter-node MB/iter", "intra-node MB/iter",
             "ms/iter", "wall s")]
    for name, s in summary.items():
        rows.append((name, "FAILED: " + runs[name]["error"], "", "", "", "", "", fmt(s["wall_s"], ".0f"))
                    if runs[name]["error"] else
                    (name, fmt(s["final_validation_loss"]), fmt(s["test_loss"]), fmt(s["final_train_loss"]),
                     fmt(s["inter_node_mb_per_iter"], ".2f"), fmt(s["intra_node_mb_per_iter"], ".2f"),
                     fmt(s["ms_per_iter"], ".0f"), fmt(s["wall_s"], ".0f")))
    return "\n".join("| " + " | ".join(r) + " |" + ("\n|" + "---|" * len(r) if i == 0 else "")
                     for i, r in enumerate(rows))


def relative(cand: list[dict], base: list[dict]) -> list[tuple[int, float]]:
    """(iteration, % from the baseline) at every iteration both logged."""
    b = {t["iteration"]: t["loss"] for t in base}
    return [(t["iteration"], 100 * (t["loss"] / b[t["iteration"]] - 1)) for t in cand if t["iteration"] in b]


def plot(runs: dict, path: Path, title: str, tolerance: float, names):
    B, C = names
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    others = iter(["tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colors = {name: COLORS.get(name) or next(others, None) for name in runs}
    base = runs.get(B)
    for name, r in runs.items():
        if not r["train"]:
            continue
        ax.plot(*zip(*[(t["iteration"], t["loss"]) for t in r["train"]]), color=colors[name], lw=1.3,
                label=f"{name} training loss", ls="--" if "seed" in name else "-")
        if r["validation"]:
            ax.plot(*zip(*[(v["iteration"], v["loss"]) for v in r["validation"]]), ls="none", color=colors[name],
                    marker="o" if name == B else "x" if name == C else "s", mfc="none", ms=6,
                    label=f"{name} validation loss")
        if base and base["train"] and name != B:
            for points, style, what in ((relative(r["train"], base["train"]), "-", "training"),
                                        (relative(r["validation"], base["validation"]), "x", "validation")):
                if points and ("seed" not in name or what == "validation"):
                    ax2.plot(*zip(*points), style, color=colors[name], ms=5, label=f"{name} {what}")
    ax.set_ylabel("lm loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax2.axhspan(-100 * tolerance, 100 * tolerance, color="tab:green", alpha=0.12, label=f"±{100 * tolerance:g}%")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_ylabel(f"vs {B} (%)")
    ax2.set_xlabel("iteration")
    ax2.legend(fontsize=7, loc="lower center", ncol=3)
    for x in (ax, ax2):
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(runs: dict, setup: dict, out_dir: Path) -> dict:
    """Summary, verdict, convergence.{json,png,md} in out_dir, and the printed table."""
    B, C = setup.get("names", ("ZeRO-3", "ZeRO++"))
    tol = setup.get("tolerance", 0.01)
    summary = {name: summarize(r) for name, r in runs.items()}
    base, cand = summary[B], summary.get(C)
    verdict = {"criterion": f"|{C} final validation loss / {B} final validation loss - 1| <= {tol}", "ratio": None}
    if cand is None:
        verdict.update(result="NOT RUN", reason=f"--baseline-only: {C} was not run")
    elif runs[B]["error"] or runs[C]["error"]:
        verdict.update(result="FAIL", reason="a run failed")
    else:
        ratio = cand["final_validation_loss"] / base["final_validation_loss"]
        verdict.update(ratio=round(ratio, 6), relative_difference_pct=round(100 * (ratio - 1), 3),
                       result="PASS" if abs(ratio - 1) <= tol else "FAIL",
                       inter_node_bytes_ratio=(round(cand["inter_node_mb_per_iter"] / base["inter_node_mb_per_iter"], 4)
                                               if base["inter_node_mb_per_iter"] else None))
    lines = [f"criterion within {100 * tol:g}%: {verdict['result']}" + (
        f" ({verdict['reason']})" if verdict["ratio"] is None else
        f"; {C} / {B} final validation loss {verdict['ratio']:.4f} ({verdict['relative_difference_pct']:+.2f}%)")]
    if verdict.get("inter_node_bytes_ratio") is not None:
        lines.append(f"inter-node bytes per iteration: {verdict['inter_node_bytes_ratio']:.3f}x {B}'s")
    for name, c in summary.items():   # every other run against the baseline and the candidate
        if name in (B, C) or runs[name]["error"] or cand is None or verdict["ratio"] is None:
            continue
        r3, rpp = (c["final_validation_loss"] / x["final_validation_loss"] for x in (base, cand))
        verdict.setdefault("candidates", {})[name] = {"vs_baseline": round(r3, 6), "vs_candidate": round(rpp, 6)}
        lines.append(f"{name} / {B} final validation loss: {r3:.4f} ({100 * (r3 - 1):+.2f}%), / {C}: {rpp:.4f} "
                     f"({100 * (rpp - 1):+.2f}%); inter-node bytes {c['inter_node_mb_per_iter']:.2f} MB/iter")
    if verdict["ratio"] is not None:
        late = [d for i, d in relative(runs[C]["train"], runs[B]["train"]) if i > setup["iters"] // 2]
        if late:
            lines.append(f"training loss, second half of the run: {C} vs {B} {sum(late) / len(late):+.2f}% on "
                         f"average, {min(late):+.2f}% to {max(late):+.2f}%")
    lines.append("ms/iter and wall times come from shared CPU cores: not a speed comparison")
    write_result(out_dir / "convergence.json", {"setup": setup, "verdict": verdict, "summary": summary, "runs": runs})
    m, nodes = setup["model"], setup["ranks"] // setup["ranks_per_node"]
    head = (f"GPT {m['num_layers']}L/{m['hidden_size']}h, seq {m['seq_length']}, global batch {setup['global_batch']}, "
            f"{setup['ranks']} ranks = {nodes} emulated nodes x {setup['ranks_per_node']}, {setup['iters']} iters, "
            f"seed {setup['seed']}")
    try:
        plot(runs, out_dir / "convergence.png", f"{head}\n{lines[0]}", tol, (B, C))
    except Exception as e:  # the numbers matter more than the figure
        print(f"warning: no plot ({e!r})")
    tbl = table(runs, summary)
    (out_dir / "convergence.md").write_text("\n".join([f"Convergence, {B} vs {C}: {head}.", "", tbl, ""]
                                                      + [f"- {line}" for line in lines]) + "\n")
    print(f"\n{tbl}\n\n" + "\n".join(lines))
    print("results: " + ", ".join(str(out_dir / f"convergence.{x}") for x in ("json", "md", "png")
                                  if (out_dir / f"convergence.{x}").exists()))
    return verdict


def step_ms(slow_link: dict, system: str, rate: int) -> float:
    """The system's time per step at `rate`: over the whole timed window where the bench took one
    (DiLoCo: its exchanges included), else the median step."""
    for r in slow_link["results"]:
        if r["system"] == system and r["rate_mbit"] == rate:
            window = r.get("samples_per_s_window")
            return 1000 * r["samples_per_s"] * r["step_ms_median"] / 1000 / window if window else r["step_ms_median"]
    raise SystemExit(f"error: {system} at {rate} Mbit/s is not in the slow-link results; run it there first")


def wallclock(files: list[str], slow_link: str, rate: int, systems: dict, out: Path) -> dict:
    """Loss against tokens and against hours on the link: iterations x that system's step at `rate`."""
    link = json.loads(Path(slow_link).read_text())
    rows, curves, seen = [], [], set()
    for path in files:
        data = json.loads(Path(path).read_text())
        setup = data["setup"]
        tokens = setup["global_batch"] * setup["model"]["seq_length"]
        for name, run in data["runs"].items():
            if name not in systems or run["error"] or (name, setup["seed"]) in seen:
                continue   # a baseline run in several files is drawn once
            seen.add((name, setup["seed"]))
            ms, val = step_ms(link, systems[name], rate), run["validation"]
            curves.append({"name": name, "seed": setup["seed"], "tokens": [v["iteration"] * tokens for v in val],
                           "hours": [v["iteration"] * ms / 3.6e6 for v in val], "loss": [v["loss"] for v in val]})
            rows.append({"run": name, "seed": setup["seed"], "final_validation_loss": val[-1]["loss"],
                         "tokens": setup["iters"] * tokens, "step_ms_at_rate": round(ms, 1),
                         "hours_at_rate": round(setup["iters"] * ms / 3.6e6, 3)})
    result = {"rate_mbit": rate, "slow_link": slow_link, "convergence": files, "rows": rows, "curves": curves}
    write_result(out.with_suffix(".json"), result)
    md = [f"Validation loss against tokens and against wall-clock at {rate} Mbit/s (iterations x the step measured "
          f"on the emulated link, over its whole timed window where the bench took one, `{slow_link}`):", "",
          "| run | seed | final val loss | tokens | step ms at the rate | hours for the run |", "|---|---|---|---|---|---|"]
    md += [f"| {r['run']} | {r['seed']} | {r['final_validation_loss']:.4f} | {r['tokens']:,} | "
           f"{r['step_ms_at_rate']:.0f} | {r['hours_at_rate']:.3f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for c in curves:
            style = "-" if c["seed"] == min(x["seed"] for x in curves) else "--"
            for ax, x in zip(axes, ("tokens", "hours")):
                ax.plot(c[x], c["loss"], style, marker=".", label=f"{c['name']} seed {c['seed']}")
        for ax, label in zip(axes, ("tokens", f"hours at {rate} Mbit/s")):
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("validation loss (nats)")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError as e:   # the numbers matter more than the figure
        print(f"warning: no plot ({e!r})")
    return result
