"""Sharded construction: build the model on the meta device, let the engine
materialize it one parameter at a time.

    with torch.device("meta"):
        model = GPT(cfg)                       # no memory
    engine = zeropp.initialize(model, ..., param_init=model.init_parameter)

`param_init(name, tensor)` fills a real fp32 tensor for the parameter (or
buffer) called `name` (its `named_parameters()` name). The engine creates the
full tensor, takes the slices this rank keeps, and drops it before the next
parameter, so no rank ever holds more than the largest parameter in full on
top of its shards. Initial values equal an unsharded build's whenever
`param_init` depends only on the name (GPT's seeds a generator from it).

A materialized parameter keeps its identity (`torch.utils.swap_tensors`), so
weights tied by sharing one Parameter stay tied.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

ParamInit = Callable[[str, torch.Tensor], None]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def full_value(name: str, tensor: torch.Tensor, param_init: ParamInit | None, device) -> torch.Tensor:
    """The tensor's full value in fp32 on `device`: initialized if it is on the
    meta device, else a copy of its data."""
    if not tensor.is_meta:
        return tensor.detach().to(device=device, dtype=torch.float32)
    if param_init is None:
        raise ValueError(f"{name} is on the meta device: pass param_init=fn(name, tensor) to "
                         f"zeropp.initialize so the engine can create it shard by shard")
    out = torch.empty(tensor.shape, dtype=torch.float32, device=device)
    with torch.no_grad():
        param_init(name, out)
    return out


def replace_data(param: torch.Tensor, data: torch.Tensor):
    """Give `param` new data, also when it lives on the meta device (where
    `.data =` refuses a real tensor)."""
    if param.is_meta:
        new = nn.Parameter(data, requires_grad=param.requires_grad) if isinstance(param, nn.Parameter) \
            else data
        torch.utils.swap_tensors(param, new)
    else:
        param.data = data


def materialize_rest(module: nn.Module, param_init: ParamInit | None, device, dtype,
                     skip: set[int] = frozenset()):
    """Materialize every parameter (id not in `skip`) and buffer of `module`
    still on the meta device, whole, in `dtype` (buffers keep their dtype)."""
    for name, p in module.named_parameters():
        if id(p) not in skip and p.is_meta:
            replace_data(p, full_value(name, p, param_init, device).to(dtype))
    for name, b in module.named_buffers():
        if b.is_meta:
            replace_data(b, full_value(name, b, param_init, device).to(b.dtype))
