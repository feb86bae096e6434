"""State carried from step to step (ARCHITECTURE.md): qgZ's error feedback (LoCo), the INT4
weight deltas' reference weights and counters. It changes only when a step is applied, is
never saved non-finite, and resumes bit for bit on the same layout.

The fault matrix (scenarios/fault_matrix.py, tests/integration/faults/test_fault_matrix.py) runs every switch
combination through these faults; here are the symptoms as they were found."""
import os
import re

import pytest
import torch

from tests.distributed import run_distributed, snapshot, train_ranks
from tests.integration.train.test_train import corpus, flags  # noqa: F401,F811  (corpus is a fixture)
from tests.unit.zeropp.test_zeropp import ALL3, gpt, make_engine, tokens
from zeropp.kernels.quant import quantize
from zeropp.techniques.delta_codec import BLOCK_SIZE

LOCO = {**ALL3, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}


def window_stats(log: str) -> tuple[int, float]:
    """(skipped iterations over the run, the last loss scale logged)."""
    skipped = sum(int(n) for n in re.findall(r"number of skipped iterations:\s+(\d+)", log))
    scales = re.findall(r"loss scale: ([0-9.]+)", log)
    return skipped, float(scales[-1])


@pytest.mark.slow
def test_fp16_overflow_does_not_poison_loco_through_train_py(corpus, tmp_path):  # noqa: F811
    """The issue's run: 4 ranks as 2 x 2, qwZ + hpZ + qgZ + LoCo, fp16 from a loss scale of 2^25 with
    hysteresis 1: the scale falls one halving per overflow until the gradients fit (near 2^16,
    as without LoCo), then training goes on. Before, the first overflow's NaN error buffers made
    every later step overflow: all 24 skipped, the scale at 4."""
    extra = ["--ranks-per-node", "2", "--zero-stage", "3", "--zero-quantized-weights", "--zero-hpz-size", "2",
             "--zero-quantized-gradients", "--zero-loco", "--fp16", "--initial-loss-scale", "33554432",
             "--hysteresis", "1", "--log-interval", "4", "--eval-interval", "1000", "--save-interval", "1000",
             "--micro-batch-size", "1", "--global-batch-size", "4"]
    rc, log = train_ranks(4, flags(corpus, tmp_path, 24, extra))
    assert rc == 0, log
    skipped, scale = window_stats(log)
    # 2^25 -> 2^16 is 9 halvings; a few more or fewer with other gradients, never all 24
    assert skipped <= 14, log
    assert scale >= 2 ** 11, log


def skip_then_go_on(rank, world_size, dtype_cfg, bad):
    """LoCo + deltas: two steps, a step whose loss is `bad` on rank 0 (skipped everywhere), then
    three more. The state before and after the skipped step, and whether later steps applied."""
    engine = make_engine(gpt(), world_size, {**LOCO, "zero_quantized_weight_deltas": True}, **dtype_cfg)
    results, before, after = [], None, None
    for step in range(6):
        x = tokens(rank, step)
        loss = engine(x[:, :-1], x[:, 1:])
        if step == 2 and rank == 0:
            loss = loss * bad
        engine.backward(loss)
        if step == 2:   # forward and backward done (a forward's gathers refresh the references)
            before = snapshot(engine)
        results.append(engine.step().skipped)
        if step == 2:
            after = snapshot(engine)
    finite = all(torch.isfinite(v).all() for v in snapshot(engine)[0].values() if v.is_floating_point())
    # the errors are INT8 blocks (uint8 in the snapshot): finite once dequantized
    finite = finite and all(torch.isfinite(e).all() for e in engine.parts.carried["error_feedback"].errors().values())
    changed = [k for k in before[0] if not torch.equal(before[0][k], after[0][k])]
    changed += [k for k in before[1] if k not in ("loss_scaler", "global_step", "skipped_steps")
                and before[1][k] != after[1][k]]
    return dict(skipped=results, changed=changed, finite=finite,
                error_keys=[k for k in after[0] if k.startswith("error_feedback.")])


@pytest.mark.slow
@pytest.mark.parametrize("precision, bad", [("fp16", float("inf")), ("bf16", float("nan"))])
def test_a_skipped_step_leaves_carried_state_alone(precision, bad):
    """The skipped step changes no error buffer, reference weight or counter, so what a checkpoint
    of it would hold is the last good state (symptom 2: it held NaN error buffers), and every later
    step is applied."""
    cfg = {"fp16": {"enabled": True, "loss_scale": 1024}} if precision == "fp16" else {"bf16": {"enabled": True}}
    for r in run_distributed(skip_then_go_on, 4, args=(cfg, bad)):
        assert r["skipped"] == [False, False, True, False, False, False], r
        assert r["error_keys"] and r["changed"] == [], r
        assert r["finite"]


def test_a_delta_with_an_infinite_scale_is_not_small():
    """The refresh rule: a delta goes only while every block's INT4 step is finite and at most the
    INT8 step of the new values. An infinite new value made inf <= inf pass (symptom 5)."""
    from zeropp.techniques.delta_codec import small_delta
    new = torch.ones(2 * BLOCK_SIZE)
    recon = new - 1e-3   # a small delta: its INT4 step is far below the INT8 step of the weights
    new[3] = float("inf")
    wire = torch.zeros(quantize(new, 4, BLOCK_SIZE).to_bytes().numel(), dtype=torch.uint8)
    assert not bool(small_delta(new, recon, wire))
    new[3] = 1.0
    assert bool(small_delta(new, recon, wire))


def resume_with_deltas(rank, world_size, path):
    """Deltas (refresh every 3 steps) + LoCo: 6 steps straight, against 3, save, load into a fresh
    engine, 3 more: the same losses and state bit for bit (the step count, the reference weights
    and the nodes' copies come back)."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    zero = {**LOCO, "zero_quantized_weight_deltas": True, "zero_quantized_weight_deltas_refresh_interval": 3}
    cfg = {"bf16": {"enabled": True}}
    straight = make_engine(gpt(), world_size, zero, **cfg)
    losses = []
    for step in range(6):
        x = tokens(rank, step)
        loss = straight(x[:, :-1], x[:, 1:])
        straight.backward(loss)
        straight.step()
        losses.append(loss.item())
        if step == 2:
            save_checkpoint(path, 3, straight, 0, {"model_config": {}, "param_shapes": {}})
    resumed = make_engine(gpt(), world_size, zero, **cfg)
    load_checkpoint(path, resumed, load_rng=False)
    again = []
    for step in range(3, 6):
        x = tokens(rank, step)
        loss = resumed(x[:, :-1], x[:, 1:])
        resumed.backward(loss)
        resumed.step()
        again.append(loss.item())
    a, b = snapshot(straight), snapshot(resumed)
    return dict(losses=losses[3:], again=again, same=[k for k in a[0] if torch.equal(a[0][k], b[0][k])],
                keys=list(a[0]), scalars=(a[1], b[1]), sent=resumed.weights.sources.deltas.sent)


@pytest.mark.slow
def test_resume_with_weight_deltas_is_bit_identical(tmp_path):
    for r in run_distributed(resume_with_deltas, 4, args=(str(tmp_path / "ckpt"),)):
        assert r["losses"] == r["again"], r
        assert r["same"] == r["keys"]
        assert r["scalars"][0] == r["scalars"][1]
        assert any(k.startswith("weight_deltas.recon.") for k in r["keys"])
        assert r["sent"] > 0   # the first gathers after the load went as deltas
    assert os.path.isdir(tmp_path / "ckpt")
