"""train.py on several ranks: exact resume for stages 1-3 and ZeRO++, and what
happens on preemption (SIGTERM), a rank crash under --max-restarts, a save
directory that cannot be written, and a loss that stops being finite. The
signal and restart tests run torchrun (the launcher is under test); the others
run train.py's run() on pooled ranks (tests/distributed.py train_ranks)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import train

from scenarios.diloco_job import child_pids
from tests.distributed import train_ranks
from tests.integration.train.test_train import corpus, flags  # noqa: F401  (corpus is a fixture)
from tools.export_checkpoint import consolidated_state_dict
from training.checkpoint import complete_iterations, latest_iteration
from tests import REPO

ROOT = str(REPO)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def torchrun(nproc, args, extra=(), wait=True, timeout=300):
    cmd = [*TORCHRUN, str(nproc), *extra, "train.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def losses(log: str) -> dict[int, str]:
    """iteration -> the logged loss, as printed."""
    out = {}
    for line in log.splitlines():
        if "lm loss:" in line and " iteration " in line:
            it = int(line.split(" iteration ")[1].split("/")[0])
            out[it] = line.split("lm loss:")[1].split("|")[0].strip()
    return out


ZERO = {"stage1": ["--zero-stage", "1"], "stage2": ["--zero-stage", "2"], "stage3": ["--zero-stage", "3"],
        "zeropp": ["--zero-stage", "3", "--zero-quantized-weights", "--zero-hpz-size", "2",
                   "--zero-quantized-gradients"]}


@pytest.mark.slow
@pytest.mark.parametrize("zero", list(ZERO))
def test_resume_is_bit_identical(corpus, tmp_path, zero):  # noqa: F811
    """4 ranks as 2 nodes x 2, fp32, dropout on, 2 micro-batches per step: 8 iterations in one go against
    4, stop, resume for 4 more. The resumed half crosses the end of warmup (iteration 5) and of the
    first data epoch (56 training samples, 8 per iteration); weights and losses are identical."""
    common = ["--ranks-per-node", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
              "--lr-warmup-iters", "5", "--log-interval", "1", "--eval-interval", "100", *ZERO[zero]]
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, full_log = train_ranks(4, flags(corpus, straight, 8, [*common, "--save-interval", "4"]))
    assert rc == 0, full_log
    rc, log = train_ranks(4, flags(corpus, split, 8, [*common, "--load", str(straight / "ckpt" / "iter_0000004")]))
    assert rc == 0, log
    assert "resumed from" in log and "at iteration 4, 32 samples consumed" in log
    a, b = losses(full_log), losses(log)
    assert sorted(b) == [5, 6, 7, 8] and all(a[i] == b[i] for i in b), (a, b)
    wa, wb = consolidated_state_dict(str(straight / "ckpt"))[0], consolidated_state_dict(str(split / "ckpt"))[0]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_sigterm_saves_and_exits_0(corpus, tmp_path):  # noqa: F811
    """The scheduler's SIGTERM reaches both ranks: they finish the step, save it and exit 0."""
    save = tmp_path / "ckpt"
    proc = torchrun(2, flags(corpus, tmp_path, 100000, ["--log-interval", "1", "--save-interval", "100000",
                                                         "--eval-interval", "100000"]), wait=False)
    seen = []
    while len(seen) < 3:  # a few iterations in
        line = proc.stdout.readline()
        assert line, "".join(seen)
        if "lm loss:" in line:
            seen.append(line)
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM does: every process of the job
    out, _ = proc.communicate(timeout=120)
    assert "SIGTERM received: stopped after iteration" in out, out
    it = latest_iteration(str(save))
    assert it is not None and it >= 3 and f"checkpoint {save / f'iter_{it:07d}'}" in out
    # resumes from there
    rc, log = train_ranks(2, flags(corpus, tmp_path, it + 2, ["--load", str(save), "--log-interval", "1"]))
    assert rc == 0 and f"at iteration {it}," in log and sorted(losses(log)) == [it + 1, it + 2], log


