"""The planner (train.py --dry-run) against real runs and its user errors.

- Per rank, per phase and per collective, the bytes the planner predicts for a gloo
  cluster equal what the Communicator counts on 4 gloo ranks as 2 emulated nodes x 2
  (tiny GPT), the bytes put on the wire across nodes too (gloo sends the plain
  reduce-scatter as an all-to-all), and its model-state bytes equal memory_report()'s
  measurement (what the techniques keep as their parts say it): ZeRO-3
  (weights held from forward to backward), ZeRO-3 with reuse 0, ZeRO++
  (qwZ, hpZ 2, qgZ) with activation checkpointing and gradient accumulation,
  the same with INT4 weight deltas and qgZ's error feedback, and stages 0 (torch DDP, fp32 and bf16), 1 and 2.
- The plan's memory of what a technique keeps is what its part says (a changed MemoryLine moves it).
- The 18B plan prints in seconds; cluster-file mistakes are one line, exit 2.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeropp
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import topology_from_env
from common import ConfigError
from planner.cluster import Cluster, load_cluster
from planner.comm import collective_bytes, issued_bytes
from planner.plan import Job, plan_config
from planner.trace import trace_model
from tests.distributed import run_distributed
from zeropp.memory import memory_report
from zeropp.techniques.deltas import WeightDeltas
from zeropp.techniques.error_feedback import ErrorFeedback
from tests import REPO

ROOT = REPO
MODEL = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
             hidden_dropout=0.0, attention_dropout=0.0)
BASE = {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 100,
        "stage3_prefetch_bucket_size": 5000}
CASES = {
    "zero3": ({**BASE}, "fp32", False, 1),
    "zero3-reuse0": ({**BASE, "stage3_max_reuse_distance": 0}, "bf16", False, 1),
    "zeropp": ({**BASE, "stage3_max_reuse_distance": 0, "zero_quantized_weights": True,
                "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}, "bf16", True, 2),
    # and beyond: INT4 weight deltas (biases whole: zero at the start, they go in full until they grow)
    # and qgZ's error feedback
    "zeropp-deltas": ({**BASE, "stage3_param_persistence_threshold": 200, "stage3_max_reuse_distance": 0,
                       "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
                       "zero_quantized_weight_deltas": True, "zeropp_loco_param": {}}, "bf16", True, 2),
    # Hadamard smoothing of qgZ's blocks: the same bytes; LoCo's buffers padded to whole blocks
    "zeropp-hadamard": ({**BASE, "stage3_max_reuse_distance": 0, "zero_quantized_weights": True,
                         "zero_hpz_partition_size": 2, "zero_quantized_gradients": True, "zeropp_loco_param": {},
                         "zero_hadamard_gradients": True}, "bf16", False, 1),
    # qgZ's hop between nodes in INT2 (with LoCo, whose INT8 errors are counted as above)
    "zeropp-int2": ({**BASE, "stage3_max_reuse_distance": 0, "zero_quantized_weights": True,
                     "zero_hpz_partition_size": 2, "zero_quantized_gradients": True, "zeropp_loco_param": {},
                     "zero_quantized_gradients_bits": 2}, "bf16", False, 1),
    # Stage 0 (torch DDP): everything whole; 16-bit syncs every micro-step, fp32 the last only.
    "zero0-bf16": ({"stage": 0}, "bf16", False, 2),
    "zero0-fp32": ({"stage": 0}, "fp32", True, 2),
    "zero1": ({"stage": 1, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000}, "bf16", False, 2),
    "zero2": ({"stage": 2, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000}, "fp32", False, 1),
}
MICRO, SEQ, WORLD, RPN = 2, 16, 4, 2
# the test's ranks as a cluster: 2 nodes x 2 gloo ranks (the rates only time the plan)
GLOO = Cluster(nodes=2, gpus_per_node=2, gpu_memory_gb=4, peak_flops=1e10, intra_node_gbps=5,
               intra_node_latency_us=300, inter_node_gbps=0.2, inter_node_latency_us=300, backend="gloo")


def ds_config(zero: dict, dtype: str) -> zeropp.DeepSpeedConfig:
    raw = {"gradient_clipping": 1.0, "zero_optimization": zero}
    if dtype != "fp32":
        raw[dtype] = {"enabled": True}
    return zeropp.DeepSpeedConfig.from_dict(raw)


def measured_run(rank, world_size):
    out = {}
    for name, (zero, dtype, ckpt, accum) in CASES.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**MODEL, checkpoint_activations=ckpt))
        comm = Communicator(topology_from_env(RPN))
        engine = zeropp.initialize(model, ds_config(zero, dtype), comm, torch.device("cpu"),
                                   zeropp.OptimizerSettings(lr=1e-3), gradient_accumulation_steps=accum)
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):   # the last one is steady state: schedules recorded
            comm.reset_stats()
            for _ in range(accum):
                x = torch.randint(0, 96, (MICRO, SEQ + 1), generator=gen)
                engine.backward(engine(x[:, :-1], x[:, 1:]))
            memory = memory_report(engine)["measured_bytes"]
            engine.step()
        stats = comm.stats
        out[name] = {"bytes": {p: list(v) for p, v in stats.by_phase.items()}, "memory": memory,
                     "by_op": {op: list(v) for op, v in stats.by_op.items()}, "issued": stats.issued_inter_node_bytes}
    return out


def case_job(name):
    """The planner's Job for a case, its ZeRO configuration and the model's trace."""
    zero, dtype, ckpt, accum = CASES[name]
    ds = ds_config(zero, dtype)
    cfg = GPTConfig(**MODEL, checkpoint_activations=ckpt)
    job = Job(cfg=cfg, ds=ds, optimizer=zeropp.OptimizerSettings(lr=1e-3), world=WORLD, ranks_per_node=RPN,
              micro_batch=MICRO, seq_length=SEQ, accumulation=accum)
    z = ds.zero_optimization
    trace = trace_model(cfg, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], MICRO, SEQ,
                        z.stage3_param_persistence_threshold)
    return job, z, trace


def planned(name):
    job, z, trace = case_job(name)
    plan = plan_config(job, z, trace, GLOO, ranks=list(range(WORLD)))
    memory = []
    for r in range(WORLD):   # rank r's layout: its model states and what its techniques' parts keep
        mine = plan_config(job, z, trace, None, ranks=[r])
        kinds = {"parameters": mine.memory["weights"], "gradients": mine.memory["gradients"],
                 "optimizer": mine.memory["optimizer"]}
        for line in mine.kept + mine.carried:
            kinds[line.kind] += line.planned_bytes()
        memory.append(kinds)
    return plan, memory


def planned_by_op(plan, rank) -> tuple[dict, int]:
    """{collective: [intra, inter]} bytes `rank` is charged in the plan's iteration, and the
    inter-node bytes it puts on the wire."""
    by_op, issued = {}, 0
    for c in plan.step.collectives:
        intra, inter = collective_bytes(c, WORLD, RPN, plan.zero.zero_hpz_partition_size, rank)
        if intra or inter:
            acc = by_op.setdefault(c.op, [0, 0])
            acc[0], acc[1] = acc[0] + intra, acc[1] + inter
        issued += issued_bytes(c, WORLD, RPN, plan.zero.zero_hpz_partition_size, rank)[1]
    return by_op, issued


@pytest.mark.slow
def test_planner_bytes_equal_a_real_run():
    runs = run_distributed(measured_run, WORLD, timeout=240)
    for name in CASES:
        plan, memory = planned(name)
        for rank, run in enumerate(runs):
            got = run[name]
            for phase in ("forward_gather", "backward_gather", "grad_reduce", "optimizer"):
                assert plan.bytes_per_rank[rank][phase] == got["bytes"].get(phase, [0, 0]), (name, rank, phase)
            for kind in ("parameters", "gradients", "optimizer"):
                assert memory[rank][kind] == got["memory"][kind], (name, rank, kind)
            assert "other" not in got["bytes"], (name, rank)   # so the collectives below are the step's
            by_op, issued = planned_by_op(plan, rank)
            assert by_op == got["by_op"], (name, rank)
            assert issued == got["issued"], (name, rank)
        if name == "zeropp":   # hpZ: nothing crosses nodes in backward; qgZ and qwZ cut the rest
            assert all(b["backward_gather"][1] == 0 for b in plan.bytes_per_rank)
        if name == "zero3":    # every weight held from forward to backward: no backward gather
            assert all(b["backward_gather"] == [0, 0] for b in plan.bytes_per_rank)


def test_the_plan_asks_the_techniques_for_their_memory(monkeypatch):
    """LoCo's errors and the weight deltas' references in the plan are what their parts say they
    keep (MemoryLine): change a part's line and the plan moves by as much, bytes and formula."""
    job, zero, trace = case_job("zeropp-deltas")
    before = plan_config(job, zero, trace, GLOO)
    for part in (ErrorFeedback, WeightDeltas):
        def more(self, memory=part.memory):
            line = memory(self)
            return dataclasses.replace(line, nbytes=line.planned_bytes() + 1000,
                                       bytes_per_param=line.bytes_per_param + 0.5)
        monkeypatch.setattr(part, "memory", more)
    after = plan_config(job, zero, trace, GLOO)
    for key in ("error_feedback_bytes", "weight_deltas_bytes"):
        assert before.memory[key] > 0
        assert after.memory[key] == before.memory[key] + 1000, key
        assert after.formula[key] == before.formula[key] + 0.5 * trace.num_parameters, key
    for key in ("weights", "gradients", "optimizer", "gradient_buckets"):
        assert after.memory[key] == before.memory[key], key


