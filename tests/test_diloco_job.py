"""Streaming DiLoCo through train.py as a user runs it: 4 gloo ranks as 2 groups of one 2-rank
node (`--ranks-per-node 2 --group-size 1`), a 2-layer GPT on a tiny corpus.

- a stop decided in one group (a SIGTERM to its ranks only, a loss that diverges there first)
  stops every group at the same iteration, and the checkpoint it leaves is complete and loadable;
- the run ends with every fragment synchronized: a run shorter than H still exports what it
  trained, and says that the final synchronization is its only one;
- the validation loss printed is the global parameters' (what the export takes) on exactly the
  samples a run without groups evaluates;
- one group only, or clipping per group, is said in one line.
"""
import os
import signal
import subprocess

import pytest
import torch

from tests.test_cli_errors import fails, good
from tests.test_cli_errors import corpus as cli_corpus   # noqa: F401 (a fixture)
from tests.test_train import corpus, flags   # noqa: F401 (corpus: the fixture)
from tests.test_train_faults import ROOT, TORCHRUN, _children
from tools.export_checkpoint import consolidated_state_dict
from training.checkpoint_files import iteration_dir, latest_iteration, resolve_checkpoint, verify_checksums

GROUPS = ["--global-batch-size", "8", "--zero-stage", "3", "--ranks-per-node", "2", "--group-size", "1"]


