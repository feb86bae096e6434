"""Table renderers for bench.report: each takes the loaded JSON files of one figure (a list of
(name, data) pairs, in the registry's order) and returns Markdown table lines. Fixed number
formats and the files' own order keep the output deterministic, so tests/unit/bench/test_report.py can
compare the committed pages with a fresh render exactly."""

MB = 1e6
MIB = 2**20
MIB = 2 ** 20


def table(header, rows):
    """A Markdown table: header cells, then one line per row."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def f(x, digits=2, suffix=""):
    """A number in a fixed format, or a dash for a figure the JSON does not hold."""
    if x is None:
        return "-"
    text = f"{x:.{digits}f}"
    return (text.lstrip("-") if float(text) == 0 else text) + suffix


def pct(ratio, digits=2):
    """A ratio as its signed percentage difference from 1."""
    return "-" if ratio is None else f"{(ratio - 1) * 100:+.{digits}f}%"


def rate_name(mbit):
    return "unthrottled" if not mbit else (f"{mbit // 1000} Gbit/s" if mbit >= 1000 else f"{mbit} Mbit/s")


# --- Slow link -----------------------------------------------------------------------------

def slow_link(files, opts):
    """bench.slow_link: one row per (system, rate); x is samples/s over the file's first system
    at the same rate; veth and counted bytes are the cross-node bytes per step; `memory`: the peak
    RSS per rank beside the step."""
    rows = []
    for name, data in files:
        base = {}
        for r in data["results"]:
            base.setdefault(r["rate_mbit"], r)
        order = sorted({r["rate_mbit"] for r in data["results"]}, key=lambda m: (m == 0, m))
        for rate in order:
            for r in (r for r in data["results"] if r["rate_mbit"] == rate):
                x = r["samples_per_s"] / base[rate]["samples_per_s"]
                row = [r["label"], rate_name(rate), f(r["step_ms_median"], 0)]
                row += [f(r.get("peak_rss_mb"), 0)] if opts.get("memory") else []
                row += [f(r["samples_per_s"]), f(x, 2, "x"), f(r.get("link_bytes_per_step", 0) / MB),
                       f((r.get("counted_inter_bytes_per_step") or 0) / MB),
                       f(r.get("step_over_bound")), f(r.get("exposed_ms"), 0)]
                rows.append(([opts.get("runs", {}).get(name, name)] if len(files) > 1 else []) + row)
    head = ["system", "rate", "step ms", *(["peak RSS MB/rank"] if opts.get("memory") else []), "samples/s",
            "x first system", "veth MB/step", "counted MB/step", "step/bound", "exposed ms"]
    return table((["run"] if len(files) > 1 else []) + head, rows)


def slow_link_diloco(files, opts):
    """bench.slow_link diloco: samples/s (window mean) per system and rate, and the speed-up at
    the lowest rate over the baseline row named in the registry."""
    rows = []
    for name, data in files:
        res = data["results"]
        rates = sorted({r["rate_mbit"] for r in res}, key=lambda m: (m == 0, m))
        low = rates[0]
        sps = {(r["label"], r["rate_mbit"]): r.get("samples_per_s_window", r["samples_per_s"]) for r in res}
        base = sps.get((opts["baseline"], low))
        veth = {r["label"]: r["link_bytes_per_step"] for r in res if r["rate_mbit"] == low}
        first = veth[res[0]["label"]]
        for label in dict.fromkeys(r["label"] for r in res):
            cells = " / ".join(f(sps.get((label, m)), 1) for m in rates)
            rows.append([opts.get("runs", {}).get(name, name), label, cells,
                         f(sps[(label, low)] / base, 2, "x") if base else "-", f(veth[label] / MB, 3),
                         f(veth[label] / first, 4)])
    rates = " / ".join(rate_name(m) for m in rates)
    return table(["run", "system", f"samples/s at {rates}", f"x {opts['baseline']} (lowest rate)",
                  "veth MB/step (lowest rate)", "/ first system's"], rows)


def planner_calibration(files, opts):
    """bench.slow_link planner: predicted / measured step ms per (system, dtype) and rate."""
    (_, data), = files
    rates = sorted({r["rate_mbit"] for r in data["rows"]})
    cells = {}
    for r in data["rows"]:
        cells.setdefault((r["label"], r["dtype"]), {})[r["rate_mbit"]] = r
    rows = [[label, dtype] + [f"{f(c[m]['predicted_ms'], 0)} / {f(c[m]['measured_ms'], 0)} "
                              f"({c[m]['error'] * 100:+.0f}%)" if m in c else "-" for m in rates]
            for (label, dtype), c in cells.items()]
    return table(["system", "dtype"] + [rate_name(m) for m in rates], rows)


# --- Convergence ---------------------------------------------------------------------------

def convergence(files, opts):
    """bench.convergence: each run's final validation loss against the file's first run (the
    baseline), and its cross-node MB per iteration."""
    rows = []
    for name, data in files:
        runs = list(data["summary"].items())
        base_name, base = runs[0]
        seed = data["setup"].get("seed", "-")
        for run, s in runs[1:]:
            run = opts.get("labels", {}).get(name, {}).get(run, run)
            bb = base.get("inter_node_mb_per_iter")
            b = s.get("inter_node_mb_per_iter")
            row = [opts.get("runs", {}).get(name, name), seed, run, base_name, f(s["final_validation_loss"], 4),
                   f(base["final_validation_loss"], 4), pct(s["final_validation_loss"] / base["final_validation_loss"])]
            rows.append(row + ([f(b, 3), f(bb, 3), f(b / bb, 3) if bb else "-"] if opts.get("bytes", True) else []))
    head = ["experiment", "seed", "run", "baseline", "val loss", "baseline val loss", "vs baseline"]
    return table(head + (["cross-node MB/iter", "baseline MB/iter", "bytes ratio"] if opts.get("bytes", True) else []),
                 rows)


# --- Memory --------------------------------------------------------------------------------

def train_memory(files, opts):
    """bench.memory train: train.py's rank-0 rise and where every MB of it goes."""
    rows = []
    for name, data in files:
        for config, r in data["rows"].items():
            p = r["large"]["pools_mb"]
            rows.append([config, f(r["rise_rank0_mb"], 0), f(r["fp32_model_mb"], 0),
                         f(r["rise_over_fp32_model"]), f(r["large"]["model_states_mb"], 0),
                         f(sum(p.values()), 0), f(r["activations_mb"], 0), f(r["gloo_staging_mb"], 0),
                         f(r["unaccounted_mb"], 0)])
    return table(["run", "rank 0 rise MB", "fp32 model MB", "rise / model", "model states MB", "pools MB",
                  "activations MB", "gloo staging MB", "unaccounted MB"], rows)