def dry_run(*extra, cluster="configs/clusters/v100_4x16_100gbps.yaml"):
    cmd = [sys.executable, "train.py", "--num-layers", "40", "--hidden-size", "6144", "--num-attention-heads", "32",
           "--seq-length", "512", "--micro-batch-size", "1", "--fp16", "--checkpoint-activations",
           "--deepspeed_config", "configs/ds_zeropp_config.json", "--train-iters", "10", "--lr", "1e-4",
           "--tokenizer-type", "GPT2BPETokenizer", "--dry-run", *extra]
    if cluster:
        cmd += ["--cluster", cluster]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_18b_plan_prints_zero3_against_zeropp():
    r = dry_run()
    assert r.returncode == 0, r.stderr
    assert "parameters: 18,434,813,952" in r.stdout
    for text in ("hpZ secondary partition", "backward_gather", "predicted speedup of ZeRO++ over ZeRO-3",
                 "TFLOPs per GPU", "samples/s", "fits in 32 GiB"):
        assert text in r.stdout, text


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("nodes: 4\ngpus_per_node: 16\n", "missing key"),
    ("nodez: 4\n", "unknown key 'nodez'; did you mean 'nodes'"),
])
@pytest.mark.slow
def test_cluster_file_errors_are_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "cluster.yaml"
    if content is not None:
        path.write_text(content)
    r = dry_run(cluster=str(path))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("change, message", [
    ("backend=mpi", "backend must be one of nccl, gloo, got 'mpi'"),
    ("reduce_scatter_factor=2.0", "reduce_scatter_factor is gone: .* replace it with backend: gloo"),
])
def test_the_cluster_files_backend(change, message):
    """The backend says what the engine sends (gloo: the reduce-scatter as an all-to-all); the
    factor that stood for it before is refused with its replacement."""
    emulated = str(ROOT / "configs" / "clusters" / "emulated_slow_link.yaml")
    assert load_cluster(emulated).backend == "gloo"
    assert load_cluster(str(ROOT / "configs" / "clusters" / "v100_4x16_100gbps.yaml")).backend == "nccl"
    with pytest.raises(ConfigError, match=message):
        load_cluster(f"{emulated},{change}")


