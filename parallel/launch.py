"""`python -m parallel.launch`: torchrun with one line for a user error, exit 0 after a signal that
every worker survived; and the worker's side of it (what a worker marks and reports for it).

torchrun (torch.distributed.run) turns any worker's non-zero exit into ChildFailedError, which
its main() re-raises: a traceback and a report repeating the error per rank, exit status 1,
after a user error as after a crash. And its agent turns a SIGTERM (or SIGINT) into
SignalException: it forwards the signal to the workers, waits up to --shutdown-timeout, then
re-raises, so torchrun exits 1 with a traceback even when every worker saved and exited 0.
`python -m parallel.launch` takes torchrun's arguments (scripts/lib/launch.sh runs it) and
1. runs train.py's checks of its command line once, before any worker starts (CHECK_ONLY): a
   user error is train.py's one line and exit status 2;
2. runs torchrun; when the workers stopped on a user error found only once they ran (train.py's
   exit status 2, its line in torchrun's error file), exits 2 without torchrun's report (rank 0
   printed the line), and with the report, as torchrun, for anything else: a crash keeps it all;
3. after a SIGTERM/SIGINT exits 0 when every worker of this node's last attempt exited 0: each
   marks its start and a clean exit in a directory it is given (EXIT_MARKS).

A worker's own start-up (the process group, its device, the C library's settings) is
parallel/startup.py.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_MARKS = "ZEROPP_EXIT_MARKS"
CHECK_ONLY = "ZEROPP_CHECK_ONLY"   # train.py checks its command line for this job's shape and exits
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
USER_ERROR_STATUS = 2
USER_ERROR_KEY = "train/user_error_reported"   # in torchrun's store: rank 0 printed this line


# -- the worker's side: its start and exit status, its error line -----------------------------
def mark_worker(status: int | None = None):
    """A worker's start (status None) or its exit status, for `python -m parallel.launch`;
    nothing under another launcher."""
    folder = os.environ.get(EXIT_MARKS)
    if not folder:
        return
    name = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.environ.get('LOCAL_RANK', '0')}"
    try:
        with open(os.path.join(folder, name + (".started" if status is None else f".exit{status}")), "w") as f:
            f.write(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except OSError:
        pass   # then the launcher reports torchrun's own status


def report_error_to_torchrun(line: str):
    """Under torchrun (torch.distributed.elastic), put `line` where its failure
    summary looks for this worker's error (the file @record writes), so the summary
    shows the one line instead of "To enable traceback see ...". Nothing otherwise."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                   "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass   # the summary then shows torchrun's generic text: the line is on stderr anyway


def report_user_error(line: str, rank: int, wait_s: float = 60.0):
    """Print a user error once per job. Every rank finds the same error; rank 0 prints it.
    torchrun stops every worker as soon as one exits, so a quiet rank that exited first could
    kill rank 0 before it printed: under torchrun the others wait on the agent's store (it
    lives as long as the job) until rank 0 says it has reported this line. A rank that hears
    nothing, or another line, within `wait_s` prints its own (an error only it found). Under
    other launchers the other ranks stay quiet."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    store = _agent_store(wait_s)
    if rank == 0:
        if store is not None:
            store.set(USER_ERROR_KEY, line)
        return
    if store is not None:
        try:
            store.wait([USER_ERROR_KEY], timedelta(seconds=wait_s))
            if store.get(USER_ERROR_KEY).decode() == line:
                return
        except RuntimeError:   # DistStoreError: rank 0 never reported
            pass
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def _agent_store(timeout_s: float):
    """torchrun's own key-value store (its agent hosts it for the job's life), or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    except (KeyError, ValueError, RuntimeError):
        return None


# -- the launcher ---------------------------------------------------------------------------------
def workers_exited_cleanly(folder: str) -> tuple[int, int]:
    """(workers of the last attempt that exited 0, workers that attempt had on this node)."""
    marks = os.listdir(folder)
    started = [m for m in marks if m.endswith(".started")]
    if not started:
        return 0, 1
    last = max(int(m.split(".")[0]) for m in started)
    with open(os.path.join(folder, next(m for m in started if int(m.split(".")[0]) == last))) as f:
        expected = int(f.read() or 1)
    return sum(m.startswith(f"{last}.") and m.endswith(".exit0") for m in marks), expected


