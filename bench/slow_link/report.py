"""The slow-link sweep's report: per (system, rate) the link time, its limit max(compute, link time)
beside the step, step / limit and the exposed communication; the targets with PASS/FAIL; the bytes
on the veth next to the counted ones; the markdown table and the plot.

- link time: veth bytes of the busier direction per step (barriers and idle traffic out) / the tbf
  rate; compute: the same system's unthrottled step (auto: that of the fixed row it chose at this
  rate); bound = max(compute, link time); exposed = step at the rate - compute.
- targets: step / bound <= STEP_OVER_BOUND_MAX at every throttled rate (ours), our ZeRO-3 at least as
  fast as FSDP2 and DeepSpeed ZeRO-3 at every rate, ZeRO++ and auto against ZeRO-3 unthrottled, auto
  against the best fixed combination, FSDP2 + plug-in against plain FSDP2 and our ZeRO++, HSDP + plug-in
  against plain HSDP (PLUGIN). Peak RSS per rank beside the step: HSDP pays memory for its bytes."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench import write_result
from bench.slow_link.systems import GLOO_ALL_REDUCE_PEERS, LABELS, chosen

REF, AUTO = "zero3-reuse0", "auto"
TECHNIQUES = ("zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "auto")
FIXED = ("zero3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp")  # auto's alternatives
FIXED_OF_CHOICE = {"none (ZeRO-3)": "zero3-reuse0", "qwZ": "zeropp-qwz", "hpZ": "zeropp-hpz", "qgZ": "zeropp-qgz",
                   "qwZ+hpZ+qgZ": "zeropp"}
# like for like: FSDP2 re-gathers every weight in backward as our reuse-0 row; DeepSpeed at reuse 0 keeps
# what its prefetcher gathered, as our default reuse distance does ("zero3")
PAIRS = (("zero3-reuse0", "fsdp2"), ("zero3-reuse0", "deepspeed-z3-reuse0"), ("zero3", "deepspeed-z3-reuse0"))
STEP_OVER_BOUND_MAX, ZEROPP_OVER_ZERO3_MIN, AUTO_OVER_ZERO3_MIN, AUTO_OVER_BEST_MIN = 1.15, 0.90, 0.98, 0.95
PLUGIN = (("fsdp2+zeropp", "fsdp2", (100,), 3.0), ("fsdp2+zeropp", "zeropp-loco", (100, 200), 0.90),
          ("fsdp2+zeropp", "zeropp", (100, 200), 0.90), ("fsdp2+zeropp", "fsdp2", (0,), 0.95),
          ("hsdp+zeropp", "hsdp", (100,), 3.0), ("hsdp+zeropp", "hsdp", (0,), 0.95))


def rate_name(r):
    return "unlimited" if r == 0 else (f"{r // 1000} Gbit/s" if r >= 1000 and r % 1000 == 0 else f"{r} Mbit/s")


def mb(b):
    return "-" if b is None else f"{b / 1e6:.2f}"


def num(v, fmt="{:.0f}"):
    return "-" if v is None else fmt.format(v)


def fmt_table(hdr, lines):
    widths = [max([len(h)] + [len(l[i]) for l in lines if len(l) > i]) for i, h in enumerate(hdr)]
    return "\n".join([" | ".join(h.ljust(w) for h, w in zip(hdr, widths)), "-+-".join("-" * w for w in widths)]
                     + [" | ".join(c.ljust(w) for c, w in zip(l, widths)) for l in lines])


def md_table(hdr, lines):
    return "\n".join(["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
                     + ["| " + " | ".join(c.replace("|", "/") for c in l) + " |" for l in lines])


def busier_direction_bytes(row) -> float:
    """Per step; older results files lack the net figure: take the overhead out here."""
    if "link_busier_bytes_per_step" in row:
        return row["link_busier_bytes_per_step"]
    return max(row["link_tx_per_step"].values()) - (row["link_bytes_per_step_raw"] - row["link_bytes_per_step"]) / 2


def phase_bound(r) -> float | None:
    """max(fwd compute, fwd link) + max(bwd compute, bwd link) + the optimizer's link time, the
    compute split 1:2 and the link time as the counted inter-node bytes per phase."""
    by_phase = r.get("counted_inter_by_phase_per_step") or {}
    total = sum(by_phase.values())
    if not r.get("link_time_ms") or r.get("compute_ms") is None or not total:
        return None
    link = {p: r["link_time_ms"] * b / total for p, b in by_phase.items()}
    c = r["compute_ms"]
    return (max(c / 3, link.get("forward_gather", 0.0)) + link.get("optimizer", 0.0) + link.get("other", 0.0)
            + max(2 * c / 3, link.get("backward_gather", 0.0) + link.get("grad_reduce", 0.0)))


def derive(rows):
    """Adds link_time_ms, compute_ms (compute_from), bound_ms, step_over_bound, phase_bound_ms, exposed_ms
    and x_zero3 to each row; returns them by (system, rate)."""
    by = {(r["system"], r["rate_mbit"]): r for r in rows if not r.get("error")}
    for r in by.values():
        rate, base = r["rate_mbit"], (r["system"], by.get((r["system"], 0)))
        if r["system"] == AUTO and rate and r.get("auto"):   # the fixed row of the switches it chose
            picks = {chosen(x.get("switches")) for x in r["auto"]}
            fixed = FIXED_OF_CHOICE.get(picks.pop()) if len(picks) == 1 else None
            base = (fixed, by[(fixed, 0)]) if fixed and (fixed, 0) in by else base
        r["compute_from"], base = base
        r["link_time_ms"] = busier_direction_bytes(r) * 8 / (rate * 1e6) * 1000 if rate else None
        r["compute_ms"] = base["step_ms_median"] if base else None
        r["bound_ms"] = max(r["compute_ms"], r["link_time_ms"] or 0.0) if base else None
        r["step_over_bound"] = r["step_ms_median"] / r["bound_ms"] if r["bound_ms"] else None
        r["phase_bound_ms"] = phase_bound(r)
        r["exposed_ms"] = r["step_ms_median"] - r["compute_ms"] if base else None
        ref = by.get((REF, rate))
        r["x_zero3"] = r["samples_per_s"] / ref["samples_per_s"] if ref else None
    return by


def row_table(rows, systems, rates, labels=LABELS, rate_name=rate_name):
    """(header, lines): one line per (system, rate), the bound beside the step."""
    by = derive(rows)
    hdr = ["system", "rate", "step ms", "peak RSS MB/rank", "samples/s", "x ZeRO-3", "veth MB/step",
           "counted MB/step", "link ms", "compute ms", "bound ms", f"step/bound (<= {STEP_OVER_BOUND_MAX})",
           "exposed ms"]
    lines = []
    for s in systems:
        for rate in rates:
            x = by.get((s, rate))
            if x is None:
                err = any(r["system"] == s and r["rate_mbit"] == rate and r.get("error") for r in rows)
                lines.append([labels.get(s, s), rate_name(rate), "ERROR" if err else "-"] + [""] * (len(hdr) - 3))
                continue
            sb = x["step_over_bound"]
            mark = "" if sb is None or not rate else (" ok" if sb <= STEP_OVER_BOUND_MAX else " OVER")
            label = labels.get(s, s) + (" -> " + "/".join(sorted({chosen(a.get("switches")) for a in x["auto"]}))
                                        if x.get("auto") else "")
            lines.append([label, rate_name(rate), f"{x['step_ms_median']:.0f}", num(x.get("peak_rss_mb")),
                          f"{x['samples_per_s']:.2f}",
                          num(x["x_zero3"], "{:.2f}x"), mb(x["link_bytes_per_step"]),
                          mb(x["counted_inter_bytes_per_step"]), num(x["link_time_ms"]), num(x["compute_ms"]),
                          num(x["bound_ms"]), (num(sb, "{:.2f}") + mark) if rate else "-",
                          num(x["exposed_ms"], "{:+.0f}") if rate else "-"])
    return hdr, lines


def goals(rows, rates, labels=LABELS, rate_name=rate_name):
    """(lines under the table, the same as a dict for the JSON): each target beside its limit."""
    by, out, res = derive(rows), [], {}
    unl = lambda s: by.get((s, 0))  # noqa: E731
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    at = lambda vals, f="{:.2f}x": ", ".join(f"{f.format(v)} at {rate_name(r)}" for r, v in vals.items())  # noqa: E731
    ref0 = unl(REF)
    if ref0:
        costs = {s: unl(s)["step_ms_median"] - ref0["step_ms_median"] for s in TECHNIQUES if unl(s)}
        if costs:
            res["technique_cost_ms_unthrottled"] = costs
            out.append(f"Cost per step unthrottled, vs ZeRO-3's {ref0['step_ms_median']:.0f} ms: " + "; ".join(
                f"{labels.get(s, s)} {d:+.0f} ms ({100 * d / ref0['step_ms_median']:+.0f}%)" for s, d in costs.items()))
    for s in ("zero3-reuse0", "zeropp", AUTO):
        vals = {r: by[(s, r)]["step_over_bound"] for r in rates if r and by.get((s, r), {}).get("step_over_bound")}
        if vals:
            ok = max(vals.values()) <= STEP_OVER_BOUND_MAX
            res.setdefault("step_over_bound_max", {})[s] = {"values": vals, "pass": ok}
            out.append(f"Overlap, {labels.get(s, s)}: step / max(compute, link) {at(vals, '{:.2f}')} "
                       f"(target <= {STEP_OVER_BOUND_MAX} at every throttled rate): {verdict(ok)}")
            phase = {r: by[(s, r)]["step_ms_median"] / by[(s, r)]["phase_bound_ms"] for r in vals
                     if by[(s, r)].get("phase_bound_ms")}
            if phase:
                res.setdefault("step_over_phase_bound", {})[s] = phase
                out.append(f"  step / per-phase bound (fwd and bwd each max(compute, link)): {at(phase, '{:.2f}')}")
    ratio = lambda a, b, rs: {r: by[(a, r)]["samples_per_s"] / by[(b, r)]["samples_per_s"]  # noqa: E731
                              for r in rs if (a, r) in by and (b, r) in by}
    for ours, other in PAIRS:
        vals = ratio(ours, other, rates)
        if vals:
            ok = min(vals.values()) >= 1.0
            res.setdefault("zero3_over_other", {})[f"{ours}/{other}"] = {"values": vals, "pass": ok}
            out.append(f"Peers, {labels.get(ours, ours)} / {labels.get(other, other)} throughput: {at(vals)} "
                       f"(target >= 1.00 at every rate): {verdict(ok)}")
    for key, s, least in (("zeropp_over_zero3_unthrottled", "zeropp", ZEROPP_OVER_ZERO3_MIN),
                          ("auto_over_zero3_unthrottled", AUTO, AUTO_OVER_ZERO3_MIN)):
        if ref0 and unl(s):
            v = unl(s)["samples_per_s"] / ref0["samples_per_s"]
            res[key] = {"value": v, "pass": v >= least}
            out.append(f"Cost, {labels.get(s, s)} / ZeRO-3 throughput unthrottled: {v:.2f}x (target >= {least}): "
                       f"{verdict(v >= least)}")
    best = {}
    for r in rates:
        fixed = [(by[(s, r)]["samples_per_s"], s) for s in FIXED if (s, r) in by]
        if (AUTO, r) in by and fixed:
            top, s = max(fixed)
            best[r] = {"value": by[(AUTO, r)]["samples_per_s"] / top, "best_fixed": s}
    if best:
        ok = min(b["value"] for b in best.values()) >= AUTO_OVER_BEST_MIN
        res["auto_over_best_fixed"] = {"values": best, "pass": ok}
        out.append("Auto / best fixed combination: " + ", ".join(
            f"{b['value']:.2f}x at {rate_name(r)} (best {labels.get(b['best_fixed'], b['best_fixed'])})"
            for r, b in best.items()) + f" (target >= {AUTO_OVER_BEST_MIN} at every rate): {verdict(ok)}")
    for row, other, rs, least in PLUGIN:
        vals = ratio(row, other, rs)
        if vals:
            ok = min(vals.values()) >= least
            res.setdefault("plugin_goals", {})[f"{row}/{other}"] = {"values": vals, "least": least, "pass": ok}
            out.append(f"Plug-in, {labels.get(row, row)} / {labels.get(other, other)} throughput: {at(vals)} "
                       f"(target >= {least:.2f}): {verdict(ok)}")
    for r in rates:  # what auto chose (its last log line) next to the measured step
        for seg in (by.get((AUTO, r)) or {}).get("auto") or []:
            out.append(f"auto at {rate_name(r)}: {(seg.get('log') or ['(no log)'])[-1].lstrip('> ')}; measured "
                       f"{by[(AUTO, r)]['step_ms_median']:.0f} ms")
    return out, res


def analyse(rows, ours="zeropp", ref=REF, target=2.5):
    """No-overlap model per system, t(rate) = t(unlimited) + busier-direction bytes / rate, and from it
    ours / ref on a very slow link (bytes) and an unlimited one (CPU), and the rate reaching `target`."""
    ok = [r for r in rows if not r.get("error")]
    model = {}
    for s in sorted({r["system"] for r in ok}):
        inf = next((r for r in ok if r["system"] == s and r["rate_mbit"] == 0), None)
        mine = [r for r in ok if r["system"] == s and r["rate_mbit"]]
        if inf and mine:
            bdir, t_inf = statistics.mean(max(r["link_tx_per_step"].values()) for r in mine), inf["step_ms_median"] / 1e3
            model[s] = {"t_unlimited_s": t_inf, "busier_direction_bytes_per_step": bdir, "predicted_vs_measured_ms": {
                r["rate_mbit"]: [1000 * (t_inf + bdir * 8 / (r["rate_mbit"] * 1e6)), r["step_ms_median"]] for r in mine}}
    out = {"model": model}
    if ours in model and ref in model:
        (ta, ba), (tb, bb) = ((model[s]["t_unlimited_s"], model[s]["busier_direction_bytes_per_step"]) for s in (ours, ref))
        x = (target * ta - tb) / (bb - target * ba) if bb - target * ba > 0 else None   # x = 8 / rate
        out.update(link_bound_limit=bb / ba, compute_bound_limit=tb / ta, target=target,
                   rate_mbit_for_target=(8 / x / 1e6) if x and x > 0 else (float("inf") if x is not None else None))
    return out


def bytes_table(rows, systems, rates):
    by = {(r["system"], r["rate_mbit"]): r for r in rows if not r.get("error")}
    hdr = ["system", "rate", "veth MB/step", "veth raw", "counted MB/step", "counted by", "veth/counted",
           "A->B MB", "B->A MB", "link busy"]
    return hdr, [[LABELS.get(s, s), rate_name(r), mb(x["link_bytes_per_step"]), mb(x["link_bytes_per_step_raw"]),
                  mb(x["counted_inter_bytes_per_step"]), "Communicator" if x["counted_source"] == "Communicator"
                  else "intercepted", num(x["veth_over_counted"], "{:.3f}"), mb(x["link_tx_per_step"]["A->B"]),
                  mb(x["link_tx_per_step"]["B->A"]), num(x.get("link_busy_fraction") and 100 * x["link_busy_fraction"],
                                                         "{:.0f}%")]
                 for s in systems for r in rates if (x := by.get((s, r)))]


def wait_table(rows):
    """--profile: ms per step each rank's main thread was blocked in Work.wait(), by phase."""
    prof = [r for r in rows if r.get("wait_ms_per_step_by_phase")]
    phases = sorted({k for r in prof for k in r["wait_ms_per_step_by_phase"]})
    return (["system", "rate", "step ms"] + [f"{k} (mean/max)" for k in phases] + ["total (mean)"],
            [[LABELS.get(r["system"], r["system"]), rate_name(r["rate_mbit"]), f"{r['step_ms_median']:.0f}"]
             + [f"{w[k]['mean']:.0f}/{w[k]['max']:.0f}" if k in w else "-" for k in phases]
             + [f"{sum(v['mean'] for v in w.values()):.0f}"] for r in prof if (w := r["wait_ms_per_step_by_phase"])])


