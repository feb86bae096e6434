"""The slow-link bench's pieces that need no root: the 1/F buckets (bench/slow_link/systems.py), the auto
row's resolution (planner.auto stubbed, and missing), and the bound and target arithmetic on rows
(bench/slow_link/report.py)."""
import sys
import types

import pytest

from bench.slow_link.report import derive, goals, rate_name, row_table
from bench.slow_link.systems import AutoUnavailable, chosen, make_prepare, num_params, zero_section

A = {"num_layers": 2, "hidden": 32, "heads": 4, "vocab": 96, "seq": 16, "micro_batch": 1, "seed": 1,
     "ranks_per_node": 2}


def test_buckets_are_a_fraction_of_the_model():
    n = num_params(A)
    for system in ("zero3-reuse0", "zeropp", "deepspeed-z3-reuse0"):
        z = zero_section(system, {**A, "bucket_fraction": 8})
        assert z["stage3_prefetch_bucket_size"] == z["reduce_bucket_size"] == n // 8
        assert z["stage3_max_reuse_distance"] == 0
    assert "reduce_bucket_size" not in zero_section("zero3-reuse0", A)  # `bench.slow_link local`: as before
    z = zero_section("auto", {**A, "bucket_fraction": 8})
    assert [z[k] for k in ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")] \
        == ["auto"] * 3


def test_auto_resolves_through_planner_auto(monkeypatch):
    calls = []

    def resolve(ds_config, cfg, comm, device, micro_batch, seq_length, accumulation=1):
        calls.append((cfg, comm, str(device), micro_batch, seq_length, accumulation))
        zero = {**ds_config["zero_optimization"], "zero_quantized_weights": True,
                "zero_hpz_partition_size": 1, "zero_quantized_gradients": False}
        return {**ds_config, "zero_optimization": zero}, ["link 25 MB/s", "chose qwZ"]

    monkeypatch.setitem(sys.modules, "planner.auto", types.SimpleNamespace(resolve=resolve))
    info = {}
    raw = {"zero_optimization": zero_section("auto", {**A, "bucket_fraction": 8})}
    out = make_prepare(A, "CFG", info)(raw, "COMM")
    assert calls == [("CFG", "COMM", "cpu", 1, 16, 1)]
    assert out["zero_optimization"]["zero_quantized_weights"] is True
    assert info["log"] == ["link 25 MB/s", "chose qwZ"]
    assert chosen(info["switches"]) == "qwZ"
    assert chosen({"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                   "zero_quantized_gradients": True}) == "qwZ+hpZ+qgZ"
    assert chosen({"zero_quantized_weights": False, "zero_hpz_partition_size": 1}) == "none (ZeRO-3)"


def test_auto_takes_a_resolution_object(monkeypatch):
    """planner.auto's Resolution: .config a DeepSpeedConfig, .lines, .predicted."""
    import zeropp

    def resolve(ds_config, cfg, comm, device, micro_batch, seq_length, accumulation=1):
        zero = {**ds_config["zero_optimization"], "zero_quantized_weights": False,
                "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
        ds = zeropp.DeepSpeedConfig.from_dict({**ds_config, "zero_optimization": zero})
        return types.SimpleNamespace(config=ds, lines=["chose hpZ+qgZ"], predicted={"hpZ+qgZ": 0.3})

    monkeypatch.setitem(sys.modules, "planner.auto", types.SimpleNamespace(resolve=resolve))
    info = {}
    raw = {"zero_optimization": zero_section("auto", {**A, "bucket_fraction": 8})}
    out = make_prepare(A, "CFG", info)(raw, "COMM")
    assert isinstance(out, zeropp.DeepSpeedConfig)
    assert chosen(info["switches"]) == "hpZ+qgZ" and info["predicted_s"] == {"hpZ+qgZ": 0.3}
    assert info["zero_optimization"]["reduce_bucket_size"] == num_params(A) // 8


def test_auto_without_planner_auto_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "planner.auto", None)  # import fails
    with pytest.raises(AutoUnavailable, match="planner.auto does not import"):
        make_prepare(A, None, {})({"zero_optimization": {}}, None)


def row(system, rate, ms, tx_mb):
    return {"system": system, "rate_mbit": rate, "step_ms_median": ms, "samples_per_s": 4000 / ms,
            "link_bytes_per_step": 2 * tx_mb * 1e6, "link_bytes_per_step_raw": 2 * tx_mb * 1e6 + 1000,
            "link_tx_per_step": {"A->B": tx_mb * 1e6 + 500, "B->A": tx_mb * 1e6 + 400},
            "counted_inter_bytes_per_step": 1.5 * tx_mb * 1e6}


def test_link_time_bound_and_goals():
    rows = [row("zero3-reuse0", 0, 200, 15), row("zero3-reuse0", 200, 650, 15),
            row("zeropp", 0, 210, 3), row("zeropp", 200, 300, 3),
            row("auto", 0, 205, 15), row("auto", 200, 310, 3)]
    rows[-1]["auto"] = [{"switches": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                      "zero_quantized_gradients": True}}]
    by = derive(rows)
    assert by[("auto", 200)]["compute_from"] == "zeropp" and by[("auto", 200)]["compute_ms"] == 210
    assert by[("auto", 0)]["compute_ms"] == 205  # unthrottled: its own step
    z = by[("zero3-reuse0", 200)]
    assert z["link_time_ms"] == pytest.approx((15e6 + 500 - 500) * 8 / 200e6 * 1000)  # overhead/2 out
    assert z["bound_ms"] == pytest.approx(600) and z["step_over_bound"] == pytest.approx(650 / 600)
    assert z["exposed_ms"] == 450
    p = by[("zeropp", 200)]
    assert p["bound_ms"] == 210 and p["step_over_bound"] == pytest.approx(300 / 210)  # compute-bound
    lines, res = goals(rows, [200, 0], {}, rate_name)
    assert res["step_over_bound_max"]["zero3-reuse0"]["pass"]
    assert not res["step_over_bound_max"]["zeropp"]["pass"]
    assert res["zeropp_over_zero3_unthrottled"]["pass"]  # 200/210 = 0.95
    assert res["auto_over_zero3_unthrottled"]["value"] == pytest.approx(200 / 205)
    assert res["auto_over_best_fixed"]["values"][200]["best_fixed"] == "zeropp"
    assert res["auto_over_best_fixed"]["pass"]  # 300/310 = 0.968 at 200, 200/205 unthrottled
    assert any(l.startswith("Cost, zeropp / ZeRO-3") and l.endswith("PASS") for l in lines)
    hdr, table = row_table(rows + [{"system": "fsdp2", "rate_mbit": 200, "error": "x"}],
                           ["zero3-reuse0", "fsdp2"], [200, 0], {}, rate_name)
    assert [l[2] for l in table[2:]] == ["ERROR", "-"] and len(table[0]) == len(hdr)


def test_diloco_rows_are_zero3_with_trains_outer_flags():
    from bench.slow_link.systems import DILOCO, outer_argv
    from training.flags import build_parser
    for system in DILOCO:
        assert zero_section(system, {**A, "bucket_fraction": 8}) == zero_section("zero3", {**A, "bucket_fraction": 8})
        ns = build_parser().parse_args(outer_argv(system, {**A, "outer_fragments": 2, "outer_sync_delay": 3}))
        assert f"-h{ns.outer_sync_interval}" in system
        assert (ns.outer_fragments, ns.outer_quantization, ns.group_size, ns.outer_sync_delay) == (2, "int4", 1, 3)
    assert outer_argv("zero3", A) is None
