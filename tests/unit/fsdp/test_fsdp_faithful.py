"""The FSDP2 plug-in changes nothing FSDP2 promises, loop by loop as users write them (4 ranks as 2
emulated nodes x 2, an MLP with LayerNorm): optimizer in backward, an all-reduce hook, LoCo's
state with frozen, unused and grouped parameters, a branch's error kept to itself, LoCo without a
commit, evaluation between backward and step, FSDP2's eval toggle, and the small misuses."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_distributed

NONE = dict(quantized_weights=False, hpz=False, quantized_gradients=False)
HPZ = dict(NONE, hpz=True)
ALL = dict(quantized_weights=True, hpz=True, quantized_gradients=True, loco=True)


class Net(nn.Module):
    """Blocks of Linear + LayerNorm, two same-shaped heads (`heads[1]` used on odd steps when
    `alternate`), a frozen scale."""

    def __init__(self, width=32, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                    for _ in range(depth))
        self.heads = nn.ModuleList(nn.Linear(width, 8) for _ in range(2))
        self.frozen = nn.Parameter(torch.ones(width), requires_grad=False)
        self.scale_a, self.use_b = 1.0, False

    def forward(self, x):
        for block in self.blocks:
            x = block(x * self.frozen)
        return self.heads[1](x) if self.use_b else self.heads[0](x) * self.scale_a


def build(plugin, grouped=False, attach=True, lr=1e-2, opt="adamw", **wrap):
    from torch.distributed.fsdp import fully_shard

    from zeropp.fsdp import apply_zeropp
    torch.manual_seed(0)
    model = Net()
    if grouped:
        fully_shard([model.blocks[0], model.blocks[1]], **wrap)
        fully_shard(model.blocks[2], **wrap)
    else:
        for block in model.blocks:
            fully_shard(block, **wrap)
    fully_shard(model, **wrap)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr) if opt == "adamw" else torch.optim.SGD(params, lr=lr)
    zpp = None
    if plugin is not None:
        zpp = apply_zeropp(model, 2, **plugin)
        if attach:
            zpp.attach(optimizer)
    return model, optimizer, zpp


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 32, generator=g)
    return x, (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def loop(model, optimizer, rank, steps, between=None, step_fn=None):
    losses = []
    for s in range(steps):
        loss = loss_of(model, rank, s)
        loss.backward()
        if between is not None:
            between(model, s)
        if step_fn is None:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# -- 1. optimizer in backward ------------------------------------------------------------------------
def optimizer_in_backward(rank, world, plugin):
    model, _, zpp = build(plugin, opt="sgd")
    for p in model.parameters():
        if p.requires_grad:
            opt = torch.optim.SGD([p], lr=0.1)

            def step(param, opt=opt):
                opt.step()
                opt.zero_grad()
            p.register_post_accumulate_grad_hook(step)
    return loop(model, None, rank, 4, step_fn=True), (getattr(zpp, "overlap_label", str)() if zpp else "")


@pytest.mark.slow
def test_optimizer_in_backward_trains_fsdp2s_bits():
    plain = run_distributed(optimizer_in_backward, 4, args=(None,))
    hpz = run_distributed(optimizer_in_backward, 4, args=(HPZ,))
    for (a, _), (b, label) in zip(plain, hpz):
        assert all(v == v for v in b) and a == b, (a, b)
        assert "post-accumulate-grad hook" in label and "overlap backward in 0 of" in label, label


# -- 2. an all-reduce hook ---------------------------------------------------------------------------
def all_reduce_hook(rank, world, plugin, hooked):
    from torch.distributed.fsdp import FSDPModule
    model, opt, _ = build(plugin)
    if hooked:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(lambda t: t.mul_(0.5))
    return loop(model, opt, rank, 3)


@pytest.mark.slow
def test_an_all_reduce_hooks_effect_is_kept():
    plain = run_distributed(all_reduce_hook, 4, args=(None, True))
    hpz = run_distributed(all_reduce_hook, 4, args=(HPZ, True))
    unhooked = run_distributed(all_reduce_hook, 4, args=(HPZ, False))
    assert plain == hpz and plain != unhooked, (plain[0], hpz[0], unhooked[0])


# -- 3. saving changes nothing: frozen, unused on odd steps, grouped ----------------------------------
def save_every_step(rank, world, save):
    model, opt, zpp = build(ALL, grouped=True)
    norms = []

    def between(m, s):
        m.use_b = s % 2 == 1   # the next step's head
        if save:
            zpp.state_dict()
        ef = zpp.carried["error_feedback"]
        norms.append(sum(float(e.norm()) for e in ef.errors().values()))
    losses = loop(model, opt, rank, 6, between=between)
    return losses, norms, {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_state_dict_changes_no_error_and_no_trajectory():
    saved = run_distributed(save_every_step, 4, args=(True,))
    unsaved = run_distributed(save_every_step, 4, args=(False,))
    for (la, na, wa), (lb, nb, wb) in zip(saved, unsaved):
        assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wa), (la, lb)
        assert na[1:] == nb[1:] and all(n > 0 for n in na[1:]), (na, nb)


# -- 4. one branch's error never lands on another's gradient -------------------------------------------
def branch_gradient(rank, world, scale):
    """lr 0: the weights never change, so B's gradient is the same at every scale of A."""
    model, opt, zpp = build(ALL, lr=0.0, opt="sgd")
    model.scale_a = scale
    grads = []
    for s in range(4):
        model.use_b = s % 2 == 1
        loss_of(model, rank, s).backward()
        if model.use_b:
            grads.append(model.heads[1].weight.grad.full_tensor().clone())
        opt.step()
        opt.zero_grad()
    return grads


