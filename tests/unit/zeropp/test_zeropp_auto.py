"""ZeRO++ "auto": the keys and --zeropp auto, the link probe on real gloo ranks, the
planner's choice on synthetic measurements, and train.py --zeropp auto end to end."""
import contextlib
import io
import time
from pathlib import Path

import pytest
import torch

import train
import zeropp
from model import GPT, GPTConfig, num_parameters
from parallel.comm import Communicator
from parallel.link_probe import LinkMeasurement, LinkProbeError, probe_links
from parallel.topology import Topology, topology_from_env
from planner.auto import choose, measured_cluster, resolve
from planner.plan import Job
from planner.probe import Measurements, measure
from tests.distributed import run_distributed, spawn_ranks
from tests.integration.train.test_train import corpus, flags  # noqa: F401 - the tiny-corpus fixture
from training.args import parse_args
from tests import REPO

ROOT = REPO
TINY = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
            hidden_dropout=0.0, attention_dropout=0.0)
# The bench's model size (bench/slow_link/__init__.py), where the choice is not a toss-up.
BENCH = dict(vocab_size=4096, num_layers=4, hidden_size=192, num_attention_heads=4, max_position_embeddings=16,
             hidden_dropout=0.0, attention_dropout=0.0)
BASE_ARGS = ["--lr", "1e-3", "--train-iters", "2", "--data-path", "x"]
AUTO_ZERO = {"stage": 3, "zero_quantized_weights": "auto", "zero_hpz_partition_size": "auto",
             "zero_quantized_gradients": "auto"}


def test_auto_keys_and_flag_parse(tmp_path):
    cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": AUTO_ZERO})
    assert cfg.zero_optimization.auto_switches() == ["zero_quantized_weights", "zero_hpz_partition_size",
                                                     "zero_quantized_gradients"]
    zero = parse_args(["--zeropp", "auto", "--zero-stage", "3", *BASE_ARGS]).ds_config.zero_optimization
    assert len(zero.auto_switches()) == 3
    # an explicit per-technique flag keeps its value; auto decides the rest
    zero = parse_args(["--zeropp", "auto", "--zero-hpz-size", "1", *BASE_ARGS]).ds_config.zero_optimization
    assert zero.zero_hpz_partition_size == 1 and len(zero.auto_switches()) == 2
    (tmp_path / "run.yaml").write_text("zeropp: auto\nzero-stage: 3\n")
    zero = parse_args(["--config", str(tmp_path / "run.yaml"), *BASE_ARGS]).ds_config.zero_optimization
    assert len(zero.auto_switches()) == 3
    # the command line's --zeropp auto wins over the YAML's per-technique keys (the demo config's)
    (tmp_path / "demo.yaml").write_text("zero-stage: 3\nzero-quantized-weights: true\nzero-hpz-size: 2\n")
    zero = parse_args(["--config", str(tmp_path / "demo.yaml"), "--zeropp", "auto", *BASE_ARGS]).ds_config
    assert len(zero.zero_optimization.auto_switches()) == 3
    # auto below stage 3 is not refused at parsing: resolve turns it off, saying so
    assert parse_args(["--zeropp", "auto", "--zero-stage", "2", *BASE_ARGS]).ds_config.zero_optimization.stage == 2


@pytest.mark.parametrize("bad, culprit", [
    ({"zero_quantized_weights": "yes"}, "zero_quantized_weights must be true or false or \"auto\""),
    ({"zero_hpz_partition_size": "node"}, "zero_hpz_partition_size must be a whole number"),
])
def test_bad_auto_values_name_the_key(bad, culprit):
    with pytest.raises(zeropp.ConfigError, match=culprit):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **bad}})


