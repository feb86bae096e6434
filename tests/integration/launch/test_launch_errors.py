"""A user error under torchrun is one line and exit status 2 through `python -m parallel.launch`
and the launch scripts: train.py's checks run once before any worker starts, and a user error
the workers find ends the job without torchrun's report. A crash keeps all of torchrun's output.
Plain torchrun prints its own report after our line (and exits 1): the tests say what it adds."""
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from parallel.launch import HeldShutdownLogs, user_error_line
from tests import REPO

ROOT = str(REPO)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
DATA = os.path.join(ROOT, "work_dir", "kjv_text_document")
TOKENIZER = os.path.join(ROOT, "work_dir", "kjv_sp.model")
# 4 ranks as 2 nodes x 2 with hpZ over 4 ranks: the case, a topology error
HPZ_TOO_BIG = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--data-path", DATA,
               "--tokenizer-model", TOKENIZER, "--zero-stage", "3", "--zero-hpz-size", "4", "--ranks-per-node", "2",
               "--distributed-backend", "gloo"]
HPZ_LINE = "error: zero_hpz_partition_size (--zero-hpz-size) 4 must divide the ranks per node (2)"


@pytest.fixture(scope="module")
def bundled_corpus():
    if not (os.path.isfile(DATA + ".idx") and os.path.isfile(TOKENIZER)):
        subprocess.run(["bash", "scripts/prepare_demo_data.sh"], cwd=ROOT, check=True, capture_output=True,
                       timeout=600)


