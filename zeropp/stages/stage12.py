"""ZeRO stages 1 and 2: every rank holds the whole 16-bit model (`FullWeights`); fp32 master
weights, optimizer state and the fp32 gradient partition are sharded (zeropp/stages/masters.py).
After the optimizer step each rank's updated slices are all-gathered back into the full
weights.

The two stages differ only in when a gradient goes to the reduce-scatter:
- stage 2 (`ImmediateGradients`, stage 3's too): every micro-step, the moment autograd produces
  it, so no full gradient outlives its bucket;
- stage 1 (`AccumulatedGradients`): on the last micro-step of the accumulation; earlier
  micro-steps add into a full-size accumulator (fp32 in 16-bit training) kept between
  micro-steps, the unpartitioned gradient that stage 1 is defined by.
"""
from __future__ import annotations

from typing import Callable

import torch

from zeropp.collectives.exact import GradientReducer, ShardGather, gather_bucketed
from zeropp.collectives.partition import Partition, ShardedParam
from zeropp.stages.init import replace_data


def set_whole(param: torch.Tensor, full_fp32: torch.Tensor, dtype: torch.dtype):
    """A parameter every rank holds whole: new data, or a copy into the old."""
    if param.is_meta or param.dtype != dtype or param.device != full_fp32.device:
        replace_data(param, full_fp32.view(param.shape).to(dtype, copy=True))
    else:
        param.data.copy_(full_fp32.view(param.shape))


class FullWeights:
    """Stages 1 and 2: the 16-bit weights stay whole on every rank."""

    def __init__(self, shards: list[ShardedParam], gather: ShardGather, partition: Partition, dtype, device,
                 allgather_bucket_size: int):
        self.shards, self.gather, self.partition = shards, gather, partition
        self.dtype, self.device, self.bucket = dtype, device, allgather_bucket_size

    def adopt(self, s: ShardedParam, full_fp32: torch.Tensor):
        """Keep what this stage holds of the weight (full: fp32, flat)."""
        set_whole(s.param, full_fp32, self.dtype)

    def weight_slice(self, s: ShardedParam) -> torch.Tensor:
        """This rank's `valid` elements of the compute-dtype weight."""
        return s.param.data.view(-1)[s.lo:s.hi]

    def publish(self, masters_are_weights: bool):
        """After a step: the updated masters into the weights, gathered whole on every rank."""
        if not masters_are_weights:  # 16-bit: round the updated masters into the weights
            with torch.no_grad():
                for s in self.shards:
                    if s.valid:
                        self.weight_slice(s).copy_(s.master)
        gather_bucketed(self.gather, self.shards, self.weight_slice,
                        lambda s, full: s.param.data.view(-1).copy_(full), self.partition, self.dtype,
                        self.device, self.bucket, "optimizer")

    def changed(self):
        """The weights were replaced from outside (a load): nothing kept depends on them."""

    def tensors(self) -> list[torch.Tensor]:
        return [s.param.data for s in self.shards]

    def memory_lines(self) -> list:
        return []

    def peak_buffers(self) -> dict:
        return {}


class ImmediateGradients:
    """Stages 2 and 3: each gradient goes to the reducer as autograd produces it; `released(s)`
    (stage 3) then frees the gathered weight."""

    def __init__(self, reducer: GradientReducer, released: Callable | None = None):
        self.reducer, self.released = reducer, released

    def begin(self, boundary: bool):
        pass

    def add(self, s: ShardedParam, grad: torch.Tensor):
        self.reducer.add(s, grad)
        if self.released is not None:
            self.released(s)

    def reduce_now(self) -> bool:
        """End of a backward: whether the reduction finishes now."""
        return True

    def tensors(self) -> list[torch.Tensor]:
        return []


class AccumulatedGradients:
    """Stage 1: gradients accumulate whole until the last micro-step, then go to the reducer."""

    def __init__(self, reducer: GradientReducer, shards: list[ShardedParam], dtype: torch.dtype):
        self.reducer, self.shards = reducer, shards
        self.accum: dict[int, torch.Tensor] = {}  # shard index -> full gradient of earlier micro-steps
        self.accum_dtype = torch.float32 if dtype != torch.float32 else dtype
        self.boundary = False

    def begin(self, boundary: bool):
        self.boundary = boundary

    def add(self, s: ShardedParam, grad: torch.Tensor):
        acc = self.accum.pop(s.index, None)
        if acc is not None:
            grad = acc.add_(grad)
        if self.boundary:
            self.reducer.add(s, grad)
        else:
            self.accum[s.index] = grad.to(self.accum_dtype)

    def reduce_now(self) -> bool:
        if self.boundary:
            for index, acc in self.accum.items():  # no gradient in the last micro-step
                self.reducer.add(self.shards[index], acc)
            self.accum.clear()
        return self.boundary

    def tensors(self) -> list[torch.Tensor]:
        return list(self.accum.values())
