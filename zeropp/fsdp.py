"""ZeRO++ for FSDP2: our qwZ, hpZ, qgZ and LoCo installed on a model already wrapped by
torch's `fully_shard` (torch.distributed.fsdp), one call after it:

    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    zeropp = apply_zeropp(model, ranks_per_node, quantized_weights=True, hpz=True,
                          quantized_gradients=True, loco=True)
    zeropp.attach(optimizer)        # LoCo's error is committed when a step is applied

What it does, through FSDP2's public hooks (torch 2.13, `FSDPModule`):
- `set_custom_all_gather`: the weight all-gather. Across nodes qwZ's INT8 blocks
  (zeropp/techniques/qwz.py); inside a node (hpZ's backward gather) exact.
- `set_custom_reduce_scatter`, one per FSDP module (its error feedback is kept per module):
  qgZ's hierarchical INT4 reduction (zeropp/techniques/qgz.py), with LoCo's error feedback
  (zeropp/techniques/loco.py) and optionally Hadamard smoothing; off, FSDP2's own
  reduce-scatter, counted (so hpZ alone gives FSDP2's bits; on gloo that reduce-scatter runs as
  an all-reduce, twice a ring's bytes, where the engine's exact reduction sends an all-to-all).
- hpZ: after forward each module keeps its weights sharded over the ranks of its node
  (FSDP2's `reshard_after_forward=<ranks per node>`), so backward gathers inside the node.
  torch 2.13's `set_reshard_after_forward` takes only a bool, so `_reshard_within_node` sets
  the post-forward mesh that `fully_shard(reshard_after_forward=<int>)` would have set.
- Overlap: gathers are issued asynchronously (FSDP2's `unshard_async_op`, forward prefetch of
  the next module); a reduction returns once issued and completes while backward goes on, at
  most `max_inflight_reductions` in flight, all done before backward returns. FSDP2 overlaps
  through CUDA streams; on CPU it has none, and this is what overlaps there.

The techniques are the engine's own parts, built from the same registry (zeropp/techniques)
and charging the same byte accounting (parallel/comm.py): `stats` says what crossed nodes.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from common.errors import ConfigError
from parallel.comm import Communicator
from parallel.topology import Topology, TopologyError
from zeropp import techniques
from zeropp.build import fill_slots
from zeropp.collectives.exact import ShardGather
from zeropp.collectives.partition import Partition, as_dcp
from zeropp.config import LocoConfig, ZeroConfig

PREFETCH = 2   # units whose forward gathers a unit issues ahead (CPU: FSDP2 has no streams there)


class PluginError(ConfigError):
    """The plug-in cannot be applied as asked (one line naming the culprit and the fix)."""


class _Issued(dist.Work):
    """Our collective's handle as FSDP2 waits on it: FSDP2 waits only on a c10d `Work`."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        return True


class NodeAwareGather:
    """FSDP2's `AllGather` comm: qwZ (or exact) over a group that spans nodes, exact over one
    inside a node (hpZ's post-forward group)."""

    def __init__(self, plugin, across):
        self.plugin, self.across, self.exact = plugin, across, ShardGather(plugin.comm)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.plugin.progress()
        n = output_tensor.numel() // input_tensor.numel()
        inside = self.plugin.inside_node(group)
        gather = self.exact if inside or self.plugin.exact_gathers else self.across
        phase = "backward_gather" if inside else "forward_gather"
        work = gather.start(input_tensor, Partition(group, n, -1), phase, async_op=True,
                            out=output_tensor.view(n, input_tensor.numel()))
        if async_op:
            return _Issued(work)
        work.wait()
        return None


class ModuleReduce:
    """FSDP2's `ReduceScatter` comm for one FSDP module: the reduction's bucket `key` is the
    module's, so LoCo keeps one error per module."""

    def __init__(self, plugin, key: int, params: list[torch.nn.Parameter]):
        self.plugin, self.key, self.params = plugin, key, params

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=ReduceOp.SUM, async_op: bool = False):
        plugin = self.plugin
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise PluginError(f"apply_zeropp's reduction sums or averages; FSDP2 asked for {op} "
                              f"(set_gradient_divide_factor): leave the divide factor unset")
        world = plugin.partition.size
        if input_tensor.numel() != world * output_tensor.numel():
            raise PluginError(f"apply_zeropp: FSDP2 reduced over {input_tensor.numel() // output_tensor.numel()} "
                              f"ranks, not the world's {world}: apply it to a model sharded over all ranks")
        plugin.progress()
        average = op == ReduceOp.AVG
        if plugin.reduction is None:   # FSDP2's own reduce-scatter, counted
            work = plugin.comm.reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True,
                                              phase="grad_reduce")
            divisor = 1
        else:
            work = plugin.reduction.start(input_tensor.view(world, output_tensor.numel()), output_tensor,
                                          plugin.partition, "grad_reduce", async_op=True, key=self.key)
            divisor = world if average else 1
        # FSDP2 only makes views of the result before backward ends when it neither converts,
        # rescales nor accumulates it: then the reduction may complete later.
        later = (average and plugin.overlap and output_tensor.dtype == self.params[0].dtype
                 and all(p.grad is None for p in self.params))
        plugin.issued(work, output_tensor, divisor, later)
        return None


