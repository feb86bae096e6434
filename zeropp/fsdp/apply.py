"""ZeRO++ for FSDP2: our qwZ, hpZ, qgZ and LoCo installed on a model already wrapped by
torch's `fully_shard` (torch.distributed.fsdp), one call after it:

    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=ranks_per_node)   # hpZ, FSDP2's own
    fully_shard(model, mp_policy=mp)
    zeropp = apply_zeropp(model, ranks_per_node, quantized_weights=True, hpz=True,
                          quantized_gradients=True, loco=True)
    zeropp.attach(optimizer)        # LoCo's error is committed when a step is applied

What it does, through FSDP2's public hooks (torch 2.13, `FSDPModule`), and what it leaves to
FSDP2 (everything it promises: hooks, frozen and unused parameters, evaluation, checkpoints):
- `set_custom_all_gather`: the weight all-gather (zeropp/fsdp/comms.py). Across nodes qwZ's
  INT8 blocks; inside a node (hpZ's backward gather), in evaluation (`eval()`) and for packed
  bytes exact. Bytes are booked by pass (forward or backward).
- `set_custom_reduce_scatter`, one per FSDP unit: qgZ's hierarchical INT4 reduction, with LoCo's
  error kept per set of parameters the unit reduces (a branch's error never lands on another's);
  off, FSDP2's own reduce-scatter, counted (so hpZ alone gives FSDP2's bits).
- hpZ is FSDP2's `reshard_after_forward=<ranks per node>`: pass it to `fully_shard`, or the
  plug-in sets it (common/torch_private.py) and sets it again when `set_reshard_after_forward(True)`
  is called later, only for parameters sharded on dim 0 (FSDP2 keeps no other). After a
  forward of the model without grad (evaluation) a unit holding the node's copy reshards to the
  world, as plain FSDP2's units do, so a step before the next forward is seen; a unit run
  without grad inside a forward with grad (reentrant checkpointing) keeps it for backward's
  recomputation (zeropp/fsdp/forward.py).
- Overlap on CPU, where FSDP2 has no streams: gathers are issued asynchronously with forward
  prefetch from the order the units ran (where the user set none; zeropp/fsdp/forward.py); a
  reduction returns once issued and completes while
  backward goes on only when nothing can read it before backward ends (no all-reduce hook,
  post-accumulate-grad hook, CPU offload, divide factor, dtype conversion or accumulation;
  `overlap_label()` says which units overlap). On CUDA FSDP2 overlaps through its streams and
  orders the optimizer after its `_last_post_reduce_events`; the plug-in completes every
  reduction before `backward()` returns, which those events then find done.

On HSDP (a (replicate, shard) mesh, shard groups inside a node) the weights never leave the node:
qgZ and LoCo compress FSDP2's gradient all-reduce across replicas instead (zeropp/fsdp/replicate.py).

The techniques are the engine's own parts, built from the same registry (zeropp/techniques)
and charging the same byte accounting (parallel/comm.py): `stats` says what crossed nodes.
It is collective: every rank calls it, or those that did say which did not (zeropp/fsdp/arrival.py).
"""
from __future__ import annotations

import weakref

import torch

from common.errors import ConfigError
from common.torch_private import (fsdp_internals_problem, group_params, has_forward_prefetch, param_group,
                                  post_forward_ranks, set_post_forward_ranks, set_unshard_async, sharded_param)
from parallel.comm import Communicator
from parallel.topology import Topology, TopologyError
from zeropp.config import ZeroConfig
from zeropp.techniques import hpz as hpz_technique
from zeropp.techniques.loco import LocoConfig
from zeropp.fsdp import replicate
from zeropp.fsdp.arrival import all_ranks_arrive
from zeropp.fsdp.comms import NodeAwareGather, UnitReduce, shard_dim
from zeropp.fsdp.forward import ForwardWatch
from zeropp.fsdp.plugin import PluginError, ZeroPP

__all__ = ["apply_zeropp", "PluginError", "ZeroPP", "NodeAwareGather", "UnitReduce"]


