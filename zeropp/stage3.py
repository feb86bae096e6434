"""ZeRO stage 3: the 16-bit weights are partitioned too.

Layout (zeropp/flat.py): each parameter flattened, padded to a multiple of N,
rank r keeps chunk r in one flat compute-dtype buffer (`param_flat`).
Parameters with at most `stage3_param_persistence_threshold` elements stay
whole on every rank (their optimizer state is still partitioned; their
gradients are reduce-scattered and the updated slices all-gathered).

While released, a partitioned parameter's `.data` is a placeholder (one NaN
broadcast to the weight's shape, no real storage);
gathering all-gathers the chunks into a fresh buffer and swaps it in as
`.data` (what DeepSpeed does), so autograd sees the same leaf Parameter.

When weights are live:
- forward: a pre-hook on every module with direct parameters (recurse=False)
  gathers them, a post-hook frees them. A parameter read while released
  during forward (e.g. GPT's tied `wte.weight` in the root's output layer) is
  gathered on access (each module's `_parameters` dict is replaced by one
  whose __getitem__ fetches) and marked `keep`: from then on it stays live
  from its first use to the end of the forward.
- backward: while forward runs, a saved-tensors pack hook replaces every
  saved tensor that is (a view of) a live gathered weight by a small token;
  the unpack hook gathers the weight again and rebuilds the view. A weight
  is freed by its post-accumulate-grad hook, which also hands its full
  gradient to the bucketed reduce-scatter (zeropp/flat.GradReducer), so the
  gradient lands on its owner and the full one is dropped.
- activation checkpointing (non-reentrant): the recompute runs the module
  forward again, so the pre-hooks gather again; torch keeps detached views
  of what it recomputes, which hold the gathered storage until that
  block's backward is done.
- prefetch: the order in which weights are first needed is recorded per
  phase (forward / backward) every step; the next step, when event i
  happens, the weights of events i+1, i+2, ... are all-gathered
  asynchronously, bounded by `stage3_prefetch_bucket_size` elements of
  not-yet-used prefetched weights and `stage3_max_live_parameters` live
  elements. If the order differs from last step's, prefetch stops for the
  rest of that phase (on-demand gathering stays correct).
- reuse: a weight whose next use, in last step's order, comes in backward
  within `stage3_max_reuse_distance` elements of other weights' use is not
  released after its forward ("held"); it is freed once its gradient is
  reduced. DeepSpeed's default (1e9) holds every weight of a model that
  small, so backward gathers nothing; 0 re-gathers everything in backward.
  Held weights count against `stage3_max_live_parameters`.
"""
from __future__ import annotations

import contextlib

import torch

from zeropp.flat import ParamShard, ShardedEngineBase

RELEASED, INFLIGHT, AVAILABLE = 0, 1, 2
_TOKEN = object()


class _GatherParamDict(dict):
    """A module's `_parameters`, gathering a released weight read during forward."""

    def __init__(self, engine, items):
        super().__init__(items)
        self._engine = engine

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        eng = self._engine
        if eng._phase is not None and p is not None:
            s = eng.shard_of.get(id(p))
            if s is not None and not s.persistent and s.state != AVAILABLE:
                if eng._phase == "forward":
                    s.keep = True
                eng._need([s])
        return p


class _Gather:
    """One in-flight all-gather of several shards."""

    def __init__(self, work, out, shards):
        self.work, self.out, self.shards = work, out, shards