def launch(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen([*TORCHRUN, "4", "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, timeout: float) -> str:
    """The job's output; a job still running after `timeout` s is killed and fails the test."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for pid in worker_ranks(proc).values():   # each worker in a session of its own
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"the job hung (killed after {timeout:.0f} s):\n{out[-3000:]}")


def loadable(save) -> int:
    """The iteration the tracker names, checked complete (meta, every file's checksum)."""
    it = latest_iteration(str(save))
    path = resolve_checkpoint(str(save))
    assert it is not None and path == iteration_dir(str(save), it), (it, path)
    assert not verify_checksums(path), verify_checksums(path)
    assert not [p for p in os.listdir(save) if p.endswith(".tmp")]
    weights, meta = consolidated_state_dict(path)
    assert meta["iteration"] == it and all(torch.isfinite(w).all() for w in weights.values())
    return it


def worker_ranks(proc) -> dict[int, int]:
    """{global rank: pid} of the job's workers (torchrun's children)."""
    out = {}
    for agent in [proc.pid] + _children(proc.pid):
        for pid in _children(agent):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env and b"LOCAL_RANK" in env:
                out[int(env[b"RANK"])] = pid
    return out


# -- a stop in one group stops the job --------------------------------------------------------------

def test_sigterm_to_one_group_stops_every_group_and_saves(corpus, tmp_path):  # noqa: F811
    """A node's preemption: SIGTERM to group 1's ranks only. Every rank stops after the same
    iteration, the checkpoint is complete, and the job exits 0."""
    save = tmp_path / "ckpt"
    proc = launch(flags(corpus, tmp_path, 100000, [*GROUPS, "--outer-sync-interval", "4", "--log-interval", "1",
                                                   "--save-interval", "100000", "--eval-interval", "100000"]))
    seen = []
    while len(seen) < 3:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("".join(seen))
        seen.append(line) if "lm loss:" in line else None
    workers = worker_ranks(proc)
    assert sorted(workers) == [0, 1, 2, 3], workers
    for r in (2, 3):
        os.kill(workers[r], signal.SIGTERM)
    out = finish(proc, 90)
    assert proc.returncode == 0, out[-3000:]
    it = loadable(save)
    assert f"SIGTERM received: stopped after iteration {it}; checkpoint {save / f'iter_{it:07d}'}" in out, out


def test_a_loss_diverging_in_one_group_stops_every_group_with_a_loadable_checkpoint(corpus, tmp_path):  # noqa: F811
    """fp32 SGD at a learning rate that diverges, group 0 first: its loss is non-finite at
    iteration 9, group 1's only at 10 (each group stopping alone, group 1 reported a save of
    iteration 10 that never completed). Every rank stops after the same iteration and saves it,
    the last good weights, and it is the latest and loadable."""
    save = tmp_path / "ckpt"
    proc = launch(flags(corpus, tmp_path, 30, [*GROUPS, "--outer-sync-interval", "4", "--optimizer", "sgd",
                                               "--lr", "6", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                                               "--clip-grad", "0", "--log-interval", "1", "--save-interval", "2",
                                               "--eval-interval", "1000"]))
    out = finish(proc, 120)
    assert proc.returncode == 1, out[-3000:]
    saved = {line.split("saved to ")[1].split(";")[0] for line in out.splitlines() if "not finite" in line}
    it = loadable(save)
    assert saved == {str(save / f"iter_{it:07d}")}, (saved, it)   # what every rank said is what is there


# -- the end of training and what is evaluated ---------------------------------------------------------

SHORT = ["--train-iters", "6", "--outer-sync-interval", "100", "--eval-interval", "3", "--eval-iters", "2",
         "--save-interval", "3", "--log-interval", "3"]


@pytest.fixture(scope="module")
def short_run(corpus, tmp_path_factory):  # noqa: F811
    """6 iterations with H = 100: no exchange before the end; evaluated and saved at 3 and 6."""
    tmp = tmp_path_factory.mktemp("short")
    argv = flags(corpus, tmp, 6, [*GROUPS, *SHORT])
    proc = launch(argv)
    out = finish(proc, 180)
    assert proc.returncode == 0, out[-3000:]
    return argv, out, tmp / "ckpt"


def test_a_run_shorter_than_h_exports_what_it_trained(short_run):
    _, out, save = short_run
    start = consolidated_state_dict(iteration_dir(str(save), 3))[0]   # no exchange yet: the initialization
    end = consolidated_state_dict(str(save))[0]
    assert any(not torch.equal(end[k], v) for k, v in start.items())
    assert "--outer-sync-interval 100 >= --train-iters 6: the final synchronization at the end of training is " \
           "the only one" in out
    assert "final exchange of all 1 fragment(s) after iteration 6" in out


def plain_validation_loss(argv, weights: dict, first: int, count: int) -> float:
    """The loss of `weights` on validation samples [first, first + count), in one process: what
    a run without groups evaluates (its ranks' micro-batch means, averaged)."""
    import train
    from model import GPT
    from training.args import parse_args, resolve_batch
    from training.model_args import model_config
    from training.preflight import check_inputs
    args = parse_args(argv)
    resolve_batch(args, 4)
    vocab = check_inputs(args).vocab_size
    valid = train.build_datasets(args)[1]
    model = GPT(model_config(args, vocab, args.seed))
    model.load_state_dict(weights)
    model.eval()
    batch = torch.stack([torch.as_tensor(valid[i % len(valid)]) for i in range(first, first + count)])
    with torch.no_grad():
        return model(batch[:, :-1], batch[:, 1:]).item()


def test_validation_is_the_global_parameters_on_the_plain_runs_samples(short_run, monkeypatch):
    argv, out, save = short_run
    monkeypatch.setenv("WORLD_SIZE", "4")   # the job's, for the argument checks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    printed = {int(line.split("iteration ")[1].split(" ")[0]): float(line.split("lm loss value: ")[1].split(" ")[0])
               for line in out.splitlines() if "validation loss at iteration" in line}
    assert sorted(printed) == [3, 6]
    per_eval = 2 * 8   # --eval-iters global batches of 8
    for it, first in ((3, 0), (6, per_eval)):
        weights = consolidated_state_dict(iteration_dir(str(save), it))[0]
        expected = plain_validation_loss(argv, weights, first, per_eval)
        assert abs(printed[it] - expected) <= 2e-5 * expected, (it, printed[it], expected)
    assert "groups' drift from them: " in out


# -- careless inputs --------------------------------------------------------------------------------------

def test_one_group_is_refused(cli_corpus, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", "2")   # one node of 2 ranks: a group of the whole job
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fails(good(cli_corpus, "--zero-stage", "3", "--outer-sync-interval", "4"), capsys,
          "--group-size 1 makes one group of the job's 1 node(s): there is no other group to synchronize with")


def test_clipping_per_group_is_said(short_run):
    assert "--clip-grad 1 clips each group's own gradient norm, not the job's" in short_run[1]
