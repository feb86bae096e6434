"""train.py --sharding fsdp2 (torch's FSDP2 with the ZeRO++ plug-in) on 4 ranks as
2 nodes x 2: it resumes bit for bit, reads and writes the engine's checkpoints (streaming
DiLoCo's too), does what the DeepSpeed JSON's communication keys say, and refuses what it
cannot do in one line."""
import json

import pytest
import torch

from tests.integration.train.test_train import corpus, flags  # noqa: F401  (corpus is a fixture)
from tests.distributed import run_distributed, train_ranks
from tests.integration.train.test_train_faults import losses
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
    full_log = resumes_bit_for_bit(corpus, tmp_path, [*COMMON, "--sharding", "fsdp2", "--bf16", *ZEROPP])
    assert "FSDP2 + ZeRO++ plug-in (qwZ, hpZ, qgZ, LoCo)" in full_log
    assert "; FSDP2 without the plug-in would send " in full_log   # the plain count is plain FSDP2's


def resumes_bit_for_bit(corpus, tmp_path, common: list[str]) -> str:  # noqa: F811
    """6 iterations saved at 3 against 3 resumed from there: the same losses and weights; the first
    run's log."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, full_log = train_ranks(4, flags(corpus, straight, 6, [*common, "--save-interval", "3"]))
    assert rc == 0, full_log
    rc, log = train_ranks(4, flags(corpus, split, 6, [*common, "--load", str(straight / "ckpt" / "iter_0000003")]))
    assert rc == 0, log
    assert "resumed from" in log and "starts from zero" not in log
    a, b = losses(full_log), losses(log)
    assert sorted(b) == [4, 5, 6] and all(a[i] == b[i] for i in b), (a, b)
    wa, wb = consolidated_state_dict(str(straight / "ckpt"))[0], consolidated_state_dict(str(split / "ckpt"))[0]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return full_log


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


@pytest.mark.slow
def test_fsdp2_loads_a_streaming_diloco_checkpoint_as_the_engine_does(corpus, tmp_path):  # noqa: F811
    """A checkpoint of 2 groups of nodes (streaming DiLoCo) loads into one job from the global parameters
    the groups shared, into FSDP2 as into the engine: the first loss after it is the engine's, bit for bit."""
    diloco = tmp_path / "diloco"
    rc, log = train_ranks(4, flags(corpus, diloco, 2, [*COMMON, "--group-size", "1", "--outer-sync-interval", "2",
                                                       "--save-interval", "2"]))
    assert rc == 0, log
    saved = str(diloco / "ckpt" / "iter_0000002")
    rc, engine_log = train_ranks(4, flags(corpus, tmp_path / "engine", 3, [*COMMON, "--load", saved]))
    assert rc == 0 and "was saved by 2 groups of nodes" in engine_log, engine_log
    rc, log = train_ranks(4, flags(corpus, tmp_path / "fsdp2", 3, [*COMMON, "--sharding", "fsdp2", "--load", saved]))
    assert rc == 0 and "was saved by 2 groups of nodes" in log, log
    assert losses(log)[3] == losses(engine_log)[3], (losses(log), losses(engine_log))


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


def conversion(rank, world_size, bucket):
    """conversion_steps() with checkpoint conversions in buckets of `bucket` elements (None: the
    engine's), put back after: the rank processes are kept for later tests."""
    import zeropp.fsdp.engine as fsdp_engine
    default = getattr(fsdp_engine, "MOVE_BUCKET", None)
    if bucket:
        fsdp_engine.MOVE_BUCKET = bucket
    try:
        return conversion_steps()
    finally:
        fsdp_engine.MOVE_BUCKET = default


