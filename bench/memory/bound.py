"""Bounded memory, measured: per rank, the peak RSS rise over training steps against model states
+ every configured buffer bound + activations + gloo's staging copies, for ZeRO-3 and ZeRO++, in
one precision, optimizer and budget (`python -m bench.memory bound`) or in every one
(`python -m bench.memory matrix`). Each system runs in freshly spawned --world ranks (emulated
nodes of --ranks-per-node), stage 3 with --bucket for reduce and prefetch, reuse distance 0:

- rise = peak RSS over the steps (VmHWM, reset before each step) minus the RSS before the model
  was built (torch, gloo: the process, no model);
- model states = memory_report(engine)["measured_bytes"]["total"] (hpZ's secondary copy included);
- bounds = every `<name>_bound` of engine.peak_buffers(), each beside its `<name>_peak`; a peak
  above its bound, or a peak without one, FAILs;
- activations = the peak RSS rise of one forward + backward of the same model unsharded at world
  size 1, each gradient dropped as autograd accumulates it (the planner's saved-activation bytes
  beside it);
- gloo staging = the RSS rise of the largest reduce-scatter and all-gather buckets in flight
  together: gloo's own full-size copies, which NCCL does not make and no engine pool holds;
- PASS when rise <= RSS_LIMIT x (states + bounds + activations + gloo staging); ZeRO++ over
  ZeRO-3, rank by rank: the excess at most hpZ's secondary copy (+ the error feedback's and
  the weight deltas' state) + ZEROPP_SLACK of ZeRO-3's rise.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import threading
import time

import torch

import zeropp
from scenarios.harness.jobs import listed
from model import GPT, GPTConfig, num_parameters
from parallel.comm import Communicator
from scenarios.harness.spawn import run_distributed
from parallel.topology import topology_from_env
from zeropp.memory import AllocationTrace, memory_report

RSS_LIMIT = 1.15       # peak rise / (states + bounds + activations + gloo staging)
ZEROPP_SLACK = 0.10    # ZeRO++ rise <= ZeRO-3 rise + hpZ secondary + new state + this x ZeRO-3 rise
NAMES = {"zero3": "ZeRO-3", "zeropp": "ZeRO++ (qwZ + hpZ + qgZ)", "zeropp-deltas": "ZeRO++ + INT4 weight deltas",
         "zeropp-all": "ZeRO++ + LoCo + INT4 weight deltas"}
BEYOND = {"zeropp-deltas": ("deltas",), "zeropp-all": ("loco", "deltas")}
# (reduce and prefetch bucket, stage3_max_live_parameters) in elements; "flags": --bucket, --max-live
BUDGETS = {"small": (30_000_000, 30_000_000), "default": (30_000_000, 150_000_000)}
MB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_split() -> list[float]:
    """[RssAnon, RssFile, RssShmem] in MB: anonymous memory vs mapped files (libraries' code pages)."""
    return [rss_mb("RssAnon"), rss_mb("RssFile"), rss_mb("RssShmem")]


class PeakRSS:
    """Peak VmRSS (MB) between start() and stop(): VmHWM after resetting it
    (write "5" to /proc/self/clear_refs), or, where the reset does not work,
    VmRSS sampled every 10 ms in a thread."""

    def start(self):
        self.base = rss_mb("VmRSS")
        self.sampled = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            ok = rss_mb("VmHWM") <= rss_mb("VmRSS") + 1
        except OSError:
            ok = False
        if not ok:
            self.sampled, self.done = self.base, threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        self.method = "VmHWM reset" if ok else "VmRSS sampled every 10 ms"
        return self

    def _sample(self):
        while not self.done.wait(0.01):
            self.sampled = max(self.sampled, rss_mb("VmRSS"))

    def stop(self) -> float:
        if self.sampled is None:
            return rss_mb("VmHWM")
        self.done.set()
        self.thread.join()
        return max(self.sampled, rss_mb("VmRSS"))


def model_config(a) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, num_layers=a.num_layers, hidden_size=a.hidden,
                     num_attention_heads=a.heads, max_position_embeddings=a.seq,
                     hidden_dropout=0.0, attention_dropout=0.0,
                     checkpoint_activations=a.checkpoint_activations)


