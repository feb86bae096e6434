"""Where stage 3 sees a weight used, and what it tells `WeightGathers` (gathers.py, beside it;
the planner's trace, planner/trace.py, runs the same hooks over a recorder of its own):

- a forward pre-hook on every module with direct partitioned weights requests them, a post-hook
  says its forward is done;
- each module's `_parameters` is a `GatherOnRead` dict: reading a released weight during a phase
  requests it (a weight read outside its module, GPT's tied `wte.weight` in the output layer);
- a saved-tensor pack hook notes every saved tensor that views a live weight (`SavedWeightView`),
  unpack requests the weight again in backward;
- a module pre-hook inside an activation-checkpointed call notes the recompute in backward.
"""
from __future__ import annotations

import contextlib

import torch

from zeropp.stages.schedule import checkpoint_region
from zeropp.stages.stage3.gathers import WeightGathers
from zeropp.stages.stage3.param import SavedWeightView, Stage3Param


class GatherOnRead(dict):
    """A module's `_parameters`: reading a released weight during a phase gathers it."""

    def __init__(self, items, weight_of, gathers: WeightGathers):
        super().__init__(items)
        self.weight_of, self.gathers = weight_of, gathers

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        if self.gathers.phase is not None and p is not None:
            s = self.weight_of.get(id(p))
            if s is not None and not s.persistent:
                self.gathers.read(s)
        return p


class Stage3Hooks:
    """The hooks of one stage-3 engine on its module; `module_weights`: each hooked module's weights."""

    def __init__(self, module, weight_of: dict[int, Stage3Param], gathers: WeightGathers):
        self.gathers = gathers
        self.module_weights: dict[object, list[Stage3Param]] = {}
        for m in module.modules():
            m._parameters = GatherOnRead(m._parameters, weight_of, gathers)
            direct = [weight_of[id(p)] for p in m.parameters(recurse=False) if id(p) in weight_of]
            direct = [s for s in direct if not s.persistent]
            if direct:
                self.module_weights[m] = direct
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward, always_call=True)

    def forward(self, module, *args, **kwargs):
        """`module(*args, **kwargs)` as stage 3's forward phase."""
        self.gathers.begin("forward")
        hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                 if torch.is_grad_enabled() else contextlib.nullcontext())
        try:
            with hooks:
                return module(*args, **kwargs)
        finally:
            self.gathers.end()

    @contextlib.contextmanager
    def backward(self):
        """Stage 3's backward phase around autograd and the gradient reduction."""
        self.gathers.begin("backward")
        try:
            yield
        finally:
            self.gathers.end()

    def _pre_forward(self, module, args):
        weights = self.module_weights[module]
        g = self.gathers
        g.request(weights)
        if g.phase == "forward" and torch.is_grad_enabled():
            region = checkpoint_region(self._pack)
            if region is not None:  # the recompute in backward will need them
                g.recorder.recomputed([s.index for s in weights], region)

    def _post_forward(self, module, args, output):
        self.gathers.forward_done(self.module_weights[module])

    # -- saved tensors: note saved views of gathered weights --------------------------
    def _pack(self, x):
        if x.layout != torch.strided:
            return x
        try:
            s = self.gathers.gathered.owner(x)
        except (RuntimeError, NotImplementedError):
            return x
        if s is None:
            return x
        self.gathers.recorder.saved(s.index)
        return SavedWeightView(s, x)

    def _unpack(self, obj):
        if type(obj) is SavedWeightView:
            self.gathers.request([obj.weight])
            return obj.tensor
        return obj

    def peak_buffers(self) -> dict:
        g, store = self.gathers, self.gathers.store
        return {"gathered_weights_peak": g.gathered.peak_bytes,
                "gathered_weights_bound": g.gathered_bound(self.module_weights.values()),
                **store.peak_buffers(store.gather_bound(self.module_weights.values()))}
