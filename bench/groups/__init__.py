"""Goodput of groups as separate jobs (train.py --lighthouse): the synchronous mode against
--outer-async, 3 groups of 2 ranks on this machine, each group its own torchrun job.

    python -m bench.groups straggler [--slow 5] [--iters 300]        # one group's inner steps 5x as long
    python -m bench.groups punisher [--minutes 10] [--seeds 1,2]     # random kills, one group 2x as long
    python -m bench.groups straggler --quick                         # a smoke run (a few iterations)

- straggler: each mode runs undisturbed, then with group 2 throttled; the table gives the fast
  groups' rate (iterations per second, groups 0 and 1) with the straggler against without, beside
  the limit (0.9), the straggler's mean weight in the outer steps (its log), and the final
  validation loss of the global model.
- punisher: each mode with group 2 throttled 2x and, at seeded random times (mean --mtbf s), a
  random group's launcher SIGKILLed and restarted from its checkpoint seconds later, to the end
  of the run (the fast groups' --train-iters, set from a calibration run to last about --minutes);
  then the undisturbed synchronous run at equal tokens (the disturbed run's inner steps, all
  groups). Per group: the useful compute time, the share of its live time (from its first to its
  last inner step, every incarnation) spent in inner steps whose work reaches the global model (a
  step reaches it when a later exchange with this group's weight commits; a kill loses the steps
  since the last one, a heal that drops a group's work loses it too), beside the limit 0.9; the
  whole run's tokens per second (processed and useful); the final validation loss against the
  undisturbed run's, beside the limit 2%.

The throttle is the harness's (training/outer.py THROTTLE: the group's inner steps take k times as
long, asleep), the per-step trace too (TRACE: a JSON line per inner step, the group's rank 0).
Writes bench/results/groups_goodput.json (--out); needs the bundled corpus
(scripts/prepare_demo_data.sh). Measure under `flock /work/locks/measure.lock`; minutes a run.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from pathlib import Path

from bench import RESULTS, provenance, write_result
from scenarios.diloco_job import demo_flags
from scenarios.groups_edges import THROTTLE, WEIGHT, launch
from scenarios.harness.jobs import RUN, VALIDATION, check_data, iterations, listed, start_lighthouse, stop, wait_for

TRACE = "ZEROPP_GROUPS_TRACE"   # training/outer.py: a JSON line per inner step (rank 0)
GROUPS = 3
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "4", "--eval-iters", "4"]
MODES = {"sync": [], "async": ["--outer-async"]}
LIMITS = {"rate": 0.9, "useful": 0.9, "loss": 0.02}


def run(tmp: Path, name: str, mode: str, iters: int, slow: dict, seed: int = 1234, kills: tuple | None = None,
        join_ms: int = 5000) -> dict:
    """3 groups to --train-iters `iters` (`slow`: group -> throttle), and with `kills` = (mean s
    between kills, seed) the punisher's kills and restarts: every incarnation's log and trace.
    `join_ms`: the Lighthouse's join window, longer than the time between two exchanges (H / F
    inner steps) on this machine (docs/fault_tolerant_groups.md)."""
    out = tmp / name
    out.mkdir(parents=True)
    lh, url = start_lighthouse(out / "lighthouse.log", join_ms=join_ms)
    argv = [*RUN, *MODEL, "--train-iters", str(iters), "--global-batch-size", str(4 * 2 * GROUPS), "--seed", str(seed),
            "--save-interval", "20", "--eval-interval", str(10 ** 6), *MODES[mode]]
    incarnations = {g: [] for g in range(GROUPS)}
    procs, killed, began = {}, [], time.time()

    def launch_group(g: int, again: bool):
        n = len(incarnations[g])
        log, trace = out / f"group{g}_{n}.log", out / f"trace{g}_{n}.jsonl"
        incarnations[g].append({"log": log, "trace": trace})
        env = {TRACE: str(trace), **({THROTTLE: str(slow[g])} if g in slow else {})}
        flags = [*demo_flags(out / f"g{g}"), *argv, *(["--load", str(out / f"g{g}" / "ckpt")] if again else [])]
        procs[g] = launch(g, GROUPS, url, flags, log, env=env)
    try:
        for g in range(GROUPS):
            launch_group(g, again=False)
        if kills is not None:
            mtbf, draw = kills[0], random.Random(kills[1])
            while all(p.poll() is None for p in procs.values()):
                time.sleep(draw.uniform(0.5, 1.5) * mtbf)
                if near_end(incarnations, iters):   # a group restarted after the others ended would end alone
                    break
                g = draw.randrange(GROUPS)
                if procs[g].poll() is not None or not wait_for(incarnations[g][-1]["log"], r"saved checkpoint", 120,
                                                                procs[g]):
                    break   # the run is ending
                if any(p.poll() is not None for p in procs.values()):
                    break
                procs[g].send_signal(signal.SIGKILL)   # the launcher: its ranks die with it (parallel/launch.py)
                procs[g].wait()
                killed.append({"at_s": round(time.time() - began), "group": g})
                time.sleep(draw.uniform(3, 15))
                launch_group(g, again=True)
        rcs = {g: p.wait(timeout=3600) for g, p in procs.items()}
    finally:
        stop(*procs.values(), lh)
    return {"name": name, "mode": mode, "iters": iters, "slow": slow, "kills": killed, "exit": rcs,
            "wall_s": time.time() - began, "groups": {g: measure(incs) for g, incs in incarnations.items()}}


def near_end(incarnations: dict, iters: int, share: float = 0.8) -> bool:
    """Whether a group has passed `share` of the run (the kills stop there)."""
    return any(seen and seen[-1][1] >= share * iters for seen in
               (iterations(incs[-1]["log"]) if incs[-1]["log"].exists() else [] for incs in incarnations.values()))


def measure(incarnations: list[dict]) -> dict:
    """One group's figures from its incarnations' traces and logs."""
    live = useful = 0.0
    steps = counted_steps = 0
    rates = []
    for inc in incarnations:
        lines = [json.loads(s) for s in inc["trace"].read_text().splitlines()] if inc["trace"].exists() else []
        stepped = [x for x in lines if x.get("dt") is not None and not x.get("final")]
        if not stepped:
            continue
        counted = max(x["counted"] for x in lines)
        live += lines[-1]["t"] - lines[0]["t"]
        steps += len(stepped)
        mine = [x for x in stepped if x["it"] <= counted]
        counted_steps += len(mine)
        useful += sum(max(0.0, x["dt"] - x["waited"]) for x in mine)
        span = stepped[-1]["t"] - stepped[0]["t"]
        rates.append((len(stepped) - 1) / span if span > 0 else 0.0)
    text = incarnations[-1]["log"].read_text(errors="replace") if incarnations else ""
    losses = VALIDATION.findall(text)
    weights = [float(w) for _, w in WEIGHT.findall(text)]
    return {"incarnations": len(incarnations), "inner_steps": steps, "useful_steps": counted_steps,
            "live_s": round(live, 3), "useful_s": round(useful, 3), "useful_fraction": useful / live if live else 0.0,
            "rate_it_per_s": rates[0] if len(rates) == 1 else (sum(rates) / len(rates) if rates else 0.0),
            "final_loss": float(losses[-1][1]) if losses else None,
            "mean_weight": sum(weights) / len(weights) if weights else None}


def tokens(result: dict, seq: int = 64, per_group_batch: int = 8) -> dict:
    """The whole run's tokens per second: processed, and in steps that reach the global model."""
    gs = result["groups"].values()
    per_step = seq * per_group_batch
    return {"processed": sum(g["inner_steps"] for g in gs) * per_step / result["wall_s"],
            "useful": sum(g["useful_steps"] for g in gs) * per_step / result["wall_s"]}


