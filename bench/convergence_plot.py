"""The convergence benchmark's table and plot (bench/convergence.py): each run's training
and validation loss, and below, each candidate's relative difference from ZeRO-3."""
from __future__ import annotations

from pathlib import Path


def plot(runs: dict, verdict: dict, path: Path, title: str, tolerance: float, names=("ZeRO-3", "ZeRO++")):
    B, C = names
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    colors = {"ZeRO-3": "tab:blue", "ZeRO++": "tab:orange", "ZeRO++ + LoCo": "tab:green",
              "ZeRO-3 (seed+1)": "tab:gray", "ZeRO++ + deltas": "tab:red", "ZeRO++ + LoCo + deltas": "tab:purple",
              "FSDP2": "tab:blue", "FSDP2 + ZeRO++": "tab:orange"}
    others = iter(["tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colors.update({name: next(others, None) for name in runs if name not in colors})
    for name, r in runs.items():
        if not r["train"]:
            continue
        c = colors.get(name)
        ax.plot([t["iteration"] for t in r["train"]], [t["loss"] for t in r["train"]], color=c, lw=1.3,
                label=f"{name} training loss", ls="--" if "seed" in name else "-")
        if r["validation"]:
            style = {B: dict(marker="o", ms=9, mfc="none", mew=1.5), C: dict(marker="x", ms=6, mew=1.5)}
            ax.plot([v["iteration"] for v in r["validation"]], [v["loss"] for v in r["validation"]], ls="none",
                    color=c, label=f"{name} validation loss", **style.get(name, dict(marker="s", ms=5, mfc="none")))
    ax.set_ylabel("lm loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    base = runs.get(B)
    if base and base["train"] and runs.get(C, {}).get("train"):
        b = {t["iteration"]: t["loss"] for t in base["train"]}
        bv = {v["iteration"]: v["loss"] for v in base["validation"]}
        for name in (n for n in runs if n != B and "seed" not in n):
            cand = runs.get(name)
            if not cand or not cand["train"]:
                continue
            pts = [(t["iteration"], 100 * (t["loss"] / b[t["iteration"]] - 1)) for t in cand["train"]
                   if t["iteration"] in b]
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[name], lw=1.2, label=f"{name} training")
            vp = [(v["iteration"], 100 * (v["loss"] / bv[v["iteration"]] - 1)) for v in cand["validation"]
                  if v["iteration"] in bv]
            ax2.plot([p[0] for p in vp], [p[1] for p in vp], "x", color=colors[name], ms=5, mew=1.5,
                     label=f"{name} validation")
        ctrl = runs.get(f"{B} (seed+1)")
        if ctrl and ctrl["validation"]:
            cp = [(v["iteration"], 100 * (v["loss"] / bv[v["iteration"]] - 1)) for v in ctrl["validation"]
                  if v["iteration"] in bv]
            ax2.plot([q[0] for q in cp], [q[1] for q in cp], "s", color="tab:gray", ms=4, mfc="none",
                     label=f"{B} seed+1 validation")
        ax2.axhspan(-100 * tolerance, 100 * tolerance, color="tab:green", alpha=0.12,
                    label=f"±{100 * tolerance:g}%")
        ax2.axhline(0, color="k", lw=0.6)
        ax2.set_ylabel(f"vs {B} (%)")
        ax2.legend(fontsize=7, loc="lower center", ncol=3)
    ax2.set_xlabel("iteration")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def table(runs: dict, summary: dict) -> str:
    rows = [("run", "final val loss", "test loss", "final train loss", "inter-node MB/iter",
             "intra-node MB/iter", "ms/iter", "wall s")]
    for name, s in summary.items():
        if runs[name]["error"]:
            rows.append((name, "FAILED: " + runs[name]["error"], "", "", "", "", "", fmt(s["wall_s"], ".0f")))
            continue
        rows.append((name, fmt(s["final_validation_loss"]), fmt(s["test_loss"]), fmt(s["final_train_loss"]),
                     fmt(s["inter_node_mb_per_iter"], ".2f"), fmt(s["intra_node_mb_per_iter"], ".2f"),
                     fmt(s["ms_per_iter"], ".0f"), fmt(s["wall_s"], ".0f")))
    return "\n".join("| " + " | ".join(r) + " |" + ("\n|" + "---|" * len(r) if i == 0 else "")
                     for i, r in enumerate(rows))