def ds_config(a, zeropp_on: bool, beyond: tuple = ()) -> zeropp.DeepSpeedConfig:
    """Stage 3 with --bucket, --max-live, reuse distance 0; ZeRO++ adds all three techniques,
    `beyond` "deltas" (INT4 weight deltas) and "loco" (qgZ's error feedback) on top."""
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": a.bucket,
                                 "stage3_prefetch_bucket_size": a.bucket,
                                 "stage3_max_live_parameters": a.max_live,
                                 "stage3_max_reuse_distance": 0, "overlap_comm": a.overlap}}
    if getattr(a, "sharding", "zero") == "fsdp2":   # FSDP2 gathers and reduces a unit at a time: no budgets
        raw["zero_optimization"] = {"stage": 3}
    if zeropp_on:  # qwZ, hpZ over each emulated node, qgZ
        raw["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True,
                                        zero_hpz_partition_size=a.ranks_per_node)
    if "deltas" in beyond:
        raw["zero_optimization"]["zero_quantized_weight_deltas"] = True
    if "loco" in beyond:
        raw["zero_optimization"]["zeropp_loco_param"] = {}
    if a.dtype != "fp32":
        raw[a.dtype] = {"enabled": True}
    return zeropp.DeepSpeedConfig.from_dict(raw)


def _tokens(a, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)


