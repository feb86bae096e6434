"""A fault injector against a long job of groups (what torchft's examples/slurm/punisher.py
`kill_loop` does to a SLURM job, here to local torchrun jobs): 3 groups train for `minutes`;
at random times (mean `mtbf_s`, a seeded draw) one group, drawn at random among those alive, has
its launcher SIGKILLed and is started again from its own checkpoint a few seconds later; at the
end every group is stopped cleanly (SIGTERM to its ranks: they save and exit 0).

Holds when: no incarnation of any group repeats an iteration or skips or re-reads a sample
(restarts heal from a peer and continue at its inner step, with their own data position); no
group that is alive stands still past two exchange timeouts; every restart heals; every
group's last incarnation exits 0. `python -m bench.groups_job --cells punisher`."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from bench.diloco_job import worker_ranks
from bench.groups_launch import (FIGURES, RUN, iterations, launch_group, problem, samples_in_order, start_lighthouse,
                                 stood_still, stop_all, wait_for)


def punisher(base, tmp: Path, minutes: float = 10.0, mtbf_s: float = 90.0, groups: int = 3, seed: int = 0) -> str:
    draw = random.Random(seed)
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", "1000000", "--save-interval", "50", "--global-batch-size", str(4 * groups)]
    flags = {g: [*base(tmp / f"g{g}"), *argv] for g in range(groups)}
    logs: dict[int, list[Path]] = {g: [tmp / f"group{g}_0.log"] for g in range(groups)}
    procs = {g: launch_group(g, groups, url, flags[g], logs[g][0]) for g in range(groups)}
    kills, end = [], time.time() + 60 * minutes
    try:
        if not all(wait_for(logs[g][0], rf"quorum: {groups} groups", 300, procs[g]) for g in range(groups)):
            return problem(logs[0][0], "the groups never exchanged all together")
        while (pause := draw.uniform(0.5, 1.5) * mtbf_s) < end - time.time() - 60:
            time.sleep(pause)
            g = draw.randrange(groups)
            if not wait_for(logs[g][-1], r"saved checkpoint", 120, procs[g]):
                return problem(logs[g][-1], f"group {g} never saved a checkpoint to restart from")
            procs[g].send_signal(signal.SIGKILL)   # the launcher: its ranks die with it (parallel/launch.py)
            procs[g].wait()
            kills.append((round(time.time() - end + 60 * minutes), g))
            time.sleep(draw.uniform(3, 15))
            logs[g].append(tmp / f"group{g}_{len(logs[g])}.log")
            procs[g] = launch_group(g, groups, url, [*flags[g], "--load", str(tmp / f"g{g}" / "ckpt")], logs[g][-1])
        time.sleep(max(0.0, end - time.time()))
        for p in procs.values():   # a clean stop: each rank saves and exits 0, and so does torchrun
            for pid in worker_ranks(p).values():
                os.kill(pid, signal.SIGTERM)
        rcs = {g: p.wait(timeout=300) for g, p in procs.items()}
    finally:
        stop_all(*procs.values(), lh)
    if any(rcs.values()):
        g = next(g for g, rc in rcs.items() if rc)
        return problem(logs[g][-1], f"exit statuses of the last incarnations {rcs}")
    for g in range(groups):
        for n, log in enumerate(logs[g]):
            seen = [it for _, it in iterations(log)]
            if seen != sorted(set(seen)) or not samples_in_order(log):
                return problem(log, f"group {g} (incarnation {n}) repeated an iteration, or skipped or re-read a sample")
            if still := stood_still(log, timeouts=2):
                return still
            if n and "healed from a peer" not in log.read_text(errors="replace"):
                return problem(log, f"group {g} restarted (incarnation {n}) without healing from a peer")
    FIGURES["punisher"] = {"minutes": minutes, "kills": [{"at_s": t, "group": g} for t, g in kills],
                           "iterations": {f"group{g}": iterations(logs[g][-1])[-1][1] for g in range(groups)}}
    return "" if kills else f"no kill in {minutes} min (mean time between failures {mtbf_s} s): run longer"