def plan_lines(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    """train.run(argv) from the repository root, as one process: (status, stdout, stderr)."""
    import train
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    status = train.run(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_demo_config_plans_its_world(capsys, monkeypatch, tmp_path):
    """configs/demo.yaml's 4 ranks as 2 nodes x 2, planned on the cluster that is that world
    (it was refused: world size 1, not under torchrun). The dry run checks that its inputs exist
    and reads the tokenizer: a small one here, so that the test does not need the demo corpus built."""
    from data.train_tokenizer import train_sentencepiece
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "the {n} birds went to the river"}}\n'
                                                 for n in range(200)))
    train_sentencepiece([str(tmp_path / "docs.jsonl")], str(tmp_path / "kjv_sp"), vocab_size=300)
    for name in ("kjv_text_document.bin", "kjv_text_document.idx"):
        (tmp_path / name).write_bytes(b"")
    inputs = ["--data-path", str(tmp_path / "kjv_text_document"), "--tokenizer-model", str(tmp_path / "kjv_sp.model")]
    status, out, err = plan_lines(capsys, monkeypatch, "--config", "configs/demo.yaml", "--dry-run", *inputs,
                                  "--cluster", "configs/clusters/emulated_slow_link.yaml")
    assert status == 0, err
    assert "2 nodes x 2 GPUs = 4" in out and "ZeRO++ = ZeRO-3 + qwZ, hpZ 2, qgZ" in out
    assert "training: 200 iterations x global batch 32 x seq 128 = 0.0 B tokens; ZeRO-3 " in out
    status, out, err = plan_lines(capsys, monkeypatch, "--config", "configs/demo.yaml", "--dry-run", *inputs)
    assert status == 2 and "--dry-run needs --cluster FILE" in err and "emulated_slow_link.yaml" in err


