"""Groups that survive each other as a user meets them: each group its own `torchrun train.py
--lighthouse ...` job of 2 gloo ranks, meeting the others through torchft's Lighthouse (a
process of its own). A cell returns "" when it holds, else what went wrong (tests/
test_groups_job.py asserts each on a tiny corpus; `python -m scenarios.faults groups` runs them).

- kill-one-group: once the groups exchange together, one rank of group 1 is frozen (SIGSTOP: the
  others meet it in an exchange that cannot finish) and its launcher SIGKILLed (its ranks die
  with it). Group 0 never waits longer than one exchange's timeout, applies outer steps alone,
  logs every iteration once and exits 0; group 1, restarted from its own checkpoint, heals from
  group 0 and exchanges with it again; both end on the same global model.
- freeze-one-group: every rank of group 1 stopped for 15 s, then continued (cut off and back):
  it heals keeping its own masters and exchanges with group 0 again.
- lighthouse-restart, late-start-clean-stop (through scripts/launch_groups.sh), same-as-one-job
  (the one-job mode's model bit for bit), the run's edges (a refused joiner, the start, groups
  that never wait for each other: scenarios/groups_edges.py), kill-one-group and link-outage with INT4
  and topk2 outer gradients (`-int4`, `-topk2`), link-outage (three groups on emulated sites, one cut off for 60 s), heal-interrupted (a late
  group's heal over a slow link cut off): scenarios/groups_sites.py, root only;
- in the bench only (`python -m scenarios.faults groups`, bench/results/groups_job.json):
  three-groups-two-kills, kill-against-uninterrupted (the final validation loss after a kill
  against the uninterrupted groups), punisher (random kills against a long job, below).
Launching and reading the jobs: scenarios/harness/jobs.py.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import torch

from scenarios.harness.results import ROOT
from scenarios.groups_edges import CELLS as EDGES
from scenarios.groups_edges import COMPRESSED, quantized
from scenarios.groups_sites import heal_interrupted, link_outage
from scenarios.harness.jobs import (FIGURES, RUN, TIMEOUT, VALIDATION, clean_stop, finals, finish, free_port, iterations, launch,
                        launch_group, problem, samples_in_order, script, start_lighthouse, stood_still, stop,
                        tensorboard, wait_for, worker_ranks)

# -- the cells ---------------------------------------------------------------------------------------


def kill_one_group(base, tmp: Path, iters: int = 700) -> str:
    """`base(out_dir)`: train.py's flags for data and model, --save inside out_dir."""
    return kills(base, tmp, 2, (1,), iters)


