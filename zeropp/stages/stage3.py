"""ZeRO stage 3: the 16-bit weights are partitioned too.

The engine keeps the hooks and the order of requests; a weight's states and a
bucket's gather are in zeropp/stages/stage3_param.py, the schedules in schedule.py.

When weights are gathered:
- forward: a pre-hook on every module with direct parameters requests them, a post-hook releases
  them. A weight read outside its module (GPT's tied `wte.weight` in the output layer) is requested
  on access (each module's `_parameters` is a dict that gathers on read) and kept live through
  forward from then on.
- backward: a saved-tensor pack hook notes every saved tensor that views a live weight; unpack
  requests the weight again. Activation-checkpoint recompute requests through the module pre-hooks.
  A weight is released by its post-accumulate-grad hook, which hands its gradient to the reducer.
- schedules: forward follows the order recorded in the previous step; backward follows this step's
  forward in reverse order of each weight's last use that backward needs (a saved view, or a run
  inside a checkpointed block). Both are cut into buckets of at most `stage3_prefetch_bucket_size`
  elements. A request issues every bucket up to the one holding the weight, then prefetches the next
  while their elements stay within the prefetch bucket and all gathered weights within
  `stage3_max_live_parameters`. Issue order is a prefix of the schedule whatever the timing, and
  backward finishes by issuing what it did not need, so every rank runs the same collectives even
  when a parameter gets no gradient on some rank. Weights requested outside the schedule (the first
  step, an order change) are gathered on demand.
- reuse (DeepSpeed's): a module's weights are released after its forward unless their backward use,
  in last step's order, comes within `stage3_max_reuse_distance` elements: then they are held for
  backward (1e9 holds a small model; 0 nothing, even when one bucket covers the model).
- live bound: `schedule.live_budget` splits `stage3_max_live_parameters` between the weights read
  outside their module, the bucket a request issues and the held weights; only a module larger than
  what is left goes beyond.

ZeRO++ (arXiv 2306.10209), each switch on its own:
- qwZ (`zero_quantized_weights`): the primary partition gathers through
  `QuantizedShardGather` (INT8 blocks) in training; fp32 masters stay exact, and
  evaluation (`engine.eval()`) gathers them exactly, so a validation loss is
  the loss of the weights a checkpoint saves.
- hpZ (`zero_hpz_partition_size` h): a `SecondaryPartition` (hpz.py) over the
  node group; a weight it holds is gathered from it, inside the node.
- qgZ (`zero_quantized_gradients`): gradients go through `HierarchicalQuantizedReduce`.
- INT4 weight deltas (`zero_quantized_weight_deltas`, with hpZ): a weight gathered
  again from the primary partition goes as `WeightDeltas` (zeropp/techniques/deltas.py).
Every rank must run the same modules in forward (as with DeepSpeed and FSDP).
"""
from __future__ import annotations

import contextlib

import torch

from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import ShardReduce
from zeropp.techniques.hpz import SecondaryPartition
from zeropp.collectives.partition import Partition
from zeropp.kernels.quant import scratch_bound, scratch_bytes
from zeropp.techniques.qgz import QuantizedShardGather, qgz_reduce
from zeropp.stages.schedule import (GatherSchedule, LiveBudget, TraceRecorder, backward_order, checkpoint_region, live_budget,
                             restore_orders, reuse_set, saved_orders, without)
from zeropp.stages.sharded import ShardedEngineBase
from zeropp.stages.stage3_param import (BucketGather, GatheredWeights, GatherOnRead, PrimaryWeights, SavedWeightView,
                                 Stage3Param, WeightState)
from zeropp.techniques.deltas import WeightDeltas

__all__ = ["Stage3Engine", "Stage3Param", "WeightState"]