def apply_zeropp(model: torch.nn.Module, topology: Topology | int | None = None, *, quantized_weights: bool = True,
                 hpz: bool = True, quantized_gradients: bool = True, loco: bool = False, hadamard: bool = False,
                 weight_block_size: int = 256, gradient_block_size: int = 128, gradient_bits: int = 4,
                 loco_beta: float | None = None,
                 loco_reset_every: int = 1024, overlap: bool = True, max_inflight_reductions: int = 2,
                 exact_replica_gather: bool = False, communicator: Communicator | None = None,
                 arrival_timeout_s: float = 300.0) -> ZeroPP:
    """Install ZeRO++ on `model`, the root a `fully_shard` returned (collective: every rank
    calls it). `topology`: which ranks share a node: a `parallel.topology.Topology`, the ranks
    per node, or None for torchrun's LOCAL_WORLD_SIZE; `communicator`: a `parallel.comm.Communicator`
    to count the bytes in (it brings its topology); `arrival_timeout_s`: how long the ranks that
    called wait for the others before they say which did not. On HSDP (a (replicate, shard) mesh,
    shard groups inside a node) qgZ and LoCo compress the gradient all-reduce across replicas, whose
    reduced rows are gathered quantized, or exactly with `exact_replica_gather`
    (zeropp/fsdp/replicate.py). Returns the `ZeroPP` that holds what it installed (its `stats`,
    its checkpoint state)."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        raise PluginError(f"apply_zeropp needs the module fully_shard returned, got a {type(model).__name__}: "
                          f"call fully_shard(model) first")
    if getattr(model, "_zeropp", None) is not None:
        raise PluginError("apply_zeropp was already applied to this model: call it once")
    problem = fsdp_internals_problem(model)
    if problem:
        raise PluginError(f"apply_zeropp: {problem}: install a torch in that range or use --sharding zero")
    for name, on in (("loco", loco), ("hadamard", hadamard)):
        if on and not quantized_gradients:
            raise PluginError(f"apply_zeropp: {name}=True works on qgZ's INT4 gradients: set quantized_gradients=True")
    all_ranks_arrive("apply_zeropp", arrival_timeout_s)   # before the first collective (a process group)
    topology = communicator.topology if communicator is not None else _topology(topology)
    replicas = _check_world(model, topology)
    if replicas > 1:   # HSDP: the weights never leave the node
        replicate.weights_note(quantized_weights, hpz)
        quantized_weights = hpz = False
    zero = ZeroConfig(stage=3, zero_quantized_weights=quantized_weights, zero_quantized_gradients=quantized_gradients,
                      zeropp_loco_param=LocoConfig(loco_beta, loco_reset_every) if loco else None,
                      zero_hadamard_gradients=hadamard, zero_quantized_weights_block_size=weight_block_size,
                      zero_quantized_gradients_block_size=gradient_block_size,
                      zero_quantized_gradients_bits=gradient_bits)
    try:
        zero.validate("apply_zeropp")
    except ConfigError as e:   # the engine's key names, said as this call's arguments
        raise PluginError(_argument_names(str(e))) from None
    units = _units(model)
    if replicas > 1:
        replicate.check_internals(units)
    # hpZ over the node's ranks, none where the node is the whole world (the primary partition itself)
    ranks = hpz_technique.group_size(3, topology.ranks_per_node if hpz else 1, topology.world_size) or None
    hpz_meshes = _check_reshard(model, units, ranks, topology.world_size)
    device = next(model.parameters()).device
    plugin = ZeroPP(topology, zero, device, overlap, max_inflight_reductions, communicator)
    plugin.shards = topology.world_size // replicas
    gather, totals = NodeAwareGather(plugin, plugin.gather), {}
    for key, (modules, group) in enumerate(units):
        reduce = UnitReduce(plugin, key, group, plugin.shards)
        modules[0].set_custom_all_gather(gather)
        modules[0].set_custom_reduce_scatter(reduce)
        plugin.units.append(reduce)
        if reduce.trained_numel:
            totals[key] = reduce.trained_numel
        for module in modules:
            module.register_forward_hook(reduce.watch)
            if ranks:
                _keep_hpz_when_toggled(module, ranks, hpz_meshes)
    prefetch = overlap and device.type == "cpu"   # on CUDA FSDP2 overlaps through its streams
    if prefetch:
        set_unshard_async(model, True)
    if replicas > 1:
        replicate.install(plugin, units, exact_replica_gather, totals, device)
    elif plugin.reduction is not None:
        plugin.reduction.expect(totals, topology, device)
    # prefetch from the order the units run in (a unit the user gave its own prefetch keeps it);
    # hpZ's node copies after a forward without grad
    user_prefetch = {key for key, (modules, _) in enumerate(units) if has_forward_prefetch(modules[0])}
    ForwardWatch(model, units, prefetch, user_prefetch, topology.world_size if ranks else None)
    plugin.root = weakref.ref(model)   # evaluation (eval()) gathers exactly, as the engine's
    plugin.hpz = ranks is not None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module._zeropp = plugin
    return plugin


def _units(model) -> list[tuple[list, object]]:
    """The FSDP units under `model`, the root first: the modules one `fully_shard` call wrapped
    (several for `fully_shard([a, b])`) and their parameter group."""
    from torch.distributed.fsdp import FSDPModule
    units: dict[int, tuple[list, object]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        if getattr(module, "_zeropp", None) is not None:
            raise PluginError(f"apply_zeropp was already applied to {name or 'this model'}: call it once, on the root")
        group = param_group(module)
        if group is not None:
            units.setdefault(id(group), ([], group))[0].append(module)
    return list(units.values())


def _check_reshard(model, units, ranks: int | None, world: int) -> dict:
    """hpZ is FSDP2's reshard_after_forward=<ranks per node>: keep it where the user passed it to
    fully_shard, set it where FSDP2 reshards to the world (the root keeps FSDP2's choice not to),
    every unit on one node mesh. Returns the meshes made, for the eval toggle to set again."""
    made: dict = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for modules, group in units:
        now = post_forward_ranks(group)
        if ranks is not None and now is not None and now not in (ranks, world):
            raise PluginError(f"apply_zeropp(hpz=True) keeps the weights over a node's {ranks} ranks after forward; "
                              f"{type(modules[0]).__name__} was wrapped with fully_shard(reshard_after_forward={now}): "
                              f"pass {ranks} or True")
        if ranks is not None and now is not None:
            _check_shard_dim(group, names, f"apply_zeropp(hpz=True) keeps the weights over a node's {ranks} ranks",
                             "or pass hpz=False")
        elif now is not None and now < world:
            _check_shard_dim(group, names, f"fully_shard(reshard_after_forward={now}) keeps the weights over "
                             f"{now} ranks", "or reshard_after_forward=True")
    if ranks is None:
        return made
    for modules, group in units:
        if post_forward_ranks(group) in (ranks, world):
            set_post_forward_ranks(group, ranks, made)
    return made


def _check_shard_dim(group, names: dict, keeps: str, otherwise: str):
    """FSDP2 keeps a copy over fewer ranks than its mesh after forward only of parameters sharded
    on dim 0: of another its copy-out fails (foreach_all_gather_copy_out)."""
    for fsdp_param in group_params(group):
        param = sharded_param(fsdp_param)
        if (dim := shard_dim(param)) != 0:
            raise PluginError(f"{keeps} after forward, which FSDP2 does only for parameters sharded on dim 0; "
                              f"{names.get(id(param), 'a parameter')} is sharded on dim {dim} (shard_placement_fn): "
                              f"shard it on dim 0 {otherwise}")


def _keep_hpz_when_toggled(module, ranks: int, made: dict):
    """FSDP2's `set_reshard_after_forward(True)` (its eval toggle) sets the world's mesh: set the
    node's again, as fully_shard(reshard_after_forward=ranks) had, the same mesh as before."""
    from torch.distributed.fsdp import FSDPModule
    original = module.set_reshard_after_forward

    def set_reshard_after_forward(reshard_after_forward: bool, recurse: bool = True) -> None:
        original(reshard_after_forward, recurse)
        if reshard_after_forward is True:
            for m in (module.modules() if recurse else [module]):
                if isinstance(m, FSDPModule) and (group := param_group(m)) is not None:
                    set_post_forward_ranks(group, ranks, made)
    module.set_reshard_after_forward = set_reshard_after_forward


_ARGUMENTS = {"apply_zeropp.zero_quantized_weights_block_size": "apply_zeropp: weight_block_size",
              "apply_zeropp.zero_quantized_gradients_block_size": "apply_zeropp: gradient_block_size",
              "apply_zeropp.zero_quantized_gradients_bits": "apply_zeropp: gradient_bits",
              "(--zero-quantized-gradients-bits)": "(gradient_bits)",
              "(--zero-quantized-gradients)": "(quantized_gradients=True)",
              "(--zero-loco)": "(loco=True)",
              "apply_zeropp.zeropp_loco_param.err_beta": "apply_zeropp: loco_beta",
              "apply_zeropp.zeropp_loco_param.reset_T": "apply_zeropp: loco_reset_every",
              "--ranks-per-node": "ranks per node (topology)"}


def _argument_names(message: str) -> str:
    for key, argument in _ARGUMENTS.items():
        message = message.replace(key, argument)
    return message


def _topology(topology) -> Topology:
    if isinstance(topology, Topology):
        return topology
    from parallel.topology import topology_from_env
    try:
        return topology_from_env(topology)
    except TopologyError as e:
        raise PluginError(_argument_names(f"apply_zeropp: {e}")) from None


def _check_world(model, topology: Topology) -> int:
    """The plug-in shards over the world, ranks in order (a node is consecutive ranks), or over the
    ranks of a node on HSDP: the number of replicas (1: none)."""
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    return 1 if mesh is None else replicate.replicas_of(mesh, topology)