def memory_bound(files, opts):
    """bench.memory bound: the worst rank's peak RSS rise against its budget (model states
    + the pools' bounds + activations) and whether every pool stayed within its bound."""
    rows = []
    for name, data in files:
        for system, s in data["systems"].items():
            w = max(s["ranks"], key=lambda r: r["judge"]["ratio"])
            j = w["judge"]
            rows.append(([name] if len(files) > 1 else []) + [system, f(w["rise_bytes"] / MB, 0), f(w["model_states_bytes"] / MB, 0),
                         f(w["bounds_bytes"] / MB, 0), f(j["activation_bytes"] / MB, 0), f(j["budget_bytes"] / MB, 0),
                         f(j["ratio"], 3), "yes" if j["rss_pass"] and j["buffers_pass"] else "no"])
    return table((["file"] if len(files) > 1 else []) + ["system", "peak rise MB (worst rank)", "model states MB", "bounds MB", "activations MB",
                  "budget MB", "rise / budget", "pools within bound, rise within limit"], rows)


def memory_matrix(files, opts):
    """bench.memory matrix: every (dtype, optimizer, system, budget) cell's RSS against its
    budget and whether every pool stayed within its bound."""
    rows = []
    for name, data in files:
        for r in data["rows"]:
            pools = r.get("pools", {})
            rows.append([name, r["dtype"], r["optimizer"], r["system"], r["budget"], f(r["rise_bytes"] / MB, 0),
                         f(r["budget_bytes"] / MB, 0), f(r["ratio"], 3),
                         "yes" if r.get("rss_pass") else "no", f"{sum(p['within'] for p in pools.values())} of {len(pools)}"])
    return table(["file", "dtype", "optimizer", "system", "budget", "rise MB", "budget MB", "rise / budget",
                  "within limit", "pools within bound"], rows)



