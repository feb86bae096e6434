"""Cells of groups as separate jobs (train.py --lighthouse) at the run's edges: nothing one group
does ends the run, the start, and groups that never wait for each other. A cell returns "" when
it holds, else what went wrong (tests/integration/groups/test_groups_job.py runs them; `python -m scenarios.faults groups`
too). Launching and reading the jobs: scenarios/harness/jobs.py.

- refused-model / refused-outer-flags / refused-duplicate: while group 0 trains, a group with
  another model (--hidden-size), with other outer flags (--outer-lr), or a second job claiming
  group 0 joins: it alone is refused at its join, one `error:` line and its ranks' exit status 2;
  group 0 goes on, logs every iteration once and exits 0.
- unreachable-lighthouse: a --lighthouse nobody answers is one line, exit status 2, in seconds,
  before the model is built.
- clean-start: three groups started a few seconds apart wait for each other (within the exchange
  timeout) and each logs every iteration from 1, none taking another's.
- async-resume: two groups with --outer-async stopped and resumed: their outer state comes back.
- async-straggler: three groups with --outer-async, one throttled (its inner steps take 5 times as
  long: THROTTLE in its environment, the harness's): every group exits 0 on the same final model
  at the run's last iteration (the first group there takes the others to it), the straggler's outer
  gradients reach the global values with their logged weights, and the others never stand still
  past the exchange timeout.
- async-late-for-the-end: three groups with --outer-async, one started only as the others end:
  they serve it their final model, it takes it at its join; all three end on it.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from scenarios.harness.jobs import (RUN, TIMEOUT, clean_stop, finals, free_port, iterations, job_env, launch_group, problem,
                        start, start_lighthouse, stood_still, stop, torchrun, wait_for)

THROTTLE = "ZEROPP_GROUPS_THROTTLE"   # training/outer.py reads it: a group's inner steps take k times as long
WEIGHT = re.compile(r"> outer rounds: .*outer gradient in (\d+), weight ([0-9.]+)")


def launch(g: int, groups: int, url: str, argv: list[str], log: Path, env: dict | None = None,
           timeout: float = TIMEOUT):
    """Group g of `groups` (scenarios/harness/jobs.py launch_group, with an environment and a timeout of its own)."""
    return start([*torchrun(2), "train.py", *argv, "--lighthouse", url, "--group-id", str(g), "--num-groups",
                  str(groups), "--outer-timeout", str(timeout)], log, env=job_env(**(env or {})))


def refused(base, tmp: Path, extra: list[str], said: str, group: int = 1, after: int = 60) -> str:
    """Group 0 trains; once it exchanged, group `group` joins with `extra` flags and must be refused
    alone (`said` in its one error line, exit status 2); group 0 goes on (`after` more iterations),
    then is stopped as a scheduler stops it: it saves and exits 0."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", "1000000", "--save-interval", "1000000"]
    logs = [tmp / "group0.log", tmp / "joiner.log"]
    g0 = launch_group(0, 2, url, [*base(tmp / "g0"), *argv], logs[0])
    joiner = None
    try:
        if not wait_for(logs[0], r"iteration +20/", 120, g0):
            return problem(logs[0], "group 0 never trained")
        joiner = launch_group(group, 2, url, [*base(tmp / "joiner"), *argv, *extra], logs[1])
        rc1 = joiner.wait(timeout=300)
        went_on = len(iterations(logs[0])) + after
        if wait_for(logs[0], rf"iteration +{went_on}/", 300, g0):
            clean_stop(g0)
        rc0 = g0.wait(timeout=300)
    finally:
        stop(*[p for p in (g0, joiner, lh) if p is not None])
    lines = logs[1].read_text(errors="replace").splitlines()
    # torchrun reports a worker's exit status 2 as its own 1, with the worker's line
    if rc1 == 0 or not any(line.startswith("error: ") and said in line for line in lines) \
            or not any("exitcode  : 2" in line for line in lines):
        return problem(logs[1], f"exit status {rc1}: expected the ranks' exit status 2 and one line saying {said!r}")
    if rc0 != 0:
        return problem(logs[0], f"group 0 ended with exit status {rc0}: a refused joiner ended the run")
    seen = [it for _, it in iterations(logs[0])]
    if seen != list(range(1, len(seen) + 1)) or len(seen) < went_on:
        return problem(logs[0], "group 0 did not go on logging every iteration exactly once")
    if f"saved checkpoint at iteration {seen[-1]} " not in logs[0].read_text(errors="replace"):
        return problem(logs[0], "group 0 did not save its last iteration when stopped")
    return stood_still(logs[0], timeouts=2)


