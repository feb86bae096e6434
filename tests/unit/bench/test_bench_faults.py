"""Smoke tests of `python -m scenarios.faults`: its --help, the matrix's parts and columns picked by
flags, and (slow) one cell of the engine's matrix end to end, its JSON with its provenance."""
import importlib.util
import json

import pytest

from bench import ROOT
from scenarios.faults import main, pick
from scenarios.harness.jobs import iterations, listed, samples_in_order
from tests.unit.bench.test_bench_slow_link_smoke import EVERY_COMMAND


def test_help_says_what_it_measures_and_its_limit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert all(w in out for w in ("groups", "inputs", "--quick", "bit for bit", "Duration"))


def test_flags_pick_parts_and_columns():
    assert listed(None, ("a", "b")) == ["a", "b"] and listed("b", ("a", "b")) == ["b"]
    with pytest.raises(SystemExit) as done:
        listed("c", ("a", "b"))
    assert done.value.code == 2
    assert pick(("overflow", "nan", "resume"), ["nan", "toggle"]) == ("nan",)
    assert pick(("overflow",), None) == ("overflow",)


def test_a_group_log_is_read_whatever_another_writer_left_in_front_of_a_line(tmp_path):
    """torchft's logger shares a group's log: its timestamp can land in front of a training line."""
    line = (" [2026-11-28 12:35:{s:02d}] iteration {it:8d}/     3 | consumed samples: {n:12d} | "
            "global batch size:     8 | lm loss: 1.0")
    lines = [line.format(s=it, it=it, n=8 * it) for it in (1, 2, 3)]
    log = tmp_path / "group0.log"
    log.write_text("\n".join([lines[0], "2026-11-28T12:35:02.644" + lines[1], lines[2]]) + "\n")
    assert [it for _, it in iterations(log)] == [1, 2, 3] and samples_in_order(log)
    log.write_text("\n".join([lines[0], lines[2]]) + "\n")   # a batch skipped
    assert not samples_in_order(log)


@pytest.mark.slow
def test_one_engine_cell(tmp_path):
    assert main(["--parts", "engine", "--layouts", "2x1", "--faults", "overflow", "--limit", "1",
                 "--out", str(tmp_path / "f.json")]) == 0
    out = json.loads((tmp_path / "f.json").read_text())
    assert out["layouts"]["2x1"]["s0"]["overflow"]["ok"] and "command" in out["provenance"]


CORPUS = pytest.mark.skipif(not (ROOT / "work_dir" / "kjv_text_document.bin").exists(),
                            reason="needs the bundled corpus (scripts/quickstart.sh)")


@pytest.mark.slow
@EVERY_COMMAND
@CORPUS
def test_careless_inputs(tmp_path):
    assert main(["inputs", "--limit", "2", "--out", str(tmp_path / "in.json")]) == 0
    rows = json.loads((tmp_path / "in.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["status"] == 2 and r["message"].startswith("error: ") for r in rows)


@pytest.mark.slow
@EVERY_COMMAND
@CORPUS
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_groups_cell(tmp_path):
    assert main(["groups", "--cells", "unreachable-lighthouse", "--out", str(tmp_path / "g.json")]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["cells"]["unreachable-lighthouse"]["ok"]


def test_a_groups_workdir_kept_from_an_earlier_run_is_one_line_before_any_job(tmp_path, capsys):
    (tmp_path / "link-outage").mkdir()
    with pytest.raises(SystemExit) as done:
        main(["groups", "--cells", "link-outage", "--workdir", str(tmp_path), "--out", str(tmp_path / "o.json")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--workdir" in err and "link-outage" in err