def checkpoint_memory(files, opts):
    """bench.memory large --checkpoint: the worst rank's peak RSS rise during a sharded save and a
    load, against what the rank keeps of the state and the whole fp32 state (MiB: RSS is in KiB)."""
    rows = []
    for name, data in files:
        a, ck = data["args"], data["checkpoint"]
        save = max(r["save_peak_increase_mb"] for r in ck["ranks"])
        load = max(r["load_peak_increase_mb"] for r in ck["ranks"])
        seconds = [max(r[k] for r in ck["ranks"]) for k in ("save_s", "load_s")]
        rows.append([a.get("sharding", "zero"), a["dtype"], a["optimizer"], f(data["num_parameters"] / 1e6, 1),
                     a["world"], f(ck["expected_bytes_per_rank"] / MIB, 0), f(save, 0), f(load, 0),
                     f(ck["moments_created_by_load_bytes_per_rank"] / MIB, 0),
                     f(ck["full_model_and_moments_fp32_bytes"] / MIB, 0), f(seconds[0], 1), f(seconds[1], 1),
                     "yes" if ck["round_trip_exact_all_ranks"] else "no"])
    return table(["engine", "dtype", "optimizer", "M params", "ranks", "rank's share MiB", "save peak rise MiB",
                  "load peak rise MiB", "moments the load creates MiB", "whole fp32 state MiB", "save s", "load s",
                  "exact round trip"], rows)


# --- Faults --------------------------------------------------------------------------------

def cells_passed(tree):
    """(ok, total) over a nested dict whose leaves are {"ok": bool, ...} cells."""
    if isinstance(tree, dict) and "ok" in tree:
        return int(bool(tree["ok"])), 1
    ok = total = 0
    for v in (tree.values() if isinstance(tree, dict) else []):
        a, b = cells_passed(v)
        ok, total = ok + a, total + b
    return ok, total


def fault_matrix(files, opts):
    """scenarios.fault_matrix: cells passed per mode and layout."""
    (_, data), = files
    rows = [["engine", layout, *cells_passed(cells)] for layout, cells in data["layouts"].items()]
    for mode, layouts in data.get("modes", {}).items():
        rows += [[mode, layout, *cells_passed(cells)] for layout, cells in layouts.items()]
    ok, total = cells_passed({"l": data["layouts"], "m": data.get("modes", {})})
    rows.append(["all", "", ok, total])
    return table(["mode", "layout", "cells passed", "cells"], rows)


def groups_job(files, opts):
    """scenarios.groups_job: each fault-tolerant-groups cell's outcome and time."""
    (_, data), = files
    rows = [[cell, "PASS" if c["ok"] else f"FAIL: {c['why']}", f(c["seconds"], 0)]
            for cell, c in data["cells"].items()]
    return table(["cell", "result", "seconds"], rows)


def groups_goodput(files, opts):
    """bench.groups: the fast groups' rate beside a throttled group, and under the punisher each
    group's useful compute time, the run's tokens per second and the final loss at equal tokens;
    each family with the command and load that gave it."""
    (_, data), = files
    out = []
    if "straggler" in data:
        st = data["straggler"]
        rows = [[mode, f(min(r["calm"]["groups"][g]["rate_it_per_s"] for g in ("0", "1"))),
                 f(min(r["slow"]["groups"][g]["rate_it_per_s"] for g in ("0", "1"))), f(r["ratio"]),
                 f(st["limits"]["rate"], 1), f(r["straggler_weight"], 3)]
                for mode, r in st.items() if mode not in ("limits", "provenance")]
        out += ["Groups 0 and 1 beside group 2 throttled (its inner steps 5 times as long), iterations per second:", ""]
        out += table(["mode", "undisturbed", "with the straggler", "ratio", "limit", "straggler's mean weight"], rows)
        out += ["", f"(`{st['provenance']['command']}`, load {st['provenance']['machine']['loadavg_1min']:.1f})", ""]
    if "punisher" in data:
        pu = data["punisher"]
        rows = [[run, *(f(r["useful_fraction"][g], 3) for g in ("0", "1", "2")), f(pu["limits"]["useful"], 1),
                 f(r["tokens_per_s"]["processed"], 0), f(r["tokens_per_s"]["useful"], 0), f(r["final_loss"], 4),
                 f(r["undisturbed_equal_tokens_loss"], 4), pct(r["loss_ratio"]), len(r["run"]["kills"])]
                for run, r in pu["rows"].items()]
        out += ["Random kills (one group's launcher every ~90 s, restarted from its checkpoint), group 2 twice as "
                "slow: useful compute time / live time per group, tokens per second, final loss against the "
                "undisturbed synchronous run at equal tokens (limit 2%):", ""]
        out += table(["run", "group 0", "group 1", "group 2 (slow)", "limit", "tokens/s", "useful tokens/s",
                      "final loss", "undisturbed", "difference", "kills"], rows)
        out += ["", f"(`{pu['provenance']['command']}`, load {pu['provenance']['machine']['loadavg_1min']:.1f})"]
    return out