def plot(rows, systems, rates, path, cfg):
    """Median step time against the link rate per system, its bound max(compute, link time) dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter
    derive(rows)
    finite = [r for r in rates if r]
    unl = max(finite) * 4 if finite else 1000
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in systems:
        mine = sorted(((x["rate_mbit"] or unl), x) for x in rows if x["system"] == s and not x.get("error"))
        if mine:
            marker = "o" if s.startswith("zero") or s == "auto" else ("s" if s.startswith("fsdp") else "^")
            (line,) = ax.plot([p for p, _ in mine], [x["step_ms_median"] for _, x in mine], "-", marker=marker,
                              lw=2.6 if s in ("zeropp", "zero3-reuse0", "auto") else 1.3, label=LABELS.get(s, s))
            bound = [(p, x["bound_ms"]) for p, x in mine if x.get("bound_ms")]
            ax.plot([p for p, _ in bound], [b for _, b in bound], "--", lw=1, color=line.get_color(), alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(set(finite)) + ([unl] if 0 in rates else [])
    ax.set_xticks(ticks)
    ax.set_xticklabels([rate_name(t) if t != unl or 0 not in rates else "unlimited\n(veth)" for t in ticks])
    ax.minorticks_off()
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set(xlabel="inter-node link rate (tc tbf, each direction)", ylabel="median step time, ms (log)")
    ax.set_title(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden']}, seq {cfg['seq']} ({cfg['params'] / 1e6:.2f} M "
                 f"parameters), {cfg['dtype']}, 2 nodes x {cfg['ranks_per_node']} ranks, gloo on CPU\n"
                 "dashed: the system's bound max(unthrottled step, link time)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(report, out: Path, png: Path | None = None):
    """Print the tables and targets; write out (.json, with provenance), .md and .png."""
    cfg, rows = report["config"], report["results"]
    systems, rates = cfg["systems"], cfg["rates_mbit"]
    for r in rows:  # what the tbf shaper metered (every segment's headers) against the veth counters
        if not r.get("error") and r.get("rate_mbit") and r.get("qdisc"):
            r["tbf_bytes_over_veth"] = sum(q.get("bytes") or 0 for q in r["qdisc"].values()) / r["whole_rate_link_bytes"][-1]
    rt = row_table(rows, systems, rates)
    goal_lines, goal_res = goals(rows, rates)
    waits = wait_table(rows)
    ana = analyse(rows)
    text = [cfg["head"], "", "Per system and rate: link = veth bytes of the busier direction per step / rate; compute "
            "= the unthrottled step (auto: the fixed row it chose); bound = max(compute, link); exposed = step - compute",
            fmt_table(*rt), "", *goal_lines, "", "Bytes over the link per step (both directions): veth (barriers and "
            "idle traffic out) vs counted (ring model, summed over ranks)", fmt_table(*bytes_table(rows, systems, rates))]
    if waits[1]:
        text += ["", "Blocked in Work.wait() per step, ms, by phase (mean/max over ranks)", fmt_table(*waits)]
    text += [f"ERROR {r['label']} @ {rate_name(r['rate_mbit'])}: {r['error'].strip().splitlines()[-1][:200]}"
             for r in rows if r.get("error")] + ["NOTE: " + n for n in report.get("notes", [])]
    if "link_bound_limit" in ana:
        r25 = ana["rate_mbit_for_target"]
        text.append(f"No-overlap model: ZeRO++ / ZeRO-3 tends to {ana['link_bound_limit']:.2f}x on a very slow link "
                    f"and {ana['compute_bound_limit']:.2f}x unlimited; {ana['target']}x at "
                    + ("-" if r25 is None else "no rate" if r25 == float("inf") else f"{r25:.0f} Mbit/s"))
    pays = sorted({r["system"] for r in rows if not r.get("error")
                   and any("reduce_scatter" in k for k in r.get("intercepted_by_op_rank0") or {})})
    text.append("Reduce-scatter run by gloo as an all-reduce (twice a ring's bytes), expected for: "
                + (", ".join(s for s in GLOO_ALL_REDUCE_PEERS if s in systems) or "none in this run") + "; seen for: " + (", ".join(pays) or "none"))
    if any(r.get("counted_equals_intercepted") is False for r in rows):
        text.append("COUNTED != INTERCEPTED for: " + ", ".join(r["label"] for r in rows
                                                                if r.get("counted_equals_intercepted") is False))
    print("\n".join(text), flush=True)
    ratio = {r: x for r in rates if (x := (by := derive(rows)).get(("zeropp", r))) and (REF, r) in by}
    report.update(zeropp_over_zero3={r: x["samples_per_s"] / by[(REF, r)]["samples_per_s"] for r, x in ratio.items()},
                  analysis=ana, goals=goal_res, table="\n".join(text))
    report.pop("provenance", None)   # a re-render is stamped with its own
    write_result(out, report)
    md = out.with_suffix(".md")
    md.write_text("\n\n".join([cfg["head"], md_table(*rt), "\n".join("- " + g for g in goal_lines)]) + "\n")
    try:
        plot(rows, systems, rates, png or out.with_suffix(".png"), cfg)
        print(f"wrote {out}, {md} and {png or out.with_suffix('.png')}")
    except Exception as e:  # noqa: BLE001 (the numbers are written; the picture is extra)
        print(f"wrote {out} and {md}; plot failed: {e}")
