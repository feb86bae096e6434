"""Every private torch attribute the product reads or writes, in one place (checked against torch
2.13.0): torch has no public way to ask these things, so each is named here, reached only through
the function beside it, and tests/test_torch_private.py fails loudly when torch renames one or
changes what it means. Nothing else in the product touches a private torch name.

| attribute | used for |
|---|---|
| torch._C._current_graph_task_id | whether a backward pass is running (a gather is booked by pass) |
| torch.autograd.Variable._execution_engine.queue_callback | run something when backward ends |
| torch._C._autograd._top_saved_tensors_default_hooks | the innermost saved-tensor hook (activation checkpointing) |
| Tensor._post_accumulate_grad_hooks | whether a parameter has post-accumulate-grad hooks |
| FSDPModule._get_fsdp_state, FSDPState._fsdp_param_groups | a unit's FSDP parameter group |
| FSDPModule._set_unshard_async_op | FSDP2's asynchronous unshard (CPU overlap) |
| FSDPState._states_to_forward_prefetch | whether forward prefetch was set |
| FSDPParamGroup.fsdp_params, .post_forward_mesh_info, .mesh_info | a group's parameters, its hpZ mesh |
| FSDPParamGroup._all_reduce_hook, .gradient_divide_factor, .reduce_scatter_unused_params | what reads a reduction |
| FSDPParam.sharded_param, ._unsharded_param, .offload_to_cpu, ._orig_size | one parameter's state |
| FSDPParam.post_forward_mesh_info, ._init_sharded_post_forward_param_metadata | hpZ's post-forward shard |
| FSDPMeshInfo.mesh, .shard_mesh_size | the DeviceMesh a group shards over, and its size |
| torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info | fully_shard(reshard_after_forward=int)'s mesh |
| HSDPMeshInfo.replicate_process_group, FSDPParamGroup.all_reduce_grads | HSDP: the group of the replica all-reduce, whether it runs |
| torch.distributed.tensor._redistribute._gen_transform_infos, torch._C._clear_DTensor_sharding_propagator_cache | DTensor's cached plans, dropped with a pooled rank's groups |
"""
from __future__ import annotations

import torch

CHECKED_TORCH = "2.13"   # the torch version (major.minor) every attribute below was checked against

ATTRIBUTES = (
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "Tensor._post_accumulate_grad_hooks",
    "FSDPModule._get_fsdp_state",
    "FSDPModule._set_unshard_async_op",
    "FSDPState._fsdp_param_groups",
    "FSDPState._states_to_forward_prefetch",
    "FSDPParamGroup.fsdp_params",
    "FSDPParamGroup.post_forward_mesh_info",
    "FSDPParamGroup.mesh_info",
    "FSDPParamGroup._all_reduce_hook",
    "FSDPParamGroup.gradient_divide_factor",
    "FSDPParamGroup.reduce_scatter_unused_params",
    "FSDPParam.sharded_param",
    "FSDPParam._unsharded_param",
    "FSDPParam.offload_to_cpu",
    "FSDPParam._orig_size",
    "FSDPParam.post_forward_mesh_info",
    "FSDPParam._init_sharded_post_forward_param_metadata",
    "FSDPMeshInfo.mesh",
    "FSDPMeshInfo.shard_mesh_size",
    "torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info",
    "HSDPMeshInfo.replicate_process_group",
    "FSDPParamGroup.all_reduce_grads",
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    "torch._C._clear_DTensor_sharding_propagator_cache",
)