def conversion_steps():
    """A save after two steps (counting what each all_to_all brings in), the chunks against the
    model, then a step and a load of that save: (received sizes, own share of the tensors that
    moved, chunks, whole model, keys whose chunk is FSDP2's storage, keys that moved, keys that
    differ after the load)."""
    from scenarios.fault_cells import build, train
    from tests.distributed import restore, snapshot
    world_size = torch.distributed.get_world_size()
    engine = build({"stage": 3}, "bf16", 1, "fsdp2")
    train(engine, [0, 1])
    received, all_to_all = [], engine.comm.all_to_all

    def counted(fn, *args):   # the collectives of a save or a load, not of a step
        engine.comm.all_to_all = lambda out, inp, **kw: (received.append(out.numel()), all_to_all(out, inp, **kw))[1]
        try:
            return fn(*args)
        finally:
            engine.comm.all_to_all = all_to_all

    state = counted(engine.checkpoint_state)
    saves = list(received)
    storage = {p.to_local().data_ptr() for p in engine.module.parameters() if p.to_local().numel()}
    in_place = sorted(k for k, v in state.items() if v.local.numel() and v.local.data_ptr() in storage)
    share = sum(v.local.numel() for k, v in state.items() if k != "optim.step"
                and not rows_are_chunks(engine_tensor(engine, k).shape, world_size))
    chunks = {k: v.local.clone() for k, v in state.items() if k != "optim.step"}
    whole = {n: p.full_tensor() for n, p in engine.module.named_parameters()}
    saved = snapshot(engine)
    train(engine, [2])   # the state moves on; the load must bring it back
    moved = sorted(k for k, v in snapshot(engine)[0].items() if not torch.equal(v, saved[0][k]))
    counted(restore, engine, saved)
    again = snapshot(engine)[0]
    return saves, received[len(saves):], share, chunks, whole, in_place, moved, \
        sorted(k for k in saved[0] if not torch.equal(saved[0][k], again[k]))


def rows_are_chunks(shape, world: int) -> bool:
    """Whether torch.chunk along dim 0 and torch.chunk of the flattened tensor cut at the same places."""
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    by_rows = [c.numel() for c in torch.chunk(t, world, dim=0)]
    return by_rows == [c.numel() for c in torch.chunk(t.reshape(-1), world)]


def engine_tensor(engine, key):
    """The DTensor behind checkpoint key `key` (model.NAME or optim.MOMENT.NAME)."""
    name = key.split(".", 2)[-1] if key.startswith("optim.") else key[len("model."):]
    p = dict(engine.module.named_parameters())[name]
    return p if key.startswith("model.") else engine._moment(p, key.split(".")[1], False)


def test_an_fsdp2_checkpoint_keeps_rows_that_are_chunks_in_place_and_moves_only_the_rest():
    """FSDP2 shards rows, the checkpoint is flat chunks. On 2 ranks every tensor of the tiny GPT has
    an even row count: a rank's rows are its chunk, so the save is views of FSDP2's storage and no
    collective (a gather per tensor was 84 collectives, gathering them whole 2 x the fp32 model in
    peak RSS at 60 M parameters); on 3 ranks the rest moves in one all_to_all, a rank receiving only
    its own chunks of them. Every rank's chunks put together are the model; a load brings back
    what was saved."""
    for world in (2, 3):
        ranks = run_distributed(conversion, world, args=(None,))
        for saves, loads, share, chunks, whole, in_place, moved, differ in ranks:
            assert len(moved) > 10 and not differ, (moved, differ)
            if world == 2:
                assert not saves and not loads and {"model." + n for n in whole} <= set(in_place), (saves, in_place)
            else:
                assert len(saves) == 1 and saves[0] == share > 0 and len(loads) == 1, (saves, share, loads)
        for name, value in ranks[0][4].items():
            flat = torch.cat([r[3]["model." + name] for r in ranks])
            assert torch.equal(flat, value.reshape(-1).float()), name


