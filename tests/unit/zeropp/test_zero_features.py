"""ZeRO stages 1-3 beyond plain exactness: a non-GPT module with a shared
weight, eval/no_grad forward, fp16 overflow skipping, communication volume,
model-state memory against the ZeRO formula, and bad configurations."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import Topology, topology_from_env
from tests.distributed import restore, run_distributed, snapshot
from tests.numerics import assert_state_within_roundoff, fp64_reference
import zeropp
from zeropp.memory import memory_report

WORLD = 4
CFG = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


class SharedMLP(nn.Module):
    """Not a GPT: one Linear called twice, its weight also used (transposed)
    outside it, and a direct parameter of the root module."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)
        self.gain = nn.Parameter(torch.ones(32))

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h)) * self.gain
        h = torch.tanh(self.hidden(h))
        h = h + F.linear(h, self.hidden.weight.t())
        return F.mse_loss(self.out(h), y)


def make_engine(model, stage, world_size, accum=1, comm=None, zero=None, **extra):
    cfg = {"gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 5000, **(zero or {})}}
    for k, v in extra.items():
        cfg[k] = v
    comm = comm or Communicator(topology_from_env() if world_size > 1 else Topology(1, 0, 1))
    return zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict(cfg), comm, torch.device("cpu"),
                             zeropp.OptimizerSettings(lr=1e-2), gradient_accumulation_steps=accum)


def mlp_run(rank, world_size, stage):
    torch.manual_seed(0)
    engine = make_engine(SharedMLP(), stage, world_size, accum=2)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        per = 8 // world_size
        mine_x, mine_y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        total = 0.0
        for m in range(2):
            sl = slice(m * per // 2, (m + 1) * per // 2)
            loss = engine(mine_x[sl], mine_y[sl])
            engine.backward(loss)
            total += loss.item() / 2
        engine.step()
        losses.append(total)
    return losses, engine.module_state_dict()


def comm_per_step(engine, comm, x, steps=3):
    stats = []
    for _ in range(steps):
        comm.reset_stats()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        stats.append({"bytes": {k: sum(v) for k, v in comm.stats.by_phase.items()},
                      "calls": dict(comm.stats.calls)})
    return stats


def gpt_stage3_checks(rank, world_size):
    """Eval/no_grad logits and the communication volume of stage 3 steps, with
    weights re-gathered in backward (reuse distance 0) and held (DeepSpeed's default)."""
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(rank))
    comm = Communicator(topology_from_env())
    torch.manual_seed(0)
    held = comm_per_step(make_engine(GPT(GPTConfig(**CFG)), 3, world_size, comm=comm), comm, x)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    engine = make_engine(model, 3, world_size, comm=comm, zero={"stage3_max_reuse_distance": 0})
    stats = comm_per_step(engine, comm, x)
    held_first = sum(engine.shards[i].numel for i in engine.parts.hooks.gathers.reuse)   # held for backward at reuse 0
    weights = engine.module_state_dict()
    engine.eval()
    probe = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = engine(probe)
    logits_grad_mode = engine(probe).detach()  # eval forward with grad enabled, no backward
    engine.train()
    psi = sum(s.numel for s in engine.shards)
    return weights, logits, logits_grad_mode, stats, held, psi, held_first


def fp16_overflow_run(rank, world_size, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    engine = make_engine(model, stage, world_size,
                         fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(rank))
    results, snapshots = [], []
    for step in range(3):
        loss = engine(x[:, :-1], x[:, 1:])
        if step == 1 and rank == 1:
            loss = loss * float("inf")  # an overflow on one rank only
        engine.backward(loss)
        results.append(engine.step())
        snapshots.append(engine.module_state_dict())
    return results, snapshots


def memory_run(rank, world_size):
    cfg = GPTConfig(vocab_size=1024, num_layers=2, hidden_size=128, num_attention_heads=4,
                    max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(rank))
    reports = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine = make_engine(GPT(cfg), stage, world_size, bf16={"enabled": True})
        for _ in range(2):  # Adam's moments exist after the first step; measure between backward and step
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            if _ == 0:
                engine.step()
        reports[stage] = memory_report(engine)
        engine.step()
    return reports


def mlp_fp64():
    """mlp_run's training in fp64 (tests/numerics.py)."""
    torch.manual_seed(0)
    model = SharedMLP()
    g = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g).double(), torch.randn(8, 8, generator=g).double()
        steps.append([lambda m, x=x[sl], y=y[sl]: m(x, y) for sl in (slice(0, 4), slice(4, 8))])
    return fp64_reference(model, steps, lr=1e-2, clip=1.0)[2]


