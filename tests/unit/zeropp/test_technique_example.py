"""A technique added as the walk in ARCHITECTURE.md adds one: its module (the first part of this
file: its keys and their check, its part, its TECHNIQUE) and one registry line (here
`techniques.registered`, for the test's duration). With nothing else edited (ZeroConfig, the
build, the planner, the checkpoint code), its key is read from the DeepSpeed JSON and a bad value
refused in one line, the planner plans it, zeropp.initialize builds it, and its carried state is
saved and resumed bit for bit (and a job without it says in one line that it was dropped).

The example: gradient noise, N(0, std^2) added to each reduced gradient shard, drawn from a
generator seeded by (rank, bucket, applied steps); the count of applied steps is its carried
state, committed with the step and saved sharded (one element per rank)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

import zeropp
from common import ConfigError
from model import GPTConfig
from parallel.comm import Work
from planner.plan import Job, label, plan_config
from planner.trace import trace_model
from tests.distributed import run_distributed, snapshot
from tests.unit.zeropp.test_zeropp import CFG, gpt, make_engine, tokens
from zeropp import techniques
from zeropp.collectives.exact import ShardReduce
from zeropp.collectives.partition import FlatState
from zeropp.collectives.protocols import MemoryLine
from zeropp.collectives.two_hop import TwoHops
from zeropp.memory import memory_report
from zeropp.techniques.technique import Technique, key

# -- the technique's module ----------------------------------------------------------------------
MEMORY_KEY = "gradient_noise_bytes"
STEPS = "gradient_noise.steps"   # its checkpoint key


@dataclass
class Keys:
    """Its key in zero_optimization: the noise's standard deviation (0: off)."""
    zero_gradient_noise: float = key(0.0)


def validate(zero, where: str):
    std = zero.zero_gradient_noise
    if not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"{where}.zero_gradient_noise must be a finite number >= 0 (0 turns the noise off), "
                          f"got {std}")


class NoiseSteps:
    """The carried state: applied steps drawn for, this rank's (protocols.CarriedState)."""

    def __init__(self, device):
        self.steps = torch.zeros(1, dtype=torch.float64, device=device)
        self.drew = False

    def end_step(self, applied: bool) -> str | None:
        if applied and self.drew:
            self.steps += 1
        self.drew = False
        return None

    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        return {STEPS: FlatState(self.steps, world, sharded=True)}

    def scalar_state(self) -> dict:
        return {"holds": True}

    def carried(self, saved: dict | None) -> bool:
        return bool(saved)

    def load_scalar_state(self, saved: dict | None) -> str | None:
        self.drew = False
        if self.carried(saved):
            return None
        self.steps.zero_()
        return "gradient noise starts from step 0: the checkpoint has none"

    def memory(self) -> MemoryLine:
        return MemoryLine(MEMORY_KEY, "gradients", [self.steps], 0.0, label="gradient noise (its step count)")

    def peak_buffers(self) -> dict:
        return {}

    def plan_step(self) -> list:
        return []   # nothing sent after a step

    def summary(self) -> str | None:
        return None


class NoisyReduce:
    """The reduction chosen before it (exact, qgZ, LoCo), then the noise added to this rank's shard."""

    def __init__(self, inner, std: float, rank: int, device):
        self.inner, self.std, self.rank = inner, std, rank
        self.state = NoiseSteps(device)

    def start(self, rows, out, partition, phase, async_op=True, pool=None, key=0) -> Work:
        work = self.inner.start(rows, out, partition, phase, async_op, pool, key)
        return TwoHops(work, lambda: Work(then=lambda: self._add_noise(out, key)))

    def _add_noise(self, out: torch.Tensor, key) -> torch.Tensor:
        self.state.drew = True
        seed = (int(self.state.steps.item()) * 1009 + key) * 64 + self.rank
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        return out.add_(noise.mul_(self.std).to(out.dtype))

    def inflight_bytes(self, bucket_elems: int, elem_bytes: int = 4) -> int:
        return self.inner.inflight_bytes(bucket_elems, elem_bytes)

    def expect(self, bucket_totals, topology, device):
        self.inner.expect(bucket_totals, topology, device)

    def carried_parts(self) -> dict:
        return {**self.inner.carried_parts(), "gradient_noise": self.state}

    def plan(self, total: int, elem_bytes: int) -> list:
        return self.inner.plan(total, elem_bytes)   # the noise is drawn where it is added: nothing sent


def build(ctx) -> NoisyReduce:
    inner = ctx.gradient_reduction or ShardReduce(ctx.comm)
    return NoisyReduce(inner, ctx.zero.zero_gradient_noise, ctx.comm.topology.rank, ctx.device)


TECHNIQUE = Technique("gradient noise", "gradient_reduction", Keys, "zero_gradient_noise", build, validate,
                      carries={"gradient_noise": "gradient noise's step count (zero_gradient_noise)"},
                      memory_key=MEMORY_KEY)