def run(cmd, env=ENV, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def launch(*args, nproc=4):
    return run([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc-per-node", str(nproc), *args])


# -- what parallel.launch reads from torchrun's failures ---------------------------------------

def failure(tmp_path, rank: int, exitcode: int, line: str | None = None) -> ProcessFailure:
    path = tmp_path / f"error_{rank}.json"
    if line is not None:   # what train.py writes (parallel.launch.report_error_to_torchrun)
        path.write_text(json.dumps({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                               "timestamp": "0"}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_a_user_error_is_exit_2_with_the_line_and_the_rest_stopped_by_the_agent(tmp_path):
    line = "error: --lr is required"
    assert user_error_line({0: failure(tmp_path, 0, 2, line), 1: failure(tmp_path, 1, 2, line),
                            2: failure(tmp_path, 2, -signal.SIGTERM), 3: failure(tmp_path, 3, -signal.SIGKILL)}) == line


@pytest.mark.parametrize("other", [
    (1, "error: x"),             # a worker exited 1 (a crash, or a runtime failure)
    (-signal.SIGSEGV, None),     # a worker died of a signal the agent does not send
    (2, None),                   # exit status 2 without our line (Python's "can't open file", ...)
])
def test_anything_else_is_a_crash(tmp_path, other):
    line = "error: --lr is required"
    assert user_error_line({0: failure(tmp_path, 0, 2, line), 1: failure(tmp_path, 1, *other)}) is None


def test_the_agents_lines_are_held_then_dropped_after_a_user_error_and_shown_otherwise():
    shown = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    logger = logging.getLogger(HeldShutdownLogs.LOGGER)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        logs = HeldShutdownLogs()
        logger.warning("Sending process %s closing signal %s", 11, "SIGTERM")
        logger.error("failed (exitcode: %s) local_rank: %s", 2, 0)
        assert shown == []
        logs.close(show=False)
        logs = HeldShutdownLogs()
        logger.warning("Sending process %s closing signal %s", 12, "SIGTERM")
        logger.error("failed (exitcode: %s) local_rank: %s", 1, 0)   # a crash: shown at once, in order
        assert shown == ["Sending process 12 closing signal SIGTERM", "failed (exitcode: 1) local_rank: 0"]
        logger.warning("Sending process %s closing signal %s", 13, "SIGTERM")
        logs.close(show=True)
        assert shown[-1] == "Sending process 13 closing signal SIGTERM"
        logger.warning("Sending process %s closing signal %s", 14, "SIGTERM")   # closed: nothing held
        assert shown[-1] == "Sending process 14 closing signal SIGTERM"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- as users run it ---------------------------------------------------------------------------

def test_train_py_without_torchrun_names_the_torchrun_command(capsys, monkeypatch):
    """`python train.py --config configs/demo.yaml`: the demo's 2 emulated nodes of 2 need 4 ranks."""
    import train
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    assert train.run(["--config", "configs/demo.yaml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --ranks-per-node 2 (from configs/demo.yaml) emulates nodes of 2 ranks, and this is one process: "
        "launch with torchrun --nproc-per-node 4 (2 nodes of 2), or drop --ranks-per-node"]


@pytest.mark.slow
def test_launch_checks_before_the_workers_start(bundled_corpus):
    r = launch("train.py", *HPZ_TOO_BIG)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(HPZ_LINE), r.stderr


@pytest.mark.slow
def test_a_user_error_only_the_workers_find_is_one_line(bundled_corpus):
    """A split whose validation part holds no document: found when the datasets are built, after
    the process group, on every rank; rank 0 prints it, the launcher adds nothing."""
    args = HPZ_TOO_BIG + ["--split", "100000,1,1"]
    args[args.index("--zero-hpz-size") + 1] = "2"
    r = launch("train.py", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"error: the valid split of {DATA} (documents 1189..1189) has 0 tokens, fewer "
                                     f"than one sample of --seq-length 64 + 1; use a smaller --seq-length or a "
                                     f"different --split"], r.stderr


CRASH = """import os, sys
sys.path.insert(0, {root!r})
from parallel.launch import mark_worker
mark_worker()
if os.environ["RANK"] == "1":
    raise RuntimeError("a bug on rank 1")
import time; time.sleep(60)
"""


@pytest.mark.slow
def test_a_crash_keeps_torchruns_report(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(CRASH.format(root=ROOT))
    r = launch(str(script), nproc=2)
    assert r.returncode == 1, r.stdout + r.stderr
    for text in ("RuntimeError: a bug on rank 1", "failed (exitcode: 1)", "ChildFailedError", "Root Cause",
                 "Sending process"):
        assert text in r.stderr, (text, r.stderr)


@pytest.mark.slow
def test_plain_torchrun_prints_the_line_first_then_its_report(bundled_corpus):
    """What plain torchrun adds (docs/launching.md): its report, rank 0's line as the root cause, exit 1."""
    r = run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "4",
             "train.py", *HPZ_TOO_BIG])
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and lines[0].startswith(HPZ_LINE), r.stderr
    assert "ChildFailedError" in r.stderr and f"traceback : {HPZ_LINE}" in r.stderr


@pytest.mark.slow
def test_a_launch_script_error_is_one_line(tmp_path):
    env = dict(ENV, SMOKE="1", TMPDIR=str(tmp_path))
    r = run(["bash", "scripts/pretrain_gpt_18b.sh", "--num-layer", "4"], env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == ["error: unrecognized arguments: --num-layer 4; did you mean --num-layers? "
                                     "see `python train.py --help`"], r.stderr
    assert "Traceback" not in r.stdout


def test_more_ranks_than_gpus_on_a_node_is_one_line(monkeypatch):
    """torchrun --nproc-per-node above the node's GPU count (GPUS_PER_NODE=16 on 8 GPUs): the
    count, before a rank fails in cuda.set_device. (CPU here: the GPU count is what torch reports.)"""
    import torch

    from common import ConfigError
    from parallel.startup import check_devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    with pytest.raises(ConfigError, match=r"^torchrun starts 16 ranks on this node and it has 8 GPU\(s\): pass "
                                          r"--nproc-per-node 8 \(GPUS_PER_NODE=8 for the launch scripts\)$"):
        check_devices("nccl")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert check_devices("nccl") == "nccl" and check_devices("gloo") == "gloo"