@pytest.mark.slow
def test_a_branchs_error_is_its_own():
    small = run_distributed(branch_gradient, 4, args=(1.0,))[0]
    large = run_distributed(branch_gradient, 4, args=(100.0,))[0]
    assert all(torch.isfinite(g).all() for g in small + large)
    assert all(torch.equal(a, b) for a, b in zip(small, large)), [float((a - b).norm()) for a, b in zip(small, large)]


# -- 5. LoCo without a commit ------------------------------------------------------------------------
def loco_unattached(rank, world):
    from zeropp.fsdp import PluginError
    model, opt, _ = build(ALL, attach=False)
    try:
        loop(model, opt, rank, 1)
    except PluginError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_loco_without_attach_is_one_clear_error():
    message = run_distributed(loco_unattached, 4)[0]
    assert message and "attach(optimizer)" in message and "\n" not in message, message


# -- 6. evaluation between backward and step -----------------------------------------------------------
def eval_between(rank, world, plugin):
    model, opt, _ = build(plugin)

    def evaluate(m, s):
        with torch.no_grad():
            m(batch(rank, 99)[0])
    return loop(model, opt, rank, 3, between=evaluate)


@pytest.mark.slow
def test_evaluation_between_backward_and_step_trains_fsdp2s_bits():
    plain = run_distributed(eval_between, 4, args=(None,))
    hpz = run_distributed(eval_between, 4, args=(HPZ,))
    assert plain == hpz, (plain[0], hpz[0])


# -- 7. FSDP2's eval toggle keeps hpZ ----------------------------------------------------------------
def node_meshes(model) -> set:
    """The meshes the units reshard to after forward (hpZ: a node's)."""
    from torch.distributed.fsdp import FSDPModule

    from common import torch_private as tp
    return {id(tp.post_forward_mesh(g)) for m in model.modules()
            if isinstance(m, FSDPModule) and (g := tp.param_group(m)) is not None and tp.post_forward_mesh(g)}


def threads() -> int:
    """This process's threads: each process group gloo makes starts some."""
    import os
    return len(os.listdir("/proc/self/task"))


