"""The launch scripts (scripts/pretrain_gpt_*.sh) as users run them.

- SMOKE=1: each script's own flags and zero_optimization, the model shrunk, 4 CPU
  ranks as 2 emulated nodes x 2, a few iterations on the bundled corpus (~15 s each).
- DRY_RUN=1: the planner's plan, without torchrun.
- A multi-node run without NODE_RANK / MASTER_ADDR is one clear line, exit 2.
"""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "pretrain_gpt_18b.sh": "ZeRO-3 + ZeRO++ (qwZ, hpZ, qgZ)",
    "pretrain_gpt_18b_zero3.sh": "ZeRO stage 3",
    "pretrain_gpt_1.5b_zero1.sh": "ZeRO stage 1",
    "pretrain_gpt_10b_zero2.sh": "ZeRO stage 2",
}


def run(script, env, *args, timeout=180):
    full = {**os.environ, **env}
    for key in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ID", "DRY_RUN", "SMOKE"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_smoke_run(script):
    r = run(script, {"SMOKE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "> SMOKE=1: 2 layers, hidden 64" in r.stdout
    assert f"4 ranks on 2 node(s) x 2, {SCRIPTS[script]}, torch.float32" in r.stdout
    assert "iteration        4/       4" in r.stdout
    if script == "pretrain_gpt_18b.sh":   # ZeRO++ cuts what crosses the emulated nodes
        assert "ZeRO-3 without ZeRO++ would send" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_dry_run_prints_the_plan(script):
    r = run(script, {"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for text in ("== Plan (--dry-run)", "-- Memory per GPU", "-- Communication per iteration per GPU",
                 "iteration time", "TFLOPs per GPU"):
        assert text in r.stdout, text
    if "18b" in script:
        assert "predicted speedup of ZeRO++ over ZeRO-3" in r.stdout


def test_multi_node_without_node_rank_is_a_clear_error():
    r = run("pretrain_gpt_18b.sh", {"NNODES": "4"})
    assert r.returncode == 2
    assert r.stderr.startswith("error: a 4-node run needs NODE_RANK") and len(r.stderr.splitlines()) == 1
