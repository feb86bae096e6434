"""SIGTERM to a job started the way the launch scripts start it (`python -m parallel.launch`,
torchrun's arguments): every worker saves and exits 0, and so does the launcher. torchrun
itself exits 1 with a traceback after a signal whatever its workers did (its agent re-raises
the signal as SignalException once the workers are down)."""
import os
import signal
import subprocess
import sys

import pytest

from parallel.launch import workers_exited_cleanly
from tests.integration.train.test_train import corpus, flags  # noqa: F401 - corpus is a fixture
from training.checkpoint import latest_iteration
from tests import REPO

ROOT = str(REPO)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def start(cmd, env=ENV):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def term_after(proc, marker: str, count: int) -> str:
    """SIGTERM to the job's whole process group (as SLURM does) once `marker` was printed
    `count` times; everything it printed."""
    seen = []
    while sum(marker in line for line in seen) < count:
        line = proc.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    return "".join(seen) + out


WORKER = """import os, signal, sys, time
sys.path.insert(0, {root!r})
from parallel.launch import mark_worker
mark_worker()
status = {status}
def stop(*_):
    mark_worker(status)
    os._exit(status)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("status, rc", [(0, 0), (3, 1)])
def test_launcher_status_follows_the_workers(tmp_path, status, rc):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=ROOT, status=status))
    proc = start([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc-per-node", "2", str(script)])
    out = term_after(proc, "ready", 2)
    assert proc.returncode == rc, out
    assert "Traceback" not in out, out
    if rc == 0:
        assert "> torchrun stopped by SIGTERM: all 2 workers on this node exited 0" in out
    else:
        assert "error: torchrun stopped by SIGTERM: 2 of 2 workers on this node did not exit 0" in out


def test_marks_of_the_last_attempt_count(tmp_path):
    for name, text in (("0.0.started", "2"), ("0.1.started", "2"), ("0.0.exit0", "2"), ("0.1.exit0", "2"),
                       ("1.0.started", "2"), ("1.1.started", "2"), ("1.0.exit0", "2")):
        (tmp_path / name).write_text(text)
    assert workers_exited_cleanly(str(tmp_path)) == (1, 2)   # attempt 1 (a restart): one worker did not finish
    (tmp_path / "1.1.exit0").write_text("2")
    assert workers_exited_cleanly(str(tmp_path)) == (2, 2)


@pytest.mark.slow
def test_sigterm_training_exits_0(corpus, tmp_path):  # noqa: F811
    """train.py on 2 ranks: both finish the step, save it and exit 0; the launcher exits 0."""
    args = flags(corpus, tmp_path, 100000, ["--log-interval", "1", "--save-interval", "100000",
                                             "--eval-interval", "100000"])
    proc = start([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc-per-node", "2", "train.py",
                  *args])
    out = term_after(proc, "lm loss:", 3)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert out.count("SIGTERM received: stopped after iteration") == 1, out   # once per job, by rank 0
    it = latest_iteration(str(tmp_path / "ckpt"))
    assert it is not None and it >= 3


@pytest.mark.slow
def test_sigterm_through_a_launch_script(tmp_path):
    """The README's promise, through scripts/pretrain_gpt_1.5b_zero1.sh (SMOKE=1: 4 CPU ranks)."""
    env = dict(ENV, SMOKE="1", SMOKE_ITERS="100000", SMOKE_SAVE=str(tmp_path / "ckpt"))
    for key in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ID", "DRY_RUN"):
        env.pop(key, None)
    proc = start(["bash", "scripts/pretrain_gpt_1.5b_zero1.sh"], env)
    out = term_after(proc, "lm loss:", 2)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("SIGTERM received: stopped after iteration") == 1, out[-3000:]
    assert latest_iteration(str(tmp_path / "ckpt")) is not None


@pytest.mark.slow
def test_exit_interval_is_said_once_per_job(corpus, tmp_path):  # noqa: F811
    args = flags(corpus, tmp_path, 100, ["--exit-interval", "2", "--log-interval", "1", "--eval-interval", "100000"])
    proc = start([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc-per-node", "2", "train.py",
                  *args])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert out.count("> --exit-interval reached: stopped after iteration 2; checkpoint") == 1, out
