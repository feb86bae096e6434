"""Smoke tests of `python -m bench.convergence`: its --help, the log it reads, a report and the
wall-clock view from made-up runs (no training), and --quick where the bundled corpus exists."""
import json

import pytest

from bench import ROOT
from bench.convergence import main
from bench.convergence.report import parse_log
from tests.unit.bench.test_bench_slow_link_smoke import EVERY_COMMAND

LINE = (" [2026-01-01 00:00:00] iteration {it:8d}/      20 | consumed samples:           32 | elapsed time per "
        "iteration (ms): 12.5 | learning rate: 1.0E-03 | global batch size:    32 | lm loss: {loss:.6E} | loss "
        "scale: 1.0 | grad norm: 0.500 | number of skipped iterations:   0 | number of nan iterations:   0 | samples "
        "per second: 1.0 | tokens per second: 1 | TFLOPs: 0.001 | intra-node MB: 1.5 | inter-node MB: {mb:.1f} |")


def log(losses, mb=2.0, valid=()):
    return "\n".join([LINE.format(it=5 * (i + 1), loss=x, mb=mb) for i, x in enumerate(losses)]
                     + [f" validation loss at iteration {it} | lm loss value: {x:.6E} | lm loss PPL: 1.0 |"
                        for it, x in valid])


def run(name, losses, mb, valid):
    return {"name": name, "command": "train.py", "wall_s": 1.0, "error": None, **parse_log(log(losses, mb, valid))}


def convergence_json(path, seed=1234, candidate=5.01):
    setup = {"names": ["ZeRO-3", "ZeRO++"], "tolerance": 0.01, "iters": 20, "seed": seed, "ranks": 4,
             "ranks_per_node": 2, "global_batch": 32, "log_interval": 5,
             "model": {"num_layers": 2, "hidden_size": 128, "heads": 4, "seq_length": 64}}
    runs = {"ZeRO-3": run("ZeRO-3", [6, 5.5, 5.2, 5.0], 2.0, [(10, 5.3), (20, 5.0)]),
            "ZeRO++": run("ZeRO++", [6, 5.6, 5.2, 5.01], 0.5, [(10, 5.31), (20, candidate)])}
    path.write_text(json.dumps({"setup": setup, "runs": runs}))
    return path


def test_help_says_what_it_measures_and_its_limit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "final validation loss" in out and "--tolerance" in out and "--wallclock" in out


def test_parse_log_reads_train_and_validation_lines():
    got = parse_log(log([6.0, 5.0], 3.0, [(10, 4.5)]))
    assert [t["iteration"] for t in got["train"]] == [5, 10] and got["train"][1]["inter_mb"] == 3.0
    assert got["validation"] == [{"iteration": 10, "loss": 4.5}]


def test_report_from_json(tmp_path):
    assert main(["--from", str(convergence_json(tmp_path / "in.json")), "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "convergence.json").read_text())
    assert out["verdict"]["result"] == "PASS" and out["verdict"]["inter_node_bytes_ratio"] == 0.25
    assert out["provenance"]["command"].startswith("python") and "machine" in out["provenance"]
    assert "| ZeRO++ |" in (tmp_path / "convergence.md").read_text()
    assert main(["--from", str(convergence_json(tmp_path / "bad.json", candidate=6.0)), "--out-dir",
                 str(tmp_path)]) == 1


def test_wallclock_from_json(tmp_path):
    link = {"results": [{"system": s, "rate_mbit": 20, "samples_per_s": 10.0, "step_ms_median": ms}
                        for s, ms in (("zero3", 100.0), ("zeropp", 50.0))]}
    (tmp_path / "link.json").write_text(json.dumps(link))
    files = [str(convergence_json(tmp_path / f"c{s}.json", seed=s)) for s in (1234, 1235)]
    assert main(["--wallclock", "20", "--slow-link", str(tmp_path / "link.json"), "--run", "ZeRO-3=zero3",
                 "--run", "ZeRO++=zeropp", "--out", str(tmp_path / "wall"), *files]) == 0
    rows = json.loads((tmp_path / "wall.json").read_text())["rows"]
    assert len(rows) == 4 and {r["step_ms_at_rate"] for r in rows} == {100.0, 50.0}


@pytest.mark.slow
@EVERY_COMMAND
@pytest.mark.skipif(not (ROOT / "work_dir" / "kjv_text_document.bin").exists(), reason="needs the bundled corpus")
def test_quick_run(tmp_path):
    assert main(["--quick", "--iters", "4", "--eval-interval", "2", "--log-interval", "2", "--baseline-only",
                 "--out-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "convergence.json").read_text())["verdict"]["result"] == "NOT RUN"