# -- autograd ------------------------------------------------------------------------------------
def in_backward() -> bool:
    """Whether this thread is running a backward pass now."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(fn) -> None:
    """Run `fn` when the running backward pass ends (call only inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def top_saved_tensors_hooks():
    """The innermost (pack, unpack) saved-tensor hooks, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


# -- FSDP2 (torch.distributed.fsdp.fully_shard) --------------------------------------------------
_FSDP_NEEDS = {   # where each FSDP2 attribute above lives on a live model: (owner, attribute)
    "module": ("_get_fsdp_state", "_set_unshard_async_op"),
    "state": ("_fsdp_param_groups", "_states_to_forward_prefetch"),
    "group": ("fsdp_params", "post_forward_mesh_info", "mesh_info", "_all_reduce_hook", "gradient_divide_factor",
              "reduce_scatter_unused_params"),
    "param": ("sharded_param", "offload_to_cpu", "_orig_size", "post_forward_mesh_info",
              "_init_sharded_post_forward_param_metadata"),
    "mesh info": ("mesh", "shard_mesh_size"),
}
_OWNER = {"module": "FSDPModule", "state": "FSDPState", "group": "FSDPParamGroup", "param": "FSDPParam",
          "mesh info": "FSDPMeshInfo"}


def missing_fsdp_internals(model) -> list[str]:
    """The FSDP2 attributes listed above that this torch lacks, looked up on `model` (wrapped by
    fully_shard, before anything is changed): the plug-in refuses in one line rather than failing
    halfway through an install on another torch."""
    from torch.distributed.fsdp import FSDPModule
    lacking: list[str] = []
    owners = {"module": model, "state": None, "group": None, "param": None, "mesh info": None}
    for module in model.modules():   # the first unit that manages parameters gives a group and a param
        if isinstance(module, FSDPModule) and hasattr(module, "_get_fsdp_state"):
            state = module._get_fsdp_state()
            owners["state"] = owners["state"] or state
            groups = getattr(state, "_fsdp_param_groups", None) or []
            if groups and list(getattr(groups[0], "fsdp_params", None) or []):
                owners.update(state=state, group=groups[0], param=list(groups[0].fsdp_params)[0])
                owners["mesh info"] = getattr(groups[0], "mesh_info", None)
                break
    for owner, names in _FSDP_NEEDS.items():
        obj = owners[owner]
        lacking += [f"{_OWNER[owner]}.{n}" for n in names if obj is not None and not hasattr(obj, n)]
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info  # noqa: F401
    except ImportError:
        lacking.append("torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info")
    return lacking


def fsdp_state(module):
    """The FSDP state `fully_shard` attached (modules grouped by one `fully_shard([a, b])` share it)."""
    return module._get_fsdp_state()


def param_group(module):
    """The unit's FSDP parameter group, or None for a module that manages no parameters."""
    groups = fsdp_state(module)._fsdp_param_groups or []
    return groups[0] if groups else None


def set_unshard_async(module, on: bool) -> None:
    module._set_unshard_async_op(on)


def has_forward_prefetch(module) -> bool:
    """Whether `set_modules_to_forward_prefetch` gave this module something to prefetch."""
    return bool(fsdp_state(module)._states_to_forward_prefetch)


def group_params(group) -> list:
    """The group's FSDP parameters, in the order FSDP2 lays out their gradients for a reduction."""
    return list(group.fsdp_params)


def sharded_param(fsdp_param) -> torch.nn.Parameter:
    return fsdp_param.sharded_param


def unsharded_param(fsdp_param) -> torch.nn.Parameter | None:
    """The gathered parameter forward computes with (None before the first gather); it persists
    across steps, so a hook registered on it stays."""
    return getattr(fsdp_param, "_unsharded_param", None)


def reads_of_reduction(group) -> list[str]:
    """What reads a reduction's output before backward ends: FSDP2 runs them right after the
    reduce-scatter returns."""
    reads = []
    if group._all_reduce_hook is not None:
        reads.append("an all-reduce hook")
    if group.gradient_divide_factor is not None:
        reads.append("a gradient divide factor")
    if any(p.offload_to_cpu for p in group.fsdp_params):
        reads.append("CPU offload")
    if any(has_post_accumulate_grad_hooks(p.sharded_param) for p in group.fsdp_params):
        reads.append("a post-accumulate-grad hook")
    return reads


def divide_factor(group) -> float | None:
    return group.gradient_divide_factor


def reduces_unused(group) -> bool:
    """`set_reduce_scatter_unused_params(True)`: every parameter that requires grad is reduced."""
    return bool(group.reduce_scatter_unused_params)


def post_forward_ranks(group) -> int | None:
    """Over how many ranks the group keeps its weights after forward: None (it keeps them
    gathered), the world (it reshards), or fewer (hpZ)."""
    info = group.post_forward_mesh_info
    return None if info is None else info.shard_mesh_size


def post_forward_mesh(group):
    """The DeviceMesh the group reshards to after forward (None: it keeps its weights gathered)."""
    info = group.post_forward_mesh_info
    return None if info is None else info.mesh


def set_post_forward_ranks(group, ranks: int, made: dict) -> None:
    """What `fully_shard(reshard_after_forward=ranks)` sets on a group (torch 2.13's
    `set_reshard_after_forward` takes only a bool), on a mesh shared through `made`: every
    DeviceMesh is process groups of its own (two a rank here, each a communicator under NCCL),
    and fully_shard makes one per unit over the same ranks, so a model would hold two a layer,
    and more at each eval toggle. A group already on `ranks` keeps its mesh and offers it to
    the others."""
    mesh = group.mesh_info.mesh   # fully_shard without a mesh makes one per call: key by its ranks
    key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), ranks)
    if post_forward_ranks(group) == ranks:
        made.setdefault(key, group.post_forward_mesh_info)
        return
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info
    if key not in made:
        made[key] = _get_post_forward_mesh_info(ranks, group.mesh_info)
    info = group.post_forward_mesh_info = made[key]
    for p in group.fsdp_params:
        p.post_forward_mesh_info = info
        if info is not None:
            p._init_sharded_post_forward_param_metadata(torch.empty(p._orig_size, device="meta"))


