"""INT4 and INT2 weight deltas (`zero_quantized_weight_deltas`, zeropp/techniques/deltas.py): the
configuration, the refresh rule, the error bound of every gathered weight over many
steps, the bytes across nodes, memory, evaluation, training and checkpoints."""
from types import SimpleNamespace

import pytest
import torch

import zeropp
from common import ConfigError
from parallel.comm import wire_bytes
from tests.distributed import run_distributed
from tests.unit.zeropp.test_zeropp import ARGS, HPZ, QGZ, QWZ, gpt, make_engine, mean_over_ranks, tokens
from zeropp.memory import memory_report
from zeropp.kernels.format import wire_nbytes
from zeropp.techniques import delta_codec
from zeropp.kernels.format import QMAX
from zeropp.techniques.delta_codec import BLOCK_SIZE, BOUND_BITS
from zeropp.techniques.deltas import WeightDeltas

DELTAS = {**HPZ, "zero_quantized_weight_deltas": True}
INT2 = {"zero_quantized_weight_deltas_bits": 2}
BF16 = {"bf16": {"enabled": True}}


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
def _zero(**zero):
    return zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **zero}}).zero_optimization


def test_keys_parsed_with_their_defaults():
    z = _zero(**DELTAS)
    assert z.zero_quantized_weight_deltas is True and z.zero_quantized_weight_deltas_refresh_interval == 100
    assert _zero(**DELTAS, zero_quantized_weight_deltas_refresh_interval=7).zero_quantized_weight_deltas_refresh_interval == 7
    assert z.zero_quantized_weight_deltas_bits == 4 and _zero(**DELTAS, **INT2).zero_quantized_weight_deltas_bits == 2


@pytest.mark.parametrize("zero, message", [
    ({"zero_quantized_weight_deltas": True}, "set zero_hpz_partition_size"),
    ({**DELTAS, "zero_quantized_weight_deltas_refresh_interval": 0}, "refresh_interval must be >= 1"),
    ({**DELTAS, "zero_quantized_weight_delta": True}, "did you mean 'zero_quantized_weight_deltas'"),
    ({**DELTAS, "zero_quantized_weight_deltas_bits": 3}, "must be 4 \\(the default\\) or 2"),
    ({**DELTAS, "zero_quantized_weight_deltas_bits": True}, "zero_quantized_weight_deltas_bits must be a number"),
    ({**HPZ, **INT2}, "set zero_quantized_weight_deltas true"),
])
def test_refused_with_a_reason(zero, message):
    with pytest.raises(ConfigError, match=message):
        _zero(**zero)


def test_refused_below_stage_3():
    with pytest.raises(ConfigError, match="need stage 3"):
        zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 2, **DELTAS}})


def test_auto_hpz_resolved_to_one_is_refused_at_start():
    z = _zero(zero_hpz_partition_size="auto", zero_quantized_weight_deltas=True)
    z.zero_hpz_partition_size = 1    # what planner.auto.resolve may pick
    with pytest.raises(ConfigError, match="needs hpZ"):
        z.validate_topology(2, 4)


def test_flag(monkeypatch):
    from training.args import parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    z = parse_args(ARGS + ["--zero-stage", "3", "--zero-hpz-size", "2", "--zero-quantized-weight-deltas"]
                   ).ds_config.zero_optimization
    assert z.zero_quantized_weight_deltas is True and z.zero_quantized_weight_deltas_bits == 4
    z = parse_args(ARGS + ["--zero-stage", "3", "--zero-hpz-size", "2", "--zero-quantized-weight-deltas",
                           "--zero-quantized-weight-deltas-bits", "2"]).ds_config.zero_optimization
    assert z.zero_quantized_weight_deltas_bits == 2
    with pytest.raises(ConfigError, match="needs hpZ|set zero_hpz_partition_size"):
        parse_args(ARGS + ["--zero-stage", "3", "--zero-quantized-weight-deltas"])


# --------------------------------------------------------------------------------------
# the refresh rule, on one rank's chunk
# --------------------------------------------------------------------------------------
class _NoComm:
    def all_reduce(self, *a, **k):
        pass


