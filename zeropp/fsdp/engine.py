"""`--sharding fsdp2`: the same training loop on torch's FSDP2 (`fully_shard` per unit, then the
root) with ZeRO++ as the plug-in (zeropp/fsdp/apply.py), behind the engine's interface
(zeropp/stages/engine.py): loss scaling, accumulation, clipping, checkpoints.

- Units: each element of the model's `nn.ModuleList`s (GPT's blocks), then the root.
- Precision: FSDP2's `MixedPrecisionPolicy`, 16-bit compute over the fp32 sharded parameters
  (the masters), gradients reduced in fp32 or the JSON's `communication_data_type` (its
  `reduce_dtype`).
- Overlap: `zero_optimization.overlap_comm` (on unless false) is the plug-in's `overlap`: off,
  every collective completes before the call that issued it returns.
- Switches: the zero_optimization section's ZeRO++ keys, as the engine reads them; what FSDP2
  has no place for (bucket sizes, INT4 weight deltas, an hpZ group other than the node) is
  refused in one line.
- Checkpoints: the engine's format (`model.<name>`, `optim.<moment>.<name>`, flat, each rank a
  torch.chunk of the flattened tensor), so either engine loads the other's. FSDP2 shards rows:
  where a rank's rows are its flat chunk (rows divisible by the world) the checkpoint reads and
  fills FSDP2's storage in place; the other tensors move in uneven all-to-alls, a rank sending
  only what another keeps, several tensors per collective (one per tensor is latency-bound).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from common.errors import ConfigError
from zeropp.collectives.partition import FlatState
from zeropp.collectives.protocols import uncarried_state
from zeropp.config import ZeroConfig
from zeropp.fsdp.apply import apply_zeropp
from zeropp.stages.engine import Engine, communication_dtype, compute_dtype, split_decay
from zeropp.stages.init import ParamInit, full_value

MOVE_BUCKET = 1 << 22   # elements of chunks moved per collective by a checkpoint conversion (or one larger tensor)

# zero_optimization keys FSDP2 has no place for: they must keep their defaults
_NO_PLACE = {"reduce_bucket_size": "FSDP2 reduces one unit (block) at a time",
             "allgather_bucket_size": "FSDP2 gathers one unit (block) at a time",
             "stage3_prefetch_bucket_size": "FSDP2 prefetches the next unit",
             "stage3_param_persistence_threshold": "FSDP2 shards every parameter",
             "stage3_max_live_parameters": "FSDP2 holds one unit (and the next) at a time",
             "stage3_max_reuse_distance": "FSDP2 reshards every unit after its forward",
             "zero_quantized_weight_deltas": "the INT4 weight deltas need the engine's weight store"}


def check_fsdp2_config(zero: ZeroConfig, ranks_per_node: int, world_size: int):
    """One line for what `--sharding fsdp2` cannot do with this config (before any work)."""
    if zero.stage != 3:
        raise ConfigError(f"--sharding fsdp2 shards weights, gradients and optimizer state (ZeRO stage 3); got "
                          f"--zero-stage {zero.stage}: pass --zero-stage 3")
    default = ZeroConfig()
    for key, why in _NO_PLACE.items():
        if getattr(zero, key) not in (getattr(default, key), None):
            raise ConfigError(f"zero_optimization.{key} has no effect under --sharding fsdp2 ({why}): "
                              f"remove it or use --sharding zero")
    h = zero.zero_hpz_partition_size
    if h > 1 and h != ranks_per_node and h != world_size:
        raise ConfigError(f"--zero-hpz-size {h} under --sharding fsdp2: hpZ keeps the copy over a node's "
                          f"{ranks_per_node} ranks; pass --zero-hpz-size {ranks_per_node}")


def check_replicas(replicas: int, ranks_per_node: int, world_size: int, name: str = "replicas"):
    """HSDP's layout: `replicas` copies of the model, each sharded over world / replicas consecutive
    ranks inside a node (one line otherwise, before any work)."""
    if replicas < 1 or world_size % replicas:
        raise ConfigError(f"{name} {replicas} must divide the world size {world_size}")
    shards = world_size // replicas
    if replicas > 1 and (shards == 1 or ranks_per_node % shards):
        nodes = world_size // ranks_per_node
        raise ConfigError(f"{name} {replicas} shards the model over groups of {shards} rank(s), which "
                          f"{'only replicate' if shards == 1 else f'span nodes of {ranks_per_node} ranks'}: HSDP "
                          f"shards inside a node; pass {nodes} (one copy per node)"
                          + (" or a multiple of it" if ranks_per_node > 2 else ""))


def plugin_switches(zero: ZeroConfig) -> dict:
    loco = zero.zeropp_loco_param
    return dict(quantized_weights=bool(zero.zero_quantized_weights), hpz=zero.zero_hpz_partition_size > 1,
                quantized_gradients=bool(zero.zero_quantized_gradients), loco=loco is not None,
                hadamard=bool(zero.zero_hadamard_gradients),
                weight_block_size=zero.zero_quantized_weights_block_size,
                gradient_block_size=zero.zero_quantized_gradients_block_size,
                gradient_bits=zero.zero_quantized_gradients_bits,
                **({"loco_beta": loco.err_beta, "loco_reset_every": loco.reset_T} if loco else {}))


class FSDP2Engine(Engine):
    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1,
                 param_init: ParamInit | None = None, replicas: int = 1):
        """`replicas` > 1: HSDP, FSDP2 on a (replicas, world / replicas) mesh: each group of
        world / replicas consecutive ranks (inside a node) shards the model, the groups replicate it."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        topo = comm.topology
        check_fsdp2_config(config.zero_optimization, topo.ranks_per_node, topo.world_size)
        check_replicas(replicas, topo.ranks_per_node, topo.world_size)
        dtype = compute_dtype(config)
        reduce_dtype = communication_dtype(config) if config.communication_data_type else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
        self.shards = topo.world_size // replicas   # the ranks one copy of the model is sharded over
        mesh = (init_device_mesh(device.type, (replicas, self.shards), mesh_dim_names=("dp_replicate", "dp_shard"))
                if replicas > 1 else init_device_mesh(device.type, (topo.world_size,)))
        self.shard_group = mesh.get_group("dp_shard") if replicas > 1 else None   # None: the world
        for unit in [m for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst]:
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        _materialize(module, param_init, device, topo.rank % self.shards, self.shards)
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.world, self.rank, self._loading = topo.world_size, topo.rank, []   # _loading: see checkpoint_state
        self.zeropp = apply_zeropp(module, topo, communicator=comm, overlap=config.zero_optimization.overlap,
                                   **plugin_switches(config.zero_optimization))
        self.zeropp.commit_by_end_step()   # the engine's step calls end_step(applied)
        self.params = [p for p in module.parameters() if p.requires_grad]
        decay, no_decay = split_decay(module)
        self.optimizer = self._make_optimizer(decay, no_decay)

    def train(self, mode: bool = True):
        self._reshard()
        return super().train(mode)

    def _reshard(self):
        """Every unit back to its shard of the world: after a forward no backward followed (evaluation)
        the root keeps its weights gathered and, with hpZ, each block its copy sharded in the node."""
        from torch.distributed.fsdp import FSDPModule
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    # -- the step ------------------------------------------------------------------------------
    def _local_grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def _grad_norm_sq(self) -> float:
        self.zeropp.finish()
        grads = self._local_grads()
        local = torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum() if grads \
            else torch.zeros(())
        # inf/nan reach every rank: one skip decision (HSDP: the replicas hold the same gradients)
        self.comm.all_reduce(local, group=self.shard_group, phase="optimizer")
        return local.item()

    def _apply_update(self, coef: float):
        torch._foreach_mul_(self._local_grads(), coef)
        self.optimizer.step()

    def _end_step(self, applied: bool):
        for note in self.zeropp.end_step(applied):
            warnings.warn(f"step {self.global_step + 1}, rank {self.rank}: {note}")

    def _zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints: the engine's flat layout -----------------------------------------------------
    def _named(self):
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def checkpoint_state(self, for_load: bool = False, optimizer: bool = True) -> dict[str, FlatState]:
        self._reshard()
        tensors = {}
        for name, p in self._named():
            tensors["model." + name] = p
            if optimizer:
                for key in self._moment_names():
                    tensors[f"optim.{key}.{name}"] = self._moment(p, key, for_load)
        out = {}
        if for_load:   # where FSDP2's rows are the flat chunk, its own storage is filled in place
            for key, t in tensors.items():
                rows, flat = spans(t, self.world, self.shards)
                local = t.to_local()
                start, end = flat[self.rank]
                in_place = rows == flat and local.dtype == torch.float32
                out[key] = FlatState(local.view(-1) if in_place else
                                     torch.zeros(end - start, dtype=torch.float32, device=self.device),
                                     t.numel(), sharded=True)
            # (entry, the DTensor it fills): the loader may drop entries or rename them (groups: the global values)
            self._loading = [(out[key], t) for key, t in tensors.items()]
        else:   # views where the rows are the chunk (no copy), the rest moved from the ranks holding it
            keys = list(tensors)
            for i, mine in self._moved([sent_to_save(tensors[k], self.rank, self.world, self.shards) for k in keys]):
                out[keys[i]] = FlatState(mine.float(), tensors[keys[i]].numel(), sharded=True)
        if optimizer:
            out["optim.step"] = self._step_entry(self.params)
            for part in self.zeropp.carried.values():
                out.update(part.checkpoint_state(self.world))
        return out

    @torch.no_grad()
    def checkpoint_loaded(self, state: dict[str, FlatState]):
        present, items, targets = {id(entry) for entry in state.values()}, [], []
        loading, self._loading = self._loading, []
        for entry, t in loading:
            (rows, flat), local = spans(t, self.world, self.shards), t.to_local()
            if id(entry) in present and not (rows == flat and entry.local.data_ptr() == local.data_ptr()):
                items.append((entry.local, flat, rows))   # loaded, not in place
                targets.append(local)
        for i, mine in self._moved(items):   # FSDP2's rows from the ranks holding their flat chunks
            targets[i].copy_(mine.view(targets[i].shape))
        self._set_optimizer_step(state, self.params)

    def _moved(self, items: list[tuple[torch.Tensor, list, list]]):
        """(i, this rank's part of tensor i under the spans `dst`) for each (this rank's part under
        `src`, src, dst) of `items` (spans as `spans` gives them, the same on every rank). Where src is dst
        the part is the tensor given (a view); the rest goes in one uneven all_to_all per bucket
        of same-dtype tensors, each rank sending only what another keeps: at most MOVE_BUCKET
        elements of chunks per bucket, or one larger tensor."""
        me, moving = self.rank, []
        for i, (local, src, dst) in enumerate(items):
            if src == dst:
                yield i, local
            else:
                moving.append(i)
        for bucket in self._buckets(moving, items):
            sends, recv_sizes = [[] for _ in range(self.world)], [[0] * len(bucket) for _ in range(self.world)]
            for b, i in enumerate(bucket):
                local, src, dst = items[i]
                for q in range(self.world):
                    lo, hi = max(src[me][0], dst[q][0]), min(src[me][1], dst[q][1])
                    if hi > lo:
                        sends[q].append(local[lo - src[me][0]:hi - src[me][0]])
                    recv_sizes[q][b] = max(0, min(src[q][1], dst[me][1]) - max(src[q][0], dst[me][0]))
            dtype = items[bucket[0]][0].dtype
            flat_sends = [part for parts in sends for part in parts]
            send = torch.cat(flat_sends) if flat_sends else torch.zeros(0, dtype=dtype, device=self.device)
            recv = torch.empty(sum(map(sum, recv_sizes)), dtype=dtype, device=self.device)
            self.comm.all_to_all(recv, send, output_splits=[sum(r) for r in recv_sizes],
                                 input_splits=[sum(p.numel() for p in parts) for parts in sends])
            del send
            pieces, offset = [[] for _ in bucket], 0
            for q in range(self.world):   # from rank q: its piece of each tensor, in bucket order
                for b, size in enumerate(recv_sizes[q]):
                    pieces[b].append(recv[offset:offset + size])
                    offset += size
            for b, i in enumerate(bucket):
                yield i, torch.cat(pieces[b])
            del recv, pieces

    def _buckets(self, moving: list[int], items) -> list[list[int]]:
        """`moving` in runs of one dtype of at most MOVE_BUCKET elements of flat chunks (sized
        the same on every rank), or one larger tensor."""
        buckets, total = [], 0
        for i in moving:
            size = -(-sum(e - s for s, e in items[i][1]) // self.world)
            if buckets and items[buckets[-1][0]][0].dtype == items[i][0].dtype and total + size <= MOVE_BUCKET:
                buckets[-1].append(i)
                total += size
            else:
                buckets.append([i])
                total = size
        return buckets

    def scalar_state(self) -> dict:
        out = super().scalar_state()
        for key, part in self.zeropp.carried.items():
            out[key] = part.scalar_state()
        return out

    def load_scalar_state(self, sd: dict) -> list[str]:
        notes = super().load_scalar_state(sd)
        for key, part in self.zeropp.carried.items():
            if note := part.load_scalar_state(sd.get(key)):
                notes.append(note)
        return notes

    def uncarried_state(self, saved_scalar_state: dict) -> list[str]:
        return uncarried_state(self.zeropp.carried, saved_scalar_state, self.world)

    # -- reports -------------------------------------------------------------------------------
    def summary(self) -> list[str]:
        return [line for part in self.zeropp.carried.values() if (line := part.summary())]

    def memory_lines(self) -> list:
        return [part.memory() for part in self.zeropp.carried.values()]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """FSDP2's fp32 shards are the parameters (no 16-bit copy between steps), its fp32 sharded
        gradients, the optimizer state; plus what the plug-in keeps (LoCo's errors)."""
        out = {"parameters": [p.to_local() for p in self.params], "gradients": self._local_grads(),
               "optimizer": [t.to_local() if hasattr(t, "to_local") else t for t in self._optimizer_tensors()]}
        for line in self.memory_lines():
            out[line.kind] = out[line.kind] + line.tensors
        return out

    def peak_buffers(self) -> dict:
        return {}


def spans(t, world: int, shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every rank's [start, end) of flattened `t`: FSDP2's rows (torch.chunk along dim 0 over the
    `shards` ranks of a copy; HSDP: each replica holds them again), and the checkpoint's flat chunk
    (torch.chunk of the flattened tensor over the world). The same on every rank."""
    numel, rows = t.numel(), (t.shape[0] if t.ndim else 1)
    per_row, by_rows, by_flat = numel // max(rows, 1), -(-rows // shards), -(-numel // world)
    return ([(min(r % shards * by_rows, rows) * per_row, min((r % shards + 1) * by_rows, rows) * per_row)
             for r in range(world)],
            [(min(r * by_flat, numel), min((r + 1) * by_flat, numel)) for r in range(world)])


def sent_to_save(t, rank: int, world: int, shards: int):
    """(what `rank` sends of `t` to a save, every rank's span of it, the flat chunks): its rows, or
    on HSDP the part of them its replica sends (the replicas' parts end to end)."""
    rows, flat = spans(t, world, shards)
    local = t.to_local().view(-1)
    if shards == world:
        return local, rows, flat
    replicas, sent = world // shards, []
    for r, (lo, hi) in enumerate(rows):
        part = -(-(hi - lo) // replicas)
        sent.append((min(lo + r // shards * part, hi), min(lo + (r // shards + 1) * part, hi)))
    (lo, _), (start, end) = rows[rank], sent[rank]
    return local[start - lo:end - lo], sent, flat


def _materialize(module, param_init, device, rank: int, world: int):
    """A model built on "meta": each parameter's rows this rank keeps (`rank` of the `world` ranks
    the model is sharded over), from its full value (one alive at a time), and the buffers whole."""
    if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        module.to(device)
        return
    buffers = {n: b.dtype for n, b in module.named_buffers() if b.is_meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = full_value(name, torch.empty(p.shape, device="meta"), param_init, device)
            rows = torch.chunk(full, world, dim=0)
            if rank < len(rows):
                p.to_local().copy_(rows[rank])
            del full
        for name, b in module.named_buffers():
            if name in buffers:
                b.copy_(full_value(name, torch.empty(b.shape, device="meta"), param_init, device).to(buffers[name]))