@pytest.mark.parametrize("argv, culprit", [
    (["--zeropp", "on"], "argument --zeropp: must be auto"),
    (["--zeropp", "true"], "argument --zeropp: must be auto"),
])
def test_bad_zeropp_flag_is_one_line_exit_2(argv, culprit, capsys):
    assert train.run([*argv, *BASE_ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and culprit in err[0], err


def test_yaml_zeropp_true_is_refused(tmp_path):
    (tmp_path / "run.yaml").write_text("zeropp: true\n")
    with pytest.raises(zeropp.ConfigError, match="zeropp must be auto, got true"):
        parse_args(["--config", str(tmp_path / "run.yaml"), *BASE_ARGS])


def test_initialize_refuses_unresolved_auto():
    cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": AUTO_ZERO})
    comm = Communicator(Topology(world_size=1, rank=0, ranks_per_node=1))
    with pytest.raises(zeropp.ConfigError, match=r"planner\.auto\.resolve"):
        zeropp.initialize(GPT(GPTConfig(**TINY)), cfg, comm, torch.device("cpu"), zeropp.OptimizerSettings())


@pytest.mark.parametrize("zero, topo, reason", [
    ({**AUTO_ZERO, "stage": 2}, (4, 2), "ZeRO stage 2"),
    (AUTO_ZERO, (1, 1), "world size 1"),
    (AUTO_ZERO, (4, 4), "one node"),
])
def test_no_probe_cases_say_one_line(zero, topo, reason):
    """No process group here: a probe would raise, so these must decide without one."""
    comm = Communicator(Topology(world_size=topo[0], rank=0, ranks_per_node=topo[1]))
    res = resolve({"zero_optimization": zero}, GPTConfig(**TINY), comm, torch.device("cpu"), 2, 16)
    z = res.config.zero_optimization
    assert len(res.lines) == 1 and reason in res.lines[0] and "off" in res.lines[0], res.lines
    assert (z.zero_quantized_weights, z.zero_hpz_partition_size, z.zero_quantized_gradients) == (False, 1, False)
    assert res.measured is None


def synthetic(inter_gbps: float, gflops: float, quant_melems: float) -> Measurements:
    links = LinkMeasurement(inter_node_bytes_per_s=inter_gbps * 1e9 / 8, intra_node_bytes_per_s=4e9 / 8,
                            inter_node_latency_s=100e-6, intra_node_latency_s=50e-6, inter_probe_bytes=2**20,
                            seconds=0.5)
    return Measurements(links, gflops * 1e9, quant_melems * 1e6, quant_melems * 1e6, 2e9, 1.0)


def bench_job(zero: dict) -> Job:
    ds = zeropp.DeepSpeedConfig.from_dict({"bf16": {"enabled": True}, "zero_optimization": zero})
    return Job(cfg=GPTConfig(**BENCH), ds=ds, optimizer=zeropp.OptimizerSettings(), world=4, ranks_per_node=2,
               micro_batch=1, seq_length=16, accumulation=1)


def pick(zero: dict, m: Measurements):
    chosen, predicted, lines = choose(bench_job(zero), measured_cluster(m, 2, 2, overlap=False, gloo=True))
    return chosen, predicted, lines


def test_slow_link_picks_quantization_and_hpz():
    # weights regathered in backward (reuse 0, a prefetch bucket of 1/8 of the model: only
    # the first backward bucket is held), so hpZ has cross-node bytes to save
    psi = num_parameters(GPTConfig(**BENCH))
    chosen, predicted, lines = pick({**AUTO_ZERO, "stage3_max_reuse_distance": 0,
                                     "stage3_prefetch_bucket_size": psi // 8}, synthetic(0.1, 50, 2000))
    assert (chosen.zero_quantized_weights, chosen.zero_hpz_partition_size, chosen.zero_quantized_gradients) == \
        (True, 2, True), lines
    assert len(predicted) == 8 and min(predicted.values()) == predicted["ZeRO++ (qwZ, hpZ 2, qgZ)"]
    assert lines[-1].startswith("> ZeRO++ auto: chose ZeRO++ (qwZ, hpZ 2, qgZ)")


def test_fast_link_with_slow_quantization_picks_none():
    # one prefetch bucket (DeepSpeed's default 5e7): with 1/8 of the model, the default when unset, each
    # collective's latency adds up and hpZ's gain reaches 2.5%
    chosen, predicted, lines = pick({**AUTO_ZERO, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 5e7},
                                    synthetic(400, 2, 20))
    assert chosen.zero_quantized_weights is False and chosen.zero_quantized_gradients is False, lines
    assert chosen.zero_hpz_partition_size == 1, lines   # hpZ's gain there is under 2%: fewer techniques win
    assert predicted["ZeRO-3"] < predicted["ZeRO++ (qwZ, qgZ)"]


def test_only_auto_switches_are_chosen_and_ties_go_to_fewer_techniques():
    """qgZ pinned off stays off; with weights held for backward (reuse default) hpZ saves
    nothing, so it is never chosen even on a slow link."""
    zero = {**AUTO_ZERO, "zero_quantized_gradients": False}
    chosen, predicted, lines = pick(zero, synthetic(0.1, 50, 2000))
    assert len(predicted) == 4 and chosen.zero_quantized_gradients is False
    assert chosen.zero_quantized_weights is True and chosen.zero_hpz_partition_size == 1, lines


def probe_run(rank, world_size):
    comm = Communicator(topology_from_env(2))
    start = time.perf_counter()
    m = measure(GPTConfig(**TINY), torch.float32, torch.device("cpu"), 2, 16, comm.topology)
    wall = time.perf_counter() - start
    res = resolve({"zero_optimization": AUTO_ZERO}, GPTConfig(**TINY), comm, torch.device("cpu"), 2, 16)
    return m, wall, res.config.zero_optimization, res.lines, comm.stats.total_bytes


@pytest.mark.slow
def test_probe_on_four_gloo_ranks_is_fast_and_identical():
    results = run_distributed(probe_run, 4)
    (m, _, zero, lines, _) = results[0]
    for other, wall, z, _, counted in results:
        assert other == m and z == zero   # every rank measured and decided the same
        assert wall < 2.0 and counted == 0, (wall, other.phase_seconds)   # no probe bytes in the counts
    assert m.seconds < 2.0
    assert m.links.inter_node_bytes_per_s > 0 and m.links.intra_node_bytes_per_s > 0
    assert m.flops_per_s > 0 and m.int8_elements_per_s > 0 and m.optimizer_bytes_per_s > 0
    assert not zero.auto_switches() and lines[-1].startswith("> ZeRO++ auto: chose ")


def absent_peer_run(rank, world_size):
    topology = topology_from_env(1)   # the groups are made together (a collective)
    if rank == 1:
        time.sleep(3)   # then rank 1 never joins the probe
        return None
    start = time.perf_counter()
    with pytest.raises(LinkProbeError, match="did not finish in 1 s") as e:
        probe_links(topology, timeout_s=1.0)
    return str(e.value), time.perf_counter() - start


@pytest.mark.slow
def test_probe_that_cannot_run_is_a_clear_error():
    # fresh: rank 0 gives up on a probe that rank 1 never joins, leaving the world half-used
    results, error = spawn_ranks(absent_peer_run, 2, timeout=60, fresh=True)
    assert error is None, error
    message, seconds = results[0]
    assert message.startswith("link probe: ") and seconds < 5


def train_run(rank, world_size, corpus_dir, out):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train.main(flags(corpus_dir, out, 3, ["--zeropp", "auto", "--zero-stage", "3", "--ranks-per-node", "2",
                                              "--global-batch-size", "8", "--eval-iters", "0", "--bf16"]))
    return buf.getvalue()


@pytest.mark.slow
def test_train_zeropp_auto_end_to_end(corpus, tmp_path):  # noqa: F811 - the fixture
    out = run_distributed(train_run, 4, (corpus, tmp_path))[0]
    auto = [line for line in out.splitlines() if line.startswith("> ZeRO++ auto:")]
    assert "inter-node" in auto[0] and "compute" in auto[1], auto
    assert sum(line.startswith(">   ") for line in out.splitlines()) == 8 and auto[-1].startswith("> ZeRO++ auto: chose ")
    chosen = {t for t in ("qwZ", "hpZ", "qgZ") if t in auto[-1].split(",")[0] + auto[-1].split("ms predicted")[0]}
    job = next(line for line in out.splitlines() if line.startswith("> 4 ranks on 2 node(s) x 2, "))
    assert {t for t in ("qwZ", "hpZ", "qgZ") if t in job} == chosen, (job, auto[-1])
    assert out.count("lm loss:") >= 1
    # no bucket size set: each is 1/8 of the model, said once (zeropp/bucket_sizing.py)
    params = int(next(line for line in out.splitlines() if line.startswith("> GPT: ")).split()[2].replace(",", ""))
    buckets = [line for line in out.splitlines() if line.startswith("> buckets sized from the model")]
    assert len(buckets) == 1 and f"({params:,} parameters / 8" in buckets[0], buckets
    assert all(f"{k} {params // 8:,}" in buckets[0] for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size"))


CLUSTERS = ROOT / "configs" / "clusters"
DRY = ["--num-layers", "4", "--hidden-size", "192", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "1", "--zero-stage", "3", "--bf16", "--zeropp", "auto", "--tokenizer-type",
       "GPT2BPETokenizer", "--dry-run", "--lr", "1e-3", "--train-iters", "2"]   # no data: the dry run checks paths


def test_dry_run_with_auto_plans_every_candidate_on_the_cluster(capsys):
    train.main([*DRY, "--cluster", str(CLUSTERS / "emulated_slow_link.yaml")])
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(">   ") for line in out) == 8
    chose = next(line for line in out if line.startswith("> ZeRO++ auto: chose "))
    picked = chose.split("chose ")[1].split(", ")[0] if "(" not in chose else chose.split("(")[1].split(")")[0]
    legend = [line.strip() for line in out if line.strip().startswith("ZeRO++ = ZeRO-3 + ")]
    assert legend == [f"ZeRO++ = ZeRO-3 + {picked}"], (chose, legend)   # the plan is of the chosen config


def test_dry_run_with_auto_on_one_node_says_one_line(capsys):
    train.main([*DRY, "--cluster", str(CLUSTERS / "v100_1x8.yaml")])
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "ZeRO++ auto" in line] == [
        "> ZeRO++ auto: qwZ, hpZ, qgZ off (one node: no slow inter-node link for quantization to save, and "
        "hpZ's copy inside the node would be the primary partition itself); now ZeRO-3"]