def kills(base, tmp: Path, groups: int, victims: tuple[int, ...], iters: int) -> str:
    """Group 0 first, the others join it; then each victim in turn (a group may die twice) has one
    rank frozen in an exchange, its launcher SIGKILLed, and is restarted from its own checkpoint
    once group 0 has gone on without it. Group 0 must log every iteration once and never stand
    still past one exchange timeout; each restart heals and exchanges with the others again; every
    group ends on the same global model."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters), "--save-interval", "10", "--global-batch-size", str(4 * groups)]
    flags = {g: [*base(tmp / f"g{g}"), *argv] for g in range(groups)}
    logs = {g: tmp / f"group{g}.log" for g in range(groups)}
    procs = {0: launch_group(0, groups, url, flags[0], logs[0])}
    killed_at, restarts = [], []
    try:   # group 0 first: the others join it (a group that joins late takes the others' inner step)
        if not wait_for(logs[0], r"iteration +1/", 120, procs[0]):
            return problem(logs[0], "group 0 never trained")
        for g in range(1, groups):
            procs[g] = launch_group(g, groups, url, flags[g], logs[g])
        for n, g in enumerate(victims):
            full = rf"quorum: {groups} groups"
            if not (wait_for(logs[g], full, 180, procs[g]) and wait_for(logs[g], r"saved checkpoint", 60, procs[g])):
                return problem(logs[g], f"group {g} never exchanged with all the others, or never saved")
            rank1 = worker_ranks(procs[g]).get(1)
            if rank1:
                os.kill(rank1, signal.SIGSTOP)   # the others meet it in an exchange it cannot finish
            time.sleep(1.0)
            procs[g].send_signal(signal.SIGKILL)   # the launcher: its ranks die with it (parallel/startup.py)
            procs[g].wait()
            killed_at.append(time.time())
            if not wait_for(logs[0], rf"quorum of {groups - 1} group\(s\), was {groups}", 60, procs[0]):
                return problem(logs[0], f"group 0 never went on without group {g}")
            logs[g] = tmp / f"group{g}_again{n}.log"
            restarts.append(logs[g])
            procs[g] = launch_group(g, groups, url, [*flags[g], "--load", str(tmp / f"g{g}" / "ckpt")], logs[g])
        rcs = {g: p.wait(timeout=900) for g, p in procs.items()}
    finally:
        stop(*procs.values(), lh)
    if any(rcs.values()):
        return problem(logs[next(g for g, rc in rcs.items() if rc)], f"exit statuses {rcs}")
    seen = iterations(logs[0])
    if [it for _, it in seen] != list(range(1, iters + 1)):
        return problem(logs[0], "group 0 did not log every iteration exactly once")
    if still := stood_still(logs[0]):
        return still
    if not any(t > killed_at[-1] for t, _ in seen):
        return problem(logs[0], "group 0 logged nothing after the last kill")
    for log in restarts:
        again = log.read_text(errors="replace")
        # (a synchronous group takes the others' inner step; an asynchronous one keeps its own)
        took = [] if "--outer-async" in flags[0] else ["continuing at their inner step"]
        for said in ("healed from a peer", *took, f"quorum: {groups} groups"):
            if said not in again:
                return problem(log, f"a restarted group never said {said!r}")
    quorum, heals = tensorboard(tmp / "g0" / "tb", "outer/quorum-size"), tensorboard(tmp / f"g{victims[-1]}" / "tb",
                                                                                        "outer/heals")
    if not {float(groups - 1), float(groups)} <= set(quorum) or not heals or max(heals) < 1:
        return problem(restarts[-1], f"TensorBoard: quorum sizes {sorted(set(quorum))} (group 0), heals {heals[-1:]}")
    ends = finals(*(logs[g] for g in range(groups)))
    if not all(ends) or any(f != ends[0] for f in ends):
        return problem(restarts[-1], f"the groups end on different global models: {ends}")
    return ""


def freeze_one_group(base, tmp: Path, iters: int = 1500, seconds: float = 15.0) -> str:
    """Every rank of group 1 stopped (SIGSTOP) for `seconds`, then continued: a group cut off
    that comes back alive. Group 0 goes on alone meanwhile; group 1 finds its exchange failed,
    goes on alone, then heals from group 0 keeping its own trained masters (merged at its next
    exchanges), and both end on the same global model."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters)]
    logs = [tmp / "group0.log", tmp / "group1.log"]
    procs = [launch_group(0, 2, url, [*base(tmp / "g0"), *argv], logs[0])]
    try:
        if not wait_for(logs[0], r"iteration +1/", 120, procs[0]):
            return problem(logs[0], "group 0 never trained")
        procs.append(launch_group(1, 2, url, [*base(tmp / "g1"), *argv], logs[1]))
        if not wait_for(logs[1], r"quorum: 2 groups", 180, procs[1]):
            return problem(logs[1], "the two groups never exchanged together")
        ranks = list(worker_ranks(procs[1]).values())
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        mark = len(logs[1].read_text(errors="replace"))
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        rcs = [p.wait(timeout=900) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[rcs.index(next(r for r in rcs if r))], f"exit statuses {rcs}")
    seen = iterations(logs[0])
    if [it for _, it in seen] != list(range(1, iters + 1)):
        return problem(logs[0], "group 0 did not log every iteration exactly once")
    if still := stood_still(logs[0]):
        return still
    after = logs[1].read_text(errors="replace")[mark:]
    if "healed from a peer" not in after or "quorum: 2 groups" not in after.split("healed from a peer", 1)[1]:
        return problem(logs[1], "group 1 did not heal from group 0 and exchange with it again after the freeze")
    ends = finals(*logs)
    if not all(ends) or ends[0] != ends[1]:
        return problem(logs[1], f"the groups end on different global models: {ends}")
    return ""


