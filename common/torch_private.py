"""Every private torch attribute the product reads or writes, in one place, checked against the
torch releases SUPPORTED names (pyproject.toml declares the same range): torch has no public way
to ask these things, so each is named here, reached only through the function beside it, and
tests/unit/common/test_torch_private.py fails loudly when torch renames one or changes what it means. Nothing
else in the product touches a private torch name. Nothing here falls back to a default: the
autograd attributes are looked up at import, the FSDP2 ones when the plug-in is applied
(`fsdp_internals_problem`), and a torch that lacks one fails there, in one line naming it.

| attribute | used for |
|---|---|
| torch._C._current_graph_task_id | whether a backward pass is running (a gather is booked by pass) |
| torch.autograd.Variable._execution_engine.queue_callback | run something when backward ends |
| torch._C._autograd._top_saved_tensors_default_hooks | the innermost saved-tensor hook (activation checkpointing) |
| Tensor._post_accumulate_grad_hooks | whether a parameter has post-accumulate-grad hooks |
| torch.distributed.distributed_c10d._get_default_store | the key-value store of the default process group |
| FSDPModule._get_fsdp_state, FSDPState._fsdp_param_groups | a unit's FSDP parameter group |
| FSDPModule._set_unshard_async_op | FSDP2's asynchronous unshard (CPU overlap) |
| FSDPState._states_to_forward_prefetch | whether forward prefetch was set |
| FSDPParamGroup.fsdp_params, .post_forward_mesh_info, .mesh_info | a group's parameters, its hpZ mesh |
| FSDPParamGroup._all_reduce_hook, .gradient_divide_factor, .reduce_scatter_unused_params | what reads a reduction |
| FSDPParamGroup.reshard_after_backward | whether a unit reshards after backward (set_reshard_after_backward has no getter) |
| FSDPParam.sharded_param, ._unsharded_param, .offload_to_cpu, ._orig_size | one parameter's state |
| FSDPParam.post_forward_mesh_info, ._init_sharded_post_forward_param_metadata | hpZ's post-forward shard |
| FSDPMeshInfo.mesh, .shard_mesh_size | the DeviceMesh a group shards over, and its size |
| torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info | fully_shard(reshard_after_forward=int)'s mesh |
| HSDPMeshInfo.replicate_process_group, FSDPParamGroup.all_reduce_grads | HSDP: the group of the replica all-reduce, whether it runs |
| torch.distributed.tensor._redistribute._gen_transform_infos, torch._C._clear_DTensor_sharding_propagator_cache | DTensor's cached plans, dropped with a pooled rank's groups |

Where one moved inside the range, MOVED says how each release reaches it. The test suite runs on
2.13.0 and 2.14.1 (`bash scripts/test.sh --torch 2.14.1`); 2.11.0 ran the plug-in's tests once by
hand, and 2.12's FSDP2 source was read against this table.
"""
from __future__ import annotations

import inspect

import torch

SUPPORTED = ((2, 11), (2, 14))   # the first and the last torch release (major, minor) checked, both included

# (first, last release, the attribute's name there; None: that release has no such thing)
MOVED = {
    "FSDPState._fsdp_param_groups": (((2, 11), (2, 11), "_fsdp_param_group"),   # one group, or None
                                     ((2, 12), (2, 14), "_fsdp_param_groups")),  # a list (several only with
                                                                                 # a mesh per parameter)
    # before set_reduce_scatter_unused_params FSDP2 reduces only the parameters that got a gradient
    "FSDPParamGroup.reduce_scatter_unused_params": (((2, 11), (2, 12), None),
                                                    ((2, 13), (2, 14), "reduce_scatter_unused_params")),
}

