"""The slow-link sweep's moving parts (bench/slow_link.py drives them): one
system run at every link rate by a pair of torchruns, one per namespace
(bench/slow_link_worker.py), cut into segments, summarized per (system, rate),
and the no-overlap model fitted to the results."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.netns import ADDR, IF, NS, RANKS_PER_NODE, link_counters, qdisc_stats, set_rate, start_tracked, stop


def run_system(system: str, rates: list[int], a: dict, port: int, setup_timeout: float, rate_timeout: float,
               logdir: Path, on_rate=None) -> list[dict]:
    """One dict per rate: the ranks' results, or "error"."""
    from bench.system_catalog import DEEPSPEED
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
                "--max-restarts", "0", "--module", "bench.slow_link_worker",
                "--system", system, "--config", json.dumps(a), "--rates", ",".join(map(str, rates)),
                "--out-dir", str(out_dir), "--ifname", ifname, "--handshake-timeout", str(rate_timeout)])
        log = open(out_dir / f"{ns}.log", "w")
        logs.append(log)
        p = start_tracked(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
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
            stop(p)
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
    w = a["warmup"]
    n = len(pr[0]["step_times_s"]) - w   # a["steps"], or a["steps_at"] for this rate
    # The link: node A's local rank 0 read vA, node B's read vB (tx of one end = rx of the other).
    heads = [x for x in pr if x["local_rank"] == 0]
    a_end = next(x for x in heads if x["ifname"] == IF[0])
    b_end = next(x for x in heads if x["ifname"] == IF[1])
    la, lb = a_end["link"], b_end["link"]
    d = lambda l, k: l["end"][k] - l["start"][k]
    cal = a_end["calib"]
    window = la["end"]["t"] - la["start"]["t"]
    tx_a, tx_b = d(la, "tx_bytes"), d(lb, "tx_bytes")
    # In the window besides the steps: 1 + n + 1 barriers (hook, the per-step one, hook; the
    # per-step one stays inside a node for DiLoCo's groups: bench/zero_systems.py) and whatever
    # flows while idle (nothing, normally; measured for 0.5 s).
    crossing = 2 + (0 if pr[0].get("step_barrier") == "group" else n)
    return {"n": n, "times": pr[0]["step_times_s"][w:],  # each step: its slowest rank
            "all_times": pr[0]["step_times_s"], "losses": pr[0]["losses"],
            "tx_a": tx_a, "tx_b": tx_b, "rx_a": d(la, "rx_bytes"), "rx_b": d(lb, "rx_bytes"),
            "window": window, "barrier": cal["barrier_bytes"], "idle": cal["idle_bytes_per_s"],
            "overhead": crossing * cal["barrier_bytes"] + cal["idle_bytes_per_s"] * window,
            "intercepted": sum(x["intercepted"]["inter_bytes"] for x in pr),
            "intercepted_calls_rank0": pr[0]["intercepted"]["calls"],
            "intercepted_by_op_rank0": pr[0]["intercepted"]["by_op"],
            "counted": (sum(x["counted"]["inter_bytes"] for x in pr) if pr[0].get("counted") else None),
            "counted_source": pr[0].get("counted_source"),
            "counted_by_phase": ({k: sum(x["counted"]["inter_by_phase"].get(k, 0) for x in pr)
                                  for k in sorted({k for x in pr for k in x["counted"]["inter_by_phase"]})}
                                 if pr[0].get("counted") else None),
            "counted_calls_rank0": pr[0]["counted"]["calls"] if pr[0].get("counted") else None,
            "issued": (sum(x["counted"]["issued_inter_bytes"] for x in pr) if pr[0].get("counted") else None),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in pr), "build_s": max(x["build_s"] for x in pr),
            "loadavg": pr[0]["loadavg"], "whole_rate_link_bytes": run["whole_rate_link_bytes"],
            "auto": pr[0].get("auto"), "waits": [x.get("wait_seconds") for x in pr],
            "qdisc": run["qdisc"], "wall_s": run["wall_s"]}


def summarize(system, rate, runs, a):
    """One row: the segments run at `rate` pooled (their timed steps together)."""
    from bench.system_catalog import LABELS
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
               step_ms_mean=1000 * statistics.mean(times),
               # over the timed windows' wall time: with the per-step barriers, and an exchange that
               # overlaps steps (DiLoCo) wherever it delays them
               samples_per_s_window=world * a["micro_batch"] * n / sum(sg["window"] for sg in segs),
               tokens_per_s=world * a["micro_batch"] * a["seq"] / med,
               loss_first=segs[0]["losses"][0], losses=[sg["losses"] for sg in segs],
               peak_rss_mb=max(sg["peak_rss_mb"] for sg in segs),
               link_bytes_per_step_raw=raw / n, link_bytes_per_step=(raw - tot("overhead")) / n,
               link_tx_per_step={"A->B": tot("tx_a") / n, "B->A": tot("tx_b") / n},
               # the busier direction, barriers and idle traffic taken out (half of them each way)
               link_busier_bytes_per_step=(max(tot("tx_a"), tot("tx_b")) - tot("overhead") / 2) / n,
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
    if segs[0]["counted_source"] == "Communicator" and segs[0]["counted"] is not None:   # ours, FSDP2 + plug-in
        row["counted_inter_bytes_per_step"] = tot("counted") / n
        row["counted_inter_by_phase_per_step"] = {k: v / segs[0]["n"] for k, v in segs[0]["counted_by_phase"].items()}
        row["counted_calls_per_step_rank0"] = tot("counted_calls_rank0") / n
        row["counted_source"] = "Communicator"
        # as issued to torch.distributed: on gloo ZeRO-3's reduce-scatter goes as an all-to-all
        row["issued_inter_bytes_per_step"] = tot("issued") / n
    else:
        row["counted_inter_bytes_per_step"] = row["intercepted_inter_bytes_per_step"]
        row["counted_source"] = "torch.distributed wrappers"
    if any(sg["auto"] for sg in segs):  # what planner.auto chose in each segment, and why
        row["auto"] = [sg["auto"] for sg in segs]
    waits = [(sg["waits"], sg["n"]) for sg in segs if all(w is not None for w in sg["waits"])]
    if waits:  # --profile: ms per step blocked in Work.wait(), by phase, mean and max over ranks
        phases = sorted({k for ws, _ in waits for w in ws for k in w})
        steps = sum(m for _, m in waits)
        per_rank = [[sum(ws[r].get(k, 0.0) for ws, _ in waits) * 1000 / steps for r in range(len(waits[0][0]))]
                    for k in phases]
        row["wait_ms_per_step_by_phase"] = {k: {"mean": sum(v) / len(v), "max": max(v)}
                                            for k, v in zip(phases, per_rank)}
    c = row["counted_inter_bytes_per_step"]
    row["veth_over_counted"] = row["link_bytes_per_step"] / c if c else None
    if row["counted_source"] == "Communicator":  # no collective bypassed or was miscounted
        row["counted_equals_intercepted"] = abs(row["issued_inter_bytes_per_step"]
                                                - row["intercepted_inter_bytes_per_step"]) < 1
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
