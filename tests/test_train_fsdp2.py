"""train.py --sharding fsdp2 (torch's FSDP2 with the ZeRO++ plug-in) on 4 ranks as
2 nodes x 2: it resumes bit for bit, reads and writes the engine's checkpoints, and refuses
what it cannot do in one line."""
import json

import pytest
import torch

from tests.test_train import corpus, flags  # noqa: F401  (corpus is a fixture)
from tests.distributed import run_distributed, train_ranks
from tests.test_train_faults import losses
from tools.export_checkpoint import consolidated_state_dict
from training.args import parse_args
from common.errors import ConfigError

COMMON = ["--ranks-per-node", "2", "--micro-batch-size", "1", "--global-batch-size", "8", "--log-interval", "1",
          "--eval-interval", "100", "--zero-stage", "3"]
ZEROPP = ["--zero-quantized-weights", "--zero-hpz-size", "2", "--zero-quantized-gradients", "--zero-loco"]


@pytest.mark.slow
def test_fsdp2_with_every_switch_resumes_bit_for_bit(corpus, tmp_path):  # noqa: F811
    """bf16, dropout on, 2 micro-batches per step, LoCo's error carried: 6 iterations in one go against
    3, stop, resume for 3 more; the losses and the weights are identical."""
    common = [*COMMON, "--sharding", "fsdp2", "--bf16", *ZEROPP]
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, full_log = train_ranks(4, flags(corpus, straight, 6, [*common, "--save-interval", "3"]))
    assert rc == 0, full_log
    assert "FSDP2 + ZeRO++ plug-in (qwZ, hpZ, qgZ, LoCo)" in full_log
    rc, log = train_ranks(4, flags(corpus, split, 6, [*common, "--load", str(straight / "ckpt" / "iter_0000003")]))
    assert rc == 0, log
    assert "resumed from" in log and "starts from zero" not in log
    a, b = losses(full_log), losses(log)
    assert sorted(b) == [4, 5, 6] and all(a[i] == b[i] for i in b), (a, b)
    wa, wb = consolidated_state_dict(str(straight / "ckpt"))[0], consolidated_state_dict(str(split / "ckpt"))[0]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_checkpoints_cross_between_the_engine_and_fsdp2(corpus, tmp_path):  # noqa: F811
    """The engine saves at iteration 3 (fp32, exact collectives); FSDP2 loads it and its first loss is the
    engine's own continuation's (the forward sees the same weights, data and RNG), bit for bit as printed;
    and back: FSDP2's checkpoint loads into the engine."""
    engine, fsdp2 = tmp_path / "engine", tmp_path / "fsdp2"
    rc, engine_log = train_ranks(4, flags(corpus, engine, 4, [*COMMON, "--save-interval", "3"]))
    assert rc == 0, engine_log
    rc, log = train_ranks(4, flags(corpus, fsdp2, 4, [*COMMON, "--sharding", "fsdp2", "--save-interval", "2",
                                                   "--load", str(engine / "ckpt" / "iter_0000003")]))
    assert rc == 0, log
    assert losses(log)[4] == losses(engine_log)[4], (losses(log), losses(engine_log))
    rc, back = train_ranks(4, flags(corpus, tmp_path / "back", 4, [*COMMON, "--load", str(fsdp2 / "ckpt")]))
    assert rc == 0 and "resumed from" in back, back


@pytest.mark.parametrize("extra, message", [
    (["--zero-stage", "2"], "--sharding fsdp2 shards weights, gradients and optimizer state (ZeRO stage 3); "
                            "got --zero-stage 2: pass --zero-stage 3"),
    (["--zero-stage", "3", "--dry-run"], "--dry-run plans this application's engine; drop --sharding fsdp2 to plan it"),
    (["--zero-stage", "3", "--zeropp", "auto"], "--zeropp auto chooses for this application's engine"),
    (["--zero-stage", "3", "--zero-hpz-size", "2", "--zero-quantized-weight-deltas"], "zero_optimization.zero_quantized_weight_deltas has no effect under "
                                         "--sharding fsdp2"),
])
def test_fsdp2_refuses_what_it_cannot_do(corpus, tmp_path, monkeypatch, extra, message):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = flags(corpus, tmp_path, 2, ["--sharding", "fsdp2", *extra])
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fsdp2_refuses_a_bucket_size_from_the_json(corpus, tmp_path, monkeypatch):  # noqa: F811
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}))
    argv = flags(corpus, tmp_path, 2, ["--deepspeed_config", str(config), "--sharding", "fsdp2"])
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size has no effect under --sharding fsdp2"):
        parse_args(argv)