def check_before_start(args) -> int:
    """train.py's checks of its command line (flags, config files, inputs, the job's shape), run
    once in a process of its own before torchrun starts the workers: its exit status (2 after a
    user error, whose line it printed on stderr; 0 when the workers may start). Its stdout (the
    notes) is dropped: rank 0 prints them again. Other scripts are not run (0)."""
    from torch.distributed import run as torchrun
    script = args.training_script
    if args.module or args.no_python or not os.path.isfile(script) or not os.path.samefile(script, TRAIN_SCRIPT):
        return 0
    local = torchrun.determine_local_world_size(args.nproc_per_node)
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env.update({CHECK_ONLY: "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(local)})
    if min_nodes == max_nodes:   # an elastic job's size is known only once its nodes meet
        env["WORLD_SIZE"] = str(min_nodes * local)
    return subprocess.run([sys.executable, script, *args.training_script_args], env=env,
                          stdout=subprocess.DEVNULL).returncode


def user_error_line(failures: dict) -> str | None:
    """The line of the user error the workers stopped on: every worker that exited by itself exited
    with status 2 and train.py's line in its error file, the others were stopped by the agent
    (SIGTERM, then SIGKILL after --shutdown-timeout). None for anything else (a crash)."""
    lines = []
    for failure in failures.values():
        if failure.exitcode < 0:   # killed by a signal
            if -failure.exitcode not in (signal.SIGTERM, signal.SIGKILL):
                return None
            continue
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        if failure.exitcode != USER_ERROR_STATUS or not str(message).startswith("error: "):
            return None
        lines.append(str(message))
    return lines[0] if lines else None


class HeldShutdownLogs(logging.Filter):
    """torchrun's agent logs a line per worker it stops and one naming the first failure. After a
    user error, or a signal every worker answered by saving and exiting 0, they add nothing: they
    are held from the first such line until the failure they lead to is known, shown at once for
    any exit status but 2 (and before anything else the agent logs), and at the end unless the
    launcher says they add nothing."""
    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.logger = logging.getLogger(self.LOGGER)
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Sending process") or (
                message.startswith("failed (exitcode") and record.args and record.args[0] == USER_ERROR_STATUS):
            self.held.append(record)
            return False
        self.release()
        return True

    def release(self, show: bool = True):
        held, self.held = self.held, []
        if show:
            self.logger.removeFilter(self)
            for record in held:
                self.logger.handle(record)
            self.logger.addFilter(self)

    def close(self, show: bool):
        self.release(show)
        self.logger.removeFilter(self)


def torchrun_main(argv: list[str]) -> int:
    """torchrun with `argv` (the three points above): 2 after a user error, 0 after a SIGTERM/SIGINT
    that every worker survived by saving and exiting 0, torchrun's own otherwise."""
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    status = check_before_start(args)
    if status:
        return status
    logs = HeldShutdownLogs()   # closed showing what it holds, unless the workers' exits say otherwise
    with tempfile.TemporaryDirectory(prefix="zeropp_launch.") as folder:
        os.environ[EXIT_MARKS] = folder
        if args.log_dir is None:   # else torchrun leaves a folder of its workers' error files in /tmp per run
            args.log_dir = os.path.join(folder, "torchelastic")
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            line = user_error_line(e.failures)
            if line is None:
                raise
            logs.close(show=False)
            if 0 not in e.failures:   # rank 0 printed the line on its node, not on this one
                print(line, file=sys.stderr, flush=True)
            return USER_ERROR_STATUS
        except SignalException as e:
            if e.sigval not in (signal.SIGTERM, signal.SIGINT):
                raise
            clean, expected = workers_exited_cleanly(folder)
            logs.close(show=clean < expected)
            if clean < expected:
                print(f"error: torchrun stopped by {e.sigval.name}: {expected - clean} of {expected} workers "
                      f"on this node did not exit 0 (their lines above say why)", file=sys.stderr, flush=True)
                return 1
            print(f"> torchrun stopped by {e.sigval.name}: all {expected} workers on this node exited 0",
                  file=sys.stderr, flush=True)
        finally:
            logs.close(show=True)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
