"""`python -m bench.slow_link`: each command's --help, its documented commands with tiny sizes (the
ones that spawn ranks or need root are marked slow), and the JSON each writes with its provenance."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ROOT, slow_link

TINY = ["--num-layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--micro-batch", "1",
        "--warmup", "1", "--steps", "1"]


# Each documented command that spawns ranks takes tens of seconds to minutes on 2 cores: the default
# suite runs one per family (the sweep on the link, comm, memory, faults; kernels in-process) and
# ZEROPP_BENCH_SMOKE=1 runs every one.
EVERY_COMMAND = pytest.mark.skipif(not os.environ.get("ZEROPP_BENCH_SMOKE"),
                                   reason="one command per family by default: ZEROPP_BENCH_SMOKE=1 runs every one")


def cli(*argv, timeout=600, env=None):
    """The documented command, as a user types it, from the repository root."""
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def written(path, command="python -m bench.") -> dict:
    """The JSON at `path`, stamped with the command (as typed: `command...`), the commit and the machine."""
    out = json.loads(Path(path).read_text())
    assert out["provenance"]["command"].startswith(command) and "commit" in out["provenance"]
    assert {"cpu", "cpu_capability", "loadavg_1min"} <= set(out["provenance"]["machine"])
    return out


@pytest.mark.parametrize("command", list(slow_link.COMMANDS))
def test_each_command_says_what_it_measures(command, capsys):
    with pytest.raises(SystemExit) as e:
        slow_link.main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Writes results/" in text and ("min" in text or "Seconds" in text)


def test_without_root_the_link_commands_skip(monkeypatch, capsys, tmp_path):
    import bench.slow_link.diloco as diloco
    import bench.slow_link.sweep as sweep
    for module in (sweep, diloco):
        monkeypatch.setattr(module, "missing", lambda: "not root")
    assert slow_link.main(["--quick", "--out", str(tmp_path / "x.json")]) == 0
    assert slow_link.main(["diloco", "--out", str(tmp_path / "d.json")]) == 0
    assert capsys.readouterr().out.count("SKIPPED (not root)") == 2
    assert not list(tmp_path.iterdir())


def row(system, rate, ms, tx_mb):
    return {"system": system, "label": system, "rate_mbit": rate, "step_ms_median": ms, "samples_per_s": 4000 / ms,
            "link_bytes_per_step": 2 * tx_mb * 1e6, "link_bytes_per_step_raw": 2 * tx_mb * 1e6 + 1000,
            "link_tx_per_step": {"A->B": tx_mb * 1e6 + 500, "B->A": tx_mb * 1e6 + 400}, "veth_over_counted": 1.3,
            "counted_inter_bytes_per_step": 1.5 * tx_mb * 1e6, "counted_source": "Communicator",
            "samples_per_s_window": 3900 / ms, "timed_steps": 2, "config": {"steps": 2}}


def test_sweep_renders_its_json_again(tmp_path):
    rows = [row("zero3-reuse0", 0, 200, 15), row("zero3-reuse0", 200, 650, 15), row("zeropp", 0, 210, 3),
            row("zeropp", 200, 300, 3), {"system": "fsdp2", "label": "fsdp2", "rate_mbit": 200, "error": "boom"}]
    cfg = {"head": "tiny", "systems": ["zero3-reuse0", "zeropp", "fsdp2"], "rates_mbit": [200, 0], "num_layers": 1,
           "hidden": 32, "seq": 8, "params": 1000, "dtype": "bf16", "ranks_per_node": 2}
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"config": cfg, "results": rows, "notes": []}))
    assert slow_link.main(["--from-json", str(src), "--out", str(tmp_path / "out.json")]) == 0
    out = written(tmp_path / "out.json", "python -m pytest")
    assert out["goals"]["step_over_bound_max"]["zero3-reuse0"]["pass"]
    assert out["zeropp_over_zero3"]["200"] == pytest.approx(650 / 300)
    md = (tmp_path / "out.md").read_text()
    assert "bound ms" in md and "ERROR" in md


def test_diloco_renders_its_json_again(tmp_path):
    rows = [{**row("zero3", 10, 4000, 15), "config": {"steps": 2}},
            {**row("zeropp-loco", 10, 2000, 3), "config": {"steps": 2}},
            {**row("diloco-h16", 10, 200, 0.01), "config": {"steps": 32, "outer_fragments": 1}}]
    cfg = {"rates_mbit": [10], "micro_batch": 1, "num_layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8,
           "dtype": "bf16", "best_fragments": 1, "warmup": 1, "steps": 2, "steps_at": {}, "cycles": 2,
           "fragments_rate": 20}
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"config": cfg, "results": rows, "fragment_search": rows[2:], "uptime": ["up"]}))
    assert slow_link.main(["diloco", "--from-json", str(src), "--out", str(tmp_path / "out.json")]) == 0
    written(tmp_path / "out.json", "python -m pytest")
    assert "x ZeRO++" in (tmp_path / "out.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated link needs root")
def test_sweep_on_the_emulated_link(tmp_path):
    """Two namespaces of its own (BENCH_NETNS), one system, unthrottled and 1 Gbit/s, one step."""
    out = tmp_path / "sl.json"
    cli("bench.slow_link", "--rates", "1000,0", "--systems", "zero3-reuse0", "--repeats", "1", *TINY,
        "--timeout", "300", "--setup-timeout", "300", "--out", str(out), env={"BENCH_NETNS": f"wtb{os.getpid()}"})
    res = written(out)["results"]
    assert [r.get("error") for r in res] == [None, None]
    assert all(r["link_bytes_per_step"] > 0 and r["counted_equals_intercepted"] for r in res)
    assert res[0]["bound_ms"] >= res[0]["link_time_ms"]


@pytest.mark.slow
@EVERY_COMMAND
@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated link needs root")
def test_diloco_on_the_emulated_link(tmp_path):
    """ZeRO-3 and DiLoCo H=16 unthrottled, one fragment count: the window throughput and the bytes."""
    out = tmp_path / "d.json"
    cli("bench.slow_link", "diloco", "--rates", "0", "--baselines", "zero3", "--diloco", "diloco-h16", "--fragments",
        "1", "--fragments-rate", "1000", "--cycles", "1", "--steps-at", "", *TINY, "--timeout", "500",
        "--setup-timeout", "400", "--out", str(out), env={"BENCH_NETNS": f"wtd{os.getpid()}"})
    rows = {r["system"]: r for r in written(out)["results"]}
    assert rows["diloco-h16"]["timed_steps"] == 16 and "error" not in rows["zero3"]
    assert rows["diloco-h16"]["counted_inter_bytes_per_step"] < rows["zero3"]["counted_inter_bytes_per_step"] / 10


@pytest.mark.slow
@EVERY_COMMAND
def test_local_systems_side_by_side(tmp_path):
    out = tmp_path / "l.json"
    cli("bench.slow_link", "local", *TINY, "--world", "2", "--systems", "zero3,fsdp2", "--world1-systems", "plain",
        "--out", str(out))
    r = written(out)
    assert r["loss_first_equal"] == {"main": True, "world1": True}
    assert [x["error"] for x in r["results"] + r["world1_results"]] == [None] * 3
    assert r["results"][0]["bytes_per_step_counted"] == r["results"][0]["bytes_per_step_intercepted"]


@pytest.mark.slow
@EVERY_COMMAND
def test_split_where_the_time_goes(tmp_path):
    out = tmp_path / "s.json"
    cli("bench.slow_link", "split", *TINY, "--repeats", "1", "--reps", "2", "--systems", "zero3-reuse0,fsdp2",
        "--out", str(out), timeout=900)
    r = written(out)
    assert set(r["systems"]) == {"zero3-reuse0", "fsdp2"} and "all_reduce" in r["collectives_ms"]


@pytest.mark.slow
def test_hsdp_rows_side_by_side(tmp_path):
    """Plain HSDP and HSDP + the plug-in (2 x 2 over loopback, no link needed): each row runs, the
    plug-in's all-reduce across replicas is inside the collectives it issues."""
    out = tmp_path / "h.json"
    cli("bench.slow_link", "split", *TINY, "--repeats", "1", "--reps", "1", "--systems", "hsdp,hsdp+zeropp",
        "--out", str(out), timeout=900)
    r = written(out)["systems"]
    assert all("error" not in r[s] and r[s]["step_ms"] > 0 for s in ("hsdp", "hsdp+zeropp")), r
    assert "all_reduce" in r["hsdp"]["calls_per_step_rank0"] and "all_to_all_single" in r["hsdp+zeropp"]["calls_per_step_rank0"], r


@pytest.mark.slow
@EVERY_COMMAND
def test_calibrate_and_planner(tmp_path):
    cli("bench.slow_link", "calibrate", "--repeats", "1", "--steps", "2", "--systems", "", "--out", str(tmp_path / "c.json"),
        timeout=900)
    assert written(tmp_path / "c.json")["rows"][0]["flops_per_s"] > 0
    if not (ROOT / "bench" / "results" / "slow_link.json").exists():
        pytest.skip("no stored sweep results to plan against")
    cli("bench.slow_link", "planner", "--results", "slow_link.json", "--out", str(tmp_path / "p.json"))
    assert written(tmp_path / "p.json")["rows"]


@pytest.mark.slow
@EVERY_COMMAND
def test_gpu_ranks_paths_on_cpu(tmp_path):
    """Without a GPU the same ranks run on CPU: the command and its JSON still work."""
    cli("bench.slow_link", "gpu", "--ranks", "2", "--ranks-per-node", "1", "--layers", "1", "--hidden", "32",
        "--heads", "2", "--seq", "8", "--vocab", "64", "--micro-batch", "1", "--steps", "1",
        "--out", str(tmp_path / "g.json"))
    assert written(tmp_path / "g.json")["ranks"][0]["systems"]