class Stage3Engine(ShardedEngineBase):
    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1):
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        z = self.zero
        threshold = z.stage3_param_persistence_threshold
        for s in self.shards:
            s.persistent = s.numel <= threshold
            s.state = AVAILABLE
            s.keep = False
            s.hold = False
            s.used = False
            s.prefetched = False
            s.handle = None
        part = [s for s in self.shards if not s.persistent]
        self.param_flat = torch.zeros(sum(s.chunk for s in part), dtype=self.dtype, device=self.device)
        off = 0
        with torch.no_grad():
            for s in part:
                s.data_shard = self.param_flat[off:off + s.chunk]
                s.data_shard[:s.valid].copy_(s.param.data.view(-1)[s.lo:s.hi])
                off += s.chunk
        self._build_masters(lambda s: (s.param.data.view(-1)[s.lo:s.hi] if s.persistent
                                       else s.data_shard[:s.valid]))
        self._alloc_grad_partition()
        # Released weights are a NaN broadcast to the full shape (one element of
        # storage): autograd's AccumulateGrad then accepts the full-size gradient
        # whatever its strides (an empty placeholder makes it copy into the
        # placeholder's shape for 2-D weights), and a weight used without being
        # gathered shows up as NaN instead of silently wrong numbers.
        self._placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)
        self._phase: str | None = None
        self._live_storage: dict[int, ParamShard] = {}
        self._traces: dict = {}       # phase key -> list of events (tuples of shard indices) last step
        self._trace_now: list = []
        self._trace_prev: list | None = None
        self._trace_pos = 0
        self._prefetch_ok = False
        self._hold: set[int] = set()  # shard indices to hold from forward to backward
        self._prefetched_elems = 0
        self._live_elems = sum(s.numel for s in part)  # all live until partitioned below
        for s in part:
            self._release(s)

        self._mod_shards = {}
        for m in module.modules():
            direct = [self.shard_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self.shard_of]
            m._parameters = _GatherParamDict(self, m._parameters)
            direct = [s for s in direct if not s.persistent]
            if direct:
                self._mod_shards[m] = direct
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward, always_call=True)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- gather / release ------------------------------------------------------
    def _fetch(self, shards: list[ParamShard], async_op: bool):
        todo = [s for s in shards if s.state == RELEASED and not s.persistent]
        if not todo:
            return
        total = sum(s.chunk for s in todo)
        inp = todo[0].data_shard if len(todo) == 1 else torch.cat([s.data_shard for s in todo])
        out = torch.empty(self.world * total, dtype=self.dtype, device=self.device)
        work = self.comm.all_gather(out, inp, group=self.group, async_op=async_op, tag="all_gather_params")
        h = _Gather(work, out, todo)
        for s in todo:
            s.state, s.handle = INFLIGHT, h
            self._live_elems += s.numel
        if not async_op:
            self._complete(h)

    def _complete(self, h: _Gather):
        h.work.wait()
        total = sum(s.chunk for s in h.shards)
        if len(h.shards) == 1:
            s = h.shards[0]
            self._install(s, h.out[:s.numel].view(s.shape))
        else:
            rows = h.out.view(self.world, total)
            off = 0
            for s in h.shards:  # each weight gets a storage of its own (the pack hook keys on it)
                full = rows[:, off:off + s.chunk].reshape(-1)[:s.numel]
                if full.untyped_storage().data_ptr() == h.out.untyped_storage().data_ptr():
                    full = full.clone()  # one rank: the column block was a plain view
                self._install(s, full.view(s.shape))
                off += s.chunk

    def _install(self, s: ParamShard, full: torch.Tensor):
        s.param.data = full
        s.state, s.handle = AVAILABLE, None
        self._live_storage[full.untyped_storage().data_ptr()] = s

    def _release(self, s: ParamShard):
        if s.persistent:
            return
        if s.state == INFLIGHT:
            self._complete(s.handle)
        if s.state == AVAILABLE:
            self._live_storage.pop(s.param.data.untyped_storage().data_ptr(), None)
            self._live_elems -= s.numel
        s.param.data = self._placeholder.expand(s.shape)
        s.state = RELEASED
        s.used = False
        if s.prefetched:
            s.prefetched = False
            self._prefetched_elems -= s.numel

    def _release_all(self, keep_held: bool = False):
        for s in self.shards:
            if keep_held and s.hold:
                continue
            s.hold = False
            if not s.persistent and s.state != RELEASED:
                self._release(s)

    def _need(self, shards: list[ParamShard]):
        """Make `shards` live now; record the event and prefetch what follows."""
        new = [s for s in shards if not s.persistent and not s.used]
        if new and self._phase is not None:
            event = tuple(s.index for s in new)
            self._trace_now.append(event)
            for s in new:
                s.used = True
                if s.prefetched:
                    s.prefetched = False
                    self._prefetched_elems -= s.numel
            self._prefetch(event)
        self._fetch(shards, async_op=False)
        for s in shards:
            if s.state == INFLIGHT:
                self._complete(s.handle)

    def _prefetch(self, event):
        if not self._prefetch_ok:
            return
        prev = self._trace_prev
        if self._trace_pos >= len(prev) or prev[self._trace_pos] != event:
            self._prefetch_ok = False  # the order changed: gather on demand from here on
            return
        self._trace_pos += 1
        budget = self.zero.stage3_prefetch_bucket_size
        live_max = self.zero.stage3_max_live_parameters
        for nxt in prev[self._trace_pos:]:
            todo = [self.shards[i] for i in nxt if self.shards[i].state == RELEASED]
            if not todo:
                continue
            elems = sum(s.numel for s in todo)
            if (self._prefetched_elems + elems > budget
                    or self._live_elems + elems > live_max):
                break
            for s in todo:
                s.prefetched = True
            self._prefetched_elems += elems
            self._fetch(todo, async_op=True)

    # -- phases -----------------------------------------------------------------
    def _begin(self, phase: str):
        self._phase = phase
        key = (phase, torch.is_grad_enabled(), self.module.training)
        self._key = key
        self._trace_prev = self._traces.get(key)
        self._trace_now = []
        self._trace_pos = 0
        self._prefetch_ok = self._trace_prev is not None
        self._hold = self._reuse_set() if key == ("forward", True, True) else set()
        for s in self.shards:
            s.used = False

    def _end(self):
        self._traces[self._key] = self._trace_now
        self._release_all(keep_held=self._phase == "forward")
        self._phase = None

    def _reuse_set(self) -> set[int]:
        """Weights to hold from forward to backward: in last step's order, the
        elements of weights used between this one's forward use and its backward
        use are at most stage3_max_reuse_distance (nearest first, within
        stage3_max_live_parameters)."""
        fwd = self._traces.get(("forward", True, True))
        bwd = self._traces.get(("backward", True, True))
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

    # -- module hooks -----------------------------------------------------------
    def _pre_forward(self, module, args):
        self._need(self._mod_shards[module])

    def _post_forward(self, module, args, output):
        for s in self._mod_shards[module]:
            if self._phase == "forward" and s.index in self._hold:
                s.hold = True
            if s.hold or (s.keep and self._phase == "forward"):
                continue  # needed again soon: freed at the end of forward or after its gradient
            self._release(s)

    # -- saved tensors: tokens instead of gathered weights ----------------------
    def _pack(self, x):
        if not self._live_storage or x.layout != torch.strided:
            return x
        try:
            s = self._live_storage.get(x.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return x
        if s is None:
            return x
        return (_TOKEN, s, x.shape, x.stride(), x.storage_offset())

    def _unpack(self, obj):
        if type(obj) is tuple and len(obj) == 5 and obj[0] is _TOKEN:
            _, s, shape, stride, offset = obj
            self._need([s])
            return torch.as_strided(s.param.data, shape, stride, offset)
        return obj

    # -- training interface -------------------------------------------------------
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
            self.reducer.drain()
        finally:
            self._end()

    def _grad_ready(self, p):
        s = self.shard_of[id(p)]
        g, p.grad = p.grad, None
        self.reducer.add(s, g)
        s.hold = False
        self._release(s)

    # -- Engine hooks ----------------------------------------------------------------
    def _reduce_gradients(self):
        pass  # reduce-scattered during backward

    def _publish_weights(self):
        with torch.no_grad():
            if self.dtype != torch.float32:
                for s in self.shards:
                    if s.valid:
                        dst = (s.param.data.view(-1)[s.lo:s.hi] if s.persistent
                               else s.data_shard[:s.valid])
                        dst.copy_(s.master)
            pers = [s for s in self.shards if s.persistent]
            self.gather_shards(pers, lambda s: s.param.data.view(-1)[s.lo:s.hi], self.dtype,
                               lambda s, full: s.param.data.view(-1).copy_(full),
                               tag="all_gather_persistent")

    def _zero_grad(self):
        self.grad_flat.zero_()

    def _load_weight(self, s: ParamShard, full_fp32: torch.Tensor):
        if s.persistent:
            s.param.data.view(-1).copy_(full_fp32)
        else:
            s.data_shard.zero_()
            s.data_shard[:s.valid].copy_(full_fp32[s.lo:s.hi])

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        live = [s.param.data for s in self.shards if s.persistent or s.state == AVAILABLE]
        grads = [self.grad_flat] + [p.grad for p in self.params if p.grad is not None]
        return {"parameters": [self.param_flat] + live, "gradients": grads,
                "optimizer": self._optimizer_tensors()}
