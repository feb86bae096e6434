"""Groups that survive each other (train.py --lighthouse): each group its own torchrun job of 2
gloo ranks, meeting the others through torchft's Lighthouse, on a 2-layer GPT and a tiny corpus
(scenarios/groups_job.py runs the jobs and checks them)."""
import importlib.util

import pytest

from scenarios.groups_edges import (async_late_for_the_end, async_resume, async_straggler, clean_start, refused_duplicate, refused_model,
                                refused_outer_flags, unreachable_lighthouse)
from scenarios.groups_job import kill_one_group, late_start_and_clean_stop, lighthouse_restart, same_as_one_job
from scenarios.groups_sites import NO_SITES, can_make_sites, heal_interrupted
from tests.integration.inputs.test_cli_errors import fails, good
from tests.integration.inputs.test_cli_errors import corpus as cli_corpus   # noqa: F401 (a fixture)
from tests.integration.train.test_train import corpus, flags   # noqa: F401 (corpus: the fixture)

# Found, not imported: torchft imports Triton (the groups' ranks import torchft in their own processes).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")


def base(corpus):  # noqa: F811
    return lambda out: flags(corpus, out, 1)


@pytest.mark.slow
def test_a_killed_group_never_stops_the_other_and_heals_from_it_when_restarted(corpus, tmp_path):  # noqa: F811
    """One rank of group 1 frozen in an exchange, then its launcher SIGKILLed: group 0 goes on
    alone within one exchange timeout and logs every iteration once; group 1, restarted from its
    own (older) checkpoint, heals from group 0, takes its inner step, exchanges with it again, and
    both end on the same global model."""
    assert kill_one_group(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_two_groups_as_two_jobs_train_the_model_of_one_job_bit_for_bit(corpus, tmp_path):  # noqa: F811
    """The outer step over torchft's quorum is the one of a job whose groups never fail: the same
    exchanges, token weights (equal: halves), data parts and final synchronization."""
    assert same_as_one_job(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_int4_groups_as_two_jobs_train_the_model_of_one_job_bit_for_bit(corpus, tmp_path):  # noqa: F811
    """INT4 outer gradients with --lighthouse (all-gathered over torchft's process group): the one
    job's model bit for bit, and its bytes across groups per iteration."""
    flags = base(corpus)
    assert same_as_one_job(lambda out: [*flags(out), "--outer-quantization", "int4"], tmp_path) == ""


@pytest.mark.slow
def test_a_lighthouse_restart_leaves_the_groups_training_and_they_meet_again(corpus, tmp_path):  # noqa: F811
    assert lighthouse_restart(base(corpus), tmp_path) == ""


@pytest.mark.slow
@pytest.mark.skipif(not can_make_sites(), reason=NO_SITES)
def test_a_heal_cut_off_midway_leaves_nothing_half_loaded_and_heals_again_later(corpus, tmp_path):  # noqa: F811
    """A late group heals from the other over a slow link (scenarios/groups_sites.py), and the link
    goes down midway for 15 s: the heal fails whole, the group trains alone, heals once the link
    is back and exchanges again; the other never stood still and read its samples in order;
    both end on the same global model."""
    assert heal_interrupted(base(corpus), tmp_path, iters=1200, rate_mbit=0.5) == ""


@pytest.mark.slow
def test_with_the_launch_script_a_late_group_joins_and_a_stopped_one_leaves(corpus, tmp_path):  # noqa: F811
    assert late_start_and_clean_stop(base(corpus), tmp_path) == ""


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "topk2"])
def test_compressed_outer_gradients_survive_a_kill_and_a_heal(corpus, tmp_path, quantization):  # noqa: F811
    """--outer-quantization with --lighthouse: the INT4 or topk2 rows all-gathered over torchft's
    process group, decoded with each member's weight; a killed group heals and exchanges again, and
    both end on the same global model."""
    flags = base(corpus)
    assert kill_one_group(lambda out: [*flags(out), "--outer-quantization", quantization], tmp_path) == ""


@pytest.mark.slow
def test_an_asynchronous_group_killed_mid_exchange_heals_and_exchanges_again(corpus, tmp_path):  # noqa: F811
    """--outer-async: the other group never waits for the killed one; the restart heals from it,
    takes the global values as its masters, offers again, and both end on the same global model."""
    flags = base(corpus)
    assert kill_one_group(lambda out: [*flags(out), "--outer-async"], tmp_path) == ""


