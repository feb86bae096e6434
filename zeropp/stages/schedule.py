"""Stage 3's schedules as plain functions over weight indices and sizes.

The engine (zeropp/stages/stage3/gathers.py) and the planner (planner/comm.py, planner/trace.py)
both use these, so the planner's collectives are the engine's by construction.

- `TraceRecorder`: what one forward records: the first use of each weight, one
  event per module request (`events`), and for each weight backward needs,
  the forward event count of its last use and the activation-checkpoint
  region it is recomputed in, if any (`touch`).
- `checkpoint_region`: which checkpointed call (if any) a forward runs in.
- `gather_buckets` / `GatherSchedule`: a recorded order cut into gather buckets.
- `backward_order`: backward's gather order, from a forward's `touch`.
- `live_budget`: how `stage3_max_live_parameters` splits between the weights
  read outside their module, one gather bucket and the weights held.
- `reuse_set`: the weights held from forward to backward.
(`bucketize` and `gradient_buckets` are in zeropp/collectives/partition.py.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from common.torch_private import top_saved_tensors_hooks
from zeropp.collectives.partition import bucketize

# A weight's last use that backward needs: (checkpoint region or None, forward event count).
Touch = tuple[object, int]


class TraceRecorder:
    """One phase's record of weight uses (weights by index)."""

    def __init__(self):
        self.events: list[list[int]] = []   # first uses, one list per request, in order
        self.used: set[int] = set()
        self.touch: dict[int, Touch] = {}   # weight -> its last use that backward needs
        self.outside: set[int] = set()      # read outside their module (a tied weight)

    def read_outside(self, index: int):
        """A weight read outside its own module: live to the end of forward, and in backward
        until its gradient, which the last use in backward order completes."""
        self.outside.add(index)

    def first_uses(self, indices: Sequence[int]):
        """A request for `indices`: those not used before in this phase form the next event."""
        first = [i for i in indices if i not in self.used]
        if first:
            self.events.append(first)
            self.used.update(first)

    def saved(self, index: int):
        """Autograd saved a view of the weight: backward reads it right there."""
        self.touch[index] = (None, len(self.events))

    def recomputed(self, indices: Sequence[int], region: object):
        """The weights run inside checkpointed call `region`: backward recomputes them."""
        for i in indices:
            self.touch[i] = (region, len(self.events))


def checkpoint_region(our_pack) -> object | None:
    """When another saved-tensor hook (activation checkpointing's) is innermost,
    the module running now saves nothing but is recomputed in backward: return
    that hook (one per checkpointed call), else None. `our_pack`: the caller's
    own pack hook, which is not a region."""
    try:
        top = top_saved_tensors_hooks()
    except (AttributeError, RuntimeError):
        return None  # cannot tell: unpack requests still gather on demand
    if top is None or top[0] == our_pack:   # ==: a bound method is a new object at each access
        return None
    return top[0]


def gather_buckets(events: list[list[int]], numels: Sequence[int], bucket_elems: int) -> list[list[int]]:
    """Cut an order of events into buckets of at most `bucket_elems` elements;
    an event is never split (a module's weights gather together)."""
    return [[i for event in group for i in event]
            for group in bucketize(events, lambda e: sum(numels[i] for i in e), bucket_elems)]


@dataclass
class GatherSchedule:
    """A recorded order cut into gather buckets, and how far one phase has got.
    Buckets are issued strictly in order (`issued` is always a prefix)."""
    buckets: list[list[int]]
    elems: list[int]                 # elements per bucket
    bucket_of: dict[int, int]        # weight -> its bucket
    issued: int = 0                  # buckets issued so far
    reached: int = 0                 # highest bucket requested so far, + 1

    @classmethod
    def cut(cls, events: list[list[int]], numels: Sequence[int], bucket_elems: int) -> GatherSchedule:
        buckets = gather_buckets(events, numels, bucket_elems)
        return cls(buckets, [sum(numels[i] for i in b) for b in buckets],
                   {i: k for k, b in enumerate(buckets) for i in b})


