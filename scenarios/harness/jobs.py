"""train.py as a user runs it, for the convergence, memory and fault benches: torchrun jobs in
sessions of their own, found, killed and waited for; torchft's Lighthouse and groups of
`train.py --lighthouse` (each group its own torchrun job); reading their logs; the names a
comma-separated flag picks."""
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

from scenarios.harness.results import ROOT

DATA_PREFIX = "work_dir/kjv_text_document"   # the bundled corpus (scripts/quickstart.sh builds it)
TOKENIZER = "work_dir/kjv_sp.model"


def usage_error(message: str):
    """A careless input to a benchmark, as argparse reports one: a line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_data():
    missing = [p for p in (DATA_PREFIX + ".bin", DATA_PREFIX + ".idx", TOKENIZER) if not (ROOT / p).is_file()]
    if missing:
        usage_error(f"missing {', '.join(missing)}: build the bundled corpus first (`bash scripts/prepare_demo_data.sh`)")


def listed(value: str | None, known, flag: str = "") -> list[str]:
    """The names of a comma-separated flag (None: all of `known`), each one of `known`."""
    names = list(known) if value is None else value.split(",")
    if set(names) - set(known):
        usage_error(f"{flag}: unknown {', '.join(sorted(set(names) - set(known)))}; choose from {', '.join(known)}")
    return names


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def job_env(root: Path = ROOT, **extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(root), **extra)


def start(argv: list[str], log: Path | None = None, wrap=list, env: dict | None = None, cwd: Path = ROOT,
          ) -> subprocess.Popen:
    """`wrap(argv)` in a session of its own, its output to `log` (else a text pipe)."""
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(wrap(argv), cwd=cwd, env=env or job_env(), stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def launch(nproc: int, argv: list[str]) -> subprocess.Popen:
    """train.py on `nproc` local ranks, its output a text pipe."""
    return start([*torchrun(nproc), "train.py", *argv], env=job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))


def child_pids(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def worker_ranks(proc: subprocess.Popen) -> dict[int, int]:
    """{global rank: pid} of a torchrun job's workers."""
    out = {}
    for agent in [proc.pid] + child_pids(proc.pid):
        for pid in child_pids(agent):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env and b"LOCAL_RANK" in env:
                out[int(env[b"RANK"])] = pid
    return out


def stop(*procs, grace: float = 0):
    """Each job ended: SIGTERM to its session first when `grace` > 0, then SIGKILL to its
    workers (each may be in a session of its own) and its session."""
    for p in procs:
        if p.poll() is None and grace:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            for pid in [*worker_ranks(p).values(), None]:
                try:
                    os.kill(pid, signal.SIGKILL) if pid else os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        p.wait()


def clean_stop(*procs):
    """Each torchrun job stopped as a scheduler stops it: SIGTERM to its ranks, which save and
    exit 0 (and so does torchrun). Wait for them with the job's `wait()`."""
    for p in procs:
        for pid in worker_ranks(p).values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, bool]:
    """A piped job's output and whether it hung: a job still running after `timeout` s is killed."""
    try:
        return proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        stop(proc)
        return proc.communicate()[0], True


def run_logged(argv: list[str], log: Path, timeout: float, root: Path = ROOT) -> tuple[str | None, str]:
    """Run argv (from `root`) to its end or `timeout`: (None or what went wrong, the log's text)."""
    proc = start(argv, log, env=job_env(root), cwd=root)
    try:
        rc = proc.wait(timeout=timeout)
        error = None if rc == 0 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        stop(proc, grace=20)
        error = f"timed out after {timeout:.0f} s"
    return error, log.read_text(errors="replace")


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


def problem(out: str | Path, what: str, lines: int = 20) -> str:
    """`what`, and the last lines of a job's output (a string, or a log file)."""
    if isinstance(out, Path):
        out = out.read_text(errors="replace") if out.exists() else ""
    return what + "; the job's last output:\n" + "\n".join(out.splitlines()[-lines:])


# -- groups as separate torchrun jobs (train.py --lighthouse) ---------------------------------------

TIMEOUT = 10   # --outer-timeout of every group: how long an exchange or a quorum waits
# every group cell's run: H = 4 in 2 fragments (an exchange every 2 inner steps), a line per iteration
RUN = ["--global-batch-size", "8", "--zero-stage", "3", "--outer-sync-interval", "4", "--outer-fragments", "2",
       "--log-interval", "1", "--eval-interval", "100000"]
LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
FIGURES: dict = {}   # a cell's measured figures, beside its verdict in the JSON
# not anchored to a line's start: another process writing to the same log (torchft's logger) can
# leave its text in front of a training line
LINE = re.compile(r" \[([0-9: -]+)\] iteration +(\d+)/")
SAMPLES = re.compile(r" \[[0-9: -]+\] iteration +\d+/ *\d+ \| consumed samples: +(\d+) .*global batch size: +(\d+)")
VALIDATION = re.compile(r"validation loss at iteration +(\d+) on validation set \| lm loss value: ([0-9.E+-]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lighthouse(log: Path, heartbeat_ms: int = 3000, join_ms: int = 2000, min_replicas: int = 1,
                     port: int | None = None, host: str = "127.0.0.1", wrap=list) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on `port` (a free local one by default): (its process, its URL)."""
    port = port or free_port()
    return start([LIGHTHOUSE, "--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_ms),
                  "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{port}"],
                 log, wrap), f"http://{host}:{port}"


def launch_group(group: int, groups: int, lighthouse: str, argv: list[str], log: Path, wrap=list) -> subprocess.Popen:
    """Group `group` of `groups`: train.py on 2 local ranks under its own torchrun (run by `wrap(argv)`)."""
    return start([*torchrun(2), "train.py", *argv, "--lighthouse", lighthouse, "--group-id", str(group),
                  "--num-groups", str(groups), "--outer-timeout", str(TIMEOUT)], log, wrap)


def script(*args, env: dict) -> subprocess.Popen:
    """scripts/launch_groups.sh `args` as a user runs it."""
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "launch_groups.sh"), *args], cwd=ROOT,
                            env=job_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def iterations(log: Path) -> list[tuple[float, int]]:
    """(wall time, iteration) of every training line of a log (--log-interval 1)."""
    return [(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp(), int(it))
            for stamp, it in LINE.findall(log.read_text(errors="replace"))]


def samples_in_order(log: Path) -> bool:
    """Whether every training line consumed exactly one global batch after the line before: the
    group's data position never skips or repeats a sample, whatever inner step it continues at."""
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
    start_ = next(n for n, line in enumerate(lines) if (m := LINE.search(line)) and int(m[2]) == seen[at][1])
    meanwhile = lines[start_:start_ + 1 + next((k for k, line in enumerate(lines[start_ + 1:])
                                               if LINE.search(line)), 40)]
    return "\n".join([f"{log.name} stood still for {gap:.0f} s after iteration {seen[at][1]} (the exchange "
                      f"timeout is {TIMEOUT} s, {timeouts} allowed); meanwhile:", *meanwhile[:60]])


def finals(*logs: Path) -> list:
    """Each log's last validation line: the same in every group when they end on one global model."""
    return [VALIDATION.findall(log.read_text(errors="replace"))[-1:] for log in logs]


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