ATTRIBUTES = (
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "Tensor._post_accumulate_grad_hooks",
    "torch.distributed.distributed_c10d._get_default_store",
    "FSDPModule._get_fsdp_state",
    "FSDPModule._set_unshard_async_op",
    "FSDPState._fsdp_param_groups",
    "FSDPState._fsdp_param_group",
    "FSDPState._states_to_forward_prefetch",
    "FSDPParamGroup.fsdp_params",
    "FSDPParamGroup.post_forward_mesh_info",
    "FSDPParamGroup.mesh_info",
    "FSDPParamGroup._all_reduce_hook",
    "FSDPParamGroup.gradient_divide_factor",
    "FSDPParamGroup.reduce_scatter_unused_params",
    "FSDPParamGroup.reshard_after_backward",
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


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version: "2.14.1+cu130" -> (2, 14)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _text(r: tuple[int, int]) -> str:
    return f"{r[0]}.{r[1]}"


CHECKED = f"torch {_text(SUPPORTED[0])}-{_text(SUPPORTED[1])}"   # said in every refusal


def unsupported(version: str) -> str | None:
    """One line when torch `version` lies outside SUPPORTED (None inside it)."""
    if SUPPORTED[0] <= release(version) <= SUPPORTED[1]:
        return None
    return (f"torch {version} is outside {CHECKED}, the releases whose private attributes "
            f"common/torch_private.py was checked against (pyproject.toml)")


def reached(attribute: str, version: str) -> str | None:
    """How torch `version` reaches a moved attribute (MOVED): its name there, or None where it is
    absent. Outside the range, the newest release's way (what reads it refuses such a torch first)."""
    rows = MOVED[attribute]
    return next((name for first, last, name in rows if first <= release(version) <= last), rows[-1][2])


def _required(owner, name: str, label: str):
    """A private attribute looked up once, at import: a torch without it fails here, in one line."""
    if not hasattr(owner, name):
        raise ImportError(f"torch {torch.__version__} has no {label}, which common/torch_private.py reads "
                          f"(checked against {CHECKED}): install a torch in pyproject.toml's range")
    return getattr(owner, name)


_graph_task_id = _required(torch._C, "_current_graph_task_id", "torch._C._current_graph_task_id")
_queue_callback = _required(_required(torch.autograd.Variable, "_execution_engine",
                                      "torch.autograd.Variable._execution_engine"),
                            "queue_callback", "torch.autograd.Variable._execution_engine.queue_callback")
_top_saved_hooks = _required(torch._C._autograd, "_top_saved_tensors_default_hooks",
                             "torch._C._autograd._top_saved_tensors_default_hooks")
_required(torch.Tensor, "_post_accumulate_grad_hooks", "Tensor._post_accumulate_grad_hooks")
_default_store = _required(torch.distributed.distributed_c10d, "_get_default_store",
                           "torch.distributed.distributed_c10d._get_default_store")
_PARAM_GROUPS = reached("FSDPState._fsdp_param_groups", torch.__version__)
_REDUCE_UNUSED = reached("FSDPParamGroup.reduce_scatter_unused_params", torch.__version__)


# -- autograd ------------------------------------------------------------------------------------
def in_backward() -> bool:
    """Whether this thread is running a backward pass now."""
    return _graph_task_id() != -1


def queue_backward_callback(fn) -> None:
    """Run `fn` when the running backward pass ends (call only inside one)."""
    _queue_callback(fn)


def top_saved_tensors_hooks():
    """The innermost (pack, unpack) saved-tensor hooks, or None."""
    return _top_saved_hooks(False)


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    return bool(tensor._post_accumulate_grad_hooks)   # None until one is registered


# -- c10d --------------------------------------------------------------------------------------
def default_store():
    """The key-value store every rank of the default process group reaches (init_process_group's,
    under torchrun its agent's, per restart): a check that each rank arrived needs no collective."""
    return _default_store()


# -- FSDP2 (torch.distributed.fsdp.fully_shard) --------------------------------------------------
_FSDP_NEEDS = {   # where each FSDP2 attribute above lives on a live model: (owner, attribute)
    "module": ("_get_fsdp_state", "_set_unshard_async_op"),
    "state": (_PARAM_GROUPS, "_states_to_forward_prefetch"),
    "group": ("fsdp_params", "post_forward_mesh_info", "mesh_info", "_all_reduce_hook", "gradient_divide_factor",
              "reshard_after_backward", *([_REDUCE_UNUSED] if _REDUCE_UNUSED else [])),
    "param": ("sharded_param", "offload_to_cpu", "_orig_size", "post_forward_mesh_info",
              "_init_sharded_post_forward_param_metadata"),
    "mesh info": ("mesh", "shard_mesh_size"),
}
_OWNER = {"module": "FSDPModule", "state": "FSDPState", "group": "FSDPParamGroup", "param": "FSDPParam",
          "mesh info": "FSDPMeshInfo"}
_DECLARED = ("_unsharded_param",)   # FSDPParam's, set at the first gather: looked up in the class's annotations


def _lacking(owner: str, obj) -> list[str]:
    return [f"{_OWNER[owner]}.{n}" for n in _FSDP_NEEDS[owner] if not hasattr(obj, n)]


def fsdp_internals_problem(model) -> str | None:
    """Why the plug-in cannot run on this torch, in one line (None: it can): a release outside
    SUPPORTED, or FSDP2 attributes listed above that it lacks, looked up on `model` (wrapped by
    fully_shard, before anything is changed), so the plug-in refuses rather than failing halfway
    through an install or quietly doing what another release did."""
    from torch.distributed.fsdp import FSDPModule
    line = unsupported(str(torch.__version__))
    if line:
        return line
    lacking = _lacking("module", FSDPModule) or _lacking("state", model._get_fsdp_state())
    if not lacking:   # the first unit that manages parameters gives a group, a parameter and a mesh
        group = next((g for m in model.modules() if isinstance(m, FSDPModule) and (g := param_group(m)) is not None),
                     None)
        lacking = [] if group is None else _lacking("group", group)
        if group is not None and not lacking and group.fsdp_params:
            param = group.fsdp_params[0]
            declared = {name for cls in type(param).__mro__ for name in inspect.get_annotations(cls)}
            lacking = (_lacking("param", param) + _lacking("mesh info", group.mesh_info)
                       + [f"FSDPParam.{n}" for n in _DECLARED if n not in declared])
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info  # noqa: F401
    except ImportError:
        lacking.append("torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info")
    if not lacking:
        return None
    return (f"torch {torch.__version__} lacks {', '.join(lacking)}, FSDP2 internals that common/torch_private.py "
            f"reads (checked against {CHECKED})")


def fsdp_state(module):
    """The FSDP state `fully_shard` attached (modules grouped by one `fully_shard([a, b])` share it)."""
    return module._get_fsdp_state()


def param_group(module):
    """The unit's FSDP parameter group, or None for a module that manages no parameters."""
    state = fsdp_state(module)
    if _PARAM_GROUPS == "_fsdp_param_group":   # torch 2.11: one group, or None
        return state._fsdp_param_group
    groups = state._fsdp_param_groups
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
    """The gathered parameter forward computes with (None before the first gather, FSDP2's own
    test: the name is checked on FSDPParam's annotations when the plug-in is applied); it persists
    across steps, so a hook registered on it stays."""
    return fsdp_param._unsharded_param if hasattr(fsdp_param, "_unsharded_param") else None


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
    if _REDUCE_UNUSED is None:   # torch 2.11-2.12: no such setting
        return False
    return bool(group.reduce_scatter_unused_params)


def reshards_after_backward(group) -> bool:
    """What `set_reshard_after_backward` last set (True unless the user set False)."""
    return bool(group.reshard_after_backward)


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
    """What `fully_shard(reshard_after_forward=ranks)` sets on a group (FSDP2's
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


def hsdp_internals_problem(group) -> str | None:
    """Why the plug-in cannot compress HSDP's all-reduce on this torch, in one line (None: it can):
    the HSDP attributes above that `group` (a unit's FSDPParamGroup on a 2-D mesh) lacks."""
    owners = {"group": group, "mesh info": group.mesh_info if hasattr(group, "mesh_info") else None}
    names = {"group": "FSDPParamGroup", "mesh info": "HSDPMeshInfo"}
    lacking = [f"{names[o]}.{n}" for o, attrs in _HSDP_NEEDS.items() for n in attrs
               if owners[o] is None or not hasattr(owners[o], n)]
    if not lacking:
        return None
    return (f"torch {torch.__version__} lacks {', '.join(lacking)}, FSDP2's HSDP internals that "
            f"common/torch_private.py reads (checked against {CHECKED})")


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
    process groups: in a process whose groups were destroyed (scenarios/harness/spawn.py's pooled ranks) a
    new equal mesh would find a cached spec naming a destroyed group."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    _gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()   # DTensor's dispatch caches propagations in C++