def test_an_fsdp2_checkpoint_in_buckets_smaller_than_a_tensor_loads_back_exactly():
    """A bucket holds at most MOVE_BUCKET elements of chunks or one larger tensor: with a bucket
    below the largest tensor, on 3 ranks (rows and chunks end at different places), the tensors
    move in several collectives, and the save loads back to the same chunks on every rank."""
    world, bucket = 3, 500
    for saves, loads, share, chunks, whole, in_place, moved, differ in \
            run_distributed(conversion, world, args=(bucket,)):
        largest = max(-(-t.numel() // world) for t in whole.values())
        assert largest > bucket and len(saves) > 2 and max(saves) <= largest and sum(saves) == share, saves
        assert len(moved) > 10 and not differ, (moved, differ)


def json_keys(rank, world, extra: dict, zero: dict):
    """The engine train.py builds under --sharding fsdp2, 2 steps: (bytes the gradient reductions
    sent, which units' reductions overlapped backward)."""
    import zeropp
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    from tests.unit.fsdp.test_fsdp_plugin import batch, tiny_gpt
    torch.manual_seed(0)
    cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **zero}, **extra})
    engine = zeropp.initialize(tiny_gpt(), cfg, Communicator(topology_from_env(2)), torch.device("cpu"),
                               zeropp.OptimizerSettings(type="adamw", lr=3e-3), sharding="fsdp2")
    for step in range(2):
        engine.backward(engine(*batch(rank, step)))
        engine.step()
    reduced = engine.comm.stats.as_dict()["by_phase"]["grad_reduce"]
    return reduced["intra_node_bytes"] + reduced["inter_node_bytes"], engine.zeropp.overlap_label()


@pytest.mark.slow
def test_communication_data_type_and_overlap_comm_do_what_they_say_under_fsdp2():
    """communication_data_type is FSDP2's reduce_dtype; overlap_comm false is the plug-in's overlap off."""
    fp32 = run_distributed(json_keys, 4, args=({}, {}))
    bf16 = run_distributed(json_keys, 4, args=({"communication_data_type": "bf16"}, {}))
    off = run_distributed(json_keys, 4, args=({}, {"overlap_comm": False}))
    for (a, label), (b, _), (_, label_off) in zip(fp32, bf16, off):
        assert a > 0 and b * 2 == a, (a, b)   # the gradients reduced in bf16: half the bytes
        assert label.startswith("reductions overlap backward in 3 of 3 units"), label
        assert label_off == "reductions overlap backward in 0 of 3 units (overlap is off)", label_off


# -- HSDP: --data-parallel-replicate-degree ---------------------------------------------------------
HSDP = ["--data-parallel-replicate-degree", "2", "--zero-quantized-gradients", "--zero-loco"]


@pytest.mark.slow
def test_hsdp_with_qgz_and_loco_resumes_bit_for_bit_and_the_engine_loads_it(corpus, tmp_path):  # noqa: F811
    """HSDP (2 replicas x 2 shards, one per node) with the replica all-reduce in INT4 and LoCo's errors:
    6 iterations against 3, stop, resume for 3 more: the same losses and weights; the ZeRO engine loads
    the checkpoint."""
    full_log = resumes_bit_for_bit(corpus, tmp_path, [*COMMON, "--sharding", "fsdp2", "--bf16", *HSDP])
    assert "FSDP2 HSDP (2 replicas) + ZeRO++ plug-in (qgZ, LoCo)" in full_log, full_log
    assert "plain HSDP would send" in full_log, full_log
    rc, engine = train_ranks(4, flags(corpus, tmp_path / "engine", 4, [*COMMON, "--bf16", "--load",
                                                                     str(tmp_path / "straight" / "ckpt" / "iter_0000003")]))
    assert rc == 0 and "resumed from" in engine, engine


@pytest.mark.parametrize("extra, message", [
    (["--sharding", "fsdp2", "--data-parallel-replicate-degree", "4"],
     "--data-parallel-replicate-degree 4 shards the model over groups of 1 rank(s), which only replicate: HSDP "
     "shards inside a node; pass 2 (one copy per node)"),
    (["--sharding", "fsdp2", "--data-parallel-replicate-degree", "3"],
     "--data-parallel-replicate-degree 3 must divide the world size 4"),
    (["--data-parallel-replicate-degree", "2"],
     "--data-parallel-replicate-degree is HSDP under --sharding fsdp2; this application's engine shards over "
     "every rank"),
])
def test_an_hsdp_layout_it_cannot_run_is_one_line(corpus, tmp_path, monkeypatch, extra, message):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        parse_args(flags(corpus, tmp_path, 2, ["--zero-stage", "3", *extra]))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
