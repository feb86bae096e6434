"""The FSDP2 plug-in (zeropp/fsdp/apply.py) on 4 ranks as 2 emulated nodes x 2: hpZ alone is FSDP2
bit for bit, the quantized collectives stay within the bounds the engine's tests state, a
model trains like plain FSDP2, cross-node bytes are the engine's, LoCo's error resumes exactly,
and a misuse is one clear error."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.unit.zeropp.test_zeropp import int4_bound

ALL = dict(quantized_weights=True, hpz=True, quantized_gradients=True, loco=True)
NONE = dict(quantized_weights=False, hpz=False, quantized_gradients=False)


def tiny_gpt():
    from model import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_position_embeddings=32, num_layers=2, num_attention_heads=2,
                         hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=1))


def sharded(plugin: dict | None, bf16: bool = False, ranks_per_node: int = 2):
    """The tiny GPT under fully_shard per block and at the root, AdamW, and the plug-in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeropp.fsdp import apply_zeropp
    torch.manual_seed(0)
    model = tiny_gpt()
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    zpp = apply_zeropp(model, ranks_per_node, **plugin).attach(opt) if plugin is not None else None
    return model, opt, zpp


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 64, (2, 32), generator=g)   # a small vocabulary in use: it learns in a few steps
    return x, (x * 3 + 1) % 64


