"""examples/fsdp2_zeropp.py, the plain FSDP2 loop with the plug-in, and examples/hsdp_zeropp.py, HSDP in
torchtitan's shape, on 4 ranks as 2 emulated nodes x 2: each learns, and a run saved to DCP and
resumed continues exactly as one that never stopped (model, optimizer, step and LoCo's error all in
the checkpoint)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests import REPO

EXAMPLE = REPO / "examples" / "fsdp2_zeropp.py"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def save_resume_and_straight(rank, world, ckpt):
    example = load(EXAMPLE)
    common = ["--ranks-per-node", "2"]
    first = example.main(common + ["--steps", "2", "--ckpt", ckpt])
    resumed = example.main(common + ["--steps", "1", "--ckpt", ckpt, "--resume"])
    straight = example.main(common + ["--steps", "3"])
    return first, resumed, straight


@pytest.mark.slow   # ~20 s idle: tests/unit/fsdp/test_fsdp_plugin.py covers the same resume in the default suite
def test_example_learns_and_resumes_from_dcp_exactly(tmp_path):
    for first, resumed, straight in run_distributed(save_resume_and_straight, 4, args=(str(tmp_path / "ckpt"),)):
        assert first + resumed == straight, (first, resumed, straight)
        assert straight[-1] < straight[0] - 0.3, straight   # it learns


HSDP_EXAMPLE = EXAMPLE.parent / "hsdp_zeropp.py"


def hsdp_save_resume_and_straight(rank, world, ckpt):
    example = load(HSDP_EXAMPLE)
    common = ["--ranks-per-node", "2"]
    first = example.main(common + ["--steps", "2", "--ckpt", ckpt])
    resumed = example.main(common + ["--steps", "2", "--ckpt", ckpt, "--resume"])
    straight = example.main(common + ["--steps", "4"])
    plain = example.main(common + ["--steps", "4", "--plain"])
    return first, resumed, straight, plain


@pytest.mark.slow   # ~10 s idle: tests/unit/fsdp/test_fsdp_hsdp.py covers the same in the default suite
def test_hsdp_example_learns_like_plain_hsdp_and_resumes_from_dcp_exactly(tmp_path):
    """examples/hsdp_zeropp.py (torchtitan's parallelize shape on a (2, 2) mesh): 2 steps saved and 2
    resumed are the 4 straight ones; the losses stay within the engine's 2% of plain HSDP's."""
    for first, resumed, straight, plain in run_distributed(hsdp_save_resume_and_straight, 4,
                                                           args=(str(tmp_path / "ckpt"),)):
        assert first + resumed == straight, (first, resumed, straight)
        assert straight[-1] < straight[0] - 0.3, straight   # it learns
        assert straight != plain and all(abs(a - b) <= 0.02 * b for a, b in zip(straight, plain)), (straight, plain)
