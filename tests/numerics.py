"""Tolerances derived from what is compared, so they hold on any CPU.

A sharded run and the single-process run it must match both compute in fp32;
they differ only in the order of their sums (ranks, buckets, the kernels a CPU
dispatches to: AVX2, AVX-512, AMX sum in other orders). Neither is "right":
the right answer is the same training in fp64. So each comparison takes three
results of one computation:

    exact   the fp64 reference (`fp64_reference`: plain torch, the engine's arithmetic)
    single  the fp32 single-process run (the engine at world size 1)
    got     the fp32 sharded run

and asserts, per tensor, max|got - exact| <= FACTOR * max|single - exact| +
FACTOR * eps32 * max|exact|. Both fp32 runs make the same roundings in another
order, so their errors against fp64 are of one size, whatever this CPU's kernels
are: the single run measures that size here and now. FACTOR = 8 leaves room for
the spread between two such errors (the maximum over a tensor's elements); the
eps32 term covers a tensor the single run happens to get almost exactly right.
A parameter whose true gradient is exactly zero (GPT's attention key bias:
softmax ignores it) is pure round-off to Adam, which normalises that noise into
lr-sized steps of either sign: both fp32 runs then err by about lr per step,
and the same bound still holds, because both errors are that size.
"""
from __future__ import annotations

import math

import torch

FACTOR = 8
EPS32 = torch.finfo(torch.float32).eps


def fp64_reference(model: torch.nn.Module, steps: list[list], lr: float, clip: float,
                   betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01,
                   optimizer: str = "adamw", momentum: float = 0.0):
    """Train `model` in fp64 as zeropp's engine trains in fp32: `steps` is a list of
    steps, each a list of micro-batch closures `loss = f(model)`; the loss of each is
    divided by the micro-batch count; the global gradient norm clips to `clip`
    (coefficient clip / (norm + 1e-6)); the optimizer is the engine's (weight decay
    on matrices only). Returns (per-step mean losses, norms, fp64 state dict)."""
    model = model.double()
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum)
    else:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        opt = cls(groups, lr=lr, betas=betas, eps=eps)
    losses, norms = [], []
    for micro_batches in steps:
        total = 0.0
        for loss_of in micro_batches:
            loss = loss_of(model)
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = math.sqrt(sum(g.pow(2).sum().item() for g in grads))
        if clip > 0 and norm > clip:
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(norm)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _as_tensor(x) -> torch.Tensor:
    return x if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64)


def roundoff_bound(single, exact) -> float:
    """What `got` may differ from `exact` by (see the module docstring)."""
    single, exact = _as_tensor(single).double(), _as_tensor(exact).double()
    return FACTOR * (single - exact).abs().max().item() + FACTOR * EPS32 * exact.abs().max().item()


def assert_within_roundoff(got, single, exact, what: str = ""):
    """`got` (fp32) against `exact` (fp64) within the round-off `single` (fp32) shows."""
    got_t, exact_t = _as_tensor(got).double(), _as_tensor(exact).double()
    if got_t.numel() == 0:
        return
    err = (got_t - exact_t).abs().max().item()
    bound = roundoff_bound(single, exact)
    assert err <= bound, (f"{what}: max |got - fp64| = {err:.3e} > {bound:.3e} = {FACTOR} x the single "
                          f"process's ({(_as_tensor(single).double() - exact_t).abs().max().item():.3e}) "
                          f"+ {FACTOR} eps32")


def assert_state_within_roundoff(got: dict, single: dict, exact: dict, what: str = ""):
    """Every floating-point entry of the state dicts (others must be equal)."""
    assert set(got) == set(exact), what
    for k in exact:
        if exact[k].is_floating_point():
            assert_within_roundoff(got[k], single[k], exact[k], f"{what} {k}")
        else:
            assert torch.equal(got[k], exact[k]), f"{what} {k}"
