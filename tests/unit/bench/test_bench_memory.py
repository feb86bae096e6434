"""Smoke tests of `python -m bench.memory`: its --help, the bound's verdict on made-up ranks, and
(slow) each mode on a tiny GPT (the fixed cost of a process dwarfs it: the verdicts are not
asserted there, only that every mode runs and writes its JSON with its provenance)."""
import json

import pytest

from bench import ROOT
from bench.memory import main
from bench.memory.bound import RSS_LIMIT, cell, over_zero3
from tests.unit.bench.test_bench_slow_link_smoke import EVERY_COMMAND

TINY = ["--num-layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--world", "2",
        "--steps", "1"]


def test_help_says_what_it_measures_and_its_limit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert all(mode in out for mode in ("large", "bound", "matrix", "train")) and "RSS_LIMIT" in out


def ranks(rise_mb: float, states_mb: float = 100, hpz_mb: float = 0) -> list[dict]:
    mb = 2**20
    return [{"rank": r, "base_rss_mb": 200.0, "rss_before_steps_mb": 250.0, "peak_rss_mb": 200 + rise_mb,
             "rise_bytes": int(rise_mb * mb), "rise_over_before_steps_bytes": int((rise_mb - 50) * mb),
             "model_states_bytes": int(states_mb * mb), "bounds_bytes": 10 * mb, "gloo_staging_bytes": 0,
             "hpz_secondary_bytes": int(hpz_mb * mb), "new_state_bytes": 0, "step_s": [1.0], "losses": [5.0],
             "allocations": None, "memory_report": {"buffers": {"gradient_buckets": {"peak": 5 * mb, "bound": 10 * mb,
                                                                                     "within": True}}}}
            for r in range(2)]


def test_bound_verdicts():
    act = 10 * 2**20
    ok = cell(ranks(rise_mb=120 * RSS_LIMIT - 1), act)
    assert ok["rss_pass"] and ok["pools_pass"] and ok["ratio"] <= RSS_LIMIT
    assert not cell(ranks(rise_mb=120 * RSS_LIMIT + 1), act)["rss_pass"]
    zero3 = {**cell(ranks(100), act), "dtype": "bf16", "optimizer": "sgd", "budget": "flags", "system": "zero3"}
    zpp = {**cell(ranks(125, hpz_mb=20), act), **{k: zero3[k] for k in ("dtype", "optimizer", "budget")},
           "system": "zeropp"}
    assert over_zero3(zero3, zpp)["pass"]   # 25 MB over, limit 20 + 10% of 100
    assert not over_zero3(zero3, {**zpp, **cell(ranks(131, hpz_mb=20), act)})["pass"]


@pytest.mark.slow
def test_large_model_tiny(tmp_path):
    """On FSDP2 with a checkpoint round trip: the ZeRO-3 engine runs in the other modes."""
    assert main([*TINY, "--sharding", "fsdp2", "--optimizer", "adamw", "--checkpoint", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "large.json")]) == 0
    out = json.loads((tmp_path / "large.json").read_text())
    assert len(out["ranks"]) == 2 and out["provenance"]["machine"]["cpu"]
    assert out["checkpoint"]["round_trip_exact_all_ranks"] and out["args"]["sharding"] == "fsdp2"


def test_fsdp2_goes_with_large_and_no_budget(capsys):
    for argv in (["bound", "--sharding", "fsdp2"], ["--sharding", "fsdp2", "--bucket", "1000"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and "--sharding fsdp2 goes with `large`" in capsys.readouterr().err


@pytest.mark.slow
@EVERY_COMMAND
def test_bound_tiny(tmp_path):
    main(["bound", *TINY, "--ranks-per-node", "1", "--systems", "zero3", "--bucket", "2000", "--max-live", "4000",
          "--out", str(tmp_path / "bound.json")])
    out = json.loads((tmp_path / "bound.json").read_text())
    assert [r["system"] for r in out["rows"]] == ["zero3"] and out["limits"]["rss_over_budget"] == RSS_LIMIT


@pytest.mark.slow
@EVERY_COMMAND
@pytest.mark.skipif(not (ROOT / "work_dir" / "kjv_text_document.bin").exists(), reason="needs the bundled corpus")
def test_train_tiny(tmp_path):
    main(["train", "--num-layers", "1", "--hidden", "64", "--heads", "4", "--seq", "16", "--world", "2", "--steps", "2",
          "--bucket", "2e4", "--variants", "train.py", "--out", str(tmp_path / "train.json")])
    row = json.loads((tmp_path / "train.json").read_text())["rows"]["train.py"]
    assert row["large"]["parameters"] > 0 and row["gloo_staging_mb"] >= 0
