"""What the FSDP2 plug-in (zeropp/fsdp/apply.py) watches around each forward of the model: the
order its units ran in, to prefetch from (CPU overlap), and the node copies hpZ keeps after a
forward without grad.

- Prefetch: during a forward of the model, a unit issues the gathers of the next PREFETCH units
  of the order the units ran in last forward (a model may run its blocks in another order than
  it registers them); the first forward, which teaches the order, prefetches nothing. A forward
  that leaves that order stops prefetching at once, a unit prefetched that did not run is
  resharded after the forward, and outside a forward of the model (activation checkpointing's
  recomputation in backward, which runs the units in backward's order) nothing is prefetched.
- Node copies: after a forward without grad FSDP2 keeps each hpZ unit's weights sharded over the
  node. In an evaluation (a forward of the model without grad) no backward needs them and a step
  before the next forward would make them stale: the unit reshards to the world at once, as
  plain FSDP2's do. In a forward with grad, a unit run without grad is reentrant activation
  checkpointing's (`CheckpointImpl.REENTRANT`), which backward runs again: its node copy stays for
  that recomputation. Until then it does not reshard after backward (reentrant checkpointing runs
  a backward of its own per recomputation, which FSDP2 may end by running every unit's
  post-backward); a copy backward did not use goes to the world when backward ends.
"""
from __future__ import annotations

import torch

from common.torch_private import in_backward, post_forward_ranks, queue_backward_callback, reshards_after_backward

PREFETCH = 2   # units whose forward gathers a unit issues ahead (CPU: FSDP2 has no streams there)


class ForwardWatch:
    """Hooks on the root and on each unit: `units` are (modules, parameter group), the root first
    where it has parameters; `prefetch`: prefetch from the order that ran (units whose key is in
    `user_prefetch` keep the user's); `world`: reshard to it the node copies a forward without
    grad leaves (None: the plug-in set no hpZ)."""

    def __init__(self, root, units: list, prefetch: bool, user_prefetch: set[int], world: int | None):
        self.units, self.prefetch, self.user_prefetch, self.world = units, prefetch, user_prefetch, world
        self.order: list[int] = []      # the units of the last forward, first use each, in order
        self.following = False          # whether the prefetch lists are set from `order` now
        self.ran: list[int] = []        # this forward's units so far
        self.issued: set[int] = set()   # units this forward's prefetch gathered
        self.training = False           # in a forward of the model with grad
        self.kept: dict[int, torch.nn.Module] = {}   # units keeping a node copy for their recomputation
        self.held: set[int] = set()     # of those, the ones not to reshard after backward before it
        self.cleanup_queued = False
        root_key = next((k for k, (modules, _) in enumerate(units) if modules[0] is root), None)
        root.register_forward_pre_hook(self._root_started(root_key), prepend=True)
        root.register_forward_hook(self._root_ended)
        for key, (modules, group) in enumerate(units):
            for module in modules:
                if key != root_key:
                    module.register_forward_pre_hook(self._unit_started(key), prepend=True)
                if world is not None:
                    module.register_forward_hook(self._unit_ended(key, group))

    # -- hooks (ours run before FSDP2's pre-forward, which issues the prefetch) -----------------
    def _root_started(self, root_key):
        @torch.compiler.disable
        def hook(*_):
            if in_backward():
                if root_key is not None:
                    self._recomputing(root_key)
                return
            self._release()   # copies no backward recomputed from (there was none)
            self.training = torch.is_grad_enabled()
            self.ran, self.issued = [], set()
            if self.prefetch and self.order:
                self._set_prefetch(self.order)
            if root_key is not None:
                self._started(root_key)
        return hook

    def _unit_started(self, key):
        @torch.compiler.disable
        def hook(*_):
            if in_backward():
                self._recomputing(key)
            else:
                self._started(key)
        return hook

    def _unit_ended(self, key, group):
        @torch.compiler.disable
        def hook(module, *_):
            ranks = post_forward_ranks(group)
            if in_backward() or torch.is_grad_enabled() or ranks is None or ranks >= self.world:
                return
            if not self.training:   # an evaluation
                module.reshard()
                return
            self.kept[key] = module
            if reshards_after_backward(group):
                module.set_reshard_after_backward(False, recurse=False)
                self.held.add(key)
        return hook

    @torch.compiler.disable
    def _root_ended(self, *_):
        if in_backward():
            return
        self.training = False   # a unit run on its own is an evaluation's
        if not self.prefetch:
            return
        for key in self.issued - set(self.ran):   # gathered ahead, never run: used and freed
            module = self.units[key][0][0]
            module.unshard()
            module.reshard()
        self.order = self.ran
        if self.following:
            self._set_prefetch([])

    # -- what they do --------------------------------------------------------------------------
    def _started(self, key: int):
        """Unit `key` begins a forward: note it, and where the forward leaves the order prefetch
        follows, clear every prefetch list before this unit issues its own."""
        if not self.prefetch or key in self.ran:
            return
        position = len(self.ran)
        self.ran.append(key)
        if not self.following:
            return
        if position < len(self.order) and self.order[position] == key:
            self.issued.update(self._targets(self.order, position))
        else:
            self._set_prefetch([])

    def _recomputing(self, key: int):
        """Backward runs unit `key`'s forward again from its node copy: from here on it reshards
        after backward, as FSDP2 had it; the copies backward does not use go when it ends."""
        if key in self.held:
            self.kept[key].set_reshard_after_backward(True, recurse=False)
            self.held.discard(key)
        self.kept.pop(key, None)
        if self.kept and not self.cleanup_queued:
            queue_backward_callback(self._release)
            self.cleanup_queued = True

    def _release(self):
        """The node copies kept for a recomputation that did not come: to the world."""
        for key, module in self.kept.items():
            if key in self.held:
                module.set_reshard_after_backward(True, recurse=False)
            module.reshard()
        self.kept.clear()
        self.held.clear()
        self.cleanup_queued = False

    def _targets(self, order: list[int], position: int) -> list[int]:
        return [] if order[position] in self.user_prefetch else order[position + 1:position + 1 + PREFETCH]

    def _set_prefetch(self, order: list[int]):
        """Each unit of `order` prefetches the next PREFETCH units of it, the others none (every
        rank runs the units in one order, so every rank sets the same lists)."""
        targets = {key: self._targets(order, i) for i, key in enumerate(order)}
        for key, (modules, _) in enumerate(self.units):
            if key not in self.user_prefetch:
                modules[0].set_modules_to_forward_prefetch([self.units[t][0][0] for t in targets.get(key, [])])
        self.following = bool(order)