def refused_model(base, tmp: Path) -> str:
    return refused(base, tmp, ["--hidden-size", "64"], "model flags (--num-layers, --hidden-size, ...)")


def refused_outer_flags(base, tmp: Path) -> str:
    return refused(base, tmp, ["--outer-lr", "0.3"], "outer settings (--outer-*) differ from the run's")


def refused_duplicate(base, tmp: Path) -> str:
    return refused(base, tmp, [], "another job is already group 0 of this run", group=0)


def unreachable_lighthouse(base, tmp: Path, limit_s: float = 40.0) -> str:
    """A Lighthouse URL nobody answers: one `error:` line naming it, exit status 2, before the model."""
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp / "group0.log"
    began = time.monotonic()
    proc = launch_group(0, 2, url, [*base(tmp / "g0"), *RUN, "--train-iters", "10"], log)
    try:
        rc = proc.wait(timeout=300)
    finally:
        stop(proc)
    took, text = time.monotonic() - began, log.read_text(errors="replace")
    lines = text.splitlines()
    if rc == 0 or not any(line.startswith(f"error: --lighthouse {url}: nothing answers") for line in lines) \
            or not any("exitcode  : 2" in line for line in lines):
        return problem(log, f"exit status {rc}: expected exit status 2 and one line naming --lighthouse {url}")
    ours = text.split("train.py FAILED")[0].split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]
    if "Traceback" in ours or "> GPT:" in text:   # (torchrun's own traceback follows a failed worker's)
        return problem(log, "a traceback, or the model was built before the Lighthouse was looked for")
    return "" if took < limit_s else f"the error came after {took:.0f} s (limit {limit_s:.0f} s)"


def clean_start(base, tmp: Path, groups: int = 3, apart_s: float = 2.0, iters: int = 60, timeout: float = 40) -> str:
    """Groups started `apart_s` s apart (well within the exchange timeout, which bounds the wait):
    every group logs every iteration from 1 exactly once, and its first quorum holds all of them."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*base(tmp / "g"), *RUN, "--train-iters", str(iters), "--global-batch-size", str(4 * groups)]
    logs = [tmp / f"group{g}.log" for g in range(groups)]
    procs = []
    try:
        for g in range(groups):
            procs.append(launch(g, groups, url, [*argv, "--save", str(tmp / f"g{g}" / "ckpt"),
                                                 "--tensorboard-dir", str(tmp / f"g{g}" / "tb")], logs[g],
                                timeout=timeout))
            time.sleep(apart_s)
        rcs = [p.wait(timeout=900) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[next(g for g, rc in enumerate(rcs) if rc)], f"exit statuses {rcs}")
    for g, log in enumerate(logs):
        if [it for _, it in iterations(log)] != list(range(1, iters + 1)):
            return problem(log, f"group {g} did not log every iteration from 1 exactly once (it took another's)")
        if f"joined a quorum of {groups} group(s)" not in log.read_text(errors="replace"):
            return problem(log, f"group {g}'s first quorum did not hold all {groups} groups")
    return ""


def async_straggler(base, tmp: Path, iters: int = 300, slow: float = 5.0, extra: tuple = ()) -> str:
    """Three groups with --outer-async, group 2's inner steps `slow` times as long."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters), "--global-batch-size", "12", "--outer-async", *extra]
    logs = [tmp / f"group{g}.log" for g in range(3)]
    procs = []
    try:
        for g in range(3):
            procs.append(launch(g, 3, url, [*base(tmp / f"g{g}"), *argv], logs[g],
                                env={THROTTLE: str(slow)} if g == 2 else None))
        rcs = [p.wait(timeout=1800) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[next(g for g, rc in enumerate(rcs) if rc)], f"exit statuses {rcs}")
    for log in logs:   # (the first group at the end takes the others there: their last iteration jumps to it)
        seen = [it for _, it in iterations(log)]
        if seen != sorted(set(seen)) or seen[-1:] != [iters] or seen[:1] != [1]:
            return problem(log, "a group repeated an iteration, or did not end at the run's last")
    for log in logs[:2]:
        if still := stood_still(log, timeouts=1):
            return still
    text = logs[2].read_text(errors="replace")
    offered = [(int(n), float(w)) for n, w in WEIGHT.findall(text)]
    # (a round the straggler has to itself gives it weight 1: the others' offers were in other rounds)
    if not any(w > 0 for _, w in offered) or not all(0 <= w <= 1 for _, w in offered):
        return problem(logs[2], "the straggler's outer gradients never reached the global values with a weight "
                                f"in (0, 1]: (rounds, weight) per log line {offered}")
    ends = finals(*logs)
    if not all(ends) or any(f != ends[0] for f in ends):
        return problem(logs[2], f"the groups end on different global models: {ends}")
    return ""


