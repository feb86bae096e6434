"""The slow-link sweep's report: tables, the markdown file, the plot, and the
explanation of the ratios (bench/slow_link.py)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from bench.netns import IF, RANKS_PER_NODE
from bench.slow_link_goals import derive, goals, row_table, wait_table
from bench.slow_link_sweep import analyse


def rate_name(r):
    return "unlimited" if r == 0 else (f"{r // 1000} Gbit/s" if r >= 1000 and r % 1000 == 0 else f"{r} Mbit/s")


def mb(b):
    return "-" if b is None else f"{b / 1e6:.2f}"


def gloo_all_reduce_payers(rows) -> list[str]:
    """Systems that called torch's reduce-scatter (the wrappers saw it), which gloo runs as an
    all-reduce: FSDP2 and DeepSpeed (ours send an all-to-all instead, on gloo)."""
    return sorted({r["system"] for r in rows if not r.get("error")
                   and any("reduce_scatter" in k for k in r.get("intercepted_by_op_rank0") or {})})


def fmt_table(hdr, lines):
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    out = [" | ".join(h.ljust(wd) for h, wd in zip(hdr, widths)), "-+-".join("-" * wd for wd in widths)]
    out += [" | ".join(c.ljust(wd) for c, wd in zip(l, widths)) for l in lines]
    return "\n".join(out)


def md_table(hdr, lines):
    return "\n".join(["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
                     + ["| " + " | ".join(c.replace("|", "/") for c in l) + " |" for l in lines])


def tables(rows, systems, rates, ref="zero3-reuse0"):
    by = {(r["system"], r["rate_mbit"]): r for r in rows}
    from bench.system_catalog import LABELS
    # 1. throughput (samples/s) and ratio to ZeRO-3, per rate
    hdr = ["system"] + [f"{rate_name(r)}" for r in rates]
    lines = []
    for s in systems:
        cells = [LABELS.get(s, s)]
        for r in rates:
            x = by.get((s, r))
            if x is None:
                cells.append("-")
            elif x.get("error"):
                cells.append("ERROR")
            else:
                base = by.get((ref, r))
                ratio = (x["samples_per_s"] / base["samples_per_s"]) if base and not base.get("error") else None
                cells.append(f"{x['samples_per_s']:.2f} ({x['step_ms_median']:.0f} ms"
                             + (f", {ratio:.2f}x" if ratio is not None else "") + ")")
        lines.append(cells)
    t1 = fmt_table(hdr, lines)
    # 2. bytes over the link per step, per system (at each rate; they should not depend on it)
    hdr2 = ["system", "rate", "veth MB/step", "veth raw", "counted MB/step", "counted by", "veth/counted",
            "A->B MB", "B->A MB", "link busy"]
    lines2 = []
    for s in systems:
        for r in rates:
            x = by.get((s, r))
            if x is None or x.get("error"):
                continue
            busy = x.get("link_busy_fraction")
            lines2.append([LABELS.get(s, s), rate_name(r), mb(x["link_bytes_per_step"]),
                           mb(x["link_bytes_per_step_raw"]), mb(x["counted_inter_bytes_per_step"]),
                           "Communicator" if x["counted_source"] == "Communicator" else "intercepted",
                           "-" if x["veth_over_counted"] is None else f"{x['veth_over_counted']:.3f}",
                           mb(x["link_tx_per_step"]["A->B"]), mb(x["link_tx_per_step"]["B->A"]),
                           "-" if busy is None else f"{100 * busy:.0f}%"])
    t2 = fmt_table(hdr2, lines2)
    errors = [f"  {r['label']} @ {rate_name(r['rate_mbit'])}: {r['error'].strip().splitlines()[-1][:200]}"
              for r in rows if r.get("error")]
    return t1, t2, errors


def plot(rows, systems, rates, path, cfg):
    """Median step time against the link rate per system; its bound max(compute, link
    time) as a dashed line of the same colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    from bench.system_catalog import LABELS
    derive(rows)
    finite = [r for r in rates if r]
    unlimited_x = (max(finite) * 4) if finite else 1000
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in systems:
        mine = sorted(((x["rate_mbit"] or unlimited_x), x) for x in rows
                      if x["system"] == s and not x.get("error") and x["rate_mbit"] in rates)
        if not mine:
            continue
        marker = "o" if s.startswith("zero") or s == "auto" else ("s" if s.startswith("fsdp") else "^")
        lw = 2.6 if s in ("zeropp", "zero3-reuse0", "auto") else 1.3
        (line,) = ax.plot([p for p, _ in mine], [x["step_ms_median"] for _, x in mine], "-", marker=marker, lw=lw,
                          label=LABELS.get(s, s))
        bound = [(p, x["bound_ms"]) for p, x in mine if x.get("bound_ms")]
        if bound:
            ax.plot([p for p, _ in bound], [b for _, b in bound], "--", lw=1, color=line.get_color(), alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(set(finite)) + ([unlimited_x] if 0 in rates else [])
    ax.set_xticks(ticks)
    ax.set_xticklabels([rate_name(t) if t != unlimited_x or 0 not in rates else "unlimited\n(veth)"
                        for t in ticks])
    ax.minorticks_off()
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("inter-node link rate (tc tbf, each direction)")
    ax.set_ylabel("median step time, ms (log)")
    ax.set_title(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden']}, seq {cfg['seq']} "
                 f"({cfg['params'] / 1e6:.2f} M parameters), {cfg['dtype']}, micro-batch {cfg['micro_batch']}/rank, "
                 f"buckets 1/{cfg.get('bucket_fraction', '?')} of the model\n"
                 f"2 nodes x {cfg['ranks_per_node']} ranks (netns + veth, tc tbf), gloo on CPU; dashed: the "
                 f"system's bound max(unthrottled step, link time)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report, rows, systems, rates, ref="zero3-reuse0"):
    """A table for the README; the explanation under it is written by hand from these numbers."""
    from bench.system_catalog import LABELS
    by = {(r["system"], r["rate_mbit"]): r for r in rows if not r.get("error")}
    a = report["config"]
    hdr = (["system"] + [f"{rate_name(r)} samples/s (x ZeRO-3)" for r in rates]
           + ["veth MB/step", "counted MB/step"])
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for s in systems:
        cells = [LABELS.get(s, s)]
        for r in rates:
            x, b = by.get((s, r)), by.get((ref, r))
            cells.append("-" if x is None else f"{x['samples_per_s']:.2f}"
                         + (f" ({x['samples_per_s'] / b['samples_per_s']:.2f}x)" if b else ""))
        xs = [by[(s, r)] for r in rates if (s, r) in by]
        if s == "auto":  # its switches, hence its bytes, change with the rate
            lines.append("| " + " | ".join(cells + ["per rate, below"] * 2) + " |")
            continue
        cells.append(f"{statistics.mean(x['link_bytes_per_step'] for x in xs) / 1e6:.2f}" if xs else "-")
        cells.append(f"{statistics.mean(x['counted_inter_bytes_per_step'] for x in xs) / 1e6:.2f}"
                     + ("" if not xs or xs[0]["counted_source"] == "Communicator" else " (intercepted)")
                     if xs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    head = (f"GPT-2 {a['num_layers']} layers, hidden {a['hidden']}, vocab {a['vocab']}, seq {a['seq']} "
            f"({a['params'] / 1e6:.2f} M parameters), {a['dtype']}, micro-batch {a['micro_batch']} per rank, "
            f"2 nodes x {RANKS_PER_NODE} ranks (network namespaces, veth limited by tc tbf in both "
            f"directions), gloo on CPU; median of {a['repeats'] * a['steps']} timed steps per cell ({a['repeats']} "
            f"passes over the systems, the second in reverse order, each {a['warmup']} warm-up + {a['steps']} "
            f"timed steps per rate). "
            f"`{report['command'].replace(sys.executable, '.venv/bin/python')}`")
    rt = md_table(*row_table(rows, systems, rates, LABELS, rate_name))
    gl = goals(rows, rates, LABELS, rate_name)[0]
    return (head + "\n\n" + "\n".join(lines) + "\n\n" + rt + "\n\n" + "\n".join("- " + g for g in gl)
            + "\n\n" + "\n".join(explain(report, rows, rates)) + "\n")


def explain(report, rows, rates, ours="zeropp", ref="zero3-reuse0"):
    """The lines under the README table, from this run's numbers."""
    from bench.system_catalog import LABELS
    ok = [r for r in rows if not r.get("error")]
    by = {(r["system"], r["rate_mbit"]): r for r in ok}
    sysrows = lambda s: [r for r in ok if r["system"] == s]
    mean = lambda s, k: statistics.mean(r[k] for r in sysrows(s)) if sysrows(s) else None
    out = []
    ratio = report.get("zeropp_over_zero3") or {}
    ratio = {int(k): v for k, v in ratio.items()}
    if ratio:
        hit = ratio.get(200)
        out.append("- ZeRO++ / ZeRO-3 throughput: " + ", ".join(f"{v:.2f}x at {rate_name(r)}" for r, v in ratio.items())
                   + (f". Issue 7's target (>= 2.5x at 200 Mbit/s) is {'met' if hit >= 2.5 else 'not met'} here."
                      if hit is not None else "."))
    ana = report.get("analysis") or {}
    if sysrows(ours) and sysrows(ref) and "link_bound_limit" in ana:
        v3, vp = mean(ref, "link_bytes_per_step"), mean(ours, "link_bytes_per_step")
        c3, cp = mean(ref, "counted_inter_bytes_per_step"), mean(ours, "counted_inter_bytes_per_step")
        t3 = by.get((ref, 200), {}).get("step_ms_median")
        i3, ip = by.get((ref, 0), {}).get("step_ms_median"), by.get((ours, 0), {}).get("step_ms_median")
        r25 = ana.get("rate_mbit_for_target")
        line = (f"- ZeRO++ cuts the bytes on the link {v3 / vp:.1f}x ({v3 / 1e6:.2f} -> {vp / 1e6:.2f} MB/step on the "
                f"veth; counted {c3 / 1e6:.2f} -> {cp / 1e6:.2f}, {c3 / cp:.1f}x, the paper's 3M -> 0.75M).")
        if t3 and i3 and ip:
            comps = {k: by[(k, 0)]["step_ms_median"] / i3 - 1 for k in ("zeropp-qwz", "zeropp-hpz", "zeropp-qgz")
                     if (k, 0) in by}
            line += (f" The throughput gain is smaller because the step is not all communication: ZeRO-3 takes "
                     f"{t3:.0f} ms/step at 200 Mbit/s and {i3:.0f} ms unlimited, so even a ZeRO++ with a free link "
                     f"and no cost of its own would reach only {t3 / i3:.2f}x there; and ZeRO++ does cost CPU time "
                     f"({ip:.0f} ms/step unlimited, {100 * (ip / i3 - 1):+.0f}%"
                     + (" (" + ", ".join(f"{k.split('-')[1][:2]}Z alone {100 * v:+.0f}%" for k, v in comps.items()) + ")"
                        if comps else "")
                     + ": block (de)quantization in torch on the CPU, qgZ's two all-to-all hops and requantization),"
                       " on 2 cores shared by 4 ranks.")
        if r25:
            line += (f" A no-overlap model (t = t_unlimited + bytes of the busier direction / rate) puts 2.5x at "
                     f"about {r25:.0f} Mbit/s and the link-bound limit at {ana['link_bound_limit']:.1f}x.")
        out.append(line)
    cfg = report["config"]
    if cfg.get("dtype") == "bf16":
        out.append(f"- Every system trains in bf16 (ours: `bf16.enabled`; FSDP2: MixedPrecisionPolicy(param_dtype="
                   f"bf16, reduce_dtype=bf16); DeepSpeed: `bf16.enabled`), as in the paper's 16-bit regime, on "
                   f"{report['versions'].get('cpu_model') or 'an unrecorded CPU'} (torch CPU capability "
                   f"{report['versions'].get('cpu_capability') or 'unrecorded'}; without AMX a bf16 forward+backward "
                   f"is ~5x an fp32 one), with a short sequence ({cfg['seq']} tokens, micro-batch "
                   f"{cfg['micro_batch']}) that keeps the step communication-heavy.")
    pays = gloo_all_reduce_payers(ok)
    stand_in = lambda r: r.get("issued_inter_bytes_per_step", r["counted_inter_bytes_per_step"]) > \
        r["counted_inter_bytes_per_step"] + 1
    ratios = lambda keep: [r["veth_over_counted"] for r in ok if r["system"] != "auto" and keep(r)
                           and r.get("veth_over_counted")]
    exact = ratios(lambda r: r["system"] not in pays and not stand_in(r))
    rs, a2a = ratios(lambda r: r["system"] in pays), ratios(stand_in)
    tv = [r["tbf_bytes_over_veth"] for r in ok if r.get("tbf_bytes_over_veth")]
    if exact:
        line = (f"- veth vs counted: all-gathers and all-to-alls cross the link as the ring model counts them (rows "
                f"without a reduce-scatter on the wire: veth / counted {min(exact):.3f}-{max(exact):.3f}, i.e. TCP/IP "
                f"headers and ACKs, counted once per GSO packet by the veth")
        if tv:
            line += f"; the tbf shaper, metering every 1500-byte segment's headers, sees {100 * (statistics.mean(tv) - 1):.1f}% more"
        line += ")."
        if a2a:
            w, l = 2 * RANKS_PER_NODE, RANKS_PER_NODE
            line += (f" Ours send their plain reduce-scatter on gloo as one all-to-all plus a local fp32 sum, charged "
                     f"as the ring reduce-scatter it stands for: a ring's bytes per rank, but sent straight to each "
                     f"peer, so across 2 nodes it crosses {w * (w - l) / (2 * (w - 1)):.2f}x the ring's inter-node "
                     f"bytes of that phase (W (W-L) / (N (W-1))): veth / counted {min(a2a):.3f}-{max(a2a):.3f}.")
        if rs:
            line += (f" Rows whose reduce-scatter is gloo's (`reduce_scatter_tensor`, run as a full all-reduce that "
                     f"keeps its own chunk, ProcessGroupGloo::reduce_scatter_tensor_coalesced: twice a ring's bytes) "
                     f"show {min(rs):.2f}-{max(rs):.2f}: {', '.join(LABELS.get(s, s) for s in pays)}.")
        out.append(line + " NCCL's ring reduce-scatter would match the count.")
    if sysrows("zeropp-hpz") and sysrows("fsdp2-hpz"):
        line = (f"- hpZ and FSDP2's `reshard_after_forward=2` (its hpZ counterpart) put the same bytes on the link "
                f"({mean('zeropp-hpz', 'link_bytes_per_step') / 1e6:.1f} and "
                f"{mean('fsdp2-hpz', 'link_bytes_per_step') / 1e6:.1f} MB/step: no backward gather across nodes).")
        if sysrows("deepspeed-z3-reuse0"):
            line += (f" DeepSpeed ZeRO-3 with the same reuse-0 keys keeps its prefetched weights from forward to "
                     f"backward on this model ({mean('deepspeed-z3-reuse0', 'link_bytes_per_step') / 1e6:.1f} MB/step "
                     f"already), so its hpZ has nothing left to remove; its qwZ and qgZ need CUDA.")
        out.append(line)
    if any("counted_equals_intercepted" in r for r in ok):
        good = all(r.get("counted_equals_intercepted", True) for r in ok)
        out.append("- Our Communicator's inter-node bytes, as issued, " + ("equal" if good else "DO NOT equal")
                   + " what wrappers on torch.distributed saw, in every row of ours.")
    loads = [x for r in ok for x in r.get("loadavg_1min_segments", [])]
    if loads:
        out.append(f"- Timing noise: other work kept the 1-minute load average at {min(loads):.0f}-{max(loads):.0f} on "
                   f"{report['versions'].get('cpus')} cores during the sweep; each row pools "
                   f"{cfg.get('repeats', 1)} segments, one per pass over the systems (the second pass in reverse "
                   f"order). Differences of ~15% or less between two rows are within that noise.")
    return out


def render(report, out: Path, png: Path | None = None):
    """Tables, the ZeRO++ / ZeRO-3 ratios and model, then out (.json), .md and .png."""
    cfg, rows, notes = report["config"], report["results"], report["notes"]
    systems, rates, head = cfg["systems"], cfg["rates_mbit"], cfg["head"]
    for r in rows:  # what the tbf shaper metered (per-segment headers) vs the veth counters
        if not r.get("error") and r.get("rate_mbit") and r.get("qdisc"):
            q = r["qdisc"]
            r["tbf_bytes_over_veth"] = (sum(q[i]["bytes"] for i in IF) / r["whole_rate_link_bytes"][-1])
    from bench.system_catalog import LABELS
    t1, t2, errors = tables(rows, systems, rates)
    t0 = fmt_table(*row_table(rows, systems, rates, LABELS, rate_name))
    goal_lines, goal_res = goals(rows, rates, LABELS, rate_name)
    waits = wait_table(rows, LABELS, rate_name)
    title1 = "Throughput, samples/s (median step ms, x ours ZeRO-3 reuse-0 at the same rate)"
    title2 = ("Bytes over the link per step (both directions): veth counters (timed steps, barriers and idle "
              "traffic taken out) vs the counted inter-node bytes (ring model, summed over ranks)")
    title0 = ("Per system and rate: link = veth bytes of the busier direction per step / rate; compute = the "
              "system's unthrottled step (auto: the fixed row it chose); bound = max(compute, link); exposed = step - "
              "compute")
    text = "\n".join([head, "", title0, t0, ""] + goal_lines + ["", title1, t1, "", title2, t2]
                     + (["", "Blocked in Work.wait() per step, ms, by phase (--profile; mean/max over ranks)",
                         fmt_table(*waits)] if waits else [])
                     + (["", "Errors:"] + errors if errors else [])
                     + ([""] + ["NOTE: " + n for n in notes] if notes else []))
    ratio = {}
    by = {(r["system"], r["rate_mbit"]): r for r in rows if not r.get("error")}
    for rate in rates:
        if ("zeropp", rate) in by and ("zero3-reuse0", rate) in by:
            ratio[rate] = by[("zeropp", rate)]["samples_per_s"] / by[("zero3-reuse0", rate)]["samples_per_s"]
    if ratio:
        text += "\n\nZeRO++ / ZeRO-3 throughput: " + ", ".join(f"{rate_name(r)} {v:.2f}x" for r, v in ratio.items())
        text += " (issue 7 target: >= 2.5x at 200 Mbit/s)"
    ana = analyse(rows, rates)
    if "link_bound_limit" in ana:
        r25 = ana["rate_mbit_for_target"]
        text += (f"\nNo-overlap model t(rate) = t(unlimited) + busier-direction veth bytes / rate: ZeRO++ / ZeRO-3 "
                 f"tends to {ana['link_bound_limit']:.2f}x on a very slow link (veth bytes) and "
                 f"{ana['compute_bound_limit']:.2f}x on an unlimited one (CPU time); it reaches "
                 f"{ana['target']}x at " + ("-" if r25 is None else "no rate" if r25 == float("inf")
                                            else f"{r25:.0f} Mbit/s") + " by this model.")
    tv = [r["tbf_bytes_over_veth"] for r in rows if r.get("tbf_bytes_over_veth")]
    if tv:
        text += (f"\ntbf shaper's byte count / veth tx_bytes over the same windows: {min(tv):.3f}-{max(tv):.3f} "
                 f"(the shaper meters every 1500-byte segment's headers; veth counts a GSO packet's once)")
    pays = gloo_all_reduce_payers(rows)
    from bench.system_catalog import GLOO_ALL_REDUCE_PEERS
    peers = [LABELS[s] for s in GLOO_ALL_REDUCE_PEERS if s in systems] or ["FSDP2", "DeepSpeed (not in this run)"]
    text += ("\nReduce-scatter that gloo runs as an all-reduce (twice a ring's bytes), still paid by the peers: "
             + ", ".join(peers) + "; measured here (torch's reduce-scatter called): "
             + (", ".join(LABELS.get(s, s) for s in pays) or "none")
             + ("" if set(pays) - set(GLOO_ALL_REDUCE_PEERS) else ". Ours send theirs as an all-to-all plus a "
                "local sum (a ring's bytes per rank), counted as the ring reduce-scatter"))
    bad = [f"{r['label']} @ {rate_name(r['rate_mbit'])}" for r in rows if r.get("counted_equals_intercepted") is False]
    if any("counted_equals_intercepted" in r for r in rows):
        text += ("\nOur rows: Communicator's inter-node bytes as issued == the torch.distributed wrappers' in every row"
                 if not bad else "\nCOUNTED != INTERCEPTED for: " + ", ".join(bad))
    lb = report.get("loadavg_1min_before_after")
    if lb:
        text += (f"\nLoad average (1 min) before/after: {lb[0]:.1f} / {lb[1]:.1f} on {report['versions'].get('cpus')} "
                 f"cores; total {report.get('wall_s', 0):.0f} s")
    print("\n" + text, flush=True)
    report.update(zeropp_over_zero3=ratio, analysis=ana, goals=goal_res, table=text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    md = out.with_suffix(".md")
    md.write_text(markdown(report, rows, systems, rates))
    png = png or out.with_suffix(".png")
    try:
        plot(rows, systems, rates, png, cfg)
        print(f"wrote {out}, {md} and {png}")
    except Exception as e:
        print(f"wrote {out} and {md}; plot failed: {e}")