class ZeroPP:
    """What `apply_zeropp` installed: the communicator (its `stats`), the reduction and its
    carried state, the reductions in flight."""

    def __init__(self, topology: Topology, zero: ZeroConfig, device, overlap: bool, max_inflight: int,
                 comm: Communicator | None = None):
        self.topology, self.zero, self.overlap, self.max_inflight = topology, zero, overlap, max_inflight
        self.comm = comm or Communicator(topology)
        self.exact_gathers = False      # True: every gather exact (evaluation, as the engine's)
        self.partition = Partition(topology.gradient_group, topology.world_size, topology.rank)
        ctx = techniques.BuildContext(zero, self.comm, None, None, device, weights=[], flat=None)
        fill_slots(ctx)
        self.gather = ctx.weight_gather or ShardGather(self.comm)
        self.reduction = ctx.gradient_reduction   # None: FSDP2's reduce-scatter (counted)
        self.carried = self.reduction.carried_parts() if self.reduction else {}
        self.inflight: list = []        # (work, output, divisor)
        self._callback_queued = False
        self._inside: dict = {}

    @property
    def stats(self):
        return self.comm.stats

    def inside_node(self, group) -> bool:
        key = id(group)
        if key not in self._inside:
            nodes = {self.topology.node_of(r) for r in self.comm.group_ranks(group)}
            self._inside[key] = len(nodes) == 1
        return self._inside[key]

    # -- reductions in flight ----------------------------------------------------------------
    def issued(self, work, output: torch.Tensor, divisor: int, later: bool):
        self.inflight.append((work, output, divisor))
        if not later:
            self.finish()
            return
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.pop(0))
        if not self._callback_queued and torch._C._current_graph_task_id() != -1:
            # inside backward: complete the rest before backward returns
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True

    def progress(self):
        """Let the reductions in flight go on (qgZ starts its second hop), in issue order and
        stopping at the first still busy: every rank issues each group's collectives in one order."""
        for work, _, _ in self.inflight:
            if not work.progress():
                break

    def finish(self):
        """Complete every reduction in flight (FSDP2's gradients are views of their results)."""
        self._callback_queued = False
        while self.inflight:
            self._complete(self.inflight.pop(0))

    @staticmethod
    def _complete(entry):
        work, output, divisor = entry
        work.wait()
        if divisor != 1:
            output.div_(divisor)

    # -- carried state -----------------------------------------------------------------------
    def end_step(self, applied: bool = True) -> list[str]:
        """The optimizer step ended (applied, or skipped by a loss scaler): commit or drop what
        the carried state (LoCo's error) took from this step's reductions."""
        self.finish()
        return [note for part in self.carried.values() if (note := part.end_step(applied))]

    def attach(self, optimizer: torch.optim.Optimizer):
        """Commit after every `optimizer.step()` (a step a scaler skips never calls it: call
        `end_step(applied=False)` then)."""
        optimizer.register_step_pre_hook(lambda *_: self.finish())
        optimizer.register_step_post_hook(lambda *_: self.end_step(True))
        return self

    def state_dict(self) -> dict:
        """For DCP, beside the model's and optimizer's: the carried errors as DTensors sharded
        over the ranks, the layout and counts as JSON."""
        out = {}
        for name, part in self.carried.items():
            for key, flat in part.checkpoint_state(self.topology.world_size).items():
                out[key] = flat
            scalars = part.scalar_state()
            out[f"{name}.scalars"] = json.dumps({k: scalars[k] for k in scalars})
        tensors = {k: v for k, v in out.items() if not isinstance(v, str)}
        return {**{k: v for k, v in out.items() if isinstance(v, str)}, **as_dcp(tensors, _device(tensors))}

    def load(self, checkpoint_id: str) -> list[str]:
        """Restore the state `state_dict` saved under "zeropp" in the DCP checkpoint
        `checkpoint_id`; on another layout the state starts from zero and each returned line
        says what was reset."""
        import torch.distributed.checkpoint as dcp
        self.finish()
        notes = []
        for name, part in self.carried.items():
            scalars = {"zeropp": {f"{name}.scalars": ""}}
            stored = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            saved = None
            if f"zeropp.{name}.scalars" in stored:
                dcp.load(scalars, checkpoint_id=checkpoint_id)
                saved = json.loads(scalars["zeropp"][f"{name}.scalars"])
            if part.carried(saved):
                flats = part.checkpoint_state(self.topology.world_size)
                dcp.load({"zeropp": as_dcp(flats, _device(flats))}, checkpoint_id=checkpoint_id)
            if note := part.load_scalar_state(saved):
                notes.append(note)
        return notes


def _device(flats: dict) -> torch.device:
    return next((v.local.device for v in flats.values()), torch.device("cpu"))