def activation_probe(rank, world, a) -> dict:
    """Peak RSS rise of one forward+backward at world size 1, weights resident,
    each gradient dropped as it is accumulated (see the module docstring)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # freed blocks go back to the kernel
    cfg = model_config(a)
    model = GPT(cfg).to(DTYPES[a.dtype]).train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    rises = []
    for i in range(3):   # the first one warms up (kernels, allocator)
        x = _tokens(a, 0, i)
        gc.collect()
        before = rss_mb("VmRSS")
        probe = PeakRSS().start()
        model(x[:, :-1], x[:, 1:]).backward()
        rises.append(probe.stop() - before)
    from planner.trace import trace_model
    saved = trace_model(cfg, DTYPES[a.dtype], a.micro_batch, a.seq, 0).activation_bytes(a.checkpoint_activations)
    return {"activation_bytes": int(max(rises[1:]) * MB), "rises_mb": rises, "method": probe.method,
            "planner_saved_activation_bytes": int(saved)}


def staging_probe(engine) -> int:
    """gloo's own copies, beside the engine's pools: on CPU a reduce_scatter_tensor or an
    all_gather_into_tensor stages its whole [N, total] buffer (NCCL does not). Measured: the
    RSS rise of the largest gradient bucket's reduce-scatter and an exact all-gather of the
    largest gather bucket, in flight together as in backward (on every rank at once)."""
    import torch.distributed as dist
    n, r, zero = engine.world, engine.reducer, engine.zero
    grad = max(b.total for b in r.buckets) * n
    gather = -(-min(zero.stage3_prefetch_bucket_size, sum(s.numel for s in engine.shards)) // n) * n
    rows, out = torch.ones(grad, dtype=r.comm_dtype), torch.ones(grad // n, dtype=r.comm_dtype)
    full, part = torch.ones(gather, dtype=engine.dtype), torch.ones(gather // n, dtype=engine.dtype)
    gc.collect()
    before, probe = rss_mb("VmRSS"), PeakRSS().start()
    works = [dist.reduce_scatter_tensor(out, rows, async_op=True),
             dist.all_gather_into_tensor(full, part, async_op=True)]
    for w in works:
        w.wait()
    return int(max(0.0, probe.stop() - before) * MB)


def bound_rank(rank, world, a, system: str) -> dict:
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    cfg, ds = model_config(a), ds_config(a, system != "zero3", beyond=BEYOND.get(system, ()))
    comm = Communicator(topology_from_env(a.ranks_per_node))
    gc.collect()
    base, base_split = rss_mb("VmRSS"), rss_split()
    with torch.device("meta"):
        model = GPT(cfg)
    optim = zeropp.OptimizerSettings(type=a.optimizer, lr=1e-4, momentum=0.0)
    engine = zeropp.initialize(model, ds, comm, torch.device("cpu"), optim, param_init=model.init_parameter)
    gc.collect()
    before_steps = rss_mb("VmRSS")
    step_peaks, step_s, losses, report, traced = [], [], [], None, None
    for i in range(a.steps):
        x = _tokens(a, rank, i)
        last = i == a.steps - 1
        trace = AllocationTrace() if last and a.trace_allocations else contextlib.nullcontext()
        probe = PeakRSS().start()
        t = time.time()
        with trace:
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            if last:   # model states exist in full between backward and step
                report = memory_report(engine)
            engine.step()
        step_s.append(time.time() - t)
        step_peaks.append(probe.stop())
        losses.append(loss.item())
        if last and a.trace_allocations:
            traced = {"peak_bytes": trace.peak_bytes, "at_peak": trace.at_peak[:25]}
    # After the step: the optimizer's moments exist (the first step creates them), and the
    # peaks include the last step's optimizer step; each category at its larger measurement.
    after = memory_report(engine)
    report["measured_bytes"] = {k: max(v, after["measured_bytes"][k]) for k, v in report["measured_bytes"].items()}
    report["measured_bytes"]["total"] = sum(v for k, v in report["measured_bytes"].items() if k != "total")
    for k in ("peaks", "buffers", "buffer_bounds_bytes"):
        report[k] = after[k]
    peak = max(step_peaks)
    staging = staging_probe(engine)
    states = report["measured_bytes"]["total"]
    bounds = report["buffer_bounds_bytes"]
    return {"rank": rank, "base_rss_mb": base, "base_rss_anon_file_shmem_mb": base_split,
            "rss_before_steps_mb": before_steps, "step_peak_rss_mb": step_peaks, "peak_rss_mb": peak,
            "end_rss_anon_file_shmem_mb": rss_split(), "rise_bytes": int((peak - base) * MB),
            "rise_over_before_steps_bytes": int((peak - before_steps) * MB), "model_states_bytes": states,
            "bounds_bytes": bounds, "gloo_staging_bytes": staging, "hpz_secondary_bytes": report["hpz_secondary_bytes"],
            "new_state_bytes": report["error_feedback_bytes"] + report["weight_deltas_bytes"],
            "losses": losses, "step_s": step_s, "peak_method": probe.method, "memory_report": report,
            "allocations": traced}


def judge(r: dict, act: int) -> dict:
    budget = r["model_states_bytes"] + r["bounds_bytes"] + act + r["gloo_staging_bytes"]
    ratio = r["rise_bytes"] / budget
    return {"activation_bytes": act, "budget_bytes": budget, "ratio": ratio, "rss_pass": ratio <= RSS_LIMIT,
            "buffers_pass": all(b["within"] for b in r["memory_report"]["buffers"].values())}


def cell(ranks: list[dict], act: int) -> dict:
    """One row: the worst rank's ratio, each pool's worst peak / bound over the ranks, and every rank."""
    for r in ranks:
        r["judge"] = judge(r, act)
    worst = max(ranks, key=lambda r: r["judge"]["ratio"])
    pools = {}
    for r in ranks:
        for name, b in r["memory_report"]["buffers"].items():
            frac = (b["peak"] or 0) / b["bound"] if b["bound"] else float("inf")
            if name not in pools or frac > pools[name]["peak_over_bound"]:
                pools[name] = {**b, "peak_over_bound": frac}
    keep = ("rank", "base_rss_mb", "rss_before_steps_mb", "peak_rss_mb", "rise_bytes", "rise_over_before_steps_bytes",
            "model_states_bytes", "bounds_bytes", "gloo_staging_bytes", "hpz_secondary_bytes", "new_state_bytes",
            "step_s", "losses")
    return {"rise_bytes": worst["rise_bytes"], "budget_bytes": worst["judge"]["budget_bytes"],
            "states_bytes": worst["model_states_bytes"], "bounds_bytes": worst["bounds_bytes"],
            "gloo_staging_bytes": worst["gloo_staging_bytes"], "activation_bytes": act,
            "ratio": worst["judge"]["ratio"], "limit": RSS_LIMIT, "rss_pass": all(r["judge"]["rss_pass"] for r in ranks),
            "pools": pools, "pools_pass": all(r["judge"]["buffers_pass"] for r in ranks),
            "ranks": [{k: r[k] for k in keep} | {"ratio": r["judge"]["ratio"]} for r in ranks],
            "allocations": ranks[0]["allocations"]}


def print_ranks(name: str, row: dict):
    """Every rank of a cell: its rise against its budget, and rank 0's tensors alive at its peak."""
    print(f"{name}: per rank (MB), limit {RSS_LIMIT:.2f} x budget (states + bounds + activations + gloo)")
    print(f"{'rank':>4} {'base':>6} {'peak':>6} {'rise':>6} {'step rise':>10} {'states':>6} {'hpZ':>5} {'bounds':>6} "
          f"{'gloo':>5} {'ratio':>6} {'limit':>5}")
    for r in row["ranks"]:
        print(f"{r['rank']:>4} {r['base_rss_mb']:>6.0f} {r['peak_rss_mb']:>6.0f} {r['rise_bytes'] / MB:>6.0f} "
              f"{r['rise_over_before_steps_bytes'] / MB:>10.0f} {r['model_states_bytes'] / MB:>6.0f} "
              f"{r['hpz_secondary_bytes'] / MB:>5.0f} {r['bounds_bytes'] / MB:>6.0f} "
              f"{r['gloo_staging_bytes'] / MB:>5.0f} {r['ratio']:>6.3f} {RSS_LIMIT:>5.2f}")
    t = row["allocations"]
    if t:
        print(f"rank 0, last step: tensors peaked at {t['peak_bytes'] / MB:.0f} MB above the step's start; "
              f"alive then, by site (function def line [op]):")
        for site, nbytes, count in t["at_peak"][:15]:
            print(f"  {nbytes / MB:>8.1f} MB {count:>4} x  {site}")


