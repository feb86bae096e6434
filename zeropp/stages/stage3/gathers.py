"""ZeRO stage 3's gathers: the order in which weights are requested, gathered and released.

`WeightGathers` is asked by the hooks (hooks.py, beside it) for weights and decides what to
gather when; a weight's states and a bucket's gather are in param.py, where a gather reads from
in weights.py, the schedules in zeropp/stages/schedule.py.

- forward: a module's pre-hook requests its weights, its post-hook releases them. A weight read
  outside its module (GPT's tied `wte.weight` in the output layer) is requested on access and
  kept live through forward from then on.
- backward: unpacking a saved view of a weight requests it again; activation-checkpoint
  recompute requests through the module pre-hooks. A weight is released once its gradient is
  handed to the reducer.
- schedules: forward follows the order recorded in the previous step; backward follows this
  step's forward in reverse order of each weight's last use that backward needs (a saved view,
  or a run inside a checkpointed block). Both are cut into buckets of at most
  `stage3_prefetch_bucket_size` elements. A request issues every bucket up to the one holding
  the weight, then prefetches the next while their elements stay within the prefetch bucket and
  all gathered weights within `stage3_max_live_parameters`. Issue order is a prefix of the
  schedule whatever the timing, and backward finishes by issuing what it did not need, so every
  rank runs the same collectives even when a parameter gets no gradient on some rank. Weights
  requested outside the schedule (the first step, an order change) are gathered on demand.
- reuse (DeepSpeed's): a module's weights are released after its forward unless their backward
  use, in last step's order, comes within `stage3_max_reuse_distance` elements: then they are
  held for backward (1e9 holds a small model; 0 nothing, even when one bucket covers the model).
- live bound: `schedule.live_budget` splits `stage3_max_live_parameters` between the weights read
  outside their module, the bucket a request issues and the held weights; only a module larger
  than what is left goes beyond.
Every rank must run the same modules in forward (as with DeepSpeed and FSDP).
"""
from __future__ import annotations

import torch

from zeropp.config import ZeroConfig
from zeropp.stages.schedule import (GatherSchedule, LiveBudget, TraceRecorder, backward_order,
                                    live_budget, restore_orders, reuse_set, saved_orders, without)
from zeropp.stages.stage3.param import BucketGather, GatheredWeights, Stage3Param, WeightState
from zeropp.stages.stage3.weights import PartitionedWeights


