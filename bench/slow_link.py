#!/usr/bin/env python
"""ZeRO-3 vs ZeRO++ (and FSDP2, DeepSpeed) over an emulated slow inter-node link.

    sudo .venv/bin/python -m bench.slow_link                    # full sweep (~12-15 min on 2 cores)
    sudo .venv/bin/python -m bench.slow_link --quick            # smoke test: 1 rate, 2 systems
    sudo .venv/bin/python -m bench.slow_link --rates 200 --systems zero3-reuse0,zeropp --steps 8

Two network namespaces, nodeA and nodeB (two "nodes"), joined by a veth pair
vA <-> vB (192.0.2.1 / 192.0.2.2, a documentation range that exists only inside the
namespaces) rate-limited in both directions with a tc tbf qdisc. In each namespace
torchrun starts 2 ranks (multi-node static rendezvous over the veth addresses,
GLOO_SOCKET_IFNAME = the veth), so LOCAL_WORLD_SIZE=2 gives 2 nodes x 2 ranks: traffic
between the two ranks of a node stays on that namespace's loopback (the fast
"NVLink"), only node-to-node traffic crosses the throttled link.

The sweep makes --repeats passes over the systems (odd passes take the systems and the
rates in reverse order). In each pass, for each system, a fresh pair of torchruns runs
bench/slow_link_worker.py: the ranks build the system once, then for each link rate in
turn (the driver sets the qdisc between them) run bench.zero_systems.timed_loop (warm-up
steps, then timed steps; one step = forward + backward + optimizer step, its time the
slowest rank's): one "segment". Reported per (system, rate), over the pooled timed steps
of its segments: the
median step time, throughput, the bytes that crossed the link per step read from the
veth counters at the start and end of the timed steps (between barriers, by local rank 0
of each node), and the inter-node bytes per step that our Communicator counted (our
rows) and that wrappers on torch.distributed counted (all rows; same ring model), both
summed over ranks (= over the link's two directions).

Needs root and iproute2 (ip, tc); without them it prints a skip line and exits 0. The
namespaces are removed afterwards, also on errors and Ctrl-C, and leftovers of a
crashed run are removed at start.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NS = ("nodeA", "nodeB")
IF = ("vA", "vB")
ADDR = ("192.0.2.1", "192.0.2.2")
RANKS_PER_NODE = 2
DEFAULT_RATES = [100, 200, 1000, 0]  # Mbit/s; 0 = no qdisc (the veth's own speed)
DEFAULT_SYSTEMS = ["zero3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "fsdp2",
                   "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz"]
QUICK_SYSTEMS = ["zero3-reuse0", "zeropp"]
TBF_LATENCY = "400ms"
RESULTS = ROOT / "bench" / "results"

_live_groups: list[int] = []   # process-group ids of the torchruns we started and not yet reaped
_netns_made = False


# --------------------------------------------------------------------------------------
# The two "nodes".
# --------------------------------------------------------------------------------------
def sh(*cmd, check=True, timeout=30):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_down():
    """Kill the torchruns we started (by their process group), then remove the namespaces."""
    for pgid in list(_live_groups):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        _live_groups.remove(pgid)
    listed = sh("ip", "netns", "list", check=False).stdout.split()
    for ns in NS:
        if ns in listed:
            sh("ip", "netns", "del", ns, check=False)


def netns_up():
    global _netns_made
    netns_down()  # leftovers of a crashed run
    _netns_made = True
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", IF[0], "netns", NS[0], "type", "veth", "peer", "name", IF[1], "netns", NS[1])
    for ns, ifname, addr in zip(NS, IF, ADDR):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
        sh("ip", "-n", ns, "link", "set", ifname, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def tbf_burst(rate_mbit: int) -> int:
    """Bucket size in bytes: 256 KiB, or 5 ms at the rate if larger (tbf needs
    burst >= rate / HZ; a bigger one lets fast links reach their rate)."""
    return max(256 * 1024, int(rate_mbit * 1e6 / 8 * 0.005))


def set_rate(rate_mbit: int):
    for ns, ifname in zip(NS, IF):
        sh("tc", "-n", ns, "qdisc", "del", "dev", ifname, "root", check=False)
        if rate_mbit:
            sh("tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", f"{rate_mbit}mbit",
               "burst", str(tbf_burst(rate_mbit)), "latency", TBF_LATENCY)


def link_counters() -> dict:
    """tx/rx bytes of both veth ends, from outside (ip -s -j link show)."""
    out = {}
    for ns, ifname in zip(NS, IF):
        s = json.loads(sh("ip", "-n", ns, "-s", "-j", "link", "show", ifname).stdout)[0]["stats64"]
        out[ifname] = {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"]}
    return out


def qdisc_stats() -> dict:
    out = {}
    for ns, ifname in zip(NS, IF):
        try:
            q = json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", ifname).stdout)
            root = next((x for x in q if x.get("root")), q[0] if q else {})
            out[ifname] = {k: root.get(k) for k in ("kind", "bytes", "packets", "drops", "overlimits")}
        except Exception as e:  # informational only
            out[ifname] = {"error": str(e)}
    return out


# --------------------------------------------------------------------------------------
# One system at every rate: one torchrun per namespace; the ranks build the system once
# and ask for each rate in turn (bench/slow_link_worker.py).
# --------------------------------------------------------------------------------------
def _stop(p):
    if p.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                pass
    if p.pid in _live_groups:
        _live_groups.remove(p.pid)


def run_system(system: str, rates: list[int], a: dict, port: int, setup_timeout: float, rate_timeout: float,
               logdir: Path, on_rate=None) -> list[dict]:
    """One dict per rate: the ranks' results, or "error"."""
    from bench.zero_systems import DEEPSPEED
    out_dir = Path(tempfile.mkdtemp(prefix=f"{system}_", dir=logdir))
    procs, logs = [], []
    t0 = time.monotonic()
    set_rate(rates[0])
    for node, (ns, ifname) in enumerate(zip(NS, IF)):
        env = ["env", f"GLOO_SOCKET_IFNAME={ifname}", "OMP_NUM_THREADS=1", f"PYTHONPATH={ROOT}",
               "PYTHONUNBUFFERED=1"]
        if system in DEEPSPEED:
            env.append("DS_ACCELERATOR=cpu")
        cmd = (["ip", "netns", "exec", ns] + env +
               [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", ADDR[0], "--master-port", str(port),
                "--max-restarts", "0", str(ROOT / "bench" / "slow_link_worker.py"),
                "--system", system, "--config", json.dumps(a), "--rates", ",".join(map(str, rates)),
                "--out-dir", str(out_dir), "--ifname", ifname, "--handshake-timeout", str(rate_timeout)])
        log = open(out_dir / f"{ns}.log", "w")
        logs.append(log)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        _live_groups.append(p.pid)
        procs.append(p)
    world = 2 * RANKS_PER_NODE
    runs = []
    try:
        deadline = t0 + setup_timeout
        for idx, rate in enumerate(rates):
            t_rate = time.monotonic()
            error = None
            while not (out_dir / f"want{idx}").exists():  # the ranks are ready for this rate
                if any(p.poll() is not None for p in procs):
                    error = f"a torchrun exited (codes {[p.poll() for p in procs]}) before rate {rate}"
                    break
                if time.monotonic() > deadline:
                    error = f"timed out after {time.monotonic() - t_rate:.0f} s waiting for the ranks"
                    break
                time.sleep(0.05)
            if error is None:
                set_rate(rate)
                before = link_counters()
                (out_dir / f"set{idx}").write_text("")
                files = [out_dir / f"rate{idx}_rank{r}.json" for r in range(world)]
                deadline = time.monotonic() + rate_timeout
                while not all(f.exists() for f in files):
                    if any(p.poll() is not None for p in procs) and not all(f.exists() for f in files):
                        time.sleep(0.5)  # let the other ranks' files land
                        if not all(f.exists() for f in files):
                            break
                    if time.monotonic() > deadline:
                        error = f"timed out after {rate_timeout:.0f} s at {rate} Mbit/s"
                        break
                    time.sleep(0.05)
                after = link_counters()
                per_rank = [json.loads(f.read_text()) if f.exists() else None for f in files]
                bad = [r for r, x in enumerate(per_rank) if x is None or not x.get("ok")]
                if error is None and bad:
                    x = per_rank[bad[0]]
                    error = (f"rank {bad[0]}: " + x["error"]) if x else f"rank {bad[0]} wrote no result"
            if error is None:
                runs.append({"per_rank": per_rank, "wall_s": time.monotonic() - t_rate,
                             "whole_rate_link_bytes": sum(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in IF),
                             "qdisc": qdisc_stats()})
            else:
                runs.append({"error": error, "wall_s": time.monotonic() - t_rate})
            if on_rate:
                on_rate(rate, runs[-1])
            if error is not None:
                break
            deadline = time.monotonic() + rate_timeout  # for the next want<i>
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            _stop(p)
        for log in logs:
            log.close()
    if any("error" in r for r in runs):
        tail = []
        for ns in NS:
            lines = (out_dir / f"{ns}.log").read_text(errors="replace").splitlines()
            tail += [f"--- {ns} log (last 15 lines) ---"] + lines[-15:]
        for r in runs:
            if "error" in r:
                r["log_tail"] = "\n".join(tail)
                r["logs"] = str(out_dir)
    while len(runs) < len(rates):  # rates not reached after an error
        runs.append({"error": "not run (an earlier rate of this system failed)", "wall_s": 0.0})
        if on_rate:
            on_rate(rates[len(runs) - 1], runs[-1])
    return runs