def toggle(rank, world, toggled):
    model, opt, zpp = build(HPZ)
    loop(model, opt, rank, 1)
    meshes, before = node_meshes(model), threads()
    for _ in range(3 if toggled else 0):
        model.set_reshard_after_forward(False)
        with torch.no_grad():
            model(batch(rank, 99)[0])
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)   # the root keeps its weights, as before
    loop(model, opt, rank, 1)   # the units still hold the evaluation's weights: this step reshards them
    zpp.comm.reset_stats()
    loop(model, opt, rank, 1)
    inter = {k: v["inter_node_bytes"] for k, v in zpp.stats.as_dict()["by_phase"].items() if v["inter_node_bytes"]}
    return inter, len(meshes), node_meshes(model) == meshes, threads() - before


@pytest.mark.slow
def test_fsdp2s_eval_toggle_keeps_hpz_and_books_bytes_by_pass():
    """...on one node mesh for every unit (each mesh is process groups of its own: a mesh a unit,
    or new ones at each toggle, would be communicators without end under NCCL)."""
    toggled = run_distributed(toggle, 4, args=(True,))
    untouched = run_distributed(toggle, 4, args=(False,))
    for (a, *_), (b, *_) in zip(toggled, untouched):
        assert a == b and a.get("backward_gather", 0) == 0, (a, b)
    assert toggled[1][0]["forward_gather"] > 0
    assert all(r[1:] == (1, True, 0) for r in toggled + untouched), (toggled, untouched)


# -- 8. the small ones -------------------------------------------------------------------------------
def small_ones(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from zeropp.fsdp import NodeAwareGather, PluginError, apply_zeropp
    out = {}
    model, _, _ = build(None)
    apply_zeropp(model.blocks[0], 2, **HPZ)
    try:
        apply_zeropp(model, 2, **HPZ)
        out["twice"] = None
    except PluginError as e:
        out["twice"] = str(e)
    # a divide factor: gloo has no pre-multiplied sum; the plug-in sums and divides
    grads = []
    for factor in (None, 8.0):
        model, _, _ = build(HPZ)
        for m in model.modules():
            if factor and isinstance(m, FSDPModule):   # it sets one unit's, not those inside
                m.set_gradient_divide_factor(factor)
        loss_of(model, rank, 0).backward()
        grads.append([p.grad.full_tensor() for p in model.parameters() if p.grad is not None])
    out["factor"] = max(float((b - a * 4 / 8).abs().max()) for a, b in zip(*grads))
    # an extension's packed bytes gather exactly, not through qwZ
    zpp = build(dict(NONE, quantized_weights=True))[2]
    mine = torch.arange(16, dtype=torch.uint8) + rank
    gathered = torch.empty(16 * world, dtype=torch.uint8)
    NodeAwareGather(zpp, zpp.gather)(gathered, mine, dist.group.WORLD)
    out["uint8"] = torch.equal(gathered, torch.cat([torch.arange(16, dtype=torch.uint8) + r for r in range(world)]))
    return out


@pytest.mark.slow
def test_small_ones_apply_twice_divide_factor_uint8():
    r = run_distributed(small_ones, 4)[0]
    assert r["twice"] and "already applied to blocks.0" in r["twice"] and "\n" not in r["twice"], r
    assert r["factor"] <= 1e-6 and r["uint8"], r


@pytest.mark.slow
@pytest.mark.parametrize("order", [[1, 0, 3, 2]], ids=["swapped"])
def test_a_mesh_in_another_rank_order_is_refused(order):
    r = run_distributed(mesh_order, 4, args=(order,))[0]
    assert r and "orders them [1, 0, 3, 2]" in r and "\n" not in r, r


def mesh_order(rank, world, order):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from zeropp.fsdp import PluginError, apply_zeropp
    model = fully_shard(nn.Linear(8, 8), mesh=DeviceMesh("cpu", torch.tensor(order)))
    try:
        apply_zeropp(model, 2, **HPZ)
    except PluginError as e:
        return str(e)
    return None
