"""What the sharded stages (1, 2, 3) share: the partition of every parameter
over the data-parallel group (zeropp/collectives/partition.py), fp32 master slices and
their optimizer, an fp32 gradient partition filled by the `GradientReducer`,
the global gradient norm and the state dicts.

Construction is sharded: parameters may arrive on the meta device; each is
materialized whole (`param_init`), sliced into this rank's master (and, for
stage 3, its 16-bit shard) and dropped before the next one (zeropp/stages/init.py).
Subclasses say where the 16-bit weights live (`_adopt`, `_publish_weights`)
and when a gradient goes to the reducer (`_on_grad`).
"""
from __future__ import annotations

import warnings

import torch

from zeropp.collectives.exact import GradientReducer, ShardGather, ShardReduce, gather_bucketed, reducer_buffers_bound
from zeropp.stages.engine import Engine, FlatState, communication_dtype
from zeropp.techniques.loco import ErrorFeedback
from zeropp.stages.init import ParamInit, full_value, materialize_rest, replace_data
from zeropp.collectives.partition import Partition, ShardedParam

class ShardedEngineBase(Engine):
    shard_class = ShardedParam   # stage 3 adds gather state

    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1,
                 param_init: ParamInit | None = None):
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.zero = config.zero_optimization
        topo = comm.topology
        self.partition = Partition(group=None, size=topo.world_size, rank=topo.rank)
        self.world, self.rank = self.partition.size, self.partition.rank
        self._scratch_peak = 0    # the optimizer step's temporaries (_step_by_bucket)
        self.gather = ShardGather(comm)   # exact: state dicts, stage 1/2 weights, persistent weights
        self.reduce = self._gradient_reduce()

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.shards = [self.shard_class(i, n, p, self.partition) for i, (n, p) in enumerate(named)]
        self.shard_of = {id(s.param): s for s in self.shards}
        # Untrained parameters and buffers are materialized whole, in the compute dtype.
        materialize_rest(module, param_init, device, self.dtype, skip=set(self.shard_of))
        for p in module.parameters():
            if id(p) not in self.shard_of:
                p.data = p.data.to(device=device, dtype=self.dtype)
        for b in module.buffers():
            b.data = b.data.to(device)

        self._allocate_partitions()
        for s in self.shards:  # one full parameter alive at a time
            full = full_value(s.name, s.param, param_init, device).view(-1)
            self._adopt(s, full)
            if self.dtype == torch.float32:
                s.master = self._weight_slice(s)  # fp32: the master is this rank's slice of the weight
            else:
                s.master.copy_(full[s.lo:s.hi])
            del full
        owned = [s for s in self.shards if s.valid]
        self.optimizer = self._make_optimizer([s.master for s in owned if s.decay],
                                              [s.master for s in owned if not s.decay])

        pre, post = config.gradient_scale_factors(self.world)
        # The same layout over a group of its own (parallel/topology.py: gradient_group).
        reduce_partition = Partition(group=topo.gradient_group, size=self.world, rank=self.rank)
        self.reducer = GradientReducer(
            self.reduce, self.shards, reduce_partition, self.zero.reduce_bucket_size,
            communication_dtype(config), device, self.zero.overlap, pre=pre, post=post)
        self.reducer.pool.budget = self._gradient_buffers_bound()
        if self.error_feedback is not None:
            self.error_feedback.expect({b.index: (topo.num_nodes, b.total) for b in self.reducer.buckets},
                                       self.world, topo.num_nodes, device)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_hook)

    def _gradient_reduce(self) -> ShardReduce:
        return ShardReduce(self.comm)

    def _allocate_partitions(self):
        """fp32 gradient partition and (16-bit training) fp32 masters: one flat
        buffer each, a view per shard."""
        n = sum(s.valid for s in self.shards)
        self.grad_flat = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.master_flat = (torch.empty(n, dtype=torch.float32, device=self.device)
                            if self.dtype != torch.float32 else None)
        off = 0
        for s in self.shards:
            s.grad = self.grad_flat[off:off + s.valid]
            if self.master_flat is not None:
                s.master = self.master_flat[off:off + s.valid]
            off += s.valid

    def _adopt(self, s: ShardedParam, full_fp32: torch.Tensor):
        """Keep what this stage holds of the weight (full: fp32, flat), in place
        where it already has storage (the fp32 master may be a view of it)."""
        raise NotImplementedError

    def _weight_slice(self, s: ShardedParam) -> torch.Tensor:
        """This rank's `valid` elements of the compute-dtype weight."""
        raise NotImplementedError

    def _set_whole(self, param: torch.Tensor, full_fp32: torch.Tensor):
        """A parameter every rank holds whole: new data, or a copy into the old."""
        if param.is_meta or param.dtype != self.dtype or param.device != full_fp32.device:
            replace_data(param, full_fp32.view(param.shape).to(self.dtype, copy=True))
        else:
            param.data.copy_(full_fp32.view(param.shape))

    # -- gradients ------------------------------------------------------------------
    def _grad_hook(self, p):
        s = self.shard_of[id(p)]
        g, p.grad = p.grad, None
        self._on_grad(s, g)

    def _on_grad(self, s: ShardedParam, grad: torch.Tensor):
        raise NotImplementedError

    def _finish_reduction(self):
        with self.clock.phase("backward_allreduce"):
            self._finish_reduction_untimed()

    def _finish_reduction_untimed(self):
        missing = self.reducer.missing()
        if missing and not self.zero.ignore_unused_parameters:
            names = ", ".join(s.name for s in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient on rank {self.rank} ({names}); "
                f"set zero_optimization.ignore_unused_parameters true to train them with zero gradient")
        self.reducer.finish()

    # -- Engine hooks ---------------------------------------------------------------
    def _grad_norm_sq(self) -> float:
        # vector_norm reduces without a temporary copy of the (large) partition
        t = torch.linalg.vector_norm(self.grad_flat).to(torch.float64).square().reshape(1)
        self.comm.all_reduce(t, group=self.partition.group, phase="optimizer")  # inf/nan reach every rank
        return t.item()

    def _apply_update(self, coef: float):
        for s in self.shards:
            if s.valid:
                s.master.grad = s.grad.mul_(coef)
        self._step_by_bucket()
        for s in self.shards:
            s.master.grad = None
        self._publish_weights()

    def _end_step(self, applied: bool):
        for part in self._carried_parts().values():
            note = part.end_step(applied)
            if note:
                warnings.warn(f"step {self.global_step + 1}, rank {self.rank}: {note}")

    def _step_by_bucket(self):
        """optimizer.step() over one gradient bucket's masters at a time: torch's foreach
        implementations allocate temporaries the size of what one call steps (Adam: the
        square root of the second moment), so the scratch is at most a bucket's share, not
        the whole shard. Each element is updated by the same operations as in one call;
        the optimizer's state stays keyed by the same masters (checkpoints unchanged)."""
        groups = self.optimizer.param_groups
        whole = [g["params"] for g in groups]
        member = [{id(p) for p in ps} for ps in whole]
        try:
            for b in self.reducer.buckets:
                masters = [s.master for s in b.shards if s.valid]
                parts = [[m for m in masters if id(m) in ids] for ids in member]
                if not any(parts):
                    continue
                for g, part in zip(groups, parts):
                    g["params"] = part
                self.optimizer.step()
                stepped = sum(m.numel() for m in masters)
                self._scratch_peak = max(self._scratch_peak, stepped * self._scratch_per_element())
        finally:
            for g, ps in zip(groups, whole):
                g["params"] = ps

    def _scratch_per_element(self) -> int:
        """Bytes per stepped element of the optimizer's temporaries (torch/optim/adam.py,
        sgd.py, foreach): Adam's sqrt of exp_avg_sq; SGD's decayed gradient."""
        s = self.optim_settings
        return (4 if s.weight_decay else 0) if s.type == "sgd" else 4

    def _scratch_bound(self) -> int:
        """A bucket's share of this rank's elements (or its largest weight's), x the above."""
        owned = sum(s.valid for s in self.shards)
        largest = max((s.valid for s in self.shards), default=0)
        share = -(-self.zero.reduce_bucket_size // self.world)
        return min(owned, max(share, largest)) * self._scratch_per_element()

    def _publish_weights(self):
        raise NotImplementedError

    def _zero_grad(self):
        self.grad_flat.zero_()

    def _gather_weights(self, shards, chunk_of, consume, dtype, phase):
        gather_bucketed(self.gather, shards, chunk_of, consume, self.partition, dtype, self.device,
                        self.zero.allgather_bucket_size, phase)

    # -- checkpoint state --------------------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full fp32 weights on every rank (collective)."""
        full = {}
        self._gather_weights(self.shards, lambda s: s.master,
                             lambda s, t: full.__setitem__(s.index, t.view(s.shape).cpu().clone()),
                             torch.float32, "other")
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            s = self.shard_of.get(id(v))
            out[k] = full[s.index] if s is not None else v.detach().cpu().clone()
        return out

    def load_module_state_dict(self, sd: dict):
        """Full fp32 (or any float) weights, keys as module.state_dict(); every
        rank passes the whole dict and keeps its slices (no communication)."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        by_id = {id(p): sd[k] for k, p in named.items() if k in sd}
        missing = [k for k, p in named.items() if id(p) not in by_id]
        if missing:
            raise KeyError(f"load_module_state_dict: missing keys {missing}")
        with torch.no_grad():
            for s in self.shards:
                full = by_id[id(s.param)].reshape(-1).to(device=self.device, dtype=torch.float32)
                if full.numel() != s.numel:
                    raise ValueError(f"load_module_state_dict: {s.name} has {s.numel} elements, "
                                     f"got {full.numel()} (shape {tuple(s.shape)})")
                self._adopt(s, full)
                if self.master_flat is not None:  # fp32: the master is the weight, already set
                    s.master.copy_(full[s.lo:s.hi])
            for p in self.module.parameters():
                if id(p) not in self.shard_of:
                    name = next(k for k, q in named.items() if q is p)
                    p.data.copy_(sd[name])
            for n, b in self.module.named_buffers():
                if n in sd:
                    b.copy_(sd[n])
        self._weights_changed()

    def _weights_changed(self):
        """Hook: the weights were replaced from outside (a state-dict load)."""

    def checkpoint_state(self, for_load: bool = False, optimizer: bool = True) -> dict:
        """This rank's slices: the fp32 masters and their optimizer state (see Engine)."""
        out = self._replicated_module_state()
        empty = torch.zeros(0, dtype=torch.float32, device=self.device)
        for s in self.shards:
            out["model." + s.name] = FlatState(s.master if s.valid else empty, s.numel, sharded=True)
        if optimizer:
            for s in self.shards:
                for key in self._moment_names():
                    local = self._moment(s.master, key, for_load) if s.valid else empty
                    out[f"optim.{key}.{s.name}"] = FlatState(local, s.numel, sharded=True)
            out["optim.step"] = self._step_entry([s.master for s in self.shards if s.valid])
            for part in self._carried_parts().values():
                out.update(part.checkpoint_state(self.world))
        return out

    @property
    def error_feedback(self) -> ErrorFeedback | None:
        """qgZ's error feedback (zeropp_loco_param), when the gradient reduction keeps one."""
        return getattr(self.reduce, "error_feedback", None)

    def _carried_parts(self) -> dict:
        """State carried from step to step besides the optimizer's, by its scalar-state key. Each
        part commits at `end_step(applied)` (ARCHITECTURE.md: "State carried across steps"),
        saves `checkpoint_state(world)` and `scalar_state()`, and on a load either takes them
        back (`carried(saved)`) or resets and says so (`load_scalar_state(saved)` -> a line)."""
        ef = self.error_feedback
        return {"error_feedback": ef} if ef is not None else {}

    def scalar_state(self) -> dict:
        out = super().scalar_state()
        for key, part in self._carried_parts().items():
            out[key] = part.scalar_state()
        return out

    def load_scalar_state(self, sd: dict) -> list[str]:
        notes = super().load_scalar_state(sd)
        parts = self._carried_parts()
        for key, part in parts.items():
            note = part.load_scalar_state(sd.get(key))
            notes += [note] if note else []
        return notes

    def uncarried_state(self, saved_scalar_state: dict) -> list[str]:
        out = []
        for key, part in self._carried_parts().items():
            if not part.carried(saved_scalar_state.get(key)):
                out += list(part.checkpoint_state(self.world))
        return out

    def checkpoint_loaded(self, state: dict):
        self._publish_weights()   # masters -> 16-bit weights, gathered where this stage keeps them whole
        self._weights_changed()
        self._set_optimizer_step(state, [s.master for s in self.shards if s.valid])

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return super()._optimizer_tensors() + [s.master for s in self.shards if s.valid]

    def peak_buffers(self) -> dict:
        """Measured peaks during steps, next to the configured bounds (bytes)."""
        return {"gradient_buckets_peak": self.reducer.pool.peak_bytes,
                "gradient_buckets_bound": self._gradient_buffers_bound(),
                "optimizer_scratch_peak": self._scratch_peak, "optimizer_scratch_bound": self._scratch_bound()}

    def _gradient_buffers_bound(self) -> int:
        r = self.reducer
        return reducer_buffers_bound([b.total for b in r.buckets], self.world, torch.finfo(r.comm_dtype).bits // 8,
                                     r.overlap, self.reduce.inflight_bytes)