# -- FSDP2 on a (replicate, shard) mesh: HSDP ------------------------------------------------------
# FSDP2 all-reduces each unit's reduced shard across replicas with `dist.all_reduce` over its mesh
# info's replicate group and has no comm hook for it (`set_all_reduce_hook` runs after it): the
# plug-in gives the group a process group whose all-reduce is its own (zeropp/fsdp/replicate.py).
_HSDP_NEEDS = {"group": ("mesh_info", "all_reduce_grads"), "mesh info": ("replicate_process_group",)}


def missing_hsdp_internals(group) -> list[str]:
    """The HSDP attributes above that this torch lacks on `group` (a unit's FSDPParamGroup on a
    2-D mesh): the plug-in refuses in one line naming them."""
    owners = {"group": group, "mesh info": getattr(group, "mesh_info", None)}
    names = {"group": "FSDPParamGroup", "mesh info": "HSDPMeshInfo"}
    return [f"{names[o]}.{n}" for o, attrs in _HSDP_NEEDS.items() for n in attrs
            if owners[o] is None or not hasattr(owners[o], n)]


def replicate_group(group):
    """The process group FSDP2 all-reduces the unit's gradients over, across replicas."""
    return group.mesh_info.replicate_process_group


def set_replicate_group(group, process_group) -> None:
    """FSDP2 all-reduces the unit's gradients over `process_group` from now on."""
    group.mesh_info.replicate_process_group = process_group


def replica_all_reduce_on(group) -> bool:
    """False after `set_requires_all_reduce(False)`: FSDP2 keeps the reduced shard to add to the
    next backward's (it reads the reduction's output) and all-reduces only then."""
    return bool(group.all_reduce_grads)


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached redistribution plans and sharding propagations. Each holds the meshes
    it was made for (an output spec, its mesh and process groups), and DeviceMesh equality ignores
    process groups: in a process whose groups were destroyed (parallel/spawn.py's pooled ranks) a
    new equal mesh would find a cached spec naming a destroyed group."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    _gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()   # DTensor's dispatch caches propagations in C++