@pytest.mark.slow
def test_fsdp2_fp16_skips_overflows_and_keeps_locos_error_finite(corpus, tmp_path):  # noqa: F811
    """fp16 (FSDP2's MixedPrecisionPolicy) with a loss scale of 2^32: the first steps overflow on every rank and
    are skipped together (the scale halves), LoCo's error is not committed from them, and training then learns."""
    rc, log = train_ranks(4, flags(corpus, tmp_path, 10, [*COMMON, "--sharding", "fsdp2", "--fp16", *ZEROPP,
                                                       "--initial-loss-scale", str(2 ** 32), "--hidden-dropout", "0"]))
    assert rc == 0, log
    skipped = [int(line.split("number of skipped iterations:")[1].split("|")[0]) for line in log.splitlines()
               if "number of skipped iterations:" in line]
    assert sum(skipped) >= 1 and "non-finite" not in log, log
    loss = losses(log)
    finite = [float(v) for v in loss.values() if v.lower() not in ("nan", "inf")]
    assert finite[-1] < finite[0], loss


def checkpoint_gathers(rank, world_size):
    from bench.fault_cells import build, train
    engine = build({"stage": 3}, "fp32", 1, "fsdp2")
    train(engine, [0, 1])
    gathered, all_gather = [], engine.comm.all_gather
    engine.comm.all_gather = lambda out, inp, **kw: (gathered.append(out.numel()), all_gather(out, inp, **kw))[1]
    state = engine.checkpoint_state()
    engine.comm.all_gather = all_gather
    whole = {n: p.full_tensor() for n, p in engine.module.named_parameters()}
    return gathered, {k: v.local.clone() for k, v in state.items() if k != "optim.step"}, whole


def test_an_fsdp2_save_gathers_in_a_few_collectives_and_never_the_whole_state():
    """FSDP2 shards rows, the checkpoint is flat chunks: the conversion gathers the tensors several
    at a time (one collective per tensor was hundreds per save, each latency-bound) yet never more
    at once than a rank's own share of them (its rows, padded), or one tensor; every rank's chunks
    put together are the model."""
    world = 2
    ranks = run_distributed(checkpoint_gathers, world)
    gathered, whole = ranks[0][0], ranks[0][2]
    states = [r[1] for r in ranks]
    padded = {n: -(-t.shape[0] // world) * (t.numel() // t.shape[0]) for n, t in whole.items()}   # a rank's rows
    moments = len([k for k in states[0] if k.startswith("optim.")]) // len(whole)
    share = sum(padded.values()) * (1 + moments)
    total = sum(t.numel() for t in whole.values()) * (1 + moments)
    assert len(states[0]) >= len(whole) * (1 + moments) > 3 * world
    assert 1 < len(gathered) <= 2 * world, gathered
    assert max(gathered) <= max(share, world * max(padded.values())) < total, (gathered, share, total)
    for name, value in whole.items():
        flat = torch.cat([s["model." + name] for s in states])
        assert torch.equal(flat, value.reshape(-1).float()), name


def small_bucket_round_trip(rank, world_size, bucket):
    import zeropp.fsdp.engine as fsdp_engine
    from bench.fault_cells import build, train
    from tests.distributed import restore, snapshot
    fsdp_engine.GATHER_BUCKET = bucket
    engine = build({"stage": 3}, "bf16", 1, "fsdp2")
    train(engine, [0, 1])
    gathered, all_gather = [], engine.comm.all_gather

    def counted(fn, *args):   # the collectives of a save or a load, not of a step
        engine.comm.all_gather = lambda out, inp, **kw: (gathered.append(out.numel()), all_gather(out, inp, **kw))[1]
        try:
            return fn(*args)
        finally:
            engine.comm.all_gather = all_gather

    saved = counted(snapshot, engine)
    largest = max(max(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]), -(-p.numel() // world_size))
                  for p in engine.module.parameters())   # a rank's rows or flat chunk of a tensor, padded
    train(engine, [2])   # the state moves on; the load must bring it back
    moved = snapshot(engine)
    counted(restore, engine, saved)
    again = snapshot(engine)
    return (gathered, largest, sorted(k for k in saved[0] if not torch.equal(saved[0][k], moved[0][k])),
            sorted(k for k in saved[0] if not torch.equal(saved[0][k], again[0][k])))


def test_an_fsdp2_checkpoint_in_buckets_smaller_than_a_tensor_loads_back_exactly():
    """A bucket holds at most GATHER_BUCKET elements or one larger tensor (the whole rank's share
    at once cost a 60 M-parameter save 2 x the fp32 model in peak RSS): with a bucket below the
    largest tensor, on 3 ranks (rows and chunks end at different places), every tensor goes in
    buckets of their own or few, and the save loads back to the same chunks on every rank."""
    world, bucket = 3, 3000
    for gathered, largest, moved, differ in run_distributed(small_bucket_round_trip, world, args=(bucket,)):
        assert world * largest > bucket and max(gathered) <= world * largest, (gathered, largest)
        assert all(size <= bucket for size in gathered if size < world * largest // 2), gathered
        assert len(moved) > 10 and not differ, (moved, differ)