def print_row(row: dict):
    pools = "  ".join(f"{n} {p['peak'] / MB:.0f}/{p['bound'] / MB:.0f}" + ("" if p["within"] else "!")
                      for n, p in sorted(row["pools"].items()) if p["peak"] is not None and p["bound"])
    print(f"{row['dtype']:<5} {row['optimizer']:<6} {row['system']:<13} {row['budget']:<8} "
          f"{row['rise_bytes'] / MB:>7.0f} {row['activation_bytes'] / MB:>5.0f} {row['gloo_staging_bytes'] / MB:>5.0f} "
          f"{row['budget_bytes'] / MB:>7.0f} {row['ratio']:>6.3f} {row['limit']:>5.2f} "
          f"{'PASS' if row['rss_pass'] and row['pools_pass'] else 'FAIL':>4}  {pools}", flush=True)


def over_zero3(zero3: dict, other: dict) -> dict:
    """ZeRO++'s rise over ZeRO-3's, rank by rank, against its limit."""
    ranks = []
    for a, b in zip(zero3["ranks"], other["ranks"]):
        excess = b["rise_bytes"] - a["rise_bytes"]
        limit = b["hpz_secondary_bytes"] + b["new_state_bytes"] + ZEROPP_SLACK * a["rise_bytes"]
        ranks.append({"rank": a["rank"], "excess_bytes": excess, "limit_bytes": int(limit), "pass": excess <= limit})
    worst = max(ranks, key=lambda r: r["excess_bytes"] - r["limit_bytes"])
    print(f"  {other['system']} over zero3: worst excess {worst['excess_bytes'] / MB:.0f} MB against its limit "
          f"{worst['limit_bytes'] / MB:.0f} MB (hpZ secondary + new state + {ZEROPP_SLACK:.0%} of ZeRO-3's rise): "
          f"{'PASS' if all(r['pass'] for r in ranks) else 'FAIL'}")
    return {k: other[k] for k in ("dtype", "optimizer", "budget", "system")} | {
        "ranks": ranks, "pass": all(r["pass"] for r in ranks)}


