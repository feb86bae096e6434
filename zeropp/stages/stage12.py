"""ZeRO stages 1 and 2: every rank holds the whole 16-bit model; fp32 master
weights, optimizer state and the fp32 gradient partition are sharded
(zeropp/stages/sharded.py). After the optimizer step each rank's updated slices are
all-gathered back into the full weights.

The two stages differ only in when a gradient goes to the reduce-scatter:
- stage 2: every micro-step, the moment autograd produces it, so no full
  gradient outlives its bucket;
- stage 1: on the last micro-step of the accumulation; earlier micro-steps
  add into a full-size accumulator (fp32 in 16-bit training) kept between
  micro-steps, the unpartitioned gradient that stage 1 is defined by.
"""
from __future__ import annotations

import torch

from zeropp.collectives.partition import ShardedParam
from zeropp.stages.sharded import ShardedEngineBase


class _FullWeights(ShardedEngineBase):
    """Stages 1 and 2: the 16-bit weights stay whole on every rank."""

    def _adopt(self, s: ShardedParam, full_fp32: torch.Tensor):
        self._set_whole(s.param, full_fp32)

    def _weight_slice(self, s: ShardedParam) -> torch.Tensor:
        return s.param.data.view(-1)[s.lo:s.hi]

    def _publish_weights(self):
        if self.master_flat is not None:  # 16-bit: round the updated masters into the weights
            with torch.no_grad():
                for s in self.shards:
                    if s.valid:
                        self._weight_slice(s).copy_(s.master)
        self._gather_weights(self.shards, self._weight_slice,
                             lambda s, full: s.param.data.view(-1).copy_(full), self.dtype, "optimizer")

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"parameters": [p.data for p in self.params], "gradients": [self.grad_flat],
                "optimizer": self._optimizer_tensors()}


class Stage2Engine(_FullWeights):
    def _on_grad(self, s, grad):
        self.reducer.add(s, grad)

    def _backward(self, loss):
        super()._backward(loss)
        self._finish_reduction()


class Stage1Engine(_FullWeights):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accum: dict[int, torch.Tensor] = {}  # shard index -> full gradient of earlier micro-steps
        self.accum_dtype = torch.float32 if self.dtype != torch.float32 else self.dtype

    def _on_grad(self, s, grad):
        acc = self.accum.pop(s.index, None)
        if acc is not None:
            grad = acc.add_(grad)
        if self.is_gradient_accumulation_boundary():
            self.reducer.add(s, grad)
        else:
            self.accum[s.index] = grad.to(self.accum_dtype)

    def _backward(self, loss):
        boundary = self.is_gradient_accumulation_boundary()
        super()._backward(loss)
        if boundary:
            for index, acc in self.accum.items():  # no gradient in the last micro-step
                self.reducer.add(self.shards[index], acc)
            self.accum.clear()
            self._finish_reduction()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().model_state_tensors()
        tensors["gradients"] += list(self.accum.values())
        return tensors
