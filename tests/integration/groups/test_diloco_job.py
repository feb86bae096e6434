"""Streaming DiLoCo through train.py as a user runs it: 4 gloo ranks as 2 groups of one 2-rank
node (`--ranks-per-node 2 --group-size 1`), a 2-layer GPT on a tiny corpus.

- a stop decided in one group (a SIGTERM to its ranks only, a loss that diverges there first)
  stops every group at the same iteration, and the checkpoint it leaves is complete and loadable;
- the run ends with every fragment synchronized: a run shorter than H still exports what it
  trained, and says that the final synchronization is its only one;
- the validation loss printed is the global parameters' (what the export takes) on exactly the
  samples a run without groups evaluates;
- a warm-up as long as the run validates as the run without groups;
- one group only, or clipping per group, is said in one line.
"""
import pytest
import torch

from scenarios.diloco_job import GROUPS, SHORT, TOPK2, diverge_one_group, short_export, signal_one_group
from tests.distributed import train_ranks
from tests.integration.inputs.test_cli_errors import fails, good
from tests.integration.inputs.test_cli_errors import corpus as cli_corpus   # noqa: F401 (a fixture)
from tests.integration.train.test_train import corpus, flags   # noqa: F401 (corpus: the fixture)
from tools.export_checkpoint import consolidated_state_dict
from training.checkpoint import iteration_dir


def base(corpus, out):  # noqa: F811
    """The tiny GPT on the tiny corpus; scenarios/diloco_job.py's flags (the groups, the fault's) come
    after these and win."""
    return flags(corpus, out, 1)


# -- a stop in one group stops the job --------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_to_one_group_stops_every_group_and_saves(corpus, tmp_path):  # noqa: F811
    """A node's preemption: SIGTERM to group 1's ranks only. Every rank stops after the same
    iteration, the checkpoint is complete, and the job exits 0 (scenarios/diloco_job.py)."""
    assert signal_one_group(base(corpus, tmp_path), tmp_path / "ckpt") == ""


@pytest.mark.slow
@pytest.mark.parametrize("outer", [(), TOPK2], ids=["exact", "topk2"])
def test_a_loss_diverging_in_one_group_stops_every_group_with_a_loadable_checkpoint(corpus, tmp_path, outer):  # noqa: F811
    """fp32 SGD at a learning rate that diverges, one group first (each group stopping alone,
    the other reported a save that never completed). Every rank stops after the same iteration
    and saves it, the last good weights, and it is the latest and loadable; with sparse outer
    gradients too (the unsent rest lives in the weights)."""
    assert diverge_one_group(base(corpus, tmp_path), tmp_path / "ckpt", tuple(outer)) == ""


# -- the end of training and what is evaluated ---------------------------------------------------------

@pytest.fixture(scope="module")
def short_run_done(corpus, tmp_path_factory):  # noqa: F811
    """6 iterations with H = 100: no exchange before the end; evaluated and saved at 3 and 6
    (scenarios/diloco_job.py's short run, on pooled ranks: the launcher is not under test here)."""
    tmp = tmp_path_factory.mktemp("short")
    argv = [*base(corpus, tmp), *GROUPS, *SHORT]
    rc, out = train_ranks(4, argv)
    assert rc == 0, out[-3000:]
    return argv, out, tmp / "ckpt"


@pytest.mark.slow
def test_a_run_shorter_than_h_exports_what_it_trained(short_run_done):
    _, out, save = short_run_done
    assert short_export(out, 0, save) == ""


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


def test_validation_is_the_global_parameters_on_the_plain_runs_samples(short_run_done, monkeypatch):
    argv, out, save = short_run_done
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


@pytest.mark.slow
def test_a_warm_up_as_long_as_the_run_validates_as_the_run_without_groups(corpus, tmp_path):  # noqa: F811
    def run(name, *extra):
        rc, out = train_ranks(4, [*base(corpus, tmp_path / name), "--train-iters", "8", "--eval-interval", "8", *extra])
        assert rc == 0, out
        return out, [float(line.split("lm loss value: ")[1].split(" ")[0])
                     for line in out.splitlines() if "validation loss at iteration 8 |" in line]

    out, warm = run("warm", *GROUPS, "--outer-sync-interval", "4", "--outer-warmup-iters", "8")
    _, plain = run("plain", "--global-batch-size", "8", "--zero-stage", "3", "--ranks-per-node", "2")
    assert "; the first 8 iterations as one synchronous job (gradients averaged across the groups)" in out
    assert "(the job's during the warm-up)" in out   # --clip-grad's note: Megatron's default 1.0 clips
    assert len(warm) == len(plain) == 1 and abs(warm[0] - plain[0]) <= 1e-5 * plain[0], (warm, plain)


# -- careless inputs --------------------------------------------------------------------------------------

def test_one_group_is_refused(cli_corpus, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", "2")   # one node of 2 ranks: a group of the whole job
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fails(good(cli_corpus, "--zero-stage", "3", "--outer-sync-interval", "4"), capsys,
          "--outer-sync-interval 4 synchronizes groups of nodes, and this job is one node of 2 ranks",
          "run 4+ ranks (2 groups of 2), or drop --outer-sync-interval 4")


def test_clipping_per_group_is_said(short_run_done):
    assert "--clip-grad 1 clips each group's own gradient norm, not the job's" in short_run_done[1]