def apply_zeropp(model: torch.nn.Module, topology: Topology | int | None = None, *, quantized_weights: bool = True,
                 hpz: bool = True, quantized_gradients: bool = True, loco: bool = False, hadamard: bool = False,
                 weight_block_size: int = 256, gradient_block_size: int = 128, loco_beta: float = 0.8,
                 loco_reset_every: int = 1024, overlap: bool = True, max_inflight_reductions: int = 2,
                 communicator: Communicator | None = None) -> ZeroPP:
    """Install ZeRO++ on `model`, the root a `fully_shard` returned (collective: every rank
    calls it). `topology`: which ranks share a node: a `parallel.topology.Topology`, the ranks
    per node, or None for torchrun's LOCAL_WORLD_SIZE; `communicator`: a `parallel.comm.Communicator`
    to count the bytes in (it brings its topology). Returns the `ZeroPP` that holds what it
    installed (its `stats`, its checkpoint state)."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        raise PluginError(f"apply_zeropp needs the module fully_shard returned, got a {type(model).__name__}: "
                          f"call fully_shard(model) first")
    if getattr(model, "_zeropp", None) is not None:
        raise PluginError("apply_zeropp was already applied to this model: call it once")
    for name, on in (("loco", loco), ("hadamard", hadamard)):
        if on and not quantized_gradients:
            raise PluginError(f"apply_zeropp: {name}=True works on qgZ's INT4 gradients: set quantized_gradients=True")
    topology = communicator.topology if communicator is not None else _topology(topology)
    zero = ZeroConfig(stage=3, zero_quantized_weights=quantized_weights, zero_quantized_gradients=quantized_gradients,
                      zeropp_loco_param=LocoConfig(loco_beta, loco_reset_every) if loco else None,
                      zero_hadamard_gradients=hadamard, zero_quantized_weights_block_size=weight_block_size,
                      zero_quantized_gradients_block_size=gradient_block_size)
    try:
        zero.validate("apply_zeropp")
    except ConfigError as e:   # the engine's key names, said as this call's arguments
        raise PluginError(_argument_names(str(e))) from None
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    device = next(model.parameters()).device
    plugin = ZeroPP(topology, zero, device, overlap, max_inflight_reductions, communicator)
    totals = {}
    for key, module in enumerate(modules):
        params = _own_params(module)
        _check_world(params, topology)
        module.set_custom_all_gather(NodeAwareGather(plugin, plugin.gather))
        module.set_custom_reduce_scatter(ModuleReduce(plugin, key, params))
        totals[key] = sum(_shard_numel(p, topology.world_size) for p in params)
    if overlap and device.type == "cpu":   # on CUDA FSDP2 overlaps through its streams
        model._set_unshard_async_op(True)
        # each unit (the root first) issues the gathers of the next PREFETCH units: on a slow link
        # the forward is link-bound, and one ahead leaves the link idle while the next is quantized
        order = [model] + [m for m in modules if m is not model]
        for i, here in enumerate(order[:-1]):
            here.set_modules_to_forward_prefetch(order[i + 1:i + 1 + PREFETCH])
    if plugin.reduction is not None:
        plugin.reduction.expect(totals, topology, device)
    if hpz and 1 < topology.ranks_per_node < topology.world_size:
        _reshard_within_node(modules, topology.ranks_per_node)
    model._zeropp = plugin
    return plugin


_ARGUMENTS = {"apply_zeropp.zero_quantized_weights_block_size": "apply_zeropp: weight_block_size",
              "apply_zeropp.zero_quantized_gradients_block_size": "apply_zeropp: gradient_block_size",
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


def _check_world(params, topology: Topology):
    mesh = params[0].device_mesh if params else None   # FSDP2's parameters are DTensors on its mesh
    if mesh is not None and (mesh.ndim != 1 or mesh.size() != topology.world_size):
        raise PluginError(f"apply_zeropp shards over all {topology.world_size} ranks; this model's FSDP mesh is "
                          f"{tuple(mesh.shape)}: pass fully_shard a 1-D mesh over the world (HSDP is not supported)")


def _own_params(module) -> list[torch.nn.Parameter]:
    """The parameters `fully_shard(module)` manages: its own, not those of FSDP modules inside it."""
    from torch.distributed.fsdp import FSDPModule
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def _shard_numel(param, world: int) -> int:
    """Elements of one rank's shard of `param` as FSDP2 reduces it: dim 0 padded to the world."""
    shape = param.shape
    rows = -(-shape[0] // world) if len(shape) else 1
    rest = 1
    for s in shape[1:]:
        rest *= s
    return rows * rest


def _reshard_within_node(modules, ranks_per_node: int):
    """What fully_shard(reshard_after_forward=ranks_per_node) sets, on modules that reshard
    after forward (the root keeps FSDP2's choice not to)."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info
    info = None
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if group.post_forward_mesh_info is None:
                continue
            if info is None:
                info = _get_post_forward_mesh_info(ranks_per_node, group.mesh_info)
            group.post_forward_mesh_info = info
            for p in group.fsdp_params:
                p.post_forward_mesh_info = info
                p._init_sharded_post_forward_param_metadata(torch.empty(p._orig_size, device="meta"))
