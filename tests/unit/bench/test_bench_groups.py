"""Smoke tests of `python -m bench.groups` (the goodput of groups as separate jobs): its --help,
the useful time it reads from a group's trace, and (slow) the straggler family end to end on the
asynchronous mode, its JSON with its figures and limits."""
import importlib.util
import json

import pytest

from bench.groups import main, measure
from tests.unit.bench.test_bench_faults import CORPUS


def test_help_says_what_it_measures_and_its_limits(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert all(w in out for w in ("straggler", "punisher", "useful compute time", "0.9", "2%", "--outer-async"))


def test_useful_time_is_the_inner_steps_a_committed_exchange_took(tmp_path):
    """Steps after the last exchange that counted this group's work are lost (a kill); the time a
    step spent waiting in an exchange is not inner-step time."""
    trace, log = tmp_path / "trace.jsonl", tmp_path / "group.log"
    lines = [{"t": 100.0, "it": 0, "dt": None, "waited": 0.0, "counted": 0, "start": True}]
    for it in range(1, 9):
        lines.append({"t": 100.0 + it, "it": it, "dt": 1.0, "waited": 0.25 if it % 2 == 0 else 0.0,
                      "counted": 6 if it >= 6 else (2 * (it // 2))})
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    log.write_text("")
    got = measure([{"trace": trace, "log": log}])
    # steps 1-6 reach the global model (3 of them waited a quarter), steps 7-8 are lost
    assert got["inner_steps"] == 8 and got["useful_steps"] == 6
    assert got["useful_s"] == pytest.approx(6 - 0.75) and got["live_s"] == 8
    assert got["useful_fraction"] == pytest.approx(5.25 / 8)


@pytest.mark.slow
@CORPUS
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_the_straggler_family_end_to_end(tmp_path):
    out = tmp_path / "goodput.json"
    assert main(["straggler", "--quick", "--modes", "async", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["straggler"]["async"]
    assert row["ratio"] > 0 and 0 < row["straggler_weight"] < 1
    # the first group at --train-iters trained all of them; one still training then takes the final
    # round and ends there too (docs/fault_tolerant_groups.md, "The end"), a few steps short when a
    # save or the machine's load held it back
    steps = [row["calm"]["groups"][k]["inner_steps"] for k in ("0", "1")]
    assert max(steps) == 30 and min(steps) >= 10, steps