def segment(run, a):
    """The numbers of one timed segment (one rate, once), from the ranks' results."""
    pr = run["per_rank"]
    n, w = a["steps"], a["warmup"]
    # The link: node A's local rank 0 read vA, node B's read vB (tx of one end = rx of the other).
    heads = [x for x in pr if x["local_rank"] == 0]
    a_end = next(x for x in heads if x["ifname"] == IF[0])
    b_end = next(x for x in heads if x["ifname"] == IF[1])
    la, lb = a_end["link"], b_end["link"]
    d = lambda l, k: l["end"][k] - l["start"][k]
    cal = a_end["calib"]
    window = la["end"]["t"] - la["start"]["t"]
    tx_a, tx_b = d(la, "tx_bytes"), d(lb, "tx_bytes")
    # In the window besides the steps: 1 + n + 1 barriers (hook, the per-step one, hook)
    # and whatever flows while idle (nothing, normally; measured for 0.5 s).
    return {"n": n, "times": pr[0]["step_times_s"][w:],  # each step: its slowest rank
            "all_times": pr[0]["step_times_s"], "losses": pr[0]["losses"],
            "tx_a": tx_a, "tx_b": tx_b, "rx_a": d(la, "rx_bytes"), "rx_b": d(lb, "rx_bytes"),
            "window": window, "barrier": cal["barrier_bytes"], "idle": cal["idle_bytes_per_s"],
            "overhead": (n + 2) * cal["barrier_bytes"] + cal["idle_bytes_per_s"] * window,
            "intercepted": sum(x["intercepted"]["inter_bytes"] for x in pr),
            "intercepted_calls_rank0": pr[0]["intercepted"]["calls"],
            "intercepted_by_op_rank0": pr[0]["intercepted"]["by_op"],
            "counted": (sum(x["counted"]["inter_bytes"] for x in pr) if pr[0].get("counted") else None),
            "counted_by_phase": ({k: sum(x["counted"]["inter_by_phase"].get(k, 0) for x in pr)
                                  for k in sorted({k for x in pr for k in x["counted"]["inter_by_phase"]})}
                                 if pr[0].get("counted") else None),
            "counted_calls_rank0": pr[0]["counted"]["calls"] if pr[0].get("counted") else None,
            "peak_rss_mb": max(x["peak_rss_mb"] for x in pr), "build_s": max(x["build_s"] for x in pr),
            "loadavg": pr[0]["loadavg"], "whole_rate_link_bytes": run["whole_rate_link_bytes"],
            "qdisc": run["qdisc"], "wall_s": run["wall_s"]}


