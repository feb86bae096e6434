"""The fault matrix (bench/fault_matrix.py): switch combinations generated from the config
validator, each through an fp16 overflow, a bf16 NaN, an exact resume, a load on another
layout and with a switch flipped, and "auto" on a fast and a slow link. The default suite runs
the quick share (each stage plain, each switch alone, all at once) on each layout; the whole matrix (and the other layouts) runs with
ZEROPP_FULL_MATRIX=1, and `python -m bench.fault_matrix` prints it as a table."""
import os

import pytest

import zeropp
from bench.fault_matrix import FAULTS, SWITCH_VALUES, accepted, combinations, name, quick, run_matrix
from common import ConfigError


def test_combinations_are_what_the_validator_accepts():
    combos = combinations(4, 2)
    names = [name(z) for z in combos]
    assert len(set(names)) == len(names)
    # everything ZeRO++ on stage 3, nothing of it below; hpZ only within a node of 2
    assert "s3+qwZ+hpZ2+qgZ+LoCo+Hadamard+deltas" in names and "s1" in names
    assert not any(n.startswith(("s0+", "s1+", "s2+")) or "hpZ4" in n for n in names)
    assert not any("LoCo" in n and "qgZ" not in n for n in names)
    for z in combos:   # and each is taken by the real parser
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": z}).zero_optimization.validate_topology(2, 4)
    refused = {"stage": 1, "zero_quantized_weights": True}
    assert not accepted(refused, 4, 2)
    with pytest.raises(ConfigError):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": refused})
    assert set(SWITCH_VALUES) >= {"zeropp_loco_param", "zero_hadamard_gradients", "zero_quantized_weight_deltas"}
    assert {name(z) for z in quick(combos)} <= set(names)


def assert_all_pass(table: dict):
    failures = [f"{combo} / {fault}: {cell['why']}" for combo, row in table.items()
                for fault, cell in row.items() if not cell["ok"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (2, 1), (4, 4)], ids=["2x2", "2x1", "1x4"])
def test_quick_matrix(world, ranks_per_node):
    combos = quick(combinations(world, ranks_per_node))
    table = run_matrix(combos, FAULTS, world, ranks_per_node)
    assert set(table) == {name(z) for z in combos}
    assert all(set(row) >= {"overflow", "nan", "resume", "reshard", "world", "toggle"} for row in table.values())
    assert_all_pass(table)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ZEROPP_FULL_MATRIX"),
                    reason="the whole matrix takes minutes: ZEROPP_FULL_MATRIX=1, or python -m bench.fault_matrix")
@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (2, 1), (4, 4)])
def test_full_matrix(world, ranks_per_node):
    combos = combinations(world, ranks_per_node)
    table = run_matrix(combos, FAULTS, world, ranks_per_node)
    assert len(table) == len(combos)
    assert_all_pass(table)
