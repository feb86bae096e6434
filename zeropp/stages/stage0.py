"""ZeRO stage 0: torch DistributedDataParallel with replicated model states,
its gradient all-reduce going through our Communicator (so bytes are counted)
in DeepSpeed's order of scaling and summing. Also every stage's short path at
world size 1: the shard is the weight, gradients land in place."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel.comm import Communicator
from zeropp.stages.engine import Engine, FlatState, communication_dtype, compute_dtype, split_decay
from zeropp.stages.init import ParamInit, materialize_rest

DDP_BUCKET_MB = 25   # torch DDP's bucket_cap_mb (its default), which the planner models


class DDPEngine(Engine):
    """ZeRO stage 0, and every stage at world size 1: each rank holds the whole
    model, its gradients and the optimizer state. Gradients are all-reduced by
    torch DDP (bucketed, overlapped with backward) through our Communicator, so
    bytes are counted. In fp32 the optimizer updates the weights in place and
    gradients accumulate in `param.grad`. In 16-bit the model runs in
    fp16/bf16, fp32 master weights are kept for the optimizer, and each
    micro-step's (all-reduced) gradient is added into the master's fp32
    gradient; DDP then syncs every micro-step, since a 16-bit `param.grad`
    would lose precision across micro-steps."""

    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1,
                 param_init: ParamInit | None = None):
        # fp32 first: the masters start from the exact initialization, as the sharded
        # stages' do, and the 16-bit weights are their rounding.
        materialize_rest(module, param_init, device, torch.float32)
        module = module.to(device=device)
        params = [p for p in module.parameters() if p.requires_grad]
        masters = [p.detach().float().clone().requires_grad_(True) for p in params] \
            if compute_dtype(config) != torch.float32 else params
        module = module.to(dtype=compute_dtype(config))
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.params = params
        self.master = masters
        decay, no_decay = split_decay(module)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.optimizer = self._make_optimizer([self.master[index[id(p)]] for p in decay],
                                              [self.master[index[id(p)]] for p in no_decay])
        self.ddp = None
        if comm.topology.world_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=DDP_BUCKET_MB, find_unused_parameters=False)
            # DDP re-buckets once, after its first step, by gradient arrival order; a ring
            # all-reduce's sums depend on where an element sits in its bucket, so a job resumed
            # from a checkpoint (first step: the old layout) would not continue the uninterrupted
            # job bit for bit. Settle the layout now (parameter order), for good.
            self.ddp.reducer._push_all_rebuilt_params()
            self.ddp.reducer._rebuild_buckets()
            pre, post = config.gradient_scale_factors(comm.topology.world_size)
            self.ddp.register_comm_hook(_ReduceState(comm, communication_dtype(config), pre, post),
                                        _counted_allreduce_hook)

    def forward(self, *args, **kwargs):
        if self.ddp is None:
            return self.module(*args, **kwargs)
        if self.is_gradient_accumulation_boundary() or self.master is not self.params:
            return self.ddp(*args, **kwargs)
        with self.ddp.no_sync():  # fp32: accumulate locally; all-reduce only on the last micro-batch
            return self.ddp(*args, **kwargs)

    def _backward(self, loss):
        super()._backward(loss)
        if self.master is not self.params:
            for p, m in zip(self.params, self.master):
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.master if p.grad is not None]

    def _grad_norm_sq(self) -> float:
        grads = self._grads()
        if not grads:
            return 0.0
        norms = torch._foreach_norm(grads, 2.0)
        # DDP's all-reduce left identical gradients on every rank, so every rank
        # computes the same norm and takes the same skip decision.
        return torch.stack([n.float() for n in norms]).pow(2).sum().item()

    def _apply_update(self, coef: float):
        for m in self.master:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        torch._foreach_mul_(self._grads(), coef)
        self.optimizer.step()
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.master)

    def _zero_grad(self):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    # -- checkpoint state ---------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full model weights (fp32 masters when training in 16-bit)."""
        sd = self.module.state_dict()
        if self.master is not self.params:
            name = {id(p): n for n, p in self.module.named_parameters()}
            for p, m in zip(self.params, self.master):
                sd[name[id(p)]] = m.detach().clone()
        return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}  # a copy, never the live weights

    def load_module_state_dict(self, sd: dict):
        self.module.load_state_dict({k: v.to(self.dtype) if v.is_floating_point() else v
                                     for k, v in sd.items()})
        if self.master is not self.params:
            name = {id(p): n for n, p in self.module.named_parameters()}
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    m.copy_(sd[name[id(p)]])

    def checkpoint_state(self, for_load: bool = False, optimizer: bool = True) -> dict[str, FlatState]:
        name = {id(p): n for n, p in self.module.named_parameters()}
        out = self._replicated_module_state()
        entries = [(name[id(p)], m) for p, m in zip(self.params, self.master)]
        for n, m in entries:
            out["model." + n] = FlatState(m.detach().view(-1), m.numel(), sharded=False)
        if optimizer:
            for n, m in entries:
                for key in self._moment_names():
                    out[f"optim.{key}.{n}"] = FlatState(self._moment(m, key, for_load).view(-1), m.numel(),
                                                        sharded=False)
            out["optim.step"] = self._step_entry([m for _, m in entries])
        return out

    def checkpoint_loaded(self, state: dict[str, FlatState]):
        if self.master is not self.params:  # 16-bit: the loaded fp32 masters, rounded into the weights
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.master)
        self._set_optimizer_step(state, self.master)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by kind, for memory_report()."""
        opt = self._optimizer_tensors()
        return {"parameters": list(self.params),
                "gradients": [p.grad for p in self.params if p.grad is not None]
                + ([m.grad for m in self.master if m.grad is not None] if self.master is not self.params else []),
                "optimizer": opt + ([] if self.master is self.params else list(self.master))}

    def peak_buffers(self) -> dict:
        return {}


@dataclass
class _ReduceState:
    comm: Communicator
    dtype: torch.dtype      # communication_data_type
    pre: float              # DeepSpeedConfig.gradient_scale_factors
    post: float


def _counted_allreduce_hook(state: _ReduceState, bucket):
    """DDP communication hook: average the bucket through our Communicator, in
    `communication_data_type`, scaled before and after the sum as DeepSpeed does."""
    grads = bucket.buffer()
    wire = grads if grads.dtype == state.dtype else grads.to(state.dtype)
    if state.pre != 1.0:
        wire.mul_(state.pre)
    work = state.comm.all_reduce(wire, async_op=True, phase="grad_reduce")

    def finish(fut):
        summed = fut.value()[0]
        if state.post != 1.0:
            summed.mul_(state.post)
        if summed is not grads:
            grads.copy_(summed)
        return grads
    return work.get_future().then(finish)