def async_late_for_the_end(base, tmp: Path, iters: int = 120, serve_s: float = 30) -> str:
    """Three groups with --outer-async; group 2 starts only once group 0 is near the run's end, so
    it cannot be in the final round. Groups 0 and 1 (after waiting their --outer-timeout `serve_s`
    for it at the start) end, then serve the final model for up to `serve_s`: group 2 takes it at
    its join, its iteration is the run's last, and all three end on one model."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters), "--global-batch-size", "12", "--outer-async"]
    logs = [tmp / f"group{g}.log" for g in range(3)]
    procs = []
    try:
        procs = [launch(g, 3, url, [*base(tmp / f"g{g}"), *argv], logs[g], timeout=serve_s) for g in (0, 1)]
        if not wait_for(logs[0], rf"iteration +{iters - 20}/", 300 + serve_s, procs[0]):
            return problem(logs[0], f"group 0 never reached iteration {iters - 20}")
        procs.append(launch(2, 3, url, [*base(tmp / "g2"), *argv], logs[2]))
        rcs = [p.wait(timeout=600) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[next(g for g, rc in enumerate(rcs) if rc)], f"exit statuses {rcs}")
    text = logs[2].read_text(errors="replace")
    if f"this group takes the final model the others served, at iteration {iters}" not in text or [it for _, it in iterations(logs[2])]:
        return problem(logs[2], "group 2 did not take the final model at its join (or trained after it)")
    if not any("the final model served to group(s) [2]" in log.read_text(errors="replace") for log in logs[:2]):
        return problem(logs[0], "neither group 0 nor group 1 says it served the final model to group 2")
    ends = finals(*logs)
    if not all(ends) or any(f != ends[0] for f in ends):
        return problem(logs[2], f"the groups end on different global models: {ends}")
    return ""


LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


def async_resume(base, tmp: Path, stop_at: int = 40, iters: int = 80) -> str:
    """Two groups with --outer-async stop at `stop_at` (--exit-interval: they save and exit 0) and
    resume from their checkpoints to `iters`: the global values, the momentum and each group's base
    values come back, so the merges after the resume do not pull the masters anywhere else (the
    training loss stays where it was, not near the untrained model's), and both end on one model."""
    lh, url = start_lighthouse(tmp / "lighthouse.log")
    argv = [*RUN, "--train-iters", str(iters), "--outer-async", "--save-interval", str(stop_at)]
    logs = {g: [tmp / f"group{g}.log", tmp / f"group{g}_again.log"] for g in (0, 1)}
    procs = []
    try:
        procs = [launch(g, 2, url, [*base(tmp / f"g{g}"), *argv, "--exit-interval", str(stop_at)], logs[g][0])
                 for g in (0, 1)]
        rcs = [p.wait(timeout=600) for p in procs]
        procs = [launch(g, 2, url, [*base(tmp / f"g{g}"), *argv, "--load", str(tmp / f"g{g}" / "ckpt")], logs[g][1])
                 for g in (0, 1)]
        rcs += [p.wait(timeout=600) for p in procs]
    finally:
        stop(*procs, lh)
    if any(rcs):
        return problem(logs[0][1], f"exit statuses {rcs}")
    for g in (0, 1):
        before = [float(x) for _, x in LOSS.findall(logs[g][0].read_text(errors="replace"))][-10:]
        after = [float(x) for _, x in LOSS.findall(logs[g][1].read_text(errors="replace"))]
        if not before or not after or max(after) > max(before) + 0.5:
            return problem(logs[g][1], f"group {g}'s loss after the resume rose from at most {max(before or [0]):.3f} "
                                       f"to {max(after or [0]):.3f}: its outer state did not come back")
    ends = finals(logs[0][1], logs[1][1])
    return "" if all(ends) and ends[0] == ends[1] else problem(logs[1][1], f"different final models: {ends}")


def quantized(cell, quantization: str):
    """`cell` with --outer-quantization `quantization` in every group."""
    def run(base, tmp: Path) -> str:
        return cell(lambda out: [*base(out), "--outer-quantization", quantization], tmp)
    return run


CELLS = {"refused-model": refused_model, "refused-outer-flags": refused_outer_flags,
         "refused-duplicate": refused_duplicate, "unreachable-lighthouse": unreachable_lighthouse,
         "clean-start": clean_start, "async-straggler": async_straggler, "async-late-for-the-end": async_late_for_the_end,
         "async-resume": async_resume}
COMPRESSED = ("kill-one-group", "link-outage")   # scenarios/groups_job.py adds them with int4 and topk2 outer gradients