def test_the_cluster_file_with_values_changed(capsys, monkeypatch):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--lr", "1e-4", "--zero-stage", "3", "--zero-hpz-size", "8", "--dry-run"]
    status, out, err = plan_lines(capsys, monkeypatch, *base, "--ranks-per-node", "2", "--cluster",
                                  "configs/clusters/v100_4x16_100gbps.yaml,gpus_per_node=8,gpu_memory_gb=80")
    assert status == 0, err
    assert "cluster configs/clusters/v100_4x16_100gbps.yaml,gpus_per_node=8,gpu_memory_gb=80: 4 nodes x 8 GPUs " \
           "= 32, 80 GiB each" in out
    assert "> note: --ranks-per-node 2 emulates nodes on one machine; the plan has the cluster's nodes of 8 GPUs" in out
    assert "vocab 50257 (padded 50304, GPT-2's BPE vocabulary: no tokenizer file given)" in out
    for spec, says in ((",gpus_per_nod=8", "unknown key 'gpus_per_nod'; did you mean 'gpus_per_node'?"),
                       (",gpus_per_node=0", "gpus_per_node must be > 0, got 0"),
                       (",gpus_per_node", "'gpus_per_node' is not key=value")):
        status, out, err = plan_lines(capsys, monkeypatch, *base, "--cluster",
                                      "configs/clusters/v100_4x16_100gbps.yaml" + spec)
        assert status == 2 and says in err and len(err.splitlines()) == 1, err


def test_dry_run_names_every_missing_input_path(capsys, monkeypatch, tmp_path):
    (tmp_path / "half.bin").write_text("")
    status, out, err = plan_lines(
        capsys, monkeypatch, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--lr", "1e-4", "--dry-run", "--cluster", "configs/clusters/v100_1x8.yaml",
        "--data-path", "1", str(tmp_path / "half"), "1", str(tmp_path / "none"),
        "--tokenizer-model", str(tmp_path / "sp.model"), "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "s"))
    assert status == 2 and len(err.splitlines()) == 1 and out == "", err
    for text in (f"--data-path {tmp_path / 'half'} (no {tmp_path / 'half.idx'})",
                 f"--data-path {tmp_path / 'none'} (no {tmp_path / 'none.bin'} or {tmp_path / 'none.idx'})",
                 f"--tokenizer-model {tmp_path / 'sp.model'} (no such file)",
                 f"--load {tmp_path / 'ckpt'} (no such directory)"):
        assert text in err, text
    status, out, err = plan_lines(   # --load = --save: a first run that resumes where it will save
        capsys, monkeypatch, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--lr", "1e-4", "--dry-run", "--cluster", "configs/clusters/v100_1x8.yaml",
        "--load", str(tmp_path / "s"), "--save", str(tmp_path / "s"))
    assert status == 0, err