def summarize(system, rate, runs, a):
    """One row: the segments run at `rate` pooled (their timed steps together)."""
    from bench.zero_systems import LABELS, OURS
    world = 2 * RANKS_PER_NODE
    row = {"system": system, "label": LABELS.get(system, system), "rate_mbit": rate,
           "wall_s": sum(r["wall_s"] for r in runs)}
    bad = [r for r in runs if r.get("error")] or ([] if runs else [{"error": "not run"}])
    if bad:
        row["error"] = bad[0]["error"]
        row["log_tail"] = bad[0].get("log_tail")
        return row
    segs = [segment(r, a) for r in runs]
    times = [t for sg in segs for t in sg["times"]]
    n = sum(sg["n"] for sg in segs)
    med = statistics.median(times)
    tot = lambda k: sum(sg[k] for sg in segs)
    raw, window = tot("tx_a") + tot("tx_b"), tot("window")
    row.update(step_ms_median=1000 * med, step_ms_min=1000 * min(times), step_ms_max=1000 * max(times),
               segment_medians_ms=[1000 * statistics.median(sg["times"]) for sg in segs],
               step_ms_all=[[1000 * t for t in sg["all_times"]] for sg in segs],
               timed_steps=n, segments=len(segs),
               samples_per_s=world * a["micro_batch"] / med,
               tokens_per_s=world * a["micro_batch"] * a["seq"] / med,
               loss_first=segs[0]["losses"][0], losses=[sg["losses"] for sg in segs],
               peak_rss_mb=max(sg["peak_rss_mb"] for sg in segs),
               link_bytes_per_step_raw=raw / n, link_bytes_per_step=(raw - tot("overhead")) / n,
               link_tx_per_step={"A->B": tot("tx_a") / n, "B->A": tot("tx_b") / n},
               link_crosscheck_rx={"A->B seen at vB": tot("rx_b") / n, "B->A seen at vA": tot("rx_a") / n},
               barrier_link_bytes=statistics.mean(sg["barrier"] for sg in segs),
               idle_link_bytes_per_s=statistics.mean(sg["idle"] for sg in segs),
               timed_window_s=window,
               link_busy_fraction=(max(tot("tx_a"), tot("tx_b")) * 8 / (rate * 1e6) / window) if rate else None,
               whole_rate_link_bytes=[sg["whole_rate_link_bytes"] for sg in segs], qdisc=segs[-1]["qdisc"],
               build_s=segs[0]["build_s"], loadavg_1min=statistics.mean(sg["loadavg"] for sg in segs),
               loadavg_1min_segments=[sg["loadavg"] for sg in segs])
    # What the counting model says crossed the link (summed over ranks = both directions).
    row["intercepted_inter_bytes_per_step"] = tot("intercepted") / n
    row["intercepted_calls_per_step_rank0"] = tot("intercepted_calls_rank0") / n
    row["intercepted_by_op_rank0"] = {k: v / segs[0]["n"] for k, v in segs[0]["intercepted_by_op_rank0"].items()}
    if system in OURS and segs[0]["counted"] is not None:
        row["counted_inter_bytes_per_step"] = tot("counted") / n
        row["counted_inter_by_phase_per_step"] = {k: v / segs[0]["n"] for k, v in segs[0]["counted_by_phase"].items()}
        row["counted_calls_per_step_rank0"] = tot("counted_calls_rank0") / n
        row["counted_source"] = "Communicator"
    else:
        row["counted_inter_bytes_per_step"] = row["intercepted_inter_bytes_per_step"]
        row["counted_source"] = "torch.distributed wrappers"
    c = row["counted_inter_bytes_per_step"]
    row["veth_over_counted"] = row["link_bytes_per_step"] / c if c else None
    if row["counted_source"] == "Communicator":  # no collective bypassed or was miscounted
        row["counted_equals_intercepted"] = abs(c - row["intercepted_inter_bytes_per_step"]) < 1
    return row


