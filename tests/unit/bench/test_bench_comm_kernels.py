"""`python -m bench.comm` and `python -m bench.kernels`: --help, the theory beside the counted bytes,
and the documented commands with tiny sizes (those spawning ranks marked slow)."""
import json

import pytest
import torch

from bench import comm, kernels
from tests.unit.bench.test_bench_slow_link_smoke import EVERY_COMMAND, cli, written



@pytest.mark.parametrize("main,argv", [(comm.main, []), (kernels.main, []), (kernels.main, ["quant"]),
                                       (kernels.main, ["hadamard"]), (kernels.main, ["host-cost"])])
def test_help(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


def test_theory_of_each_technique():
    """W = 4 ranks as 2 nodes x 2, bf16: qwZ's INT8 + scales, hpZ's backward gather inside the node,
    qgZ's INT4 all-to-all across nodes in place of a ring reduce-scatter."""
    t = comm.theory_ratios(4, 2, 2)
    assert t["ZeRO-3"] == (1, 1, 1) and t["+hpZ"] == (1, 0, 1)
    assert t["+qwZ"][0] == pytest.approx((1 + 4 / 256) / 2, rel=1e-3)
    assert t["+qgZ"][2] == pytest.approx((0.5 + 4 / 128) * 4 * 1 / (2 * 3) / 2, rel=1e-3)


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quant_throughput_beside_a_copy(tmp_path, threads, capsys):
    kernels.main(["quant", "--numel", "4096", "--repeats", "1", "--out", str(tmp_path / "q.json")])
    rows = written(tmp_path / "q.json", "python -m pytest")["rows"]
    assert {r["bits"] for r in rows} == {8, 4} and all(r["copy_GBps"] > 0 for r in rows)
    assert "limit: copy" in capsys.readouterr().out


def test_hadamard_cost(tmp_path, threads):
    kernels.main(["hadamard", "--numel", "4096", "--reps", "2", "--out", str(tmp_path / "h.json")])
    assert "quantize_int4" in written(tmp_path / "h.json", "python -m pytest")["ms"]["1_threads"]


@pytest.mark.slow
def test_comm_counts_beside_theory(tmp_path):
    cli("bench.comm", "--configs", "4x2:bf16", "--systems", "+qgZ", "--layers", "1", "--hidden", "64", "--seq", "16",
        "--vocab", "128", "--out", str(tmp_path / "c.json"))
    rows = written(tmp_path / "c.json")["results"][0]["rows"]
    assert [r["system"] for r in rows] == ["ZeRO-3", "+qgZ"]
    assert rows[1]["inter_bytes"] == pytest.approx(rows[1]["theory_inter_bytes"], rel=0.2)
    assert rows[1]["plain_inter_bytes"] == rows[0]["inter_bytes"]


@pytest.mark.slow
@EVERY_COMMAND
def test_host_cost(tmp_path):
    cli("bench.kernels", "host-cost", "--num-layers", "1", "--hidden", "64", "--seq", "8", "--steps", "1",
        "--rounds", "1", "--out", str(tmp_path / "hc.json"))
    assert set(json.loads((tmp_path / "hc.json").read_text())["median_step_ms"]) == {"real", "no_op"}