def final_loss(result: dict) -> float | None:
    """The global model's final validation loss: the one most groups ended on."""
    losses = [g["final_loss"] for g in result["groups"].values() if g["final_loss"] is not None]
    return max(set(losses), key=losses.count) if losses else None


def straggler(a, tmp: Path) -> dict:
    rows = {}
    for mode in listed(a.modes, MODES, "--modes"):
        calm = run(tmp, f"{mode}-calm", mode, a.iters, {}, join_ms=a.join_ms)
        slow = run(tmp, f"{mode}-slow", mode, a.iters, {2: a.slow}, join_ms=a.join_ms)
        fast = [slow["groups"][g]["rate_it_per_s"] / calm["groups"][g]["rate_it_per_s"] for g in (0, 1)]
        rows[mode] = {"ratio": min(fast), "fast_ratios": fast, "straggler_weight": slow["groups"][2]["mean_weight"],
                      "straggler_steps": slow["groups"][2]["inner_steps"], "calm": calm, "slow": slow}
        print(f"{mode:6s} fast groups' rate with a {a.slow:g}x straggler / without: {min(fast):.2f} "
              f"(limit {LIMITS['rate']}); straggler's mean weight {rows[mode]['straggler_weight']}; final loss "
              f"{final_loss(slow)} (without: {final_loss(calm)})", flush=True)
    return rows