@pytest.mark.slow
def test_sigint_single_process_exits_0(corpus, tmp_path):  # noqa: F811
    cmd = [sys.executable, "train.py", *flags(corpus, tmp_path, 100000, ["--log-interval", "1",
                                                                          "--eval-interval", "100000"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    while "lm loss:" not in proc.stdout.readline():
        pass
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "SIGINT received" in out, out
    assert latest_iteration(str(tmp_path / "ckpt")) >= 1


@pytest.mark.slow
def test_rank_crash_restarts_and_resumes(corpus, tmp_path):  # noqa: F811
    """kill -9 of one rank after the first checkpoint: torchrun --max-restarts 1 restarts the job, which
    resumes from the last checkpoint and finishes; at most --save-interval steps are redone."""
    save = tmp_path / "ckpt"
    iters, interval = 40, 4
    args = flags(corpus, tmp_path, iters, ["--load", str(save), "--save-interval", str(interval),
                                           "--log-interval", "1", "--eval-interval", "100000"])
    log = tmp_path / "log.txt"
    with open(log, "w") as f:  # a file, not a pipe: nobody reads the output while we wait
        proc = subprocess.Popen([*TORCHRUN, "2", "--max-restarts", "1", "--monitor-interval", "0.5", "train.py",
                                 *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                         # torch's shared rendezvous store hands restarted workers stale
                                         # addresses (pytorch/pytorch#135712)
                                         TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        assert wait_for(lambda: (latest_iteration(str(save)) or 0) >= interval), log.read_text()
        workers = [p for p in child_pids(proc.pid) if "train.py" in open(f"/proc/{p}/cmdline").read()]
        assert workers, "no worker processes found"
        killed_at = latest_iteration(str(save))
        os.kill(workers[-1], signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert proc.returncode == 0, out
    resumed = [int(line.split("at iteration ")[1].split(",")[0]) for line in out.splitlines()
               if "> resumed from" in line]
    assert len(resumed) == 1 and resumed[0] >= killed_at, out
    assert latest_iteration(str(save)) == iters and iters in complete_iterations(str(save))


def test_unwritable_save_dir_fails_before_training(corpus, tmp_path, capsys):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    # train.run(), the command's own entry point, in this process (an exception would fail the test)
    status = train.run(flags(corpus, tmp_path, 4, ["--save", str(blocker / "ckpt")]))
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in err
    assert f"--save {blocker / 'ckpt'} is not writable" in err
    assert "lm loss" not in out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nonfinite_loss_stops_with_last_good_checkpoint(corpus, tmp_path, capsys, precision):  # noqa: F811
    """A learning rate of 1e30 makes the weights huge after one step, so the next losses are not finite.
    fp32 stops at the first bad step; fp16 skips steps (loss scale halved each time) and stops after
    --max-nan-iters of them. Either way the checkpoint holds the last finite weights."""
    extra = ["--lr", "1e30", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--clip-grad", "0",
             "--log-interval", "1"]
    if precision == "fp16":
        extra += ["--fp16", "--initial-loss-scale", "1024", "--max-nan-iters", "3"]
    status = train.run(flags(corpus, tmp_path, 50, extra))   # the command's entry point, in this process
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert "Traceback" not in err
    streak = 3 if precision == "fp16" else 1
    assert f"not finite for {streak} consecutive iteration(s)" in err, err
    it = latest_iteration(str(tmp_path / "ckpt"))
    assert f"saved to {tmp_path / 'ckpt' / f'iter_{it:07d}'}" in err
    weights, _ = consolidated_state_dict(str(tmp_path / "ckpt"))
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_async_save_writes_the_same_checkpoints(corpus, tmp_path):  # noqa: F811
    """--async-save: training goes on while each checkpoint is written; every checkpoint (and so every
    resume) is bit-identical to the synchronous run's, and each one is complete before the next."""
    common = ["--zero-stage", "3", "--save-interval", "2", "--log-interval", "1", "--eval-interval", "100"]
    rc, log_sync = train_ranks(2, flags(corpus, tmp_path / "sync", 6, common))
    assert rc == 0, log_sync
    rc, log = train_ranks(2, flags(corpus, tmp_path / "async", 6, [*common, "--async-save"]))
    assert rc == 0, log
    assert log.count("in the background") == 3 and log.count("> saved checkpoint at iteration") == 3, log
    assert losses(log) == losses(log_sync)
    for it in (2, 4, 6):
        a = consolidated_state_dict(str(tmp_path / "sync" / "ckpt" / f"iter_{it:07d}"))[0]
        b = consolidated_state_dict(str(tmp_path / "async" / "ckpt" / f"iter_{it:07d}"))[0]
        assert all(torch.equal(a[k], b[k]) for k in a), it
    assert complete_iterations(str(tmp_path / "async" / "ckpt")) == [2, 4, 6]


@pytest.mark.slow
def test_resume_on_fewer_ranks_continues_the_run(corpus, tmp_path):  # noqa: F811
    """Saved by 4 ranks at stage 3, resumed by 2 ranks at stage 1 with the same global batch: the data
    position is kept (same samples, same consumed count) and the losses continue the uninterrupted
    4-rank run's to a relative 1e-4 (printed to 7 digits; the reduction order differs). Dropout off,
    since dropout masks depend on which rank runs which sample."""
    common = ["--micro-batch-size", "1", "--global-batch-size", "8", "--log-interval", "1",
              "--eval-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]
    rc, full_log = train_ranks(4, flags(corpus, tmp_path / "four", 8, [*common, "--zero-stage", "3",
                                                                    "--save-interval", "4"]))
    assert rc == 0, full_log
    rc, log = train_ranks(2, flags(corpus, tmp_path / "two", 8, [*common, "--zero-stage", "1", "--load",
                                                              str(tmp_path / "four" / "ckpt" / "iter_0000004")]))
    assert rc == 0, log
    assert "at iteration 4, 32 samples consumed (saved by 4 ranks" in log
    assert "consumed samples:           64" in log
    a, b = losses(full_log), losses(log)
    assert sorted(b) == [5, 6, 7, 8]
    torch.testing.assert_close(torch.tensor([float(b[i]) for i in b]), torch.tensor([float(a[i]) for i in b]),
                               rtol=1e-4, atol=0)