def _one_weight(new: torch.Tensor, recon: torch.Tensor, interval=100, bits=4):
    flat = new.clone()
    s = SimpleNamespace(index=0, chunk=new.numel(), numel=new.numel(), valid=new.numel(), lo=0, hi=new.numel(),
                        shard=flat)
    one = SimpleNamespace(size=1, group=None)
    d = WeightDeltas(one, _NoComm(), [s], flat, None, interval, one, one, bits)
    d._recon[0].copy_(recon)
    d._based.add(0)
    return d, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_delta_goes_while_its_int4_step_is_within_int8s_and_not_beyond(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, generator=g) * 0.02).to(dtype)
    amax = w.float().abs().max()
    small = (torch.rand(300, generator=g) - 0.5) * 2 * (7 / 127) * 0.9 * 0.05 * amax   # well within
    d, s = _one_weight(w, (w.float() - small).to(dtype))
    d.prepare()
    assert d.holds(s)
    big = torch.zeros(300)
    big[5] = 0.2 * amax   # one element moves by a fifth of the largest weight of its block
    d, s = _one_weight(w, (w.float() - big).to(dtype))
    d.prepare()
    assert not d.holds(s)
    nan = w.clone()
    nan[7] = float("nan")
    d, s = _one_weight(nan, w)
    d.prepare()
    assert not d.holds(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int2_delta_goes_while_its_step_is_within_int4s(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, generator=g) * 0.02).to(dtype)
    amax = w.float().abs().max()   # INT2's error is at most a step, half the block's largest |delta|
    small = (torch.rand(300, generator=g) - 0.5) * 2 * 0.05 * amax / 7
    d, s = _one_weight(w, (w.float() - small).to(dtype), bits=2)
    d.prepare()
    assert d.holds(s)
    # INT4's rule would refuse this one (its INT4 step, 0.5 amax / 7 / 7, is over INT8's amax / 127);
    # INT2's error, up to 0.5 amax / 7 / 2, is within max|w| / 14
    d4, s4 = _one_weight(w, (w.float() - 10 * small).to(dtype))
    d4.prepare()
    assert not d4.holds(s4)
    d, s = _one_weight(w, (w.float() - 10 * small).to(dtype), bits=2)
    d.prepare()
    assert d.holds(s)
    big = torch.zeros(300)
    big[5] = 0.2 * amax   # an error of up to 0.1 amax: over amax / 14
    d, s = _one_weight(w, (w.float() - big).to(dtype), bits=2)
    d.prepare()
    assert not d.holds(s)


def test_every_weight_is_refreshed_each_interval_and_after_a_load():
    w = torch.randn(256) * 0.02
    d, s = _one_weight(w, w, interval=3)
    ready = []
    for _ in range(6):
        d.prepare()
        ready.append(d.holds(s))
    assert ready == [True, True, False, True, True, False]
    d.forget()
    d.prepare()
    assert not d.holds(s)


# --------------------------------------------------------------------------------------
# the error of every gathered weight, step after step
# --------------------------------------------------------------------------------------
def gathered_errors(rank, world_size, interval, steps, dequant_elements=None, bits=4):
    """Train in bf16 with deltas; at each step compare every weight gathered as a delta with
    the exact one (the fp32 master rounded to bf16) against the bound of techniques/deltas.py:
    max|w|/254 over its block (INT2 deltas: max|w|/14; member j's chunk of the weight, in blocks
    of 128 from its start) plus half a bf16 ulp of the value and an fp32 rounding of the sum."""
    if dequant_elements is not None:   # receivers dequantize a weight's members a few at a time
        delta_codec.DEQUANT_ELEMENTS = dequant_elements   # this rank's process only
    engine = make_engine(gpt(), world_size, {**DELTAS, "zero_quantized_weight_deltas_refresh_interval": interval,
                                             "zero_quantized_weight_deltas_bits": bits}, lr=1e-3, **BF16)
    deltas = engine.weights.sources.deltas
    arrived = []
    plain_arrived = deltas.arrived
    deltas.arrived = lambda s, full: (arrived.append((s, full.detach().float().clone())), plain_arrived(s, full))
    worst, errors, per_step = 0.0, [], []
    for step in range(steps):
        exact = engine.module_state_dict()
        arrived.clear()
        x = tokens(rank, step % 6, n=4)
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        per_step.append(len(arrived))
        for s, got in arrived:
            want = exact[s.name].reshape(-1).to(torch.bfloat16).float()
            bound = torch.empty_like(want)
            for lo in range(0, s.numel, s.chunk):           # member j's chunk
                for b in range(lo, min(lo + s.chunk, s.numel), BLOCK_SIZE):
                    e = min(b + BLOCK_SIZE, lo + s.chunk, s.numel)
                    bound[b:e] = want[b:e].abs().max() / (2 * QMAX[BOUND_BITS[bits]])
            bound += want.abs() * 2.0 ** -8 + want.abs().max() * 2.0 ** -22
            err = (got.view(-1) - want).abs()
            worst = max(worst, float((err / bound).max()))
            errors.append(float(err.max()))
    pools = engine.peak_buffers()
    return dict(worst=worst, nonzero=sum(e > 0 for e in errors), per_step=per_step, weights=len(deltas.weights),
                pools=pools["gather_buffers_peak"] <= pools["gather_buffers_bound"])


