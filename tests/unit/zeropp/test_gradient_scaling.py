"""Gradient averaging in DeepSpeed's order, and the same start at any world size.

- Stages 1-3 divide 16-bit gradients by the world size before the sum, as
  DeepSpeed's ZeRO does, so two ranks whose fp16 gradient is 40000 (mean 40000,
  representable; sum 80000, not) step instead of overflowing; qgZ too.
- Stage 0 follows DeepSpeed's non-ZeRO all-reduce: sum, then divide (the sum
  overflows), unless prescale_gradients divides first, or
  communication_data_type fp32 sums in fp32.
- The fp32 masters start from the exact fp32 initialization at every world
  size, stage and precision."""
import pytest
import torch
import torch.nn as nn

import zeropp
from common import ConfigError
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import Topology, topology_from_env
from tests.distributed import run_distributed

GRAD = 40000.0   # < fp16 max 65504; twice it is not


class Scaled(nn.Module):
    """loss = sum(w * c): every element's gradient is c."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64))

    def forward(self, c):
        return (self.w * c).sum()


def engine_for(model, world_size, top, zero, param_init=None, ranks_per_node=None):
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0, **zero}, **top}
    topo = topology_from_env(ranks_per_node) if world_size > 1 else Topology(1, 0, 1)
    return zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict(cfg), Communicator(topo),
                             torch.device("cpu"), zeropp.OptimizerSettings(lr=1e-6), param_init=param_init)


FP16 = {"fp16": {"enabled": True, "loss_scale": 1.0}}
CASES = {
    "stage 1": ({**FP16}, {"stage": 1}, False),
    "stage 2": ({**FP16}, {"stage": 2}, False),
    "stage 3": ({**FP16}, {"stage": 3}, False),
    "stage 3 + qgZ": ({**FP16}, {"stage": 3, "zero_quantized_gradients": True}, False),
    "stage 0": ({**FP16}, {"stage": 0}, True),   # DeepSpeed's stage 0 sums first: overflow
    "stage 0, prescale_gradients": ({**FP16, "prescale_gradients": True}, {"stage": 0}, False),
    "stage 0, fp32 communication": ({**FP16, "communication_data_type": "fp32"}, {"stage": 0}, False),
}


def scaled_step(rank, world_size, case):
    top, zero, _ = CASES[case]
    engine = engine_for(Scaled(), world_size, top, zero, ranks_per_node=1)   # 2 nodes x 1 for qgZ
    engine.backward(engine(torch.tensor(GRAD, dtype=torch.float16)))
    result = engine.step()
    state = engine.scalar_state()
    return result.skipped, result.grad_norm, (engine.global_step, engine.skipped_steps, state["skipped_steps"])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fp16_gradients_are_averaged_in_deepspeeds_order(case):
    overflows = CASES[case][2]
    for skipped, norm, steps in run_distributed(scaled_step, world_size=2, args=(case,)):
        assert skipped == overflows, case
        # A skipped step is taken but not applied: the LR schedule does not advance on it,
        # and checkpoints keep the count.
        assert steps == ((1, 1, 1) if overflows else (1, 0, 0))
        if not overflows:  # the mean gradient, 40000 in each of 64 elements (exact in fp16 and INT4)
            assert norm == pytest.approx(GRAD * 8, rel=1e-6)


@pytest.mark.parametrize("key", [{"gradient_predivide_factor": 2}, {"prescale_gradients": True}])
def test_zero_stages_refuse_what_deepspeed_refuses(key):
    name = next(iter(key))
    with pytest.raises(ConfigError, match=f"{name}.*not supported.*ZeRO stage 3"):
        zeropp.DeepSpeedConfig.from_dict({**key, "zero_optimization": {"stage": 3}})
    zeropp.DeepSpeedConfig.from_dict({**key, "zero_optimization": {"stage": 0}})   # stage 0 keeps them


# -- the same start at any world size ---------------------------------------------------------
CFG = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def initial_masters(rank, world_size, dtype, stage):
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    engine = engine_for(model, world_size, {dtype: {"enabled": True}} if dtype != "fp32" else {},
                        {"stage": stage}, param_init=model.init_parameter)
    return engine.module_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_initial_fp32_masters_are_bit_identical_at_any_world_size(dtype):
    """module_state_dict() gives the fp32 masters: the exact initialization, not a
    16-bit rounding of it, whatever the stage and world size."""
    (exact,) = run_distributed(initial_masters, world_size=1, args=("fp32", 0))
    (alone,) = run_distributed(initial_masters, world_size=1, args=(dtype, 0))
    per_stage = {stage: run_distributed(initial_masters, world_size=2, args=(dtype, stage))[0]
                 for stage in (0, 1, 3)}
    for k in exact:
        assert torch.equal(alone[k], exact[k]), (dtype, "world 1", k)
        for stage, weights in per_stage.items():
            assert torch.equal(weights[k], exact[k]), (dtype, stage, k)
