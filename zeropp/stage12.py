"""ZeRO stages 1 and 2: every rank holds the whole 16-bit model; the fp32
master weights and Adam state are partitioned (layout: zeropp/flat.py).

Stage 1: backward fills the full `param.grad` as usual (all micro-steps
accumulate into it); at step() the gradients are reduce-scattered in buckets
of `reduce_bucket_size` elements, each rank updates its partition, and the
updated 16-bit slices are all-gathered back into the full weights.

Stage 2: a post-accumulate-grad hook moves each gradient into the current
bucket as soon as autograd has produced it and drops `param.grad`; a full
bucket is copied into one contiguous buffer and reduce-scattered (async when
`overlap_comm`), its averaged result added into this rank's gradient
partition. Every micro-step is reduced, so the partition accumulates across
gradient-accumulation steps and no full gradient outlives its bucket.
"""
from __future__ import annotations

import torch

from zeropp.flat import ParamShard, ShardedEngineBase


class ShardedOptimizerEngine(ShardedEngineBase):
    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1):
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.stage = self.zero.stage
        self._build_masters(lambda s: s.param.data.view(-1)[s.lo:s.hi])
        if self.stage == 2:
            self._alloc_grad_partition()
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- stage 2: reduce during backward -----------------------------------
    def _grad_ready(self, p):
        g, p.grad = p.grad, None
        self.reducer.add(self.shard_of[id(p)], g)

    def backward(self, loss):
        super().backward(loss)
        if self.stage == 2:
            self.reducer.drain()

    # -- Engine hooks ---------------------------------------------------------
    def _reduce_gradients(self):
        if self.stage == 2:
            return
        self._alloc_grad_partition()
        for s in self.shards:
            g = s.param.grad
            if g is None:
                g = torch.zeros_like(s.param)  # every rank must put the same params in a bucket
            self.reducer.add(s, g)
        self.reducer.drain()

    def _publish_weights(self):
        if self.dtype != torch.float32:  # fp32: the master is a view of the weight itself
            with torch.no_grad():
                for s in self.shards:
                    if s.valid:
                        s.param.data.view(-1)[s.lo:s.hi].copy_(s.master)
        self.gather_shards(self.shards, lambda s: s.param.data.view(-1)[s.lo:s.hi], self.dtype,
                           lambda s, full: s.param.data.view(-1).copy_(full), tag="all_gather_params")

    def _zero_grad(self):
        for p in self.params:
            p.grad = None
        if self.stage == 2:
            self.grad_flat.zero_()
        else:
            self.grad_flat = None
            for s in self.shards:
                s.grad_view = None

    def _load_weight(self, s: ParamShard, full_fp32: torch.Tensor):
        s.param.data.view(-1).copy_(full_fp32)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_flat is not None:
            grads.append(self.grad_flat)
        return {"parameters": [p.data for p in self.params], "gradients": grads,
                "optimizer": self._optimizer_tensors()}
