"""Running groups as separate torchrun jobs and reading their logs (bench/groups_job.py's cells):
torchft's Lighthouse, a group's torchrun, scripts/launch_groups.sh, the logs' lines and TensorBoard."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from bench import ROOT
from bench.diloco_job import worker_ranks

TIMEOUT = 10   # --outer-timeout of every group: how long an exchange or a quorum waits
# every cell's run: H = 4 in 2 fragments (an exchange every 2 inner steps), a line per iteration
RUN = ["--global-batch-size", "8", "--zero-stage", "3", "--outer-sync-interval", "4", "--outer-fragments", "2", "--log-interval", "1",
       "--eval-interval", "100000"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
FIGURES: dict = {}   # a cell's measured figures, beside its verdict in bench/results/groups_job.json
LINE = re.compile(r"^ \[([0-9: -]+)\] iteration +(\d+)/", re.M)
VALIDATION = re.compile(r"validation loss at iteration +(\d+) on validation set \| lm loss value: ([0-9.E+-]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(log: Path, heartbeat_ms: int = 3000, join_ms: int = 2000, min_replicas: int = 1,
                     port: int | None = None, host: str = "127.0.0.1", wrap=list) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on `port` (a free local one by default): (its process, its URL).
    `wrap(argv)`: the command that runs argv elsewhere (bench/groups_sites.py's hub)."""
    port = port or free_port()
    proc = subprocess.Popen(wrap([LIGHTHOUSE, "--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_ms),
                                  "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", str(heartbeat_ms),
                                  "--bind", f"[::]:{port}"]), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://{host}:{port}"


def launch_group(group: int, groups: int, lighthouse: str, argv: list[str], log: Path,
                 wrap=list) -> subprocess.Popen:
    """Group `group` of `groups`: train.py on 2 local ranks under its own torchrun (run by
    `wrap(argv)`: on a site of bench/groups_sites.py, say)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(wrap([*TORCHRUN, "train.py", *argv, "--lighthouse", lighthouse, "--group-id", str(group),
                                  "--num-groups", str(groups), "--outer-timeout", str(TIMEOUT)]),
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def iterations(log: Path) -> list[tuple[float, int]]:
    """(wall time, iteration) of every training line of a log (--log-interval 1)."""
    out = []
    for stamp, it in LINE.findall(log.read_text(errors="replace")):
        out.append((datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp(), int(it)))
    return out


SAMPLES = re.compile(r"^ \[[0-9: -]+\] iteration +\d+/ *\d+ \| consumed samples: +(\d+) .*global batch size: +(\d+)", re.M)


def samples_in_order(log: Path) -> bool:
    """Whether every training line consumed exactly one global batch after the line before: the
    group's own data position never skips or repeats a sample (--log-interval 1), whatever
    inner step it continues at after a heal."""
    seen = [(int(n), int(b)) for n, b in SAMPLES.findall(log.read_text(errors="replace"))]
    return bool(seen) and all(n == m + b for (m, _), (n, b) in zip(seen, seen[1:]))


def stood_still(log: Path, timeouts: int = 1) -> str:
    """"" when the log's iterations never stand still past `timeouts` exchange timeouts (plus a
    quorum's join timeout and the log's one-second stamps), else what the group logged meanwhile."""
    seen = iterations(log)
    gap, at = max(((b[0] - a[0], n) for n, (a, b) in enumerate(zip(seen, seen[1:]))), default=(0.0, 0))
    if gap <= timeouts * TIMEOUT + 5:
        return ""
    lines = log.read_text(errors="replace").splitlines()
    start = next(n for n, line in enumerate(lines) if LINE.match(line + "\n") and int(LINE.match(line + "\n")[2]) == seen[at][1])
    meanwhile = lines[start:start + 1 + next((k for k, line in enumerate(lines[start + 1:]) if LINE.match(line + "\n")), 40)]
    return "\n".join([f"{log.name} stood still for {gap:.0f} s after iteration {seen[at][1]} (the exchange "
                       f"timeout is {TIMEOUT} s, {timeouts} allowed); meanwhile:", *meanwhile[:60]])


def wait_for(log: Path, pattern: str, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Whether `pattern` shows in `log` within `timeout` s (False at once if `proc` ended)."""
    end = time.time() + timeout
    while time.time() < end:
        if log.exists() and re.search(pattern, log.read_text(errors="replace")):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def tensorboard(folder: Path, tag: str) -> list[float]:
    """Every value of scalar `tag` written under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    values = []
    for run in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(run))
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values += [e.value for e in events.Scalars(tag)]
    return values


def stop_all(*procs):
    for p in procs:
        if p.poll() is None:
            for pid in worker_ranks(p).values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
        p.wait()


def problem(log: Path, what: str) -> str:
    tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
    return what + "\n" + "\n".join(tail)


def script(*args, env: dict) -> subprocess.Popen:
    """scripts/launch_groups.sh `args` as a user runs it."""
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "launch_groups.sh"), *args], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
