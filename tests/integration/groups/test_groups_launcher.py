"""The groups' launchers as a user trusts them: scripts/launch_groups.sh and
examples/slurm/diloco_groups.sbatch exit with the groups' status and name those that failed,
report a Lighthouse that cannot start, append to a restarted group's log, never start a group
that is running, and refuse a run of no group; train.py --lighthouse keeps each group's files
(--save, --load, --tensorboard-dir, from flags or --config) in DIR/group<g>. Most cases need no
training: the groups fail at once on a bad flag."""
import importlib.util
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from scenarios.harness.jobs import free_port, job_env, wait_for
from tests.integration.train.test_train import corpus   # noqa: F401 (the tiny corpus: a fixture)
from training.args import parse_args
from training.checkpoint import TRACKER
from tests import REPO

ROOT = REPO
SCRIPT = ROOT / "scripts" / "launch_groups.sh"
SBATCH = ROOT / "examples" / "slurm" / "diloco_groups.sbatch"
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")


def launcher(tmp: Path, *args, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    env = job_env(GROUPS_DIR=str(tmp / "run"), LIGHTHOUSE_PORT=env.pop("port", str(free_port())), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_error(r: subprocess.CompletedProcess) -> str:
    """The one `error:` line on stderr (no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("args, says", [
    (("start", "0", "2"), "error: G must be at least 1, got 0"),
    (("start", "2", "0"), "error: NPROC must be at least 1, got 0"),
    (("group", "0", "2", "0"), "error: NPROC must be at least 1, got 0"),
    (("group", "2", "2", "2"), "error: group 2 of 2: g must be below G (groups 0..1)"),
    (("start", "08", "2"), "error: G must be a number, got '08'"),
    (("stop", "1"), "error: group 1 is not running"),
])
def test_a_run_of_no_group_is_refused_before_anything_starts(tmp_path, args, says):
    r = launcher(tmp_path, *args)
    assert r.returncode == 2 and one_error(r).startswith(says), r
    assert not (tmp_path / "run").exists()   # nothing started: no Lighthouse started and stopped, no log


@pytest.mark.slow   # torchrun jobs (they fail at once, but each worker imports torch)
@needs_torchft
def test_start_exits_with_the_groups_status_and_says_which_failed_and_a_restart_appends(tmp_path):
    r = launcher(tmp_path, "start", "2", "1", "--not-a-flag")
    log = tmp_path / "run"
    assert r.returncode == 2, r   # a user error: parallel.launch's status (the check before any worker)
    assert one_error(r) == (f"error: 2 of 2 group(s) failed: group 0 (exit status 2, {log}/group0.log); "
                            f"group 1 (exit status 2, {log}/group1.log)")
    assert not answers(int(re.search(r"127\.0\.0\.1:(\d+)", r.stdout)[1]))   # the Lighthouse stopped with them
    assert not list(log.glob("*.pid"))   # nothing left that `stop` would signal
    # Group 1 again, alone: its log keeps the first run and adds a line at the start of the second.
    again = launcher(tmp_path, "group", "1", "2", "1", "--not-a-flag-either")
    assert again.returncode == 2 and "group 1 (exit status 2" in one_error(again), again
    text = (log / "group1.log").read_text()
    assert len(re.findall(r"(?m)^=== .* group 1 of 2 starts \(1 ranks\)", text)) == 2
    assert text.index("--not-a-flag") < text.index("--not-a-flag-either")


@needs_torchft
def test_a_lighthouse_that_cannot_start_is_one_line_and_no_group_starts(tmp_path):
    with socket.socket() as taken:   # the port in use by another program
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = launcher(tmp_path, "start", "2", "1", "--not-a-flag", port=str(port))
    assert r.returncode == 1 and one_error(r).startswith(f"error: port {port} is in use"), r
    r = launcher(tmp_path, "start", "2", "1", "--not-a-flag", port="70000")   # the Lighthouse exits at once
    assert r.returncode == 1 and one_error(r).startswith("error: the Lighthouse exited at once (status 1: "), r
    assert not list((tmp_path / "run").glob("group*"))


# -- the SLURM example, with SLURM's commands standing in on this machine ---------------------------

FAKE_SRUN = """#!/bin/bash
# srun on this machine: srun's own options dropped, the command run here
while (($#)); do case $1 in -w) shift 2 ;; -*) shift ;; *) break ;; esac; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
for ((i = 0; i < FAKE_NODES; i++)); do echo localhost; done
"""


def sbatch(tmp: Path, nodes: int, *flags, **env) -> subprocess.CompletedProcess:
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = job_env(**{"PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT),
                     "SLURM_JOB_NODELIST": "n[1-9]", "FAKE_NODES": str(nodes), "NODES_PER_GROUP": "1", "GPUS_PER_NODE": "1",
                     "RDZV_PORT": str(free_port()), "LIGHTHOUSE_PORT": str(free_port()), **env})
    return subprocess.run(["bash", str(SBATCH), *flags], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_slurm_example_refuses_a_job_too_small_for_one_group(tmp_path):
    r = sbatch(tmp_path, 1, NODES_PER_GROUP="2")
    assert r.returncode == 2 and one_error(r).startswith(
        "error: 1 node(s) make no group of NODES_PER_GROUP=2; sbatch --nodes=4 or more"), r
    r = sbatch(tmp_path, 1, ONLY_GROUP="1")
    assert r.returncode == 2 and "ONLY_GROUP=1 needs NUM_GROUPS" in one_error(r), r


@pytest.mark.slow   # torchrun jobs (they fail at once, but each worker imports torch)
@needs_torchft
def test_the_slurm_example_ends_with_its_groups_and_says_which_failed(tmp_path):
    port = free_port()
    r = sbatch(tmp_path, 2, "--not-a-flag", LIGHTHOUSE_PORT=str(port))
    assert r.returncode == 1, r
    # under SLURM the groups' and the Lighthouse's output is the job's too, in whatever order they wrote
    verdict = [line for line in r.stderr.splitlines() if line.startswith("error: group 0")]
    assert verdict and verdict[-1].startswith(
        "error: group 0 (exit status 2); group 1 (exit status 2); restart one alone: "
        "sbatch --nodes=1 --export=ALL,ONLY_GROUP=g,NUM_GROUPS=2,LIGHTHOUSE="), r.stderr[-2000:]
    assert not answers(port)   # the Lighthouse stopped with its groups (it used to hold the job to its time limit)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = sbatch(tmp_path, 2, LIGHTHOUSE_PORT=str(taken.getsockname()[1]))
    assert r.returncode == 1 and "is in use: set LIGHTHOUSE_PORT" in one_error(r), r


# -- each group's files ------------------------------------------------------------------------------

@pytest.fixture
def lighthouse_answers(monkeypatch):
    """group_args' Lighthouse URL answers (parsing checks that one does, before the model is built)."""
    monkeypatch.setattr("training.outer_args.lighthouse_answers", lambda url, wait: True)


def group_args(tmp: Path, *extra, group: int = 1):
    return parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                       "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--data-path", "data",
                       "--zero-stage", "3", "--outer-sync-interval", "4", "--lighthouse", "http://127.0.0.1:1",
                       "--group-id", str(group), "--num-groups", "2", *extra])


@needs_torchft
def test_each_group_keeps_its_own_files_from_flags_or_config(tmp_path, capsys, lighthouse_answers):
    config = tmp_path / "run.yaml"
    config.write_text(f"save: {tmp_path}/ckpt\ntensorboard-dir: {tmp_path}/tb\nload: {tmp_path}/ckpt\n")
    args = group_args(tmp_path, "--config", str(config))
    assert (args.save, args.load, args.tensorboard_dir) == tuple(
        str(tmp_path / d / "group1") for d in ("ckpt", "ckpt", "tb"))
    assert f"> note: group 1 keeps its own files: --save {tmp_path}/ckpt/group1" in capsys.readouterr().out
    assert group_args(tmp_path, "--save", str(tmp_path / "s"), group=0).save == str(tmp_path / "s" / "group0")


@needs_torchft
def test_a_group_loads_its_own_checkpoint_or_else_one_that_every_group_starts_from(tmp_path, lighthouse_answers):
    one_job, run = tmp_path / "warmup", tmp_path / "run"
    one_job.mkdir()
    (one_job / TRACKER).write_text("100")   # a checkpoint of one job (a warm-up): every group starts from it
    assert group_args(tmp_path, "--load", str(one_job)).load == str(one_job)
    assert group_args(tmp_path, "--load", str(run)).load == str(run / "group1")   # nothing yet: its own, later
    (run / "group1").mkdir(parents=True)
    (run / "group1" / TRACKER).write_text("40")
    assert group_args(tmp_path, "--load", str(run)).load == str(run / "group1")
    (one_job / "group1").mkdir()
    (one_job / "group1" / TRACKER).write_text("7")   # its own, once it saved there
    assert group_args(tmp_path, "--load", str(one_job)).load == str(one_job / "group1")


@pytest.mark.slow
@needs_torchft
def test_groups_from_one_config_save_apart_and_a_running_group_is_not_started_twice(corpus, tmp_path):  # noqa: F811
    """Two groups started with one --config that names --save and --tensorboard-dir: each saves and
    logs in its own folder (group 1 used to crash at its first save), `group 1` while group 1 runs
    is refused (it used to overwrite its pid file), and a Lighthouse killed meanwhile is said."""
    config = tmp_path / "run.yaml"
    config.write_text("\n".join([
        "num-layers: 2", "hidden-size: 32", "num-attention-heads: 4", "seq-length: 16", "micro-batch-size: 2",
        "global-batch-size: 8", "train-iters: 5000", "lr: 3.0e-3", f"data-path: {corpus}/docs_text_document",
        f"tokenizer-model: {corpus}/sp.model", f"data-cache-path: {tmp_path}/cache", "log-interval: 1",
        "eval-interval: 100000", "eval-iters: 1", "split: 90,10,0", "zero-stage: 3", "outer-sync-interval: 4",
        "outer-timeout: 5", f"save: {tmp_path}/ckpt", "save-interval: 10", f"tensorboard-dir: {tmp_path}/tb", ""]))
    env = job_env(GROUPS_DIR=str(tmp_path / "run"), LIGHTHOUSE_PORT=str(free_port()), JOIN_TIMEOUT_MS="2000")
    said = tmp_path / "start.err"
    with open(said, "w") as err:
        start = subprocess.Popen(["bash", str(SCRIPT), "start", "2", "2", "--config", str(config)], cwd=ROOT,
                                 env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        for g in (0, 1):   # group 1 used to crash here, at its first save
            assert wait_for(tmp_path / "run" / f"group{g}.log", r"saved checkpoint", 300, start), f"group {g}: no save"
        pid = (tmp_path / "run" / "group1.pid").read_text().strip()
        twice = launcher(tmp_path, "group", "1", "2", "2", "--config", str(config), port=env["LIGHTHOUSE_PORT"])
        assert twice.returncode == 2 and one_error(twice).startswith(f"error: group 1 is running (pid {pid}"), twice
        assert (tmp_path / "run" / "group1.pid").read_text().strip() == pid
        os.kill(int((tmp_path / "run" / "lighthouse.pid").read_text()), 9)   # the groups go on alone; start says so
        assert wait_for(said, r"warning: the Lighthouse has exited", 30, start), said.read_text()
        for g in (0, 1):
            stop = launcher(tmp_path, "stop", str(g), port=env["LIGHTHOUSE_PORT"])
            assert stop.returncode == 0, stop
        start.wait(timeout=300)
    finally:
        if start.poll() is None:
            os.killpg(start.pid, 9)
            start.wait()
    logs = "".join((tmp_path / "run" / f"group{g}.log").read_text()[-3000:] for g in (0, 1))
    assert start.returncode == 0, said.read_text() + logs
    for g in (0, 1):
        assert (tmp_path / "ckpt" / f"group{g}" / TRACKER).exists()
        assert list((tmp_path / "tb" / f"group{g}").glob("events.out.tfevents.*"))
        assert not (tmp_path / "ckpt" / TRACKER).exists() and not list((tmp_path / "tb").glob("events.*"))
