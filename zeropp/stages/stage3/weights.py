"""Stage 3's parameter store: the 16-bit weights partitioned too, and where each gather of a
weight comes from.

`place_weights` decides each weight's layout (persistent or partitioned, hpZ's slice) and binds
the partitioned ones to one flat compute-dtype buffer. `PartitionedWeights` keeps them and the
weight sources (zeropp/collectives/protocols.py `WeightSource`) a gather may read:
- the primary partition over all ranks (`PrimaryWeights`: exact, or qwZ's INT8 gather);
- hpZ's secondary partition inside the node (zeropp/techniques/hpz.py), for the weights it holds;
- the INT4 weight deltas (zeropp/techniques/deltas.py), for those that may go as deltas;
- evaluation (`engine.eval()`) computes with the exact primary weights (those a checkpoint
  saves): from the primary partition, or from hpZ's copy where it holds them exactly (an
  evaluation's first batch keeps them there; zeropp/techniques/hpz.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import ShardGather, gather_bucketed
from zeropp.collectives.partition import Partition
from zeropp.kernels.quant import scratch_bound, scratch_bytes
from zeropp.stages.stage12 import set_whole
from zeropp.stages.stage3.param import GatheredWeights, PrimaryWeights, Stage3Param, WeightState


def place_weights(shards: list[Stage3Param], persist_threshold: int, secondary: Partition | None, dtype, device,
                  gathered: GatheredWeights) -> torch.Tensor:
    """Lay the weights out (persistent or partitioned, hpZ's slice) and bind each partitioned one
    to its chunk of one flat compute-dtype buffer, which is returned."""
    for s in shards:
        s.place(persist_threshold, secondary)
    part = [s for s in shards if not s.persistent]
    flat = torch.zeros(sum(s.chunk for s in part), dtype=dtype, device=device)
    # Released weights are a NaN broadcast to the full shape (one element of storage):
    # AccumulateGrad accepts a full-size gradient for it, and a weight used without being
    # gathered shows up as NaN.
    placeholder = torch.full((1,), float("nan"), dtype=dtype, device=device)
    off = 0
    for s in part:
        s.bind(flat[off:off + s.chunk], placeholder, gathered)
        off += s.chunk
    return flat


@dataclass
class WeightSources:
    """Where gathers read from. `primary` always; `exact` (evaluation) when `primary` is not exact;
    `secondary` (hpZ) and `deltas` when on. `quantizer_block`: the largest block size of the
    quantized paths on (their kernels' scratch), 0 when none is."""
    primary: PrimaryWeights
    exact: PrimaryWeights | None = None
    secondary: object | None = None
    deltas: object | None = None
    quantizer_block: int = 0

    def memory_lines(self) -> list:
        """What they keep between steps besides the shards (hpZ's copy; the deltas' references are
        carried state): zeropp/collectives/protocols.py MemoryLine."""
        return [self.secondary.memory()] if self.secondary is not None else []


class PartitionedWeights:
    """The partitioned weights of stage 3, their sources and the pool their gathers take from."""

    def __init__(self, shards: list[Stage3Param], flat: torch.Tensor, sources: WeightSources, gather: ShardGather,
                 partition: Partition, allgather_bucket_size: int, prefetch_bucket_size: int):
        self.shards, self.flat, self.sources = shards, flat, sources
        self.prefetch_bucket = prefetch_bucket_size
        self.partitioned = [s for s in shards if not s.persistent]
        self.gather, self.partition, self.bucket = gather, partition, allgather_bucket_size
        self.dtype, self.device = flat.dtype, flat.device
        self.pool = BufferPool(flat.device)   # gather inputs, rows and qwZ's wire buffers

    def adopt(self, s: Stage3Param, full_fp32: torch.Tensor):
        """Keep what this stage holds of the weight (full: fp32, flat)."""
        if s.persistent:
            set_whole(s.param, full_fp32, self.dtype)
            return
        s.release()
        if self.sources.secondary is not None:
            self.sources.secondary.invalidate(s)
        s.set_shard(full_fp32)

    def weight_slice(self, s: Stage3Param) -> torch.Tensor:
        return s.param.data.view(-1)[s.lo:s.hi] if s.persistent else s.shard[:s.valid]

    def plan(self, todo: list[Stage3Param], training: bool) -> list[tuple[object, list[Stage3Param]]]:
        """(source, weights) to gather `todo` from, in issue order: hpZ's partition for the weights
        it holds (exactly, in evaluation), the deltas for those that may go so (in training), the
        primary partition for the rest, exactly in evaluation (issued primary, deltas, secondary)."""
        src = self.sources
        exact_only = src.exact is not None and not training
        secondary = [s for s in todo if src.secondary is not None and src.secondary.holds(s, exact=exact_only)]
        if exact_only:
            rest = [s for s in todo if s not in secondary]
            return [(source, ws) for source, ws in ((src.exact, rest), (src.secondary, secondary)) if ws]
        as_delta = [s for s in todo if src.deltas is not None and src.deltas.holds(s) and s not in secondary]
        primary = [s for s in todo if s not in secondary and s not in as_delta]
        return [(source, ws) for source, ws in ((src.primary, primary), (src.deltas, as_delta),
                                                  (src.secondary, secondary)) if ws]

    def publish(self, masters_are_weights: bool):
        """After a step: hpZ's copies are stale; the masters into the shards; persistent weights gathered."""
        if self.sources.secondary is not None:
            self.sources.secondary.invalidate()   # it holds the weights of before
        with torch.no_grad():
            if not masters_are_weights:  # 16-bit: round the updated masters into the shards
                for s in self.shards:
                    if s.valid:
                        self.weight_slice(s).copy_(s.master)
            gather_bucketed(self.gather, [s for s in self.shards if s.persistent], self.weight_slice,
                            lambda s, full: s.param.data.view(-1).copy_(full), self.partition, self.dtype,
                            self.device, self.bucket, "optimizer")

    def changed(self):
        """Loaded: hpZ's copies are stale, the deltas have no base."""
        if self.sources.secondary is not None:
            self.sources.secondary.invalidate()
        if self.sources.deltas is not None:
            self.sources.deltas.forget()

    def tensors(self) -> list[torch.Tensor]:
        """The shards, what the sources keep and the weights live now (memory reports)."""
        live = [s.param.data for s in self.shards if s.persistent or s.state is WeightState.LIVE]
        kept = self.sources.secondary.tensors() if self.sources.secondary is not None else []
        return [self.flat] + kept + live

    def memory_lines(self) -> list:
        return self.sources.memory_lines()

    def gather_bound(self, module_weights) -> int:
        """Gathers in flight at once: the bucket requested, those prefetched (at most the prefetch
        bucket) and a weight read outside its module, each bucket at most max(prefetch bucket, the
        largest module's weights: `module_weights`). Per gathered element the most any source
        needs (an exact gather over N ranks, for evaluation or without ZeRO++, at least: its
        [N, total] rows and the input when not adjacent, b (1 + 1/N)), plus what a source holds
        whatever the size (the deltas' dequantization buffer)."""
        n, prefetch, part = self.partition.size, self.prefetch_bucket, self.partitioned
        largest_module = max((sum(s.chunk for s in ws) * n for ws in module_weights), default=0)
        largest_weight = max((s.chunk * n for s in part), default=0)
        bucket = max(prefetch, largest_module)
        elems = min(prefetch + bucket + largest_weight, sum(s.chunk * n for s in part))   # at most every weight
        b = self.flat.element_size()
        sources = [s for s in (self.sources.primary, self.sources.exact, self.sources.secondary,
                               self.sources.deltas) if s is not None]
        per_elem = max([b * (1 + 1 / self.partition.size)] + [s.bytes_per_element(b) for s in sources])
        return int(elems * per_elem) + sum(s.fixed_bytes() for s in sources) + 4096

    def peak_buffers(self, bound: int) -> dict:
        peaks = {"gather_buffers_peak": self.pool.peak_bytes, "gather_buffers_bound": bound}
        if self.sources.quantizer_block:
            # the torch quantization path's chunk temporaries, kept for reuse (none on CUDA)
            peaks["quantizer_scratch_peak"] = scratch_bytes(self.device)
            peaks["quantizer_scratch_bound"] = scratch_bound(self.sources.quantizer_block, self.partition.size)
        return peaks