# -- end of the technique's module ---------------------------------------------------------------

NOISE = {"zero_gradient_noise": 0.05}


def ds(zero: dict) -> zeropp.DeepSpeedConfig:
    return zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **zero}})


def test_its_key_is_read_and_a_bad_value_refused():
    with pytest.raises(ConfigError, match="unknown key 'zero_gradient_noise'"):
        ds(NOISE)   # not registered: a typo like any other
    with techniques.registered(TECHNIQUE):
        zero = ds(NOISE).zero_optimization
        assert zero.zero_gradient_noise == 0.05 and zero.stage3_param_persistence_threshold == 100_000
        assert techniques.names(zero) == ["gradient noise"] and ds({}).zero_optimization.zero_gradient_noise == 0
        for bad, culprit in ((-1, "zero_gradient_noise must be a finite number >= 0"),
                             ("loud", "zero_gradient_noise must be a number")):
            with pytest.raises(ConfigError, match=culprit):
                ds({"zero_gradient_noise": bad})
        with pytest.raises(ConfigError, match=r"zero_gradient_noise \(ZeRO\+\+\) need stage 3"):
            zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 2, **NOISE}})
    with pytest.raises(ConfigError, match="unknown key"):   # gone again with the block
        ds(NOISE)


def test_it_is_planned():
    """The planner builds its part like the others: its label, its memory line, its carried bytes
    in a checkpoint, and its collectives (its inner reduction's: the noise sends nothing)."""
    cfg = GPTConfig(**CFG)
    with techniques.registered(TECHNIQUE):
        plans = {}
        for name, zero in (("plain", {}), ("noise", NOISE)):
            config = ds({"stage3_param_persistence_threshold": 0, **zero})
            job = Job(cfg=cfg, ds=config, optimizer=zeropp.OptimizerSettings(), world=4, ranks_per_node=2,
                      micro_batch=2, seq_length=16, accumulation=1)
            trace = trace_model(cfg, torch.float32, 2, 16, 0)
            plans[name] = plan_config(job, config.zero_optimization, trace, None)
        plain, noise = plans["plain"], plans["noise"]
        assert label(noise.zero) == "ZeRO++ (gradient noise)" and label(plain.zero) == "ZeRO-3"
    assert noise.memory[MEMORY_KEY] == 8 and MEMORY_KEY not in plain.memory
    assert noise.saved == {"gradient_noise": 4 * 8}
    assert noise.bytes_per_rank == plain.bytes_per_rank


def train(engine, rank, steps) -> list[float]:
    """The losses of training `engine` on `steps`."""
    losses = []
    for step in steps:
        x = tokens(rank, step)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_save_resume(rank, world_size, path):
    """6 steps straight with the noise, saving after 3; a fresh engine loads that and runs the last
    3: the same losses and state bit for bit. Against: the same without noise, and a load into a
    job without it."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    with techniques.registered(TECHNIQUE):
        straight = make_engine(gpt(), world_size, NOISE)
        losses = train(straight, rank, range(3))
        save_checkpoint(path, 3, straight, 0, {"model_config": {}, "param_shapes": {}})
        losses += train(straight, rank, range(3, 6))
        report = memory_report(straight)
        resumed = make_engine(gpt(), world_size, NOISE)
        load_checkpoint(path, resumed, load_rng=False)
        again = train(resumed, rank, range(3, 6))
        plain = make_engine(gpt(), world_size)   # the noise off: its state is dropped, said in one line
        notes = plain.load_scalar_state(straight.scalar_state())
        plain_losses = train(make_engine(gpt(), world_size), rank, range(6))
    a, b = snapshot(straight), snapshot(resumed)
    return dict(losses=losses, plain=plain_losses, again=again, keys=list(a[0]), memory=report[MEMORY_KEY],
                same=[k for k in a[0] if torch.equal(a[0][k], b[0][k])], notes=notes,
                steps=straight.parts.carried["gradient_noise"].steps.item())


@pytest.mark.slow
def test_it_is_built_trained_and_resumed_from_a_checkpoint(tmp_path):
    for r in run_distributed(train_save_resume, 2, args=(str(tmp_path / "ckpt"),)):
        assert r["losses"][0] == r["plain"][0] and r["losses"][1:] != r["plain"][1:], r   # the noise acts
        assert r["losses"][3:] == r["again"], r
        assert STEPS in r["keys"] and r["same"] == r["keys"], r
        assert r["steps"] == 6 and r["memory"] == 8, r
        assert r["notes"] == ["gradient noise's step count (zero_gradient_noise) in the checkpoint is dropped: "
                              "this job runs without it"], r["notes"]
    assert os.path.isdir(tmp_path / "ckpt")