def analyse(rows, rates, ours="zeropp", ref="zero3-reuse0", target=2.5):
    """A no-overlap model per system, t(rate) = t(unlimited) + (bytes of the busier direction)
    / rate, from the unlimited-rate step time and the veth bytes; and from it the link-bound
    limit of ZeRO++ / ZeRO-3 and the link rate at which the ratio would reach `target`."""
    ok = [r for r in rows if not r.get("error")]
    model = {}
    for sname in sorted({r["system"] for r in ok}):
        inf = next((r for r in ok if r["system"] == sname and r["rate_mbit"] == 0), None)
        mine = [r for r in ok if r["system"] == sname and r["rate_mbit"]]
        if inf is None or not mine:
            continue
        bdir = statistics.mean(max(r["link_tx_per_step"].values()) for r in mine)
        t_inf = inf["step_ms_median"] / 1000
        model[sname] = {"t_unlimited_s": t_inf, "busier_direction_bytes_per_step": bdir,
                        "predicted_vs_measured_ms": {
                            r["rate_mbit"]: [1000 * (t_inf + bdir * 8 / (r["rate_mbit"] * 1e6)), r["step_ms_median"]]
                            for r in mine}}
    out = {"model": model}
    if ours in model and ref in model:
        a, b = model[ours], model[ref]
        out["link_bound_limit"] = b["busier_direction_bytes_per_step"] / a["busier_direction_bytes_per_step"]
        out["compute_bound_limit"] = b["t_unlimited_s"] / a["t_unlimited_s"]
        # (t_b + B_b x) / (t_a + B_a x) = target, x = 8 / rate
        den = b["busier_direction_bytes_per_step"] - target * a["busier_direction_bytes_per_step"]
        num = target * a["t_unlimited_s"] - b["t_unlimited_s"]
        x = num / den if den > 0 else None
        out["target"] = target
        out["rate_mbit_for_target"] = (8 / x / 1e6) if x and x > 0 else (float("inf") if x is not None else None)
    return out


