"""examples/fsdp2_zeropp.py, the plain FSDP2 loop with the plug-in, on 4 ranks as 2 emulated
nodes x 2: it learns, and a run saved to DCP and resumed continues exactly as one that never
stopped (model, optimizer, step and LoCo's error all in the checkpoint)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed import run_distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_zeropp.py"


def save_resume_and_straight(rank, world, ckpt):
    spec = importlib.util.spec_from_file_location("fsdp2_zeropp", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--ranks-per-node", "2"]
    first = example.main(common + ["--steps", "2", "--ckpt", ckpt])
    resumed = example.main(common + ["--steps", "1", "--ckpt", ckpt, "--resume"])
    straight = example.main(common + ["--steps", "3"])
    return first, resumed, straight


@pytest.mark.slow   # ~20 s idle: tests/test_fsdp_plugin.py covers the same resume in the default suite
def test_example_learns_and_resumes_from_dcp_exactly(tmp_path):
    for first, resumed, straight in run_distributed(save_resume_and_straight, 4, args=(str(tmp_path / "ckpt"),)):
        assert first + resumed == straight, (first, resumed, straight)
        assert straight[-1] < straight[0] - 0.3, straight   # it learns