@pytest.mark.slow
def test_asynchronous_groups_stopped_and_resumed_take_their_outer_state_back(corpus, tmp_path):  # noqa: F811
    """The asynchronous outer state's copy for a save was also what a load filled: the global values
    came back as the untrained model's."""
    assert async_resume(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_a_group_of_another_model_is_refused_alone_and_the_run_goes_on(corpus, tmp_path):  # noqa: F811
    """Restarted with another --hidden-size, a group is refused at its join with one line (exit 2);
    the healthy group goes on to its end (it used to stop too, without saving)."""
    assert refused_model(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_a_group_with_other_outer_flags_is_refused_alone(corpus, tmp_path):  # noqa: F811
    """--outer-lr 0.3 against a run with 0.7 (their global values drifted apart, unseen)."""
    assert refused_outer_flags(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_a_second_job_claiming_a_group_id_is_refused(corpus, tmp_path):  # noqa: F811
    """Two jobs with --group-id 0 met as separate groups and read the same samples: the second is refused."""
    assert refused_duplicate(base(corpus), tmp_path) == ""


def test_an_unreachable_lighthouse_is_one_line_before_the_model(corpus, tmp_path):  # noqa: F811
    """Was torchft's traceback after the connect timeout, exit status 1."""
    assert unreachable_lighthouse(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_groups_started_together_take_their_first_step_together(corpus, tmp_path):  # noqa: F811
    """Three groups started 3 s apart: the first used to form a quorum alone and the others joined
    later, taking its inner step (skipping iteration numbers)."""
    assert clean_start(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_groups_that_never_wait_for_a_straggler(corpus, tmp_path):  # noqa: F811
    """--outer-async, one group's inner steps 5 times as long: the others never stand still, the
    straggler's outer gradients reach the global values with their weights, one final model."""
    assert async_straggler(base(corpus), tmp_path) == ""


@pytest.mark.slow
def test_a_group_that_missed_the_final_round_is_served_the_final_model(corpus, tmp_path):  # noqa: F811
    """--outer-async, a group not in the final round (here: started as the others end): it used to
    train on alone to the end and end on its own model; the groups that ended serve it theirs."""
    assert async_late_for_the_end(base(corpus), tmp_path) == ""


LH = ("--zero-stage", "3", "--outer-sync-interval", "4", "--lighthouse", "http://127.0.0.1:1")


@pytest.mark.parametrize("extra, says", [
    (LH, "--lighthouse needs --group-id G and --num-groups N"),
    (LH + ("--group-id", "2", "--num-groups", "2"), "--group-id 2 must be below --num-groups 2"),
    (LH + ("--group-id", "0", "--num-groups", "2", "--group-size", "1"), "--group-size 1 has no effect with --lighthouse"),
    (LH + ("--group-id", "0", "--num-groups", "2", "--outer-min-groups", "3"), "--outer-min-groups 3 exceeds --num-groups 2"),
    (LH + ("--group-id", "0", "--num-groups", "2", "--outer-max-staleness", "2"),
     "--outer-max-staleness 2 has no effect without --outer-async"),
    (("--zero-stage", "3", "--outer-sync-interval", "4", "--outer-async"), "--outer-async needs --lighthouse URL"),
    (LH + ("--group-id", "0", "--num-groups", "2", "--outer-warmup-iters", "5"), "--outer-warmup-iters 5 is not fault tolerant yet"),
    (LH + ("--group-id", "0", "--num-groups", "2", "--outer-fragments", "4", "--outer-sync-delay", "1"),
     "--outer-sync-delay 1 must be below --outer-sync-interval 4 / --outer-fragments 4 = 1"),
    (("--zero-stage", "3", "--outer-sync-interval", "4", "--group-id", "0"), "--group-id 0 needs --lighthouse URL"),
    (("--zero-stage", "3", "--lighthouse", "http://x:1"), "--lighthouse has no effect without --outer-sync-interval"),
])
def test_bad_fault_tolerant_input(cli_corpus, capsys, monkeypatch, extra, says):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fails(good(cli_corpus, *extra), capsys, says)
