"""What a checkpoint holds besides the files' layout: the engine's state as
torch.distributed.checkpoint (DCP) sees it, and every RNG's state as JSON
(see training/checkpoint.py)."""
from __future__ import annotations

import base64
import contextlib
import random
import warnings

import numpy as np
import torch

from parallel.launch import world_size
from zeropp.collectives.partition import FlatState


# -- RNG states as JSON -------------------------------------------------------------------
def rng_state() -> dict:
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def set_rng_state(state: dict):
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


# -- engine state <-> DCP ------------------------------------------------------------------
def as_dcp(state: dict[str, FlatState], device: torch.device, group=None, topology=None) -> dict:
    """FlatStates as DCP sees them: a sharded one is a DTensor over all ranks,
    Shard(0) of its flat global tensor (the partition layout is torch.chunk's). With the
    engine's `topology` one of several groups (zeropp/diloco.py), each group holds its own
    state: the global tensor is the groups' tensors end to end, Shard(0) over the groups,
    then Shard(0) over each group's ranks (what all groups share: replicated over them)."""
    world = world_size()
    if world == 1:
        return {k: v.local for k, v in state.items()}
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    if topology is not None and topology.groups > 1:
        from torch.distributed.tensor import Replicate
        g = topology.groups
        mesh = DeviceMesh.from_group([topology.across_group, topology.world_group], device.type,
                                     mesh=torch.arange(g * topology.world_size).view(g, topology.world_size),
                                     mesh_dim_names=("groups", "ranks"))

        def grouped(v):   # each group's own value end to end, or one value all groups share
            n, first = (g * v.numel, Shard(0)) if v.per_group else (v.numel, Replicate())
            return DTensor.from_local(v.local, mesh, [first, Shard(0)], run_check=False, shape=(n,), stride=(1,))
        return {k: grouped(v) if v.sharded else v.local for k, v in state.items()}
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type)
    else:
        mesh = init_device_mesh(device.type, (world,))  # over the default group: no new process group
    return {k: DTensor.from_local(v.local, mesh, [Shard(0)], run_check=False, shape=(v.numel,), stride=(1,))
            if v.sharded else v.local for k, v in state.items()}


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def engine_device(state: dict[str, FlatState]) -> torch.device:
    return next((v.local.device for v in state.values() if v.sharded), torch.device("cpu"))