def calibrate(tmp: Path, minutes: float) -> int:
    """The fast groups' --train-iters for a run of about `minutes`, from a short undisturbed run."""
    probe = run(tmp, "calibration", "sync", 60, {})
    rate = min(g["rate_it_per_s"] for g in probe["groups"].values())
    return max(60, int(rate * 60 * minutes))


def punisher(a, tmp: Path) -> dict:
    iters = a.iters or calibrate(tmp, a.minutes)
    rows = {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for mode in listed(a.modes, MODES, "--modes"):
            hit = run(tmp, f"{mode}-seed{seed}", mode, iters, {2: a.slow}, seed=seed, kills=(a.mtbf, seed),
                      join_ms=a.join_ms)
            steps = sum(g["inner_steps"] for g in hit["groups"].values())
            calm = run(tmp, f"{mode}-seed{seed}-equal-tokens", "sync", max(1, round(steps / GROUPS)), {}, seed=seed,
                       join_ms=a.join_ms)
            loss, base = final_loss(hit), final_loss(calm)
            row = {"useful_fraction": {g: x["useful_fraction"] for g, x in hit["groups"].items()},
                   "tokens_per_s": tokens(hit), "final_loss": loss, "undisturbed_equal_tokens_loss": base,
                   "loss_ratio": loss / base if loss and base else None, "run": hit, "undisturbed": calm}
            rows[f"{mode} seed {seed}"] = row
            print(f"{mode:6s} seed {seed}: useful time / live time per group "
                  + ", ".join(f"{g}: {f:.3f}" for g, f in row["useful_fraction"].items())
                  + f" (limit {LIMITS['useful']}); tokens/s {row['tokens_per_s']['processed']:.0f} processed, "
                  f"{row['tokens_per_s']['useful']:.0f} useful; final loss {loss} / {base} undisturbed = "
                  f"{row['loss_ratio']} (limit 1 +- {LIMITS['loss']}); kills {len(hit['kills'])}", flush=True)
    return {"iters": iters, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.groups", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=["straggler", "punisher"])
    p.add_argument("--modes", default="sync,async", help="some of sync,async (default: both)")
    p.add_argument("--slow", type=float, help="the throttled group's factor (straggler: 5, punisher: 2)")
    p.add_argument("--iters", type=int, help="the fast groups' --train-iters (straggler: 300; punisher: calibrated)")
    p.add_argument("--minutes", type=float, default=10.0, help="punisher: about how long a run lasts (%(default)s)")
    p.add_argument("--mtbf", type=float, default=90.0, help="punisher: mean seconds between kills (%(default)s)")
    p.add_argument("--seeds", default="1,2", help="punisher: the seeds (default %(default)s)")
    p.add_argument("--join-ms", type=int, default=5000, help="the Lighthouse's join window (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 30 iterations, one seed, one kill")
    p.add_argument("--workdir", help="keep the runs' logs and traces here (default: a temporary folder)")
    p.add_argument("--out", default=str(RESULTS / "groups_goodput.json"))
    a = p.parse_args(argv)
    check_data()
    a.slow = a.slow or (5.0 if a.family == "straggler" else 2.0)
    if a.quick:
        a.iters, a.seeds, a.minutes, a.mtbf = 30, a.seeds.split(",")[0], 0.5, 10.0
    a.iters = a.iters or (300 if a.family == "straggler" else None)
    with tempfile.TemporaryDirectory() if a.workdir is None else _kept(a.workdir) as tmp:
        report = {"straggler": straggler, "punisher": punisher}[a.family](a, Path(tmp))
    old = Path(a.out)   # the other family's results stay, each with its own provenance
    kept = json.loads(old.read_text()) if old.exists() else {}
    kept.pop("provenance", None)
    entry = {**report, "limits": LIMITS, "provenance": provenance()}
    print(f"wrote {write_result(a.out, {**kept, a.family: entry})}")
    return 0


def _kept(folder: str):
    import contextlib
    Path(folder).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(folder)