# --------------------------------------------------------------------------------------
# Tables, plot.
# --------------------------------------------------------------------------------------
def rate_name(r):
    return "unlimited" if r == 0 else (f"{r // 1000} Gbit/s" if r >= 1000 and r % 1000 == 0 else f"{r} Mbit/s")


def mb(b):
    return "-" if b is None else f"{b / 1e6:.2f}"


def fmt_table(hdr, lines):
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    out = [" | ".join(h.ljust(wd) for h, wd in zip(hdr, widths)), "-+-".join("-" * wd for wd in widths)]
    out += [" | ".join(c.ljust(wd) for c, wd in zip(l, widths)) for l in lines]
    return "\n".join(out)


def tables(rows, systems, rates, ref="zero3-reuse0"):
    by = {(r["system"], r["rate_mbit"]): r for r in rows}
    from bench.zero_systems import LABELS
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.zero_systems import LABELS
    finite = [r for r in rates if r]
    unlimited_x = (max(finite) * 4) if finite else 1000
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in systems:
        pts = sorted((r or unlimited_x, x["samples_per_s"]) for x in rows
                     if x["system"] == s and not x.get("error") for r in [x["rate_mbit"]] if r in rates)
        if not pts:
            continue
        style = "-" if s.startswith("zero") else ("--" if s.startswith("fsdp") else ":")
        lw = 2.8 if s in ("zeropp", "zero3-reuse0") else 1.4
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", lw=lw, label=LABELS.get(s, s))
    ax.set_xscale("log")
    ticks = sorted(set(finite)) + ([unlimited_x] if 0 in rates else [])
    ax.set_xticks(ticks)
    ax.set_xticklabels([rate_name(t) if t != unlimited_x or 0 not in rates else "unlimited\n(veth)"
                        for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("inter-node link rate (tc tbf, each direction)")
    ax.set_ylabel("throughput (samples/s, 4 ranks)")
    ax.set_title(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden']}, seq {cfg['seq']} "
                 f"({cfg['params'] / 1e6:.2f} M parameters), {cfg['dtype']}, micro-batch {cfg['micro_batch']}/rank\n"
                 f"2 nodes x {cfg['ranks_per_node']} ranks (netns + veth, tc tbf), gloo on CPU; median step time",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report, rows, systems, rates, ref="zero3-reuse0"):
    """A table for the README; the explanation under it is written by hand from these numbers."""
    from bench.zero_systems import LABELS
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
    return head + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(explain(report, rows, rates)) + "\n"


def explain(report, rows, rates, ours="zeropp", ref="zero3-reuse0"):
    """The lines under the README table, from this run's numbers."""
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
                   f"bf16, reduce_dtype=bf16); DeepSpeed: `bf16.enabled`), as in the paper's 16-bit regime. The "
                   f"machine measured has no native bf16 matmul (torch.ops.mkldnn._is_mkldnn_bf16_supported() is "
                   f"False; a bf16 forward+backward is ~5x an fp32 one), hence the short sequence ({cfg['seq']} "
                   f"tokens, micro-batch {cfg['micro_batch']}) that keeps the step communication-heavy.")
    qg = [r["veth_over_counted"] for r in ok if r["system"] in ("zeropp", "zeropp-qgz") and r.get("veth_over_counted")]
    rs = [r["veth_over_counted"] for r in ok if r["system"] not in ("zeropp", "zeropp-qgz")
          and r.get("veth_over_counted")]
    tv = [r["tbf_bytes_over_veth"] for r in ok if r.get("tbf_bytes_over_veth")]
    if qg and rs:
        z = sysrows(ref)
        extra = (statistics.mean(r["link_bytes_per_step"] - r["counted_inter_bytes_per_step"] for r in z)
                 if z else None)
        grad = (z[0].get("counted_inter_by_phase_per_step") or {}).get("grad_reduce") if z else None
        line = (f"- veth vs counted: all-gathers and all-to-alls cross the link as the ring model counts them (rows "
                f"without a reduce-scatter, ZeRO++ and + qgZ: veth / counted {min(qg):.3f}-{max(qg):.3f}, i.e. TCP/IP "
                f"headers and ACKs, counted once per GSO packet by the veth")
        if tv:
            line += f"; the tbf shaper, metering every 1500-byte segment's headers, sees {100 * (statistics.mean(tv) - 1):.1f}% more"
        line += (f"). Rows with a reduce-scatter show {min(rs):.2f}-{max(rs):.2f}: gloo runs `reduce_scatter_tensor` "
                 f"as a full all-reduce and keeps its own chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced), "
                 f"twice a ring reduce-scatter's bytes")
        if extra and grad:
            line += (f"; the surplus ({extra / 1e6:.2f} MB/step for ZeRO-3) is the counted gradient reduce-scatter "
                     f"({grad / 1e6:.2f} MB/step) again")
        line += ". NCCL's ring reduce-scatter would match the count."
        out.append(line)
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
        out.append("- Our Communicator's inter-node bytes " + ("equal" if good else "DO NOT equal")
                   + " what wrappers on torch.distributed saw, in every row of ours.")
    loads = [x for r in ok for x in r.get("loadavg_1min_segments", [])]
    if loads:
        out.append(f"- Timing noise: other work kept the 1-minute load average at {min(loads):.0f}-{max(loads):.0f} on "
                   f"{report['versions'].get('cpus')} cores during the sweep; each row pools "
                   f"{cfg.get('repeats', 1)} segments, one per pass over the systems (the second pass in reverse "
                   f"order). Differences of ~15% or less between two rows are within that noise.")
    return out


def versions():
    v = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
         "kernel": platform.release()}
    try:
        import torch
        v["torch"] = torch.__version__
    except Exception:
        pass
    try:
        from importlib.metadata import version
        v["deepspeed"] = version("deepspeed")
    except Exception:
        v["deepspeed"] = None
    return v


