"""ZeRO stage 3: the 16-bit weights are partitioned too.

Each partitioned weight (a `Stage3Param`) keeps its chunk in one flat
compute-dtype buffer and owns a full-shaped tensor `full` whose storage is
allocated only while the weight is gathered. The module's Parameter points at
`full` while the weight is LIVE and at a NaN placeholder (no storage) while it
is RELEASED, so a use without a gather shows up as NaN, never as stale data.
Releasing frees the storage itself (`resize_(0)`), also when autograd or an
activation-checkpoint recompute still holds views of it; re-gathering fills
the same storage, so those views are valid again. Parameters with at most
`stage3_param_persistence_threshold` elements stay whole on every rank.

When weights are gathered (all through one `ShardGather`, a bucket of weights
per collective):
- forward: a pre-hook on every module with direct parameters requests them, a
  post-hook releases them. A weight read outside its module (GPT's tied
  `wte.weight` in the output layer) is requested on access (each module's
  `_parameters` is a dict that gathers on read) and kept to the end of forward.
- backward: a saved-tensor pack hook notes every saved tensor that views a
  live weight; unpack requests the weight again. Activation-checkpoint
  recompute requests through the module pre-hooks. A weight is released by
  its post-accumulate-grad hook, which hands its gradient to the reducer.
- schedules: forward follows the order recorded in the previous step;
  backward follows this step's forward in reverse order of each weight's last
  use that backward needs (a saved view, or a run inside a checkpointed
  block). Schedules are cut into buckets of `stage3_prefetch_bucket_size`
  elements. A request issues every bucket up to the one holding the weight,
  then prefetches the next while their elements stay within the prefetch
  bucket and all gathered weights within `stage3_max_live_parameters`. Issue
  order is a prefix of the schedule whatever the timing, and backward finishes
  by issuing what it did not need, so every rank runs the same collectives
  even when a parameter gets no gradient on some rank. Weights requested outside
  the schedule (the first step, an order change) are gathered on demand.
- reuse: a weight whose backward use, in last step's order, comes within
  `stage3_max_reuse_distance` elements of its forward use is held from
  forward to backward (DeepSpeed's default 1e9 holds every weight of a small
  model; 0 re-gathers everything in backward).

ZeRO++ (REFERENCE.md section 2), each switch on its own:
- qwZ (`zero_quantized_weights`): the weight gathers above go through
  `QuantizedShardGather` (INT8 blocks); fp32 masters stay exact.
- hpZ (`zero_hpz_partition_size` h): when a weight arrives from the primary
  partition, each rank keeps a slice of it partitioned over its group of h
  ranks inside the node (the secondary partition, 2M/h bytes in 16-bit). Every
  later gather of that weight (backward, checkpoint recompute, the next
  micro-step's forward, eval) reads the secondary partition inside the group
  only, with the exact gather. The secondary copy holds exactly the values the
  primary gather produced, so results are bit-identical to plain ZeRO-3. It
  goes stale after each optimizer step and each load of weights.
- qgZ (`zero_quantized_gradients`): gradient buckets go through
  `HierarchicalQuantizedReduce` instead of a reduce-scatter.

Stage 3 needs every rank to run the same modules in forward (as DeepSpeed and
FSDP do); what reaches the loss may differ.
"""
from __future__ import annotations

import contextlib
import enum

import torch

from zeropp.collectives import ShardReduce
from zeropp.init import replace_data
from zeropp.partition import Partition, ShardedParam, bucketize
from zeropp.quantized_collectives import HierarchicalQuantizedReduce, QuantizedShardGather
from zeropp.sharded import ShardedEngineBase


class WeightState(enum.Enum):
    RELEASED = "released"      # only this rank's chunk exists
    GATHERING = "gathering"    # an all-gather for it is in flight
    LIVE = "live"              # `full` holds the whole weight and the Parameter points at it