def run(a, detail: bool) -> dict:
    """Every --dtypes x --optimizers x --budgets x --systems cell, a row each (with `detail`, every rank)."""
    budgets = {**BUDGETS, "flags": (a.bucket, a.max_live)}
    dtypes, optimizers = listed(a.dtypes, DTYPES, "--dtypes"), listed(a.optimizers, ("adamw", "sgd"), "--optimizers")
    systems, names = listed(a.systems, NAMES, "--systems"), listed(a.budgets, budgets, "--budgets")
    psi = num_parameters(model_config(a))
    print(f"GPT {a.num_layers} x {a.hidden}, vocab {a.vocab}, seq {a.seq}, micro-batch {a.micro_batch}: "
          f"{psi / 1e6:.0f} M parameters; {a.world} ranks ({a.ranks_per_node} a node), {a.steps} step(s); budgets "
          + ", ".join(f"{k} {budgets[k][0]:.3g}/{budgets[k][1]:.3g} ({budgets[k][0] / psi:.3f} of the model)"
                      for k in names))
    print("rise, activations, gloo staging, budget (states + bounds + activations + gloo): MB, worst rank; "
          "pools: peak/bound MB, worst rank (! = beyond its bound)")
    header = (f"{'dtype':<5} {'optim':<6} {'system':<13} {'budget':<8} {'rise':>7} {'act':>5} {'gloo':>5} "
              f"{'budget':>7} {'ratio':>6} {'limit':>5} {'':>4}  pools")
    out = {"num_parameters": psi, "args": vars(a), "limits": {"rss_over_budget": RSS_LIMIT,
           "zeropp_slack_of_zero3_rise": ZEROPP_SLACK}, "activation_probes": {}, "rows": [], "over_zero3": []}
    for dtype in dtypes:
        b = copy.copy(a)
        b.dtype = dtype
        act = run_distributed(activation_probe, world_size=1, args=(b,), timeout=a.timeout,
                              env={"OMP_NUM_THREADS": "1"})[0]
        out["activation_probes"][dtype] = act
        print(f"activations in {dtype}: {act['activation_bytes'] / MB:.0f} MB measured (world size 1, "
              f"{act['method']}); the planner's saved activations {act['planner_saved_activation_bytes'] / MB:.0f} MB")
        print(header)
        for optimizer in optimizers:
            for budget in names:
                done = {}
                for system in systems:
                    c = copy.copy(b)
                    c.optimizer, (c.bucket, c.max_live) = optimizer, budgets[budget]
                    ranks = run_distributed(bound_rank, world_size=a.world, args=(c, system), timeout=a.timeout,
                                            env={"OMP_NUM_THREADS": "1"})
                    done[system] = row = {"dtype": dtype, "optimizer": optimizer, "system": system, "budget": budget,
                                          **cell(ranks, act["activation_bytes"])}
                    out["rows"].append(row)
                    print_row(row)
                    if detail:
                        print_ranks(NAMES[system], row)
                out["over_zero3"] += [over_zero3(done["zero3"], r) for s, r in done.items()
                                      if "zero3" in done and s != "zero3"]
    out["pass"] = (all(r["rss_pass"] and r["pools_pass"] for r in out["rows"])
                   and all(r["pass"] for r in out["over_zero3"]))
    within = sum(r["rss_pass"] and r["pools_pass"] for r in out["rows"])
    print(f"bounded memory: {'PASS' if out['pass'] else 'FAIL'} ({within}/{len(out['rows'])} cells within the limit)")
    return out