def train(model, opt, rank, steps, first=0):
    losses = []
    for s in range(first, first + steps):
        loss = model(*batch(rank, s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def weights(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


# -- exact where exact -------------------------------------------------------------------------
def hpz_alone(rank, world, bf16):
    plain = sharded(None, bf16)
    got = sharded(dict(NONE, hpz=True), bf16)
    out = {"plain": train(plain[0], plain[1], rank, 4), "hpz": train(got[0], got[1], rank, 4)}
    out["same_weights"] = all(torch.equal(a, b) for a, b in zip(weights(plain[0]).values(),
                                                                   weights(got[0]).values()))
    out["phases"] = {k: v["inter_node_bytes"] for k, v in got[2].stats.as_dict()["by_phase"].items()}
    return out


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp32", "bf16"])
def test_hpz_alone_is_fsdp2_bit_for_bit_and_backward_gathers_stay_in_node(bf16):
    runs = run_distributed(hpz_alone, 4, args=(bf16,))
    for r in runs:
        assert r["plain"] == r["hpz"] and r["same_weights"], r
        assert r["phases"].get("backward_gather", 0) == 0, r["phases"]
    # ranks 1 and 3 send across nodes in the ring (successors 2 and 0): the forward gathers cross
    assert runs[1]["phases"]["forward_gather"] > 0 and runs[1]["phases"]["grad_reduce"] > 0


# -- error bounds where quantized ----------------------------------------------------------------
def comms_against_exact(rank, world, ranks_per_node):
    """The plug-in's comms called as FSDP2 calls them, on rows every rank can rebuild."""
    import torch.nn.functional as F

    from parallel.topology import topology_from_env
    from zeropp.config import ZeroConfig
    from torch.distributed.fsdp import fully_shard

    from common.torch_private import param_group
    from zeropp.fsdp import NodeAwareGather, UnitReduce, ZeroPP
    topo = topology_from_env(ranks_per_node)
    zero = ZeroConfig(stage=3, zero_quantized_weights=True, zero_quantized_gradients=True)
    plugin = ZeroPP(topo, zero, torch.device("cpu"), overlap=False, max_inflight=2)
    g = torch.Generator().manual_seed(7)
    total, bs = 1000, zero.zero_quantized_weights_block_size
    every = torch.randn(world, total, generator=g) * torch.logspace(-3, 1, total)   # mixed scales
    gathered = torch.empty(world * total)
    NodeAwareGather(plugin, plugin.gather)(gathered, every[rank].clone(), dist.group.WORLD)
    padded = -(-total // bs) * bs
    step = F.pad(every, (0, padded - total)).view(world, -1, bs).abs().amax(-1) / 127   # INT8 step per block
    allowed = step.repeat_interleave(bs, -1)[:, :total] / 2 * (1 + 1e-6) + every.abs() * 1e-6
    out = {"int8_worst": float(((gathered.view(world, total) - every).abs() / allowed).max())}
    rows = torch.randn(world, world, 300, generator=g) * torch.rand(world, world, 1, generator=g) * 4
    mine = torch.empty(300)
    unit = fully_shard(torch.nn.Linear(300, world, bias=False))   # one row of 300 per rank, as reduced
    reduce = UnitReduce(plugin, 0, param_group(unit), world)
    reduce(mine, rows[rank].clone().view(-1), dist.group.WORLD, dist.ReduceOp.SUM)
    sent = rows[:, rank]
    exact = sent.sum(0)
    bound = int4_bound(sent, world // ranks_per_node, ranks_per_node, plugin.reduction.block_size)
    out["int4_worst"] = float(((mine - exact).abs() / (bound + 1e-6)).max())
    out["changed"] = not torch.equal(mine, exact) and not torch.equal(gathered.view(world, total), every)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, ranks_per_node", [(4, 2), (6, 2)], ids=["2x2", "3x2"])
def test_quantized_comms_within_the_engines_int8_and_int4_bounds(world, ranks_per_node):
    for r in run_distributed(comms_against_exact, world, args=(ranks_per_node,)):
        assert r["int8_worst"] <= 1.0 and r["int4_worst"] <= 1.0 and r["changed"], r


def every_switch(rank, world, bf16):
    plain, zpp = sharded(None, bf16), sharded(ALL, bf16)
    return {"plain": train(plain[0], plain[1], rank, 12), "zeropp": train(zpp[0], zpp[1], rank, 12)}


@pytest.mark.parametrize("bf16", [pytest.param(False, marks=pytest.mark.slow), True], ids=["fp32", "bf16"])
def test_every_switch_trains_like_plain_fsdp2(bf16):
    r = run_distributed(every_switch, 4, args=(bf16,))[0]
    base, got = r["plain"], r["zeropp"]
    assert base[-1] < base[0] - 0.3, base   # it learns
    # the engine's stated tolerance (tests/unit/zeropp/test_zeropp.py): each step within 2%, the last 4 within 0.5%
    for a, b in zip(got, base):
        assert abs(a - b) <= 0.02 * b, (got, base)
    assert abs(sum(got[-4:]) - sum(base[-4:])) <= 0.005 * sum(base[-4:]), (got, base)
    assert got != base


# -- the bytes across nodes: the engine's ------------------------------------------------------
def bytes_both_ways(rank, world):
    import zeropp
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    model, opt, zpp = sharded(ALL)
    train(model, opt, rank, 1)
    zpp.comm.reset_stats()   # the second step: the engine's schedule has learnt the order of use
    train(model, opt, rank, 1, first=1)
    plugin = torch.tensor([zpp.stats.inter_node_bytes], dtype=torch.int64)
    torch.manual_seed(0)
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                 "zero_quantized_gradients": True, "zeropp_loco_param": {}}}
    comm = Communicator(topology_from_env(2))
    engine = zeropp.initialize(tiny_gpt(), zeropp.DeepSpeedConfig.from_dict(cfg), comm, torch.device("cpu"),
                               zeropp.OptimizerSettings(type="adamw", lr=3e-3))
    for step in range(2):
        comm.reset_stats()
        x, y = batch(rank, step)
        engine.backward(engine(x, y))
        engine.step()
    ours = torch.tensor([comm.stats.inter_node_bytes], dtype=torch.int64)
    dist.all_reduce(plugin)
    dist.all_reduce(ours)
    return int(plugin), int(ours)


@pytest.mark.slow
def test_cross_node_bytes_equal_the_engines_within_5_percent():
    plugin, engine = run_distributed(bytes_both_ways, 4)[0]
    assert engine > 0 and abs(plugin - engine) <= 0.05 * engine, (plugin, engine)


# -- resume --------------------------------------------------------------------------------------
def state(model, opt, zpp):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "zeropp": zpp.state_dict()}


def every_switch_model(**kw):
    return sharded(ALL, **kw)


def save_then_go_on(rank, world, path, build=every_switch_model):
    """3 steps, a DCP save, 3 more: their losses (`build(**kw)`: model, optimizer, plug-in)."""
    import torch.distributed.checkpoint as dcp
    model, opt, zpp = build()
    train(model, opt, rank, 3)
    dcp.save(state(model, opt, zpp), checkpoint_id=path)
    return train(model, opt, rank, 3, first=3)


def load_then_go_on(rank, world, path, ranks_per_node, build=every_switch_model, **kw):
    """A step to be overwritten, the load, 3 steps: their losses and what the load said was reset."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    model, opt, zpp = build(ranks_per_node=ranks_per_node, **kw)
    train(model, opt, rank, 1, first=100)   # state to be overwritten: the error, the moments
    sd = state(model, opt, zpp)
    del sd["zeropp"]
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    notes = zpp.load(path)
    return train(model, opt, rank, 3, first=3), notes


@pytest.mark.slow
def test_resume_continues_exactly_and_another_layout_says_what_reset(tmp_path):
    path = str(tmp_path / "ckpt")
    went_on = run_distributed(save_then_go_on, 4, args=(path,))
    resumed = run_distributed(load_then_go_on, 4, args=(path, 2))
    for a, (b, notes) in zip(went_on, resumed):
        assert a == b and notes == [], (a, b, notes)
    one_node = run_distributed(load_then_go_on, 4, args=(path, 4))
    for _, notes in one_node:
        assert len(notes) == 1 and "starts from zero" in notes[0] and "2 nodes" in notes[0], notes


def dropped_model_is_freed(rank, world, build=every_switch_model):
    import gc
    import weakref
    model, opt, zpp = build()
    train(model, opt, rank, 1)
    refs = weakref.ref(model), weakref.ref(zpp)
    del model, opt, zpp
    gc.collect()
    return [r() is None for r in refs]


def test_a_dropped_model_and_its_plugin_are_freed():
    """Nothing of the plug-in's keeps a trained model alive (with its gathered weights and
    process groups) once the user drops it: a hook on a parameter that held the plug-in made a
    cycle Python's collector cannot see."""
    assert run_distributed(dropped_model_is_freed, 4) == [[True, True]] * 4


# -- misuse --------------------------------------------------------------------------------------
def misuse(rank, world):
    from torch.distributed.fsdp import fully_shard

    from zeropp.fsdp import PluginError, apply_zeropp
    out = {}

    def error(fn):
        try:
            fn()
        except PluginError as e:
            return str(e)
        return None
    out["unsharded"] = error(lambda: apply_zeropp(tiny_gpt(), 2))
    model = tiny_gpt()
    fully_shard(model)
    out["topology"] = error(lambda: apply_zeropp(model, 3))
    out["loco_alone"] = error(lambda: apply_zeropp(model, 2, quantized_gradients=False, loco=True))
    out["block"] = error(lambda: apply_zeropp(model, 2, weight_block_size=3))
    out["beta"] = error(lambda: apply_zeropp(model, 2, loco=True, loco_beta=float("nan")))
    apply_zeropp(model, 2)
    out["twice"] = error(lambda: apply_zeropp(model, 2))
    return out


def test_misuse_is_one_clear_error():
    r = run_distributed(misuse, 4)[0]
    assert "call fully_shard(model) first" in r["unsharded"], r
    assert "ranks per node (topology) 3 must divide the world size 4" in r["topology"], r
    assert r["block"].startswith("apply_zeropp: weight_block_size must be a power of two"), r
    assert r["beta"].startswith("apply_zeropp: loco_beta must be in [0, 1)") and "got nan" in r["beta"], r
    assert "set quantized_gradients=True" in r["loco_alone"], r
    assert "already applied" in r["twice"], r
    assert all("\n" not in v for v in r.values()), r