class Stage3Engine(ShardedEngineBase):
    # ShardedEngineBase builds its shards with this class.
    shard_class = Stage3Param

    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1, param_init=None):
        zero = config.zero_optimization
        self._persist_threshold = zero.stage3_param_persistence_threshold
        self.gathered = GatheredWeights()
        self.gather_pool = BufferPool(device)   # gather inputs, rows and qwZ's wire buffers
        self._phase: str | None = None
        self._key: tuple | None = None
        self._recorder = TraceRecorder()              # this phase's record
        self._forward_record = TraceRecorder()        # the last forward with autograd on: backward's order
        self._traces: dict[tuple, list[list[int]]] = {}  # (phase, grad, training) -> events of the last step
        self._schedule: GatherSchedule | None = None
        self._reuse: set[int] = set()       # weights to hold from forward to backward this step
        self._held: set[int] = set()        # weights held LIVE now, waiting for backward
        self._read_outside: set[int] = set()  # read outside their module: LIVE through forward (from step 2)
        self._last_backward_events: list[list[int]] | None = None
        # The ZeRO++ switches: which gather for the primary partition, and hpZ's group.
        self._weight_gather = (QuantizedShardGather(comm, zero.zero_quantized_weights_block_size)
                               if zero.zero_quantized_weights else None)   # None: the exact gather
        topo = comm.topology
        h = zero.zero_hpz_partition_size
        # A group as large as the world is the primary partition itself: nothing to add.
        self._secondary_layout = (Partition(group=topo.build_subgroup(h), size=h, rank=topo.rank % h)
                                  if 1 < h < topo.world_size else None)
        self.secondary_partition: SecondaryPartition | None = None
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps, param_init)
        self._install_hooks(module)
        self.gather_pool.budget = self._gather_buffers_bound()

    def _gradient_reduce(self) -> ShardReduce:
        return qgz_reduce(self.comm, self.zero) if self.zero.zero_quantized_gradients else super()._gradient_reduce()

    def _allocate_partitions(self):
        super()._allocate_partitions()
        for s in self.shards:
            s.place(self._persist_threshold, self._secondary_layout)
        part = [s for s in self.shards if not s.persistent]
        self.param_flat = torch.zeros(sum(s.chunk for s in part), dtype=self.dtype, device=self.device)
        # Released weights are a NaN broadcast to the full shape (one element of
        # storage): AccumulateGrad accepts a full-size gradient for it, and a
        # weight used without being gathered shows up as NaN.
        self._placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)
        off = 0
        for s in part:
            s.bind(self.param_flat[off:off + s.chunk], self._placeholder, self.gathered)
            off += s.chunk
        if self._secondary_layout is not None:
            self.secondary_partition = SecondaryPartition(self._secondary_layout, self.comm, part,
                                                          self.dtype, self.device)
        keeper = self.secondary_partition   # where weights from the primary partition are kept
        self.deltas = None
        if self.zero.zero_quantized_weight_deltas and keeper is not None:
            topo, h = self.comm.topology, keeper.size
            across = Partition(group=topo.build_strided_group(h), size=self.world // h, rank=self.rank // h)
            within = Partition(group=topo.build_subgroup(h), size=h, rank=self.rank % h)
            self.deltas = keeper = WeightDeltas(self.partition, self.comm, part, self.param_flat, keeper,
                                                self.zero.zero_quantized_weight_deltas_refresh_interval, across, within)
        self.primary = PrimaryWeights(self.partition, self.param_flat, self._weight_gather or self.gather, keeper)
        # qwZ, deltas: evaluation gathers the exact weights (those a checkpoint saves), leaving hpZ's
        # secondary copy, which holds the quantized ones training computes with, alone.
        self._exact_primary = (PrimaryWeights(self.partition, self.param_flat, self.gather)
                               if self._weight_gather is not None or self.deltas is not None else None)

    def _adopt(self, s: Stage3Param, full_fp32: torch.Tensor):
        if s.persistent:
            self._set_whole(s.param, full_fp32)
            return
        self._release(s)
        if self.secondary_partition is not None:
            self.secondary_partition.invalidate(s)
        s.set_shard(full_fp32)

    def _weight_slice(self, s: Stage3Param) -> torch.Tensor:
        return s.param.data.view(-1)[s.lo:s.hi] if s.persistent else s.shard[:s.valid]

    def _install_hooks(self, module):
        self._mod_weights = {}
        for m in module.modules():
            m._parameters = GatherOnRead(self, m._parameters)
            direct = [self.shard_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self.shard_of]
            direct = [s for s in direct if not s.persistent]
            if direct:
                self._mod_weights[m] = direct
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward, always_call=True)

    # -- the order of requests ------------------------------------------------------
    def _issue(self, params: list[Stage3Param]):
        """Start gathering the released weights among `params`: one collective
        from the secondary partition (hpZ) for those it holds, one of INT4 deltas
        for those that may go so, one from the primary partition for the rest."""
        todo = [s for s in params if not s.persistent and s.state is WeightState.RELEASED]
        if not todo:
            return
        phase = "backward_gather" if self._phase == "backward" else "forward_gather"
        if self._exact_primary is not None and not self.module.training:
            BucketGather(todo, self._exact_primary, phase, self.gather_pool)
            return
        sec, deltas = self.secondary_partition, self.deltas
        secondary = [s for s in todo if sec is not None and sec.holds(s)]
        as_delta = [s for s in todo if deltas is not None and deltas.ready(s) and s not in secondary]
        primary = [s for s in todo if s not in secondary and s not in as_delta]
        for source, weights in ((self.primary, primary), (deltas, as_delta), (sec, secondary)):
            if weights:
                BucketGather(weights, source, phase, self.gather_pool)

    def _issue_next(self, sched: GatherSchedule):
        self._issue([self.shards[i] for i in sched.buckets[sched.issued]])
        sched.issued += 1

    def _request(self, params: list[Stage3Param]):
        """Make `params` live now: issue what the schedule has up to them (the
        needed bucket first), prefetch after, then wait."""
        if self._phase is not None:  # the order of first uses, whatever was prefetched
            self._recorder.first_uses([s.index for s in params if not s.persistent])
        need = [s for s in params if not s.persistent and s.state is not WeightState.LIVE]
        if not need:
            return
        sched = self._schedule
        if sched is not None:
            target = max((sched.bucket_of.get(s.index, -1) for s in need), default=-1)
            while sched.issued <= target:
                self._issue_next(sched)
            sched.reached = max(sched.reached, target + 1)
        self._issue(need)  # anything the schedule did not cover: on demand
        if sched is not None:
            self._prefetch(sched)
        for s in need:
            s.wait()

    def _prefetch(self, sched: GatherSchedule):
        """Issue the next buckets while those issued ahead of the last requested
        one stay within the prefetch bucket and all gathered weights (held ones
        and those still waiting for their gradients included) within
        `stage3_max_live_parameters`. Ranks may decide differently (a weight
        without gradient stays live longer on some rank); that changes only
        when a bucket is issued, never which buckets or in which order."""
        zero = self.zero
        live = self.gathered.bytes // self._placeholder.element_size()
        while sched.issued < len(sched.buckets):
            nxt = sched.elems[sched.issued]
            if sum(sched.elems[sched.reached:sched.issued]) + nxt > zero.stage3_prefetch_bucket_size \
                    or live + nxt > zero.stage3_max_live_parameters:
                return
            self._issue_next(sched)
            live += nxt

    # -- phases -------------------------------------------------------------------
    def _numels(self) -> list[int]:
        return [s.numel for s in self.shards]

    def _begin(self, phase: str):
        self._phase = phase
        self._key = (phase, torch.is_grad_enabled(), self.module.training)
        self._recorder = TraceRecorder()
        if phase == "forward":
            if torch.is_grad_enabled():  # a forward without a graph (eval) has no backward
                self._forward_record = self._recorder
            events = self._traces.get(self._key)
            self._reuse = self._reuse_set() if self._key == ("forward", True, True) else set()
        else:
            order = backward_order(self._forward_record.touch)
            if self._key == ("backward", True, True):
                self._last_backward_events = order
            events = without(order, self._held)  # held: already live
        self._schedule = (GatherSchedule.cut(events, self._numels(), self._budget(events).bucket)
                          if events else None)

    def _end(self):
        if self._phase == "backward" and self._schedule is not None:
            sched = self._schedule  # what backward did not need: issue anyway, so ranks agree
            while sched.issued < len(sched.buckets):
                self._issue_next(sched)
        self._traces[self._key] = self._recorder.events
        for s in self.shards:
            if not (self._phase == "forward" and s.index in self._held):
                self._release(s)
        self._phase = None
        self._schedule = None

    def _budget(self, events: list[list[int]] | None) -> LiveBudget:
        return live_budget(self.zero.stage3_max_live_parameters, self.zero.stage3_prefetch_bucket_size,
                           self._numels(), events or [], self._read_outside)

    def _reuse_set(self) -> set[int]:
        fwd = self._traces.get(("forward", True, True))
        return reuse_set(fwd, self._last_backward_events, self._numels(), self.zero.stage3_max_reuse_distance,
                         self._budget(fwd).hold, pinned=self._read_outside)

    # -- module hooks ---------------------------------------------------------------
    def _pre_forward(self, module, args):
        weights = self._mod_weights[module]
        self._request(weights)
        if self._phase == "forward" and torch.is_grad_enabled():
            region = checkpoint_region(self._pack)
            if region is not None:  # the recompute in backward will need them
                self._recorder.recomputed([s.index for s in weights], region)

    def _post_forward(self, module, args, output):
        if self._phase != "forward":
            return  # recompute in backward: freed once their gradients are in
        for s in self._mod_weights[module]:
            if s.index in self._reuse and torch.is_grad_enabled():
                self._held.add(s.index)
            if s.index not in self._held and s.index not in self._read_outside:
                s.release()

    # -- saved tensors: note saved views of gathered weights --------------------------
    def _pack(self, x):
        if x.layout != torch.strided:
            return x
        try:
            s = self.gathered.owner(x)
        except (RuntimeError, NotImplementedError):
            return x
        if s is None:
            return x
        self._recorder.saved(s.index)
        return SavedWeightView(s, x)

    def _unpack(self, obj):
        if type(obj) is SavedWeightView:
            self._request([obj.weight])
            return obj.tensor
        return obj

    # -- training interface ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._begin("forward")
        hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                 if torch.is_grad_enabled() else contextlib.nullcontext())
        try:
            with hooks:
                return self.module(*args, **kwargs)
        finally:
            self._end()

    def _backward(self, loss):
        self._begin("backward")
        try:
            super()._backward(loss)
            self._finish_reduction()
        finally:
            self._end()

    def _on_grad(self, s: Stage3Param, grad: torch.Tensor):
        self.reducer.add(s, grad)
        self._release(s)

    def _release(self, s: Stage3Param):
        s.release()
        self._held.discard(s.index)

    # -- Engine hooks ------------------------------------------------------------------
    def _weights_changed(self):   # loaded: hpZ's copies are stale, the deltas have no base
        if self.secondary_partition is not None:
            self.secondary_partition.invalidate()
        if self.deltas is not None:
            self.deltas.forget()

    def _publish_weights(self):
        if self.secondary_partition is not None:
            self.secondary_partition.invalidate()   # it holds the weights of before
        with torch.no_grad():
            if self.master_flat is not None:  # 16-bit: round the updated masters into the shards
                for s in self.shards:
                    if s.valid:
                        self._weight_slice(s).copy_(s.master)
            self._gather_weights([s for s in self.shards if s.persistent], self._weight_slice,
                                 lambda s, full: s.param.data.view(-1).copy_(full), self.dtype, "optimizer")

    def scalar_state(self) -> dict:   # the recorded orders too (schedule.saved_orders says why)
        return {**super().scalar_state(), "schedule": saved_orders(self._traces, self._last_backward_events)}

    def load_scalar_state(self, sd: dict) -> list[str]:
        last = self._last_backward_events
        self._last_backward_events = restore_orders(sd.get("schedule"), self._traces, last, self.shards)
        return super().load_scalar_state(sd)

    def _carried_parts(self) -> dict:   # the deltas prepare themselves at end_step
        return {**super()._carried_parts(), **({"weight_deltas": self.deltas} if self.deltas is not None else {})}

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        live = [s.param.data for s in self.shards if s.persistent or s.state is WeightState.LIVE]
        secondary = [self.secondary_partition.flat] if self.secondary_partition is not None else []
        feedback = self.error_feedback.tensors() if self.error_feedback is not None else []
        deltas = [self.deltas.recon, self.deltas.flat] if self.deltas is not None else []
        return {"parameters": [self.param_flat] + secondary + deltas + live, "gradients": [self.grad_flat] + feedback,
                "optimizer": self._optimizer_tensors()}

    def peak_buffers(self) -> dict:
        b = self._placeholder.element_size()
        peaks = {**super().peak_buffers(), "gathered_weights_peak": self.gathered.peak_bytes,
                 "gathered_weights_bound": self._gathered_bound(b),
                 "gather_buffers_peak": self.gather_pool.peak_bytes,
                 "gather_buffers_bound": self._gather_buffers_bound()}
        zero = self.zero
        if zero.zero_quantized_weights or zero.zero_quantized_gradients or self.deltas is not None:
            # the torch quantization path's chunk temporaries, kept for reuse (none on CUDA)
            block = max(zero.zero_quantized_weights_block_size, zero.zero_quantized_gradients_block_size)
            peaks["quantizer_scratch_peak"] = scratch_bytes(self.device)
            peaks["quantizer_scratch_bound"] = scratch_bound(block, self.world)
        return peaks

    def _gathered_bound(self, b: int) -> int:
        """schedule.live_budget: the live bound, or the weights read outside their module + the largest module."""
        largest = max((sum(s.numel for s in ws) for ws in self._mod_weights.values()), default=0)
        pinned = sum(self._numels()[i] for i in self._read_outside)
        return b * max(self.zero.stage3_max_live_parameters, pinned + largest)

    def _gather_buffers_bound(self) -> int:
        """Gathers in flight at once: the bucket requested, those prefetched (at most the prefetch bucket) and a
        weight read outside its module, each bucket at most max(prefetch bucket, the largest module's weights).
        Per gathered element, the most any of the gathers needs (compute dtype, b bytes): an exact gather over N
        ranks (evaluation, or without ZeRO++) its [N, total] rows and the input when not adjacent, b (1 + 1/N);
        hpZ's over the h ranks of its group b (1 + 1/h); qwZ, which delivers row by row into the weights, its
        input and one row, 2b/N, and the INT8 wire, received (1 + 4/block bytes) and sent (1/N of that); the
        weight deltas' gather, what WeightDeltas.inflight_bytes_per_element says."""
        zero, n, b = self.zero, self.world, self._placeholder.element_size()
        largest_module = max((sum(s.chunk for s in ws) * n for ws in self._mod_weights.values()), default=0)
        largest_weight = max((s.chunk * n for s in self.shards if not s.persistent), default=0)
        bucket = max(zero.stage3_prefetch_bucket_size, largest_module)
        elems = min(zero.stage3_prefetch_bucket_size + bucket + largest_weight,   # at most every weight
                    sum(s.chunk * n for s in self.shards if not s.persistent))
        per_elem = b * (1 + 1 / n)
        if self.secondary_partition is not None:
            per_elem = max(per_elem, b * (1 + 1 / self.secondary_partition.size))
        if self._weight_gather is not None:
            wire = (1 + 4 / zero.zero_quantized_weights_block_size) * (1 + 1 / n)
            per_elem = max(per_elem, 2 * b / n + wire)
        if self.deltas is not None:
            per_elem = max(per_elem, self.deltas.inflight_bytes_per_element(b))
        return int(elems * per_elem) + (self.deltas.dequant_buffer_bytes() if self.deltas else 0) + 4096