def deepspeed_importable() -> bool:
    r = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, timeout=120,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return r.returncode == 0


def zeropp_in_build() -> bool:
    """False while zeropp.initialize still refuses the ZeRO++ keys."""
    src = (ROOT / "zeropp" / "__init__.py").read_text()
    return "is not in this build yet" not in src


# --------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)),
                   help="link rates in Mbit/s, comma separated; 0 = unlimited (no qdisc)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    p.add_argument("--steps", type=int, default=6, help="timed steps per segment, after its warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each segment")
    p.add_argument("--repeats", type=int, default=2,
                   help="passes over the systems (odd passes in reverse order, rates too); each "
                        "(system, rate) row pools one segment per pass")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=240, help="seconds per (system, rate) before it is an error")
    p.add_argument("--setup-timeout", type=float, default=240,
                   help="seconds for a system's ranks to start and build it")
    p.add_argument("--quick", action="store_true", help="smoke test: one rate (200), two systems, 4 steps")
    p.add_argument("--out", default=None, help=f"results JSON (also .md, .png beside it); default "
                   f"{RESULTS / 'slow_link.json'}, with --quick a temporary file")
    p.add_argument("--plot", default=None, help="default: --out with .png")
    p.add_argument("--from-json", default=None,
                   help="run nothing: re-render the tables, --out (.json/.md) and the plot from this results file")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (str(Path(tempfile.gettempdir()) / "slow_link_quick.json") if args.quick
                    else str(RESULTS / "slow_link.json"))
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), Path(args.out), Path(args.plot) if args.plot else None)
        return 0

    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"{' and '.join(missing)} not found"
        print(f"slow_link: SKIPPED ({why}): the emulated link needs root and iproute2 (ip, tc) "
              f"to create network namespaces and a tc qdisc")
        return 0

    from bench.zero_systems import (
        DEEPSPEED,
        LABELS,
        SLOW_LINK_SYSTEMS,
        ZEROPP,
        num_params,
        zero_section,
    )
    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    systems = [s for s in args.systems.split(",") if s]
    if args.quick:
        rates, systems = [200], QUICK_SYSTEMS
        args.steps, args.warmup, args.repeats = 4, 2, 1
    for s in systems:
        if s not in SLOW_LINK_SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SLOW_LINK_SYSTEMS)}")
    notes = []
    if any(s in DEEPSPEED for s in systems) and not deepspeed_importable():
        notes.append("DeepSpeed rows skipped: `import deepspeed` fails in this environment")
        systems = [s for s in systems if s not in DEEPSPEED]
    if any(s in DEEPSPEED for s in systems):
        notes.append("DeepSpeed's qwZ and qgZ need CUDA (its quantizer kernels); only its hpZ runs on CPU")
    if not zeropp_in_build():
        dropped = [s for s in systems if s in ZEROPP and not s.startswith("deepspeed")]
        if dropped:
            notes.append(f"ZeRO++ rows skipped (zeropp.initialize: not in this build yet): {', '.join(dropped)}")
            systems = [s for s in systems if s not in dropped]

    a = {"num_layers": args.num_layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
         "seq": args.seq, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
         "seed": args.seed, "dtype": args.dtype, "ranks_per_node": RANKS_PER_NODE, "repeats": args.repeats}
    psi = num_params(a)
    elt = 2 if args.dtype == "bf16" else 4
    head = (f"GPT {a['num_layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, seq "
            f"{a['seq']}: {psi:,} parameters ({psi * elt / 1e6:.2f} MB in {args.dtype}); micro-batch "
            f"{a['micro_batch']} per rank, 2 nodes x {RANKS_PER_NODE} ranks (global batch "
            f"{2 * RANKS_PER_NODE * a['micro_batch']}); {a['repeats']} pass(es) over the systems (then in reverse "
            f"order), each (system, rate) {a['warmup']} warm-up + {a['steps']} timed steps per pass, median over "
            f"the pooled timed steps; "
            f"{args.dtype}, AdamW; gloo on CPU, 1 thread per rank, {os.cpu_count()} cores")
    print(head, flush=True)
    for n in notes:
        print("NOTE: " + n, flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="slow_link_logs_"))
    atexit.register(netns_down)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, t_start = [], time.monotonic()
    # `repeats` passes over the systems, each system freshly launched in every pass: odd
    # passes take the systems and the rates in reverse order (ABBA), and each row pools its
    # segments, so that a burst of load from elsewhere on the machine hits one segment of
    # several, and every system and rate is measured both early and late.
    schedule = []  # (pass, system, rates in order)
    for i in range(args.repeats):
        fwd = i % 2 == 0
        schedule += [(i, s, rates if fwd else rates[::-1]) for s in (systems if fwd else systems[::-1])]
    segs = {}  # (system, rate) -> [run, ...]
    load_before = os.getloadavg()
    port = 29500
    try:
        netns_up()
        for i, s, order in schedule:
            port += 1
            print(f"pass {i + 1}/{args.repeats}: {LABELS.get(s, s)} ({s}):", flush=True)

            def on_rate(rate, run):
                segs.setdefault((s, rate), []).append(run)  # noqa: B023 (called before the loop moves on)
                if run.get("error"):
                    print(f"  [{rate_name(rate)}] ERROR ({run['wall_s']:.0f} s): "
                          f"{run['error'].strip().splitlines()[-1][:200]}", flush=True)
                else:
                    sg = segment(run, a)
                    print(f"  [{rate_name(rate)}] {1000 * statistics.median(sg['times']):.0f} ms/step; link "
                          f"{mb((sg['tx_a'] + sg['tx_b'] - sg['overhead']) / sg['n'])} MB/step "
                          f"({run['wall_s']:.0f} s, load {sg['loadavg']:.1f})", flush=True)

            t_sys = time.monotonic()
            run_system(s, order, a, port, args.setup_timeout, args.timeout, logdir, on_rate=on_rate)
            print(f"  ({time.monotonic() - t_sys:.0f} s)", flush=True)
        print(flush=True)
        for s in systems:
            for rate in rates:
                rows.append(summarize(s, rate, segs.get((s, rate), []), a))
    except KeyboardInterrupt:
        print("\ninterrupted: ranks stopped, namespaces removed; nothing written", flush=True)
        return 130
    finally:
        netns_down()
    load_after = os.getloadavg()
    report = {"config": {**a, "params": psi, "rates_mbit": rates, "systems": systems,
                         "schedule": [[i, sname, order] for i, sname, order in schedule],
                         "head": head,
                         "tbf": {"latency": TBF_LATENCY, "burst_bytes": {r: tbf_burst(r) for r in rates if r}},
                         "zero_optimization": {s: zero_section(s, a) for s in systems
                                               if not s.startswith("fsdp")},
                         "labels": {s: LABELS.get(s, s) for s in systems}},
              "versions": versions(), "notes": notes,
              "command": " ".join([sys.executable, "-m", "bench.slow_link"] + (argv or sys.argv[1:])),
              "loadavg_1min_before_after": [load_before[0], load_after[0]],
              "results": rows, "logs": str(logdir), "wall_s": time.monotonic() - t_start}
    render(report, Path(args.out), Path(args.plot) if args.plot else None)
    return 0