def lighthouse_restart(base, tmp: Path, iters: int = 1000) -> str:
    """The Lighthouse killed while two groups exchange, and started again on its port 5 s later:
    both go on alone meanwhile (no step lost, no exchange past its chain of timeouts) and
    exchange together again after it returns. Once both have, and have trained a while past
    the chain of timeouts, each is stopped as a scheduler stops it (SIGTERM: it saves, exits 0)."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters)]
    logs = [tmp / "group0.log", tmp / "group1.log"]
    procs = [launch_group(g, 2, url, [*base(tmp / f"g{g}"), *argv], logs[g]) for g in (0, 1)]
    try:
        if not wait_for(logs[1], r"quorum: 2 groups", 120, procs[1]):
            return problem(logs[1], "the two groups never exchanged together")
        lh.kill()
        lh.wait()
        time.sleep(5)
        back = time.time()
        lh, _ = start_lighthouse(tmp / "lighthouse_again.log", port=int(url.rsplit(":", 1)[1]))
        met_again = r"goes on alone[\s\S]*quorum of 2 group\(s\), was 1"
        if all(wait_for(log, met_again, 6 * TIMEOUT + 60, p) for log, p in zip(logs, procs)):
            time.sleep(max(0.0, back + TIMEOUT + 8 - time.time()))
            clean_stop(*procs)
        rcs = [p.wait(timeout=600) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[0], f"exit status {rcs}")
    for log in logs:
        seen = iterations(log)
        if len({it for _, it in seen}) != len(seen) or not samples_in_order(log):
            return problem(log, "an iteration was repeated, or a sample skipped or repeated")
        if f"saved checkpoint at iteration {seen[-1][1]} " not in log.read_text(errors="replace"):
            return problem(log, "the group did not save its last iteration when stopped")
        # torchft's Lighthouse numbers quorums from 1 again after a restart: a group whose last
        # quorum had the same number but other members keeps its process group, and one exchange
        # can then wait out each of its steps in turn (quorum, reconfiguration, heal, header,
        # exchange, commit), every one bounded by the timeout
        if still := stood_still(log, timeouts=6):
            return still
        text = log.read_text(errors="replace")
        after = [t for t, _ in seen if t > back + TIMEOUT + 5]
        if "goes on alone" not in text or not after or not re.search(r"quorum of 2 group\(s\), was 1", text.split(
                "goes on alone", 1)[1]):
            return problem(log, "the group did not go on alone and then exchange with the other again")
    return ""


def late_start_and_clean_stop(base, tmp: Path, iters: int = 4000) -> str:
    """With scripts/launch_groups.sh: group 0 trains alone; group 1 starts late, heals and joins;
    `stop 1` makes it save and leave (exit 0); group 0 goes on alone, no step lost, until
    `stop 0` (or the last iteration) ends it the same way. `iters` only bounds group 0: it must
    still be training when group 1 has started (its launcher checks train.py's flags first) on a
    loaded machine; 800 iterations of 22 ms were not always enough."""
    env = {"GROUPS_DIR": str(tmp / "run"), "LIGHTHOUSE_PORT": str(free_port()), "JOIN_TIMEOUT_MS": "2000"}
    flags = [*base(tmp / "out"), *RUN, "--train-iters", str(iters), "--outer-timeout", str(TIMEOUT)]
    logs = [tmp / "run" / "group0.log", tmp / "run" / "group1.log"]
    lh = script("lighthouse", env=env)
    g0 = script("group", "0", "2", "2", *flags, env=env)
    g1 = None
    try:
        if not wait_for(logs[0], r"iteration +30/", 120, g0):
            return problem(logs[0], "group 0 did not train alone")
        g1 = script("group", "1", "2", "2", *flags, env=env)
        if not wait_for(logs[1], r"quorum: 2 groups", 120, g1):
            return problem(logs[1], "the late group never exchanged with group 0")
        stop_group = ["bash", str(ROOT / "scripts" / "launch_groups.sh"), "stop"]
        subprocess.run([*stop_group, "1"], env=dict(os.environ, **env), check=True, capture_output=True)
        rc1 = g1.wait(timeout=120)
        if wait_for(logs[0], r"quorum of 1 group\(s\), was 2", 6 * TIMEOUT + 60, g0):
            time.sleep(3)   # a few iterations alone
            subprocess.run([*stop_group, "0"], env=dict(os.environ, **env), check=True, capture_output=True)
        rc0 = g0.wait(timeout=600)
    finally:
        stop(*[p for p in (g0, g1, lh) if p is not None])
    if rc0 or rc1:
        return problem(logs[1] if rc1 else logs[0], f"exit status {rc0} (group 0), {rc1} (group 1 stopped)")
    late = logs[1].read_text(errors="replace")
    if "healed from a peer" not in late or "saved checkpoint" not in late.split("quorum: 2 groups", 1)[1]:
        return problem(logs[1], "the late group did not heal, or did not save when stopped")
    seen = iterations(logs[0])
    text = logs[0].read_text(errors="replace")
    if [it for _, it in seen] != list(range(1, len(seen) + 1)):
        return problem(logs[0], "group 0 did not log every iteration exactly once")
    if f"saved checkpoint at iteration {seen[-1][1]} " not in text:
        return problem(logs[0], "group 0 did not save its last iteration when stopped")
    if not re.search(r"quorum of 2 group\(s\), was 1[\s\S]*quorum of 1 group\(s\), was 2", text):
        return problem(logs[0], "group 0 did not see the late group join and then leave")
    return ""


def steady_groups(base, tmp: Path, argv: list[str], name: str) -> str:
    """Two groups that meet at every exchange (the Lighthouse waits for both), to the end: ""
    or what failed; logs `name`0.log and `name`1.log, outputs under tmp / `name`<g>."""
    lh, url = start_lighthouse(tmp / f"lighthouse_{name}.log", min_replicas=2)
    logs = [tmp / f"{name}{g}.log" for g in (0, 1)]
    procs = [launch_group(g, 2, url, [*base(tmp / f"{name}{g}"), *argv], logs[g]) for g in (0, 1)]
    try:
        rcs = [p.wait(timeout=900) for p in procs]
    finally:
        stop(*procs, lh)
    return problem(logs[rcs.index(next(r for r in rcs if r))], f"exit statuses {rcs}") if any(rcs) else ""


CROSS = re.compile(r"cross-group MB: ([0-9.]+)")


def same_as_one_job(base, tmp: Path, iters: int = 24) -> str:
    """Two groups as two jobs, every exchange with both (the Lighthouse waits for 2), against the
    same two groups in one torchrun job (`--group-size 1`): the exported models are equal bit for
    bit (equal token weights are halves: exact; INT4 and topk2 rows decode to the same mean), and
    so are the bytes across groups each iteration counts."""
    from tools.export_checkpoint import consolidated_state_dict
    argv = [*RUN, "--train-iters", str(iters), "--hidden-dropout", "0", "--save-interval", str(iters)]
    one = launch(4, [*base(tmp / "one"), *argv, "--ranks-per-node", "2", "--group-size", "1"])
    out, hung = finish(one, 300)
    if hung or one.returncode:
        return f"the one-job run failed ({one.returncode}):\n" + "\n".join(out.splitlines()[-10:])
    why = steady_groups(base, tmp, argv, "g")
    if why:
        return why
    want = consolidated_state_dict(str(tmp / "one" / "ckpt"))[0]
    for g in (0, 1):
        got = consolidated_state_dict(str(tmp / f"g{g}" / "ckpt" / f"group{g}"))[0]   # train.py: each group its own
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        if differ:
            worst = max((want[k] - got[k]).abs().max().item() for k in differ)
            return f"group {g}'s export differs from the one job's in {len(differ)} tensors (worst {worst:.3e})"
    sent = [CROSS.findall(text) for text in (out, (tmp / "g0.log").read_text(errors="replace"))]
    if sent[0] != sent[1]:   # the bytes across groups per iteration, counted: the same wires
        return f"cross-group MB per iteration: one job {sent[0]}, groups as jobs {sent[1]}"
    return ""


CELLS = {"kill-one-group": kill_one_group, "freeze-one-group": freeze_one_group, "lighthouse-restart": lighthouse_restart,
         "late-start-clean-stop": late_start_and_clean_stop, "same-as-one-job": same_as_one_job,
         "link-outage": link_outage, "heal-interrupted": heal_interrupted, **EDGES}
CELLS.update({f"{name}-{q}": quantized(CELLS[name], q) for name in COMPRESSED for q in ("int4", "topk2")})
FAULTS = tuple(CELLS)


def run_group_cells(base, tmp: Path, faults=FAULTS) -> dict:
    """{fault: {"ok", "why", "seconds"}} (scenarios/fault_matrix.py's table of groups as jobs)."""
    row = {}
    for fault in faults:
        (tmp / fault).mkdir(parents=True)
        start = time.perf_counter()
        why = CELLS[fault](base, tmp / fault)
        row[fault] = {"ok": not why, "why": why, "seconds": time.perf_counter() - start}
    return row


def final_loss(log: Path) -> float | None:
    found = VALIDATION.findall(log.read_text(errors="replace"))
    return float(found[-1][1]) if found else None


def kill_against_uninterrupted(base, tmp: Path, iters: int = 700, tolerance: float = 0.02) -> str:
    """The final validation loss (the global model, the plain run's validation samples) of
    kill-one-group against the same two groups uninterrupted (the Lighthouse waits for both):
    within `tolerance`. The ratio is in the cell's "why" when it is not."""
    why = steady_groups(base, tmp, [*RUN, "--train-iters", str(iters)], "steady")
    if why:
        return "the uninterrupted run failed: " + why
    (tmp / "killed").mkdir()
    why = kill_one_group(base, tmp / "killed", iters)
    if why:
        return why
    steady, killed = final_loss(tmp / "steady0.log"), final_loss(tmp / "killed" / "group0.log")
    ratio = killed / steady
    FIGURES["kill-against-uninterrupted"] = {"uninterrupted_loss": steady, "killed_loss": killed, "ratio": ratio}
    return "" if abs(ratio - 1) <= tolerance else f"final validation loss {killed:.4f} with the kill / {steady:.4f} " \
                                                   f"uninterrupted = {ratio:.4f}, beyond {tolerance:.0%}"


def punisher(base, tmp: Path, minutes: float = 10.0, mtbf_s: float = 90.0, groups: int = 3, seed: int = 0) -> str:
    """A fault injector against a long job of groups (what torchft's examples/slurm/punisher.py
    `kill_loop` does to a SLURM job, here to local torchrun jobs): 3 groups train for `minutes`;
    at random times (mean `mtbf_s`, a seeded draw) one group, drawn at random among those alive, has
    its launcher SIGKILLed and is started again from its own checkpoint a few seconds later; at the
    end every group is stopped cleanly (SIGTERM to its ranks: they save and exit 0).
    
    Holds when: no incarnation of any group repeats an iteration or skips or re-reads a sample
    (restarts heal from a peer and continue at its inner step, with their own data position); no
    group that is alive stands still past two exchange timeouts; every restart heals; every
    group's last incarnation exits 0."""
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
            procs[g].send_signal(signal.SIGKILL)   # the launcher: its ranks die with it (parallel/startup.py)
            procs[g].wait()
            kills.append((round(time.time() - end + 60 * minutes), g))
            time.sleep(draw.uniform(3, 15))
            logs[g].append(tmp / f"group{g}_{len(logs[g])}.log")
            procs[g] = launch_group(g, groups, url, [*flags[g], "--load", str(tmp / f"g{g}" / "ckpt")], logs[g][-1])
        time.sleep(max(0.0, end - time.time()))
        clean_stop(*procs.values())
        rcs = {g: p.wait(timeout=300) for g, p in procs.items()}
    finally:
        stop(*procs.values(), lh)
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


def three_groups_two_kills(base, tmp: Path) -> str:
    """3 groups of 2 ranks; group 1 killed mid-exchange, restarted; then killed again at a later
    step and restarted again."""
    return kills(base, tmp, 3, (1, 1), 900)


MORE = {"three-groups-two-kills": three_groups_two_kills, "kill-against-uninterrupted": kill_against_uninterrupted,
        "punisher": punisher}   # the bench's only