@pytest.mark.slow
def test_shared_weight_mlp_stage3_matches_reference():
    ref_losses, ref_weights = mlp_run(0, 1, 0)
    exact = mlp_fp64()
    for losses, weights in run_distributed(mlp_run, world_size=WORLD, args=(3,)):
        # per-rank losses differ (local data): compare the rank-average below via weights;
        # the updated weights must match the single-process run to fp32 round-off.
        assert_state_within_roundoff(weights, ref_weights, exact, "stage 3")
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.slow
def test_stage3_eval_logits_and_comm_volume():
    results = run_distributed(gpt_stage3_checks, world_size=WORLD)
    for weights, logits, logits_grad_mode, stats, held, psi, held_first in results:
        ref = GPT(GPTConfig(**CFG))
        ref.load_state_dict(weights)
        ref.eval()
        with torch.no_grad():
            expect = ref(torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(9)))
        torch.testing.assert_close(logits, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits_grad_mode, expect, rtol=1e-5, atol=1e-5)
        # Bytes this rank sent in a steady-state step (3rd: the prefetch order is known),
        # in units of M * (N-1)/N, M = the model's bytes in the compute dtype (fp32 here).
        unit = psi * 4 * (WORLD - 1) / WORLD
        step = stats[2]["bytes"]
        gathered = (step["forward_gather"] + step["backward_gather"]) / unit
        reduced = step["grad_reduce"] / unit
        # Forward gathers every weight once (1.0) and backward again, except weights
        # autograd never saves (biases, LayerNorm bias, the position embedding:
        # ~6% of this tiny model), so 1.9-2.0 (padding to multiples of N adds <1%): at
        # reuse distance 0 every module's weights are released after its forward.
        assert held_first == 0
        assert 1.85 <= gathered <= 2.02, gathered
        # Gradients: one reduce-scatter of every weight (+ padding).
        assert 0.99 <= reduced <= 1.02, reduced
        # stage3_max_reuse_distance 1e9 (default): every weight of this small model is
        # held from forward to backward, so only the forward gathers (the first step
        # has no recorded order yet and gathers again in backward).
        assert (held[0]["bytes"]["forward_gather"] + held[0]["bytes"]["backward_gather"]) / unit >= 1.85
        assert 0.99 <= held[2]["bytes"]["forward_gather"] / unit <= 1.01
        assert "backward_gather" not in held[2]["bytes"]
        assert 0.99 <= held[2]["bytes"]["grad_reduce"] / unit <= 1.02
        # One collective per bucket: this model (~36k elements) fits one prefetch bucket
        # (5000 elements here) in 8 or fewer, against one gather per module (20) before.
        assert held[2]["calls"]["forward_gather"] <= 8, held[2]["calls"]


def fp16_overflow_all(rank, world_size):
    return {stage: fp16_overflow_run(rank, world_size, stage) for stage in (1, 2, 3)}


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_everywhere():
    per_rank = run_distributed(fp16_overflow_all, world_size=WORLD)  # stages 1, 2, 3 in one launch
    for stage in (1, 2, 3):
        results = [r[stage] for r in per_rank]
        for res, snaps in results:
            assert [r.skipped for r in res] == [False, True, False], stage
            assert res[0].loss_scale == 256.0 and res[1].loss_scale == 256.0
            assert res[2].loss_scale == 128.0  # halved after the overflow (hysteresis 1)
            for k in snaps[0]:
                assert torch.equal(snaps[0][k], snaps[1][k]), (stage, k)  # skipped: nothing changed
        for k in results[0][1][2]:  # all ranks hold the same model afterwards
            for res, snaps in results[1:]:
                assert torch.equal(snaps[2][k], results[0][1][2][k])


@pytest.mark.slow
def test_model_state_memory_matches_formula():
    reports = run_distributed(memory_run, world_size=WORLD)
    for per_rank in reports:
        for stage, rep in per_rank.items():
            assert rep["predicted_bytes_per_param"]["total"] == {
                0: 18, 1: 2 + 16 / WORLD, 2: 2 + 16 / WORLD, 3: 18 / WORLD}[stage]
            for kind in ("parameters", "gradients", "optimizer", "total"):
                assert abs(rep["ratio"][kind] - 1) < 0.05, (stage, kind, rep)


def test_bad_configs_are_clear_errors():
    with pytest.raises(zeropp.ConfigError, match="did you mean 'reduce_bucket_size'"):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"reduce_bucket_sise": 10}})
    with pytest.raises(zeropp.ConfigError, match="stages are 0, 1, 2 and 3"):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 4}})
    with pytest.raises(zeropp.ConfigError, match="reduce_bucket_size must be a positive"):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"reduce_bucket_size": 0}})
    cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3,
                                                                  "zero_hpz_partition_size": 3}})
    topo = Topology(world_size=4, rank=0, ranks_per_node=2)
    with pytest.raises(zeropp.ConfigError, match="must divide the ranks per node"):
        cfg.zero_optimization.validate_topology(topo.ranks_per_node, topo.world_size)
    with pytest.raises(zeropp.ConfigError, match="must divide the ranks per node"):
        zeropp.initialize(nn.Linear(2, 2), cfg, Communicator(topo), torch.device("cpu"),
                          zeropp.OptimizerSettings())


def checkpoint_run(rank, world_size):
    """Save module + optimizer state after 2 steps, load them into a fresh engine:
    the next step is bit-identical to the original engine's."""
    out = {}
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 96, (2, 17), generator=g) for _ in range(3)]
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        engine = make_engine(GPT(GPTConfig(**CFG)), stage, world_size, bf16={"enabled": True})
        for x in data[:2]:
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
        saved = snapshot(engine)  # a copy: Adam updates its moments in place
        engine.backward(engine(data[2][:, :-1], data[2][:, 1:]))
        engine.step()
        expect = engine.module_state_dict()
        torch.manual_seed(1)  # different init: everything must come from the checkpoint
        fresh = make_engine(GPT(GPTConfig(**CFG)), stage, world_size, bf16={"enabled": True})
        restore(fresh, saved)
        fresh.backward(fresh(data[2][:, :-1], data[2][:, 1:]))
        fresh.step()
        got = fresh.module_state_dict()
        out[stage] = all(torch.equal(got[k], expect[k]) for k in expect) and set(got) == set(expect)
    return out


@pytest.mark.slow
def test_checkpoint_round_trip_is_exact():
    for per_rank in run_distributed(checkpoint_run, world_size=WORLD):
        assert per_rank == {1: True, 2: True, 3: True}