class WeightGathers:
    """The order of requests of one stage-3 engine: phases, schedules, prefetch, holding for backward."""

    def __init__(self, store: PartitionedWeights, gathered: GatheredWeights, zero: ZeroConfig, module):
        self.store, self.gathered, self.zero, self.module = store, gathered, zero, module
        self.shards = store.shards
        self.numels = [s.numel for s in self.shards]
        self.phase: str | None = None
        self._key: tuple | None = None
        self.recorder = TraceRecorder()              # this phase's record
        self._forward_record = TraceRecorder()        # the last forward with autograd on: backward's order
        self._traces: dict[tuple, list[list[int]]] = {}  # (phase, grad, training) -> events of the last step
        self._schedule: GatherSchedule | None = None
        self.reuse: set[int] = set()       # weights to hold from forward to backward this step
        self.held: set[int] = set()        # weights held LIVE now, waiting for backward
        self.read_outside: set[int] = set()  # read outside their module: LIVE through forward (from step 2)
        self._last_backward_events: list[list[int]] | None = None

    # -- the order of requests ------------------------------------------------------
    def _issue(self, params: list[Stage3Param]):
        """Start gathering the released weights among `params`, one collective per source
        (PartitionedWeights.plan says which)."""
        todo = [s for s in params if not s.persistent and s.state is WeightState.RELEASED]
        if not todo:
            return
        phase = "backward_gather" if self.phase == "backward" else "forward_gather"
        for source, weights in self.store.plan(todo, self.module.training):
            BucketGather(weights, source, phase, self.store.pool)

    def _issue_next(self, sched: GatherSchedule):
        self._issue([self.shards[i] for i in sched.buckets[sched.issued]])
        sched.issued += 1

    def request(self, params: list[Stage3Param]):
        """Make `params` live now: issue what the schedule has up to them (the
        needed bucket first), prefetch after, then wait."""
        if self.phase is not None:  # the order of first uses, whatever was prefetched
            self.recorder.first_uses([s.index for s in params if not s.persistent])
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

    def read(self, s: Stage3Param):
        """`s` is read (GatherOnRead): if it is not live, outside its module's forward, so it is
        gathered and kept live through forward."""
        if s.state is WeightState.LIVE:
            return
        if self.phase == "forward":
            self.read_outside.add(s.index)
            self.recorder.read_outside(s.index)
        self.request([s])

    def _prefetch(self, sched: GatherSchedule):
        """Issue the next buckets while those issued ahead of the last requested
        one stay within the prefetch bucket and all gathered weights (held ones
        and those still waiting for their gradients included) within
        `stage3_max_live_parameters`. Ranks may decide differently (a weight
        without gradient stays live longer on some rank); that changes only
        when a bucket is issued, never which buckets or in which order."""
        zero = self.zero
        live = self.gathered.bytes // self.store.dtype.itemsize
        while sched.issued < len(sched.buckets):
            nxt = sched.elems[sched.issued]
            if sum(sched.elems[sched.reached:sched.issued]) + nxt > zero.stage3_prefetch_bucket_size \
                    or live + nxt > zero.stage3_max_live_parameters:
                return
            self._issue_next(sched)
            live += nxt

    # -- phases -------------------------------------------------------------------
    def begin(self, phase: str):
        self.phase = phase
        self._key = (phase, torch.is_grad_enabled(), self.module.training)
        self.recorder = TraceRecorder()
        if phase == "forward":
            if torch.is_grad_enabled():  # a forward without a graph (eval) has no backward
                self._forward_record = self.recorder
            events = self._traces.get(self._key)
            self.reuse = self._reuse_set() if self._key == ("forward", True, True) else set()
        else:
            order = backward_order(self._forward_record.touch)
            if self._key == ("backward", True, True):
                self._last_backward_events = order
            events = without(order, self.held)  # held: already live
        self._schedule = (GatherSchedule.cut(events, self.numels, self._budget(events).bucket)
                          if events else None)

    def end(self):
        if self.phase == "backward" and self._schedule is not None:
            sched = self._schedule  # what backward did not need: issue anyway, so ranks agree
            while sched.issued < len(sched.buckets):
                self._issue_next(sched)
        self._traces[self._key] = self.recorder.events
        for s in self.shards:
            if not (self.phase == "forward" and s.index in self.held):
                self.release(s)
        self.phase = None
        self._schedule = None

    def _budget(self, events: list[list[int]] | None) -> LiveBudget:
        return live_budget(self.zero.stage3_max_live_parameters, self.zero.stage3_prefetch_bucket_size,
                           self.numels, events or [], self.read_outside)

    def _reuse_set(self) -> set[int]:
        fwd = self._traces.get(("forward", True, True))
        return reuse_set(fwd, self._last_backward_events, self.numels, self.zero.stage3_max_reuse_distance,
                         self._budget(fwd).hold, pinned=self.read_outside)

    def forward_done(self, weights: list[Stage3Param]):
        """A module's forward is over: release its weights unless held for backward or read outside."""
        if self.phase != "forward":
            return  # recompute in backward: freed once their gradients are in
        for s in weights:
            if s.index in self.reuse and torch.is_grad_enabled():
                self.held.add(s.index)
            if s.index not in self.held and s.index not in self.read_outside:
                s.release()

    def release(self, s: Stage3Param):
        """`s` is no longer needed (its gradient is in, or it was loaded)."""
        s.release()
        self.held.discard(s.index)

    # -- what the engine reports and saves -------------------------------------------------
    def largest_module(self, module_weights) -> int:
        return max((sum(s.numel for s in ws) for ws in module_weights), default=0)

    def gathered_bound(self, module_weights) -> int:
        """schedule.live_budget: the live bound, or the weights read outside their module + the largest module."""
        pinned = sum(self.numels[i] for i in self.read_outside)
        b = self.store.dtype.itemsize
        return b * max(self.zero.stage3_max_live_parameters, pinned + self.largest_module(module_weights))

    def scalar_state(self) -> dict:   # the recorded orders (schedule.saved_orders says why)
        return saved_orders(self._traces, self._last_backward_events)

    def load_scalar_state(self, saved: dict | None):
        self._last_backward_events = restore_orders(saved, self._traces, self._last_backward_events, self.shards)