def render(report, out: Path, png: Path | None = None):
    """Tables, the ZeRO++ / ZeRO-3 ratios and model, then out (.json), .md and .png."""
    cfg, rows, notes = report["config"], report["results"], report["notes"]
    systems, rates, head = cfg["systems"], cfg["rates_mbit"], cfg["head"]
    for r in rows:  # what the tbf shaper metered (per-segment headers) vs the veth counters
        if not r.get("error") and r.get("rate_mbit") and r.get("qdisc"):
            q = r["qdisc"]
            r["tbf_bytes_over_veth"] = (sum(q[i]["bytes"] for i in IF) / r["whole_rate_link_bytes"][-1])
    t1, t2, errors = tables(rows, systems, rates)
    title1 = "Throughput, samples/s (median step ms, x ours ZeRO-3 reuse-0 at the same rate)"
    title2 = ("Bytes over the link per step (both directions): veth counters (timed steps, barriers and idle "
              "traffic taken out) vs the counted inter-node bytes (ring model, summed over ranks)")
    text = "\n".join([head, "", title1, t1, "", title2, t2] + (["", "Errors:"] + errors if errors else [])
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
    bad = [f"{r['label']} @ {rate_name(r['rate_mbit'])}" for r in rows if r.get("counted_equals_intercepted") is False]
    if any("counted_equals_intercepted" in r for r in rows):
        text += ("\nOur rows: Communicator's inter-node bytes == the torch.distributed wrappers' in every row"
                 if not bad else "\nCOUNTED != INTERCEPTED for: " + ", ".join(bad))
    lb = report.get("loadavg_1min_before_after")
    if lb:
        text += (f"\nLoad average (1 min) before/after: {lb[0]:.1f} / {lb[1]:.1f} on {report['versions'].get('cpus')} "
                 f"cores; total {report.get('wall_s', 0):.0f} s")
    print("\n" + text, flush=True)
    report.update(zeropp_over_zero3=ratio, analysis=ana, table=text)
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


if __name__ == "__main__":
    sys.exit(main())