# --- Communication -------------------------------------------------------------------------

def zeropp_comm(files, opts):
    """bench.comm: cross-node MiB per iteration per rank by phase, theory in brackets."""
    (_, data), = files
    out = []
    for res in data["results"]:
        out += [f"{res['world'] // res['ranks_per_node']} nodes x {res['ranks_per_node']} ranks, {res['dtype']}:", ""]
        rows = []
        for r in res["rows"]:
            ph = r["by_phase_inter_bytes"]
            th = r.get("theory_ratio_by_phase", {})
            plain = r.get("plain_inter_bytes") or 1
            zero3 = res["rows"][0]["by_phase_inter_bytes"]
            cell = [f(ph[k] / MIB, 3) + (f" [{f(th[k] * zero3[k] / MIB, 3)}]" if th.get(k) not in (1, None) else "")
                    for k in ("forward_gather", "backward_gather", "grad_reduce")]
            rows.append([r["system"], *cell, f(r["inter_bytes"] / MIB, 3), f(r["inter_bytes"] / plain, 3)])
        out += table(["", "forward gather", "backward gather", "gradients", "cross-node total", "/ ZeRO-3"], rows)
        out.append("")
    return out[:-1]


def fsdp2_time_split(files, opts):
    """bench.slow_link split: where each system's step goes on CPU ranks, ms per rank and step."""
    (_, data), = files
    rows = [[s["label"], f(s["step_ms"], 0), f(s["cpu_ms"], 0), f(s["blocked_ms"], 0),
             f(sum(s["in_call_ms"].values()), 0), f(sum(s["wait_ms"].values()), 0),
             f(sum(s["calls_per_step_rank0"].values()), 0)] for s in data["systems"].values()]
    return table(["system", "step ms", "CPU ms", "blocked ms", "inside collectives ms", "waiting on handles ms",
                  "collectives per step"], rows)


# --- Kernels -------------------------------------------------------------------------------

def quant_bench(files, opts):
    """bench.kernels quant: GB/s of input bytes per dtype, bits and backend, next to copy_."""
    rows = []
    for name, data in files:
        for r in data["rows"]:
            rows.append([data.get("device_name", name), r["dtype"], r["bits"], r["backend"], f(r["copy_GBps"], 1),
                         f(r["quantize_GBps"], 1), f(r["dequantize_GBps"], 1), f(r.get("fused_GBps"), 1)])
    return table(["device", "dtype", "bits", "backend", "copy GB/s", "quantize GB/s", "dequantize GB/s",
                  "fused 4-part INT4 GB/s"], rows)


def hadamard_cost(files, opts):
    """bench.kernels hadamard: ms per transform against an INT4 quantization, per thread count."""
    (_, data), = files
    rows = [[threads.split("_")[0], f(m["hadamard_forward"], 3), f(m["hadamard_inverse"], 3), f(m["quantize_int4"], 3),
             f(m["dequantize_int4"], 3), f(m["forward_over_quantize"])] for threads, m in data["ms"].items()]
    return table(["threads", "forward ms", "inverse ms", "INT4 quantize ms", "INT4 dequantize ms",
                  "forward / quantize"], rows)


def quant_host_cost(files, opts):
    """bench.kernels host-cost (a diagnostic): median step ms with the quantizers as they are and as no-ops."""
    rows = []
    for name, data in files:
        real, noop = data["median_step_ms"]["real"], data["median_step_ms"]["no_op"]
        rows += [[data["args"]["dtype"], system, f(real[system], 1), f(noop[system], 1),
                  f(real["zero3-reuse0"] / real[system], 2, "x"), f(noop["zero3-reuse0"] / noop[system], 2, "x")]
                 for system in real]
    return table(["dtype", "system", "step ms", "step ms, no-op quantizers", "x ZeRO-3 (reuse 0)",
                  "x ZeRO-3 (reuse 0), no-ops"], rows)


RENDERERS = {fn.__name__: fn for fn in (fsdp2_time_split, quant_host_cost, slow_link, slow_link_diloco, planner_calibration, convergence,
                                        train_memory, memory_bound, memory_matrix, checkpoint_memory, fault_matrix, groups_job, groups_goodput,
                                        zeropp_comm, quant_bench, hadamard_cost)}
