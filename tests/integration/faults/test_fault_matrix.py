"""The fault matrix (scenarios/fault_matrix.py): switch combinations generated from the config
validator, each through an fp16 overflow, a bf16 NaN, an exact resume, a load on another
layout and with a switch flipped, and "auto" on a fast and a slow link. The default suite runs
the quick share (each stage plain, each switch alone, all at once) on each layout; the whole matrix (and the other layouts) runs with
ZEROPP_FULL_MATRIX=1, and `python -m scenarios.faults` prints it as a table.

The two modes' rows (scenarios/fault_modes.py): streaming DiLoCo, one outer setting per layout in
the default suite (INT4 merged a step late on 2 x 2, exact at once on 4 x 1 with ZeRO++ inside),
every setting with ZEROPP_FULL_MATRIX=1; FSDP2 + the plug-in, every switch at once in the
default suite, the quick share as a slow test, every combination FSDP2 accepts with
ZEROPP_FULL_MATRIX=1."""
import os

import pytest

import zeropp
from scenarios.fault_matrix import FAULTS, SWITCH_VALUES, accepted, combinations, name, quick, run_matrix
from scenarios.fault_modes import (DILOCO_FAULTS, DILOCO_LAYOUTS, FSDP2_FAULTS, outer_settings, quick_settings, run_diloco,
                               run_fsdp2, settings_name)
from common import ConfigError
from zeropp.fsdp.engine import check_fsdp2_config


def test_combinations_are_what_the_validator_accepts():
    combos = combinations(4, 2)
    names = [name(z) for z in combos]
    assert len(set(names)) == len(names)
    # everything ZeRO++ on stage 3, nothing of it below; hpZ only within a node of 2
    assert "s3+qwZ+hpZ2+qgZ+LoCo+Hadamard+deltas+INT2" in names and "s1" in names
    assert not any("INT2" in n and "LoCo" not in n for n in names)   # INT2 needs the error fed back
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


@pytest.mark.slow
@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (2, 1), (4, 4)], ids=["2x2", "2x1", "1x4"])
def test_quick_matrix(world, ranks_per_node):
    combos = quick(combinations(world, ranks_per_node))
    table = run_matrix(combos, FAULTS, world, ranks_per_node, pool=True)
    assert set(table) == {name(z) for z in combos}
    assert all(set(row) >= {"overflow", "nan", "resume", "reshard", "world", "toggle"} for row in table.values())
    assert_all_pass(table)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ZEROPP_FULL_MATRIX"),
                    reason="the whole matrix takes minutes: ZEROPP_FULL_MATRIX=1, or python -m scenarios.faults")
@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (2, 1), (4, 4)])
def test_full_matrix(world, ranks_per_node):
    combos = combinations(world, ranks_per_node)
    table = run_matrix(combos, FAULTS, world, ranks_per_node)
    assert len(table) == len(combos)
    assert_all_pass(table)


# -- the modes -------------------------------------------------------------------------------------

FULL = pytest.mark.skipif(not os.environ.get("ZEROPP_FULL_MATRIX"),
                          reason="every row takes minutes: ZEROPP_FULL_MATRIX=1, or python -m scenarios.faults")


def test_fsdp2_combinations_are_what_both_validators_accept():
    engine, fsdp2 = combinations(4, 2), combinations(4, 2, "fsdp2")
    names = {name(z) for z in fsdp2}
    assert names <= {name(z) for z in engine} and "s3+qwZ+hpZ2+qgZ+LoCo+Hadamard" in names and "s3" in names
    refused = [z for z in engine if name(z) not in names]
    # what FSDP2 has no place for: stages below 3 and the INT4 weight deltas, each in one line
    assert refused and all(z["stage"] != 3 or z.get("zero_quantized_weight_deltas") for z in refused)
    for z in refused:
        with pytest.raises(ConfigError) as e:
            check_fsdp2_config(zeropp.DeepSpeedConfig.from_dict({"zero_optimization": z}).zero_optimization, 2, 4)
        assert "\n" not in str(e.value) and str(e.value)
    assert not accepted({"stage": 3, "reduce_bucket_size": 1000}, 4, 2, "fsdp2")
    assert {settings_name(s) for s in outer_settings()} == {
        f"H2F2+{q}+delay{d}" for q in ("none", "int4", "topk2") for d in (0, 1)}


def assert_rows(table: dict, rows: list[str], faults):
    assert set(table) == set(rows)
    assert all(set(row) == set(faults) for row in table.values()), table
    assert_all_pass(table)


def assert_diloco(settings_of):
    rows = [(layout, s) for layout in DILOCO_LAYOUTS for s in settings_of(layout)]
    tables = run_diloco(rows, pool=True)
    assert set(tables) == set(DILOCO_LAYOUTS)
    for layout, table in tables.items():
        assert_rows(table, [f"{name(DILOCO_LAYOUTS[layout][2])}+{settings_name(s)}" for s in settings_of(layout)],
                    DILOCO_FAULTS)


@pytest.mark.slow
def test_quick_diloco_rows():
    assert_diloco(quick_settings)


@pytest.mark.slow
def test_fsdp2_with_every_switch():
    combos = [max(combinations(4, 2, "fsdp2"), key=lambda z: len(name(z)))]
    assert name(combos[0]) == "s3+qwZ+hpZ2+qgZ+LoCo+Hadamard+INT2"
    assert_rows(run_fsdp2(combos, pool=True), [name(combos[0])], FSDP2_FAULTS)


@pytest.mark.slow
def test_quick_fsdp2_rows():
    """The quick share but the row with every switch (test_fsdp2_with_every_switch runs it)."""
    every = max(combinations(4, 2, "fsdp2"), key=lambda z: len(name(z)))
    combos = [z for z in quick(combinations(4, 2, "fsdp2")) if z != every]
    assert len(combos) > 1 and all(z["stage"] == 3 for z in combos)
    assert_rows(run_fsdp2(combos, pool=True), [name(z) for z in combos], FSDP2_FAULTS)


@pytest.mark.slow
@FULL
def test_full_diloco_rows():
    assert_diloco(lambda layout: outer_settings())


@pytest.mark.slow
@FULL
def test_full_fsdp2_rows():
    combos = combinations(4, 2, "fsdp2")
    assert_rows(run_fsdp2(combos), [name(z) for z in combos], FSDP2_FAULTS)
