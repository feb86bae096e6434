"""ZeRO stages 1-3 as one engine composed of parts (built by zeropp/build.py):

- `weights`, the parameter store: whole on every rank (`FullWeights`, stages 1-2) or partitioned
  with the weight sources a gather reads from (`PartitionedWeights`, stage 3);
- `masters`: the fp32 master slices, the fp32 gradient partition and the optimizer;
- `gradients`, when a gradient goes to the `reducer`: as autograd produces it (stages 2-3) or
  at the accumulation boundary (stage 1); the reducer's reduction is the plain reduce-scatter
  or a technique's (qgZ, LoCo);
- `hooks` (stage 3): the module and saved-tensor hooks and the order of gathers;
- `gradient_hooks`: what runs on the reduced gradient partition before the step reads it (the
  outer synchronization's warm-up averages it across the groups);
- `carried`: the state carried from step to step besides the optimizer's (LoCo's error
  feedback, the INT4 weight deltas), by its scalar-state key (zeropp/collectives/protocols.py
  `CarriedState`).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from zeropp.collectives.exact import GradientReducer, ShardGather, gather_bucketed
from zeropp.collectives.partition import FlatState, Partition, ShardedParam
from zeropp.collectives.protocols import uncarried_state
from zeropp.stages.engine import Engine
from zeropp.stages.masters import Masters


@dataclass
class ShardedParts:
    partition: Partition
    shards: list[ShardedParam]
    weights: object                 # FullWeights | PartitionedWeights
    masters: Masters
    reducer: GradientReducer
    gradients: object               # ImmediateGradients | AccumulatedGradients
    gather: ShardGather             # exact: state dicts
    hooks: object | None = None     # Stage3Hooks
    gradient_hooks: list = field(default_factory=list)   # f(grad_flat), before the norm and the update
    carried: dict = field(default_factory=dict)   # scalar-state key -> CarriedState part


class ShardedEngine(Engine):
    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps: int, parts: ShardedParts):
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.zero = config.zero_optimization
        self.parts = parts
        self.partition, self.shards, self.weights = parts.partition, parts.shards, parts.weights
        self.world, self.rank = self.partition.size, self.partition.rank
        self.masters, self.optimizer, self.reducer = parts.masters, parts.masters.optimizer, parts.reducer
        self.params = [s.param for s in self.shards]
        self.shard_of = {id(s.param): s for s in self.shards}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_hook)

    # -- forward and backward ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.parts.hooks is None:
            return self.module(*args, **kwargs)
        return self.parts.hooks.forward(self.module, *args, **kwargs)

    def _backward(self, loss):
        phase = self.parts.hooks.backward() if self.parts.hooks is not None else contextlib.nullcontext()
        with phase:   # stage 3: its end issues every gather of the schedule backward did not need...
            self.parts.gradients.begin(self.is_gradient_accumulation_boundary())
            super()._backward(loss)
        # ...before this rank waits on a reduction that waits for the others' gradients, which a rank
        # whose backward is still gathering (a parameter without gradient here) needs those gathers for
        if self.parts.gradients.reduce_now():
            with self.clock.phase("backward_allreduce"):
                self._finish_reduction()

    def _grad_hook(self, p):
        g, p.grad = p.grad, None
        self.parts.gradients.add(self.shard_of[id(p)], g)

    def _finish_reduction(self):
        missing = self.reducer.missing()
        # Finish first, so every rank completes the same reductions: none is left waiting on a
        # rank that raised and left, and each rank says why.
        self.reducer.finish()
        if missing and not self.zero.ignore_unused_parameters:
            names = ", ".join(s.name for s in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient on rank {self.rank} ({names}); "
                f"set zero_optimization.ignore_unused_parameters true to train them with zero gradient")

    # -- Engine hooks ---------------------------------------------------------------
    def _gradients_reduced(self):
        for hook in self.parts.gradient_hooks:
            hook(self.masters.grad_flat)

    def _grad_norm_sq(self) -> float:
        return self.masters.grad_norm_sq(self.comm, self.partition.group)

    def _apply_update(self, coef: float):
        self.masters.step(coef, self.reducer.buckets, self._scratch_per_element())
        self.weights.publish(self.masters.flat is None)

    def _end_step(self, applied: bool):
        for part in self.parts.carried.values():
            note = part.end_step(applied)
            if note:
                warnings.warn(f"step {self.global_step + 1}, rank {self.rank}: {note}")

    def _zero_grad(self):
        self.masters.grad_flat.zero_()

    def _scratch_per_element(self) -> int:
        """Bytes per stepped element of the optimizer's temporaries (torch/optim/adam.py,
        sgd.py, foreach): Adam's sqrt of exp_avg_sq; SGD's decayed gradient."""
        s = self.optim_settings
        return (4 if s.weight_decay else 0) if s.type == "sgd" else 4

    # -- state dicts ------------------------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full fp32 weights on every rank (collective)."""
        full = {}
        gather_bucketed(self.parts.gather, self.shards, lambda s: s.master,
                        lambda s, t: full.__setitem__(s.index, t.view(s.shape).cpu().clone()),
                        self.partition, torch.float32, self.device, self.zero.allgather_bucket_size, "other")
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
                self.weights.adopt(s, full)
                self.masters.load(s, full)
            for p in self.module.parameters():
                if id(p) not in self.shard_of:
                    name = next(k for k, q in named.items() if q is p)
                    p.data.copy_(sd[name])
            for n, b in self.module.named_buffers():
                if n in sd:
                    b.copy_(sd[n])
        self.weights.changed()

    # -- checkpoint state --------------------------------------------------------------
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
            out["optim.step"] = self._step_entry([s.master for s in self.masters.owned])
            for part in self.parts.carried.values():
                out.update(part.checkpoint_state(self.world))
        return out

    def scalar_state(self) -> dict:
        out = super().scalar_state()
        for key, part in self.parts.carried.items():
            out[key] = part.scalar_state()
        if self.parts.hooks is not None:   # stage 3: the recorded gather orders
            out["schedule"] = self.parts.hooks.gathers.scalar_state()
        return out

    def load_scalar_state(self, sd: dict) -> list[str]:
        if self.parts.hooks is not None:
            self.parts.hooks.gathers.load_scalar_state(sd.get("schedule"))
        notes = super().load_scalar_state(sd)
        for key, part in self.parts.carried.items():
            note = part.load_scalar_state(sd.get(key))
            notes += [note] if note else []
        return notes

    def uncarried_state(self, saved_scalar_state: dict) -> list[str]:
        return uncarried_state(self.parts.carried, saved_scalar_state, self.world)

    def checkpoint_loaded(self, state: dict):
        self.masters_changed()
        self._set_optimizer_step(state, [s.master for s in self.masters.owned])

    def masters_changed(self):
        """The masters were set from outside (a load, an outer step): the weights follow (collective)."""
        self.weights.publish(self.masters.flat is None)   # masters -> weights, gathered where kept whole
        self.weights.changed()

    # -- memory -------------------------------------------------------------------------
    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return super()._optimizer_tensors() + [s.master for s in self.masters.owned]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = {"parameters": self.weights.tensors(),
               "gradients": [self.masters.grad_flat] + self.parts.gradients.tensors(),
               "optimizer": self._optimizer_tensors()}
        for line in self.memory_lines():   # listed once more is counted once (zeropp/memory.py)
            out[line.kind] = out[line.kind] + line.tensors
        return out

    def summary(self) -> list[str]:
        return [line for part in self.parts.carried.values() if (line := part.summary())]

    def memory_lines(self) -> list:
        """What the techniques' parts keep (zeropp/collectives/protocols.py MemoryLine)."""
        return self.weights.memory_lines() + [part.memory() for part in self.parts.carried.values()]

    def num_trained_parameters(self) -> int:
        return sum(s.numel for s in self.shards)   # stage 3's weights are placeholders

    def peak_buffers(self) -> dict:
        """Measured peaks during steps, next to the configured bounds (bytes)."""
        per = self._scratch_per_element()
        peaks = {"gradient_buckets_peak": self.reducer.pool.peak_bytes,
                 "gradient_buckets_bound": self.reducer.buffers_bound(),
                 "optimizer_scratch_peak": self.masters.scratch_peak,
                 "optimizer_scratch_bound": self.masters.scratch_bound(self.zero.reduce_bucket_size, self.world, per)}
        if self.parts.hooks is not None:
            peaks.update(self.parts.hooks.peak_buffers())
        for part in self.parts.carried.values():
            peaks.update(part.peak_buffers())
        return peaks