@pytest.mark.slow
def test_every_gathered_weight_is_within_the_bound_and_errors_do_not_pile_up():
    """40 steps without a refresh: the bound holds at the last step as at the first (the delta
    is taken against what receivers hold, so the error of a step does not carry into the next)."""
    for r in run_distributed(gathered_errors, 4, args=(1000, 40)):
        assert r["worst"] <= 1.0 and r["pools"], r
        assert r["nonzero"] > 0, r              # lossy: not the exact gather under another name
        assert r["per_step"][0] == 0            # nothing to take a delta against yet
        assert sum(r["per_step"][-10:]) > 0.5 * 10 * r["weights"], r   # most weights go as deltas


@pytest.mark.slow
def test_int2_deltas_keep_int4s_bound_and_their_errors_do_not_pile_up():
    for r in run_distributed(gathered_errors, 4, args=(1000, 30, None, 2)):
        assert r["worst"] <= 1.0 and r["pools"], r
        assert r["nonzero"] > 0, r
        assert sum(r["per_step"][-10:]) > 0.5 * 10 * r["weights"], r


@pytest.mark.slow
def test_a_full_gather_every_interval():
    """Also: receivers dequantize two members of a weight at a time (a large weight's way)."""
    for r in run_distributed(gathered_errors, 4, args=(3, 7, 2 * 96 * 32 // 4)):
        assert r["worst"] <= 1.0 and r["pools"], r
        # optimizer steps 3 and 6 refresh everything: the forwards of steps 3 and 6 send no delta
        assert r["per_step"][0] == r["per_step"][3] == r["per_step"][6] == 0, r
        assert all(r["per_step"][i] > 0 for i in (1, 2, 4, 5)), r


# --------------------------------------------------------------------------------------
# bytes, memory, evaluation, training
# --------------------------------------------------------------------------------------
def train(rank, world_size, zero, steps=16):
    engine = make_engine(gpt(), world_size, zero, lr=1e-3, **BF16)
    losses, fwd = [], None
    for step in range(steps):
        x = tokens(rank, step % 6, n=4)
        refresh = set(engine.weights.sources.deltas._refresh) if engine.weights.sources.deltas is not None else set()
        engine.comm.reset_stats()
        loss = engine(x[:, :-1], x[:, 1:])
        if step == steps - 1:
            fwd = engine.comm.stats.by_phase["forward_gather"][1]
        engine.backward(loss)
        if step == steps - 1:
            report = memory_report(engine)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    out = dict(losses=losses, fwd_inter=fwd, measured=report["measured_bytes"]["parameters"],
               predicted=report["predicted_bytes"]["parameters"],
               within={k: b["within"] for k, b in report["buffers"].items()})
    if engine.weights.sources.deltas is not None:
        part = engine.weights.sources.deltas.weights
        # across nodes: the first hop only, among the ranks at my index in their node (hpZ 2)
        across = list(range(rank % 2, world_size, 2))
        ring = wire_bytes("all_gather", across, rank, 1, lambda r: r // 2)[1]   # inter bytes per byte of input
        bits = zero.get("zero_quantized_weight_deltas_bits", 4)
        out["expected_fwd_inter"] = ring * sum(s.chunk * 2 if s.index in refresh else wire_nbytes(s.chunk, bits, 128)
                                               for s in part)
        out["delta_state_bytes"] = engine.weights.sources.deltas.recon.numel() * 2 + engine.weights.sources.deltas.flat.numel()
        out["refresh_last"] = refresh
        deltas = engine.weights.sources.deltas

        def base_is_exact():
            return all(torch.equal(deltas._recon[s.index][:s.valid], s.shard[:s.valid]) for s in part)
        out["base_exact_before_eval"] = base_is_exact()   # the last step moved the weights
        engine.eval()
        x = tokens(rank, 99)
        with torch.no_grad():
            engine(x[:, :-1], x[:, 1:])
        # evaluation gathered the exact weights: they are the next base, and hpZ's copy holds them
        out["base_exact_after_eval"] = base_is_exact()
        engine.train()
        engine.comm.reset_stats()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        out["train_inter_after_eval"] = engine.comm.stats.by_phase["forward_gather"][1]
    return out


def train_all(rank, world_size):
    small = {"stage3_param_persistence_threshold": 200}   # biases and norms whole: the matrices go as deltas
    return {name: train(rank, world_size, {**small, **zero}) for name, zero in
            (("zero3", {}), ("zeropp", {**QWZ, **HPZ, **QGZ}), ("deltas", {**QWZ, **DELTAS, **QGZ}),
             ("deltas2", {**QWZ, **DELTAS, **QGZ, **INT2}))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deltas", "deltas2"])
def test_deltas_train_like_zero3_send_int4_or_int2_across_nodes_and_count_their_memory(name):
    runs = run_distributed(train_all, 4)
    base, zpp, dl = (runs[0][k]["losses"] for k in ("zero3", "zeropp", name))
    for a, b in zip(dl, base):   # as tests/unit/zeropp/test_zeropp.py's qwZ/qgZ check
        assert abs(a - b) <= 0.02 * b, (dl, base)
    assert abs(sum(dl[-4:]) - sum(base[-4:])) <= 0.005 * sum(base[-4:]), (dl, base)
    for r in runs:
        d, z = r[name], r["zeropp"]
        assert d["refresh_last"] == set()
        assert d["fwd_inter"] == d["expected_fwd_inter"], (d["fwd_inter"], d["expected_fwd_inter"])
        assert d["measured"] - z["measured"] == d["delta_state_bytes"]
        assert d["predicted"] > z["predicted"]
        assert d["measured"] / d["predicted"] == pytest.approx(z["measured"] / z["predicted"], rel=0.1)
        assert all(d["within"].values()), d["within"]
        assert not d["base_exact_before_eval"] and d["base_exact_after_eval"]
        assert d["train_inter_after_eval"] == 0
    mean_inter = sum(r[name]["fwd_inter"] for r in runs)
    mean_zpp = sum(r["zeropp"]["fwd_inter"] for r in runs)
    # INT4 (0.53 B/element) or INT2 (0.28) against qwZ's INT8 (1.02)
    assert mean_inter < (0.6 if name == "deltas" else 0.32) * mean_zpp


# --------------------------------------------------------------------------------------
# checkpoints: the reference weights are saved per weight, so a load goes on with deltas
# --------------------------------------------------------------------------------------
def deltas_engine(world, ranks_per_node, seed=0):
    from model import GPT, GPTConfig
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    from tests.unit.training.test_checkpoint import CFG, GLOBAL_BATCH
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **QWZ, "zero_hpz_partition_size": ranks_per_node,
            "zero_quantized_weight_deltas": True}
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG, init_seed=seed))
    optim = zeropp.OptimizerSettings(type="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict({"zero_optimization": zero, **BF16}),
                             Communicator(topology_from_env(ranks_per_node)), torch.device("cpu"), optim,
                             max(1, GLOBAL_BATCH // (2 * world)), param_init=model.init_parameter)


def deltas_save(rank, world, path):
    from tests.unit.training.test_checkpoint import GLOBAL_BATCH, META, train_steps
    from training.checkpoint import save_checkpoint
    engine = deltas_engine(world, 2)
    train_steps(engine, rank, world, range(4))
    save_checkpoint(path, 4, engine, 4 * GLOBAL_BATCH, META)
    return engine.weights.sources.deltas.sent, train_steps(engine, rank, world, range(4, 8))


def deltas_load(rank, world, path, ranks_per_node):
    from tests.unit.training.test_checkpoint import train_steps
    from training.checkpoint import load_checkpoint
    engine = deltas_engine(world, ranks_per_node, seed=1)
    load_checkpoint(path, engine)
    losses = train_steps(engine, rank, world, [4])
    first = engine.weights.sources.deltas.sent
    losses += train_steps(engine, rank, world, range(5, 8))
    return first, engine.weights.sources.deltas.sent, losses


@pytest.mark.slow
@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (8, 4)], ids=["same layout", "2x4 ranks"])
def test_a_load_goes_on_with_deltas(tmp_path, world, ranks_per_node):
    """Saved on 2 x 2 ranks after 4 steps, loaded on the same layout or on 2 x 4 (another world
    size and hpZ group): the reference weights come back (resharded by DCP), the nodes' copies are
    rebuilt from them, and the first forward after the load already sends deltas. On the same
    layout the losses are the uninterrupted run's bit for bit; on the other, within the
    reduction-order noise of bf16."""
    path = str(tmp_path / "save")
    saved = run_distributed(deltas_save, 4, (path,))
    uninterrupted = saved[0][1]
    assert saved[0][0] > 0
    for first, later, losses in run_distributed(deltas_load, world, (path, ranks_per_node)):
        assert 0 < first < later
        if world == 4:
            assert losses == uninterrupted
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), rtol=1e-2, atol=0)