class Stage3Param(ShardedParam):
    """A partitioned weight's gather state (persistent ones use none of it)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.persistent = False
        self.shard: torch.Tensor | None = None   # compute dtype, `chunk` elements (padded)
        self.full: torch.Tensor | None = None    # full shape; storage allocated only while gathered
        self.state = WeightState.RELEASED
        self.bucket: _Gather | None = None       # the collective bringing it, while GATHERING
        self.hold = False   # stays live from forward to backward (reuse distance)
        self.keep = False   # once read outside its module in forward: live from first use to its end
        # hpZ: this rank's slice of the weight in its node group (sec_chunk elements, padded)
        self.sec_chunk = self.sec_lo = self.sec_hi = 0
        self.secondary: torch.Tensor | None = None
        self.sec_fresh = False   # holds the weights of the current step

    def place(self, persist_threshold: int, secondary: Partition | None):
        """Decide the layout (no memory; the planner calls this too): persistent
        (at most `persist_threshold` elements: kept whole on every rank) or
        partitioned, and then hpZ's slice in the `secondary` partition, the
        primary's layout over its h members."""
        self.persistent = self.numel <= persist_threshold
        if secondary is not None and not self.persistent:
            self.sec_chunk = max(1, -(-self.numel // secondary.size))
            self.sec_lo = min(secondary.rank * self.sec_chunk, self.numel)
            self.sec_hi = min(self.sec_lo + self.sec_chunk, self.numel)


class _Gather:
    """One in-flight all-gather of several weights, from the primary partition
    or (hpZ) from the secondary one."""

    def __init__(self, params: list[Stage3Param], pending, secondary: bool):
        self.params, self.pending, self.secondary = params, pending, secondary


class _Schedule:
    """A recorded order of weights, cut into gather buckets."""

    def __init__(self, events: list[list[int]], params: list[Stage3Param], bucket_elems: int):
        self.buckets = [[i for event in group for i in event]
                        for group in bucketize(events, lambda e: sum(params[i].numel for i in e),
                                               bucket_elems)]
        self.elems = [sum(params[i].numel for i in b) for b in self.buckets]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self.issued = 0     # buckets issued so far (always a prefix)
        self.reached = 0    # highest bucket requested so far, + 1


class Stage3Engine(ShardedEngineBase):
    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1, param_init=None):
        self._init_state(config.zero_optimization)
        self._init_zeropp(config.zero_optimization, comm)
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps, param_init)
        self._install_hooks(module)

    # ShardedEngineBase builds its shards with this class.
    shard_class = Stage3Param

    def _init_state(self, zero):
        self._placeholder = None
        self._persist_threshold = zero.stage3_param_persistence_threshold
        self._phase: str | None = None
        self._live_storage: dict[int, Stage3Param] = {}  # data_ptr of a live `full` -> its weight
        self._traces: dict = {}          # (phase, grad, training) -> events of the last step
        self._trace: list[list[int]] = []
        self._used: set[int] = set()     # weights requested so far in this phase
        self._schedule: _Schedule | None = None
        # weight index -> (checkpoint region or None, forward event) of its last use backward needs
        self._touch: dict[int, tuple[object, int]] = {}
        self._hold: set[int] = set()
        self._last_backward_events: list[list[int]] | None = None
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def _init_zeropp(self, zero, comm):
        """The ZeRO++ switches: which collectives, and hpZ's group."""
        self.weight_gather = (QuantizedShardGather(comm, zero.zero_quantized_weights_block_size)
                              if zero.zero_quantized_weights else None)   # None: the exact gather
        topo = comm.topology
        h = zero.zero_hpz_partition_size
        # A group as large as the world is the primary partition itself: nothing to add.
        self.secondary_partition = None
        if 1 < h < topo.world_size:
            self.secondary_partition = Partition(group=topo.build_subgroup(h), size=h, rank=topo.rank % h)
        self.secondary_flat: torch.Tensor | None = None

    def _gradient_reduce(self) -> ShardReduce:
        if self.zero.zero_quantized_gradients:
            return HierarchicalQuantizedReduce(self.comm, self.zero.zero_quantized_gradients_block_size)
        return super()._gradient_reduce()

    def _allocate_partitions(self):
        super()._allocate_partitions()
        sec = self.secondary_partition
        for s in self.shards:
            s.place(self._persist_threshold, sec)
        part = [s for s in self.shards if not s.persistent]
        self.param_flat = torch.zeros(sum(s.chunk for s in part), dtype=self.dtype, device=self.device)
        off = 0
        for s in part:
            s.shard = self.param_flat[off:off + s.chunk]
            off += s.chunk
        if sec is not None:  # hpZ: the same layout over the h ranks of the group (place())
            self.secondary_flat = torch.zeros(sum(s.sec_chunk for s in part), dtype=self.dtype,
                                              device=self.device)
            off = 0
            for s in part:
                s.secondary = self.secondary_flat[off:off + s.sec_chunk]
                off += s.sec_chunk
        # Released weights are a NaN broadcast to the full shape (one element of
        # storage): AccumulateGrad accepts a full-size gradient for it, and a
        # weight used without being gathered shows up as NaN.
        self._placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)

    def _adopt(self, s: Stage3Param, full_fp32: torch.Tensor):
        if s.persistent:
            self._set_whole(s.param, full_fp32)
            return
        if s.state is not WeightState.RELEASED:
            self._release(s)
        s.sec_fresh = False
        s.shard.zero_()
        s.shard[:s.valid].copy_(full_fp32[s.lo:s.hi])
        if s.full is None:
            s.full = torch.empty(s.shape, dtype=self.dtype, device=self.device)
            s.full.untyped_storage().resize_(0)
            replace_data(s.param, self._placeholder.expand(s.shape))

    def _weight_slice(self, s: Stage3Param) -> torch.Tensor:
        return s.param.data.view(-1)[s.lo:s.hi] if s.persistent else s.shard[:s.valid]

    def _install_hooks(self, module):
        self._mod_weights = {}
        for m in module.modules():
            m._parameters = _GatherOnRead(self, m._parameters)
            direct = [self.shard_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self.shard_of]
            direct = [s for s in direct if not s.persistent]
            if direct:
                self._mod_weights[m] = direct
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward, always_call=True)

    # -- gather / release -----------------------------------------------------------
    def _issue(self, params: list[Stage3Param]):
        """All-gather the released weights among `params`: one collective from
        the primary partition, one (hpZ) for those the secondary one holds."""
        todo = [s for s in params if not s.persistent and s.state is WeightState.RELEASED]
        if not todo:
            return
        for s in todo:
            s.full.untyped_storage().resize_(s.numel * s.full.element_size())
            self.live_bytes += s.numel * s.full.element_size()
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        phase = "backward_gather" if self._phase == "backward" else "forward_gather"
        primary = [s for s in todo if not s.sec_fresh]
        secondary = [s for s in todo if s.sec_fresh]
        if primary:
            self._issue_from(primary, self.partition, self.param_flat, lambda s: s.shard,
                             lambda s: s.chunk, self.weight_gather or self.gather, phase, False)
        if secondary:
            self._issue_from(secondary, self.secondary_partition, self.secondary_flat,
                             lambda s: s.secondary, lambda s: s.sec_chunk, self.gather, phase, True)

    def _issue_from(self, todo, partition, flat, shard_of, chunk_of, gather, phase, secondary):
        first, n = todo[0], partition.size
        total = sum(chunk_of(s) for s in todo)
        if all(shard_of(b).data_ptr() == shard_of(a).data_ptr() + chunk_of(a) * flat.element_size()
               for a, b in zip(todo, todo[1:])):
            inp = flat.as_strided((total,), (1,), shard_of(first).storage_offset())  # adjacent
        else:
            inp = torch.cat([shard_of(s) for s in todo])
        # One unpadded weight is gathered straight into its own storage.
        c = chunk_of(first)
        out = first.full.view(n, c) if len(todo) == 1 and first.numel == c * n else None
        if secondary:  # inside the node group, in place of a gather over the world
            self.comm.charge_plain("all_gather", self.partition.group,
                                   sum(s.chunk for s in todo) * flat.element_size())
            pending = gather.start(inp, partition, phase, out=out, plain=False)
        else:
            pending = gather.start(inp, partition, phase, out=out)
        g = _Gather(todo, pending, secondary)
        for s in todo:
            s.state, s.bucket = WeightState.GATHERING, g

    def _wait(self, g: _Gather):
        rows = g.pending.wait()
        off = 0
        for s in g.params:  # copy each weight out of the bucket into its own storage
            c = s.sec_chunk if g.secondary else s.chunk
            if rows.data_ptr() != s.full.data_ptr():
                s.full.view(-1).copy_(rows[:, off:off + c].reshape(-1)[:s.numel])
            off += c
            if s.secondary is not None and not g.secondary:  # hpZ: keep my slice for later gathers
                s.secondary[:s.sec_hi - s.sec_lo].copy_(s.full.view(-1)[s.sec_lo:s.sec_hi])
                s.sec_fresh = True
            s.param.data = s.full
            s.state, s.bucket = WeightState.LIVE, None
            self._live_storage[s.full.untyped_storage().data_ptr()] = s

    def _release(self, s: Stage3Param):
        if s.persistent or s.state is WeightState.RELEASED:
            return
        if s.state is WeightState.GATHERING:
            self._wait(s.bucket)
        self._live_storage.pop(s.full.untyped_storage().data_ptr(), None)
        s.full.untyped_storage().resize_(0)
        self.live_bytes -= s.numel * s.full.element_size()
        s.param.data = self._placeholder.expand(s.shape)
        s.state = WeightState.RELEASED
        s.hold = False

    def _release_all(self, keep_held: bool = False):
        for s in self.shards:
            if not (keep_held and s.hold):
                self._release(s)

    def _request(self, params: list[Stage3Param]):
        """Make `params` live now: issue what the schedule has up to them (the
        needed bucket first), prefetch after, then wait."""
        if self._phase is not None:  # the order of first uses, whatever was prefetched
            first = [s.index for s in params if not s.persistent and s.index not in self._used]
            if first:
                self._trace.append(first)
                self._used.update(first)
        need = [s for s in params if not s.persistent and s.state is not WeightState.LIVE]
        if not need:
            return
        sched = self._schedule
        if sched is not None:
            target = max((sched.bucket_of.get(s.index, -1) for s in need), default=-1)
            while sched.issued <= target:
                self._issue([self.shards[i] for i in sched.buckets[sched.issued]])
                sched.issued += 1
            sched.reached = max(sched.reached, target + 1)
        self._issue(need)  # anything the schedule did not cover: on demand
        if sched is not None:
            self._prefetch(sched)
        for s in need:
            if s.state is WeightState.GATHERING:
                self._wait(s.bucket)

    def _prefetch(self, sched: _Schedule):
        """Issue the next buckets while those issued ahead of the last requested
        one stay within the prefetch bucket and all gathered weights (held ones
        and those still waiting for their gradients included) within
        `stage3_max_live_parameters`. Ranks may decide differently (a weight
        without gradient stays live longer on some rank); that changes only
        when a bucket is issued, never which buckets or in which order."""
        zero = self.zero
        live = self.live_bytes // self._placeholder.element_size()
        while sched.issued < len(sched.buckets):
            nxt = sched.elems[sched.issued]
            if sum(sched.elems[sched.reached:sched.issued]) + nxt > zero.stage3_prefetch_bucket_size \
                    or live + nxt > zero.stage3_max_live_parameters:
                return
            self._issue([self.shards[i] for i in sched.buckets[sched.issued]])
            sched.issued += 1
            live += nxt

    # -- phases -------------------------------------------------------------------
    def _begin(self, phase: str):
        self._phase = phase
        self._key = (phase, torch.is_grad_enabled(), self.module.training)
        self._trace = []
        self._used: set[int] = set()
        if phase == "forward":
            self._touch = {}
            events = self._traces.get(self._key)
            self._hold = self._reuse_set() if self._key == ("forward", True, True) else set()
        else:
            order = self._backward_order()
            if self._key == ("backward", True, True):
                self._last_backward_events = order
            held = {s.index for s in self.shards if s.hold}  # already live
            events = [e for e in ([i for i in event if i not in held] for event in order) if e]
        self._schedule = _Schedule(events, self.shards, self.zero.stage3_prefetch_bucket_size) \
            if events else None

    def _backward_order(self) -> list[list[int]]:
        """This step's forward in reverse order of each weight's last use that
        backward needs; a checkpointed region is recomputed as one unit when
        backward reaches its end, its modules in forward order."""
        region_end: dict[object, int] = {}
        for region, t in self._touch.values():
            if region is not None:
                region_end[region] = max(region_end.get(region, t), t)
        by_key: dict[tuple[int, int], list[int]] = {}
        for i, (region, t) in self._touch.items():
            key = (region_end[region], t) if region is not None else (t, 0)
            by_key.setdefault(key, []).append(i)
        return [by_key[k] for k in sorted(by_key, key=lambda k: (-k[0], k[1]))]

    def _end(self):
        if self._phase == "backward" and self._schedule is not None:
            sched = self._schedule  # what backward did not need: issue anyway, so ranks agree
            while sched.issued < len(sched.buckets):
                self._issue([self.shards[i] for i in sched.buckets[sched.issued]])
                sched.issued += 1
        self._traces[self._key] = self._trace
        self._release_all(keep_held=self._phase == "forward")
        self._phase = None
        self._schedule = None

    def _reuse_set(self) -> set[int]:
        """Weights to hold from forward to backward: in last step's order, the
        elements of weights used between this one's forward use and its backward
        use are at most stage3_max_reuse_distance (nearest first, within
        stage3_max_live_parameters). Backward's order is its schedule, which
        comes from the forward and so is the same on every rank."""
        fwd = self._traces.get(("forward", True, True))
        bwd = self._last_backward_events
        limit = self.zero.stage3_max_reuse_distance
        if not fwd or not bwd or limit == 0:
            return set()

        def size(event):
            return sum(self.shards[i].numel for i in event)

        used_before_in_backward, seen = {}, 0
        for event in bwd:
            for i in event:
                used_before_in_backward.setdefault(i, seen)
            seen += size(event)
        hold, held_elems, used_after_in_forward = set(), 0, 0
        for event in reversed(fwd):
            for i in event:
                distance = used_after_in_forward + used_before_in_backward.get(i, limit + 1)
                numel = self.shards[i].numel
                if distance <= limit and held_elems + numel <= self.zero.stage3_max_live_parameters:
                    hold.add(i)
                    held_elems += numel
            used_after_in_forward += size(event)
        return hold

    # -- module hooks ---------------------------------------------------------------
    def _pre_forward(self, module, args):
        weights = self._mod_weights[module]
        self._request(weights)
        region = _checkpoint_region(self._pack) if self._phase == "forward" and torch.is_grad_enabled() \
            else None
        if region is not None:
            for s in weights:  # the recompute in backward will need them
                self._touch[s.index] = (region, len(self._trace))

    def _post_forward(self, module, args, output):
        if self._phase != "forward":
            return  # recompute in backward: freed once their gradients are in
        for s in self._mod_weights[module]:
            if s.index in self._hold and torch.is_grad_enabled():
                s.hold = True
            if not (s.hold or s.keep):
                self._release(s)

    # -- saved tensors: note saved views of gathered weights --------------------------
    def _pack(self, x):
        if not self._live_storage or x.layout != torch.strided:
            return x
        try:
            s = self._live_storage.get(x.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return x
        if s is None:
            return x
        self._touch[s.index] = (None, len(self._trace))
        return _SavedWeightView(s, x)

    def _unpack(self, obj):
        if type(obj) is _SavedWeightView:
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

    def backward(self, loss):
        self._begin("backward")
        try:
            super().backward(loss)
            self._finish_reduction()
        finally:
            self._end()

    def _on_grad(self, s: Stage3Param, grad: torch.Tensor):
        self.reducer.add(s, grad)
        self._release(s)

    # -- Engine hooks ------------------------------------------------------------------
    def _weights_changed(self):
        self._invalidate_secondary()

    def _invalidate_secondary(self):
        """hpZ: the secondary partition holds last step's weights (or weights
        from before a load): the next gather goes to the primary partition."""
        for s in self.shards:
            s.sec_fresh = False

    def _publish_weights(self):
        self._invalidate_secondary()
        with torch.no_grad():
            if self.master_flat is not None:  # 16-bit: round the updated masters into the shards
                for s in self.shards:
                    if s.valid:
                        self._weight_slice(s).copy_(s.master)
            self._gather_weights([s for s in self.shards if s.persistent], self._weight_slice,
                                 lambda s, full: s.param.data.view(-1).copy_(full), self.dtype, "optimizer")

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        live = [s.param.data for s in self.shards if s.persistent or s.state is WeightState.LIVE]
        return {"parameters": [self.param_flat, self.secondary_flat] + live, "gradients": [self.grad_flat],
                "optimizer": self._optimizer_tensors()}

    def peak_buffers(self) -> dict:
        b = self._placeholder.element_size()
        return {**super().peak_buffers(), "gathered_weights_peak": self.peak_live_bytes,
                "gathered_weights_bound": self.zero.stage3_max_live_parameters * b}


class _SavedWeightView:
    """What the pack hook stores for a saved view of a gathered weight."""
    __slots__ = ("weight", "tensor")

    def __init__(self, weight: Stage3Param, tensor: torch.Tensor):
        self.weight, self.tensor = weight, tensor


class _GatherOnRead(dict):
    """A module's `_parameters`: reading a released weight during a phase gathers it."""

    def __init__(self, engine: Stage3Engine, items):
        super().__init__(items)
        self._engine = engine

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        eng = self._engine
        if eng._phase is not None and p is not None:
            s = eng.shard_of.get(id(p))
            if s is not None and not s.persistent and s.state is not WeightState.LIVE:
                if eng._phase == "forward":
                    s.keep = True
                eng._request([s])
        return p


def _checkpoint_region(our_pack):
    """When another saved-tensor hook (activation checkpointing's) is innermost,
    this module's weights are not saved now but recomputed in backward: return
    that hook (one per checkpointed call), else None."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return None  # cannot tell: unpack requests still gather on demand
    if top is None or top[0] == our_pack:   # ==: a bound method is a new object at each access
        return None
    return top[0]