def backward_order(touch: dict[int, Touch]) -> list[list[int]]:
    """Backward's gather order: the forward in reverse order of each weight's
    last use that backward needs; a checkpointed region is recomputed as one
    unit when backward reaches its end, its modules in forward order."""
    region_end: dict[object, int] = {}
    for region, t in touch.values():
        if region is not None:
            region_end[region] = max(region_end.get(region, t), t)
    by_key: dict[tuple[int, int], list[int]] = {}
    for i, (region, t) in touch.items():
        key = (region_end[region], t) if region is not None else (t, 0)
        by_key.setdefault(key, []).append(i)
    return [by_key[k] for k in sorted(by_key, key=lambda k: (-k[0], k[1]))]


def without(order: list[list[int]], held: set[int]) -> list[list[int]]:
    """`order` less the weights in `held` (already live), empty events dropped."""
    return [e for e in ([i for i in event if i not in held] for event in order) if e]


@dataclass
class LiveBudget:
    """stage3_max_live_parameters, split: the weights read outside their module (live
    whatever the schedule: `pinned`), one gather bucket (`bucket`: a request issues its
    bucket whatever the live count) and the weights held from forward to backward (`hold`).
    So pinned + a bucket + what is held stay within max_live whenever the largest module
    and the pinned weights fit in it."""
    pinned: int
    bucket: int
    hold: int


def live_budget(max_live: int, prefetch_bucket: int, numels: Sequence[int], events: list[list[int]],
                pinned: set[int]) -> LiveBudget:
    """`events`: a phase's gather order (its largest event, one module's weights, is a
    bucket of its own when larger than the others)."""
    p = sum(numels[i] for i in pinned)
    bucket = max(1, min(prefetch_bucket, max_live - p))
    largest = max((sum(numels[i] for i in e if i not in pinned) for e in events), default=0)
    return LiveBudget(p, bucket, max(0, max_live - p - max(bucket, largest)))


def reuse_set(forward_events: list[list[int]] | None, backward_events: list[list[int]] | None,
              numels: Sequence[int], max_reuse_distance: int, hold_elems: int,
              pinned: set[int] = frozenset()) -> set[int]:
    """Weights to hold from forward to backward (DeepSpeed's stage3_max_reuse_distance:
    a module's weights are released after its forward unless they are used again soon):
    in last step's order, the elements of weights used between a weight's forward use and
    its backward use are at most `max_reuse_distance` (nearest first, within `hold_elems`,
    `live_budget`'s hold, which the `pinned` weights do not count against: they are live
    at the end of forward anyway; 0 holds nothing). Backward's order comes from the forward, so it
    is the same on every rank."""
    if not forward_events or not backward_events or max_reuse_distance <= 0:
        return set()

    def size(event):
        return sum(numels[i] for i in event)

    used_before_in_backward, seen = {}, 0
    for event in backward_events:
        for i in event:
            used_before_in_backward.setdefault(i, seen)
        seen += size(event)
    hold, held_elems, used_after_in_forward = set(), 0, 0
    for event in reversed(forward_events):
        for i in event:
            before = used_before_in_backward.get(i)
            if before is None:
                continue
            cost = 0 if i in pinned else numels[i]
            if used_after_in_forward + before <= max_reuse_distance and held_elems + cost <= hold_elems:
                hold.add(i)
                held_elems += cost
        used_after_in_forward += size(event)
    return hold


TRAINING_FORWARD = ("forward", True, True)   # the trace key (phase, grad enabled, training) of a step


def saved_orders(traces: dict, last_backward: list[list[int]] | None) -> dict:
    """The recorded orders a checkpoint keeps: they are carried state, since qwZ's INT8 blocks
    span a bucket and the buckets are cut from them, so they decide the bits of the next step."""
    return {"forward": traces.get(TRAINING_FORWARD), "backward": last_backward}


def restore_orders(saved: dict | None, traces: dict, last_backward, shards):
    """Put saved_orders() back into `traces` when they are of this model's partitioned weights
    (of `shards`); returns the backward order to use."""
    partitioned = {s.index for s in shards if not s.persistent}
    if not saved or not saved.get("forward") or {i for e in saved["forward"] for i in e} != partitioned:
        return last_backward
    traces[TRAINING_FORWARD] = saved["forward"]
    return saved["backward"]
