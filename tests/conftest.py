"""Session-wide: the pooled rank processes of tests/distributed.py end with the session; a test
that uses a fixture which trains on several ranks or launches train.py is slow, as the fixture is;
the slow tests the daily command keeps are marked `daily`."""
import os
from pathlib import Path

import pytest
import torch

# The Triton kernels run on CPU tensors under Triton's interpreter, which must be chosen before
# anything imports triton (kernels are decorated at import; torchft imports triton too): set here,
# before any test module is collected, whichever folder pytest starts with.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import forget_notes
from scenarios.harness import spawn

# module fixtures that train (several ranks, or a train.py process) before their tests read the result
SLOW_FIXTURES = {"runs", "short_run_done", "saved_4_ranks_stage3", "checkpoint"}


# `bash scripts/test.sh` (every day, under 10 minutes on 2 idle cores) runs the quick tier and these
# slow tests, one of each slow family; `bash scripts/test.sh --full` (CI) runs every test.
UNIT, INTEGRATION = "tests/unit/", "tests/integration/"
DAILY = (
    INTEGRATION + "faults/test_fault_matrix.py::test_quick_matrix[2x2]",   # one fault-matrix layout: 2 nodes x 2 ranks
    INTEGRATION + "faults/test_fault_matrix.py::test_quick_fsdp2_rows",   # the FSDP2 plug-in's quick rows of the matrix
    INTEGRATION + "groups/test_diloco_job.py::test_sigterm_to_one_group_stops_every_group_and_saves",   # a DiLoCo job
    # a groups job with a kill and a heal (torchft's Lighthouse, two torchrun jobs)
    INTEGRATION + "groups/test_groups_job.py::"
                  "test_a_killed_group_never_stops_the_other_and_heals_from_it_when_restarted",
    # a torchrun launch
    INTEGRATION + "launch/test_launch_errors.py::test_a_user_error_only_the_workers_find_is_one_line",
    # the FSDP2 scenarios' quick rows: hpZ alone bit for bit plain FSDP2, every switch within bounds
    *(INTEGRATION + "fsdp2/test_fsdp2_scenarios.py::"
      f"test_scenario_hpz_alone_is_plain_fsdp2_and_every_switch_within_bounds[{s}]"
      for s in ("single_group", "multi_group_reshard_true", "mixed_precision_bf16_reduce", "hf_gpt2_tied")),
    INTEGRATION + "train/test_train.py::test_resume_continues_exactly",   # train.py's save and exact resume
    INTEGRATION + "launch/test_scripts.py::test_smoke_run[pretrain_gpt_18b.sh]",   # the 18B launch script, shrunk
    UNIT + "training/test_checkpoint.py::test_reshard_on_load[8-3-True]",   # a checkpoint resharded on load
    UNIT + "bench/test_bench_slow_link_smoke.py::test_sweep_on_the_emulated_link",   # the slow-link bench, tiny
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.nodeid in DAILY:
            item.add_marker(pytest.mark.daily)
    # a representative renamed or gone fails the collection of its file (not silently dropped)
    files = {Path(str(item.fspath)).relative_to(config.rootpath).as_posix() for item in items}
    gone = [n for n in DAILY if n.split("::")[0] in files and n not in {item.nodeid for item in items}]
    if gone and not config.getoption("keyword") and not config.getoption("markexpr", "").startswith("slow"):
        raise pytest.UsageError(f"tests/conftest.py DAILY names tests that are not there: {gone}")


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    spawn.close_pools()


@pytest.fixture(autouse=True)
def _fresh_notes():
    """Each test hears its own notes (a note is printed once per process)."""
    forget_notes()
