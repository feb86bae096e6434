"""A stage-3 weight and its lifecycle; the gather that brings a bucket of them.

Each partitioned weight (`Stage3Param`) keeps its chunk in the engine's flat
compute-dtype buffer and owns a full-shaped tensor `full` whose storage exists
only while the weight is gathered. The module's Parameter points at `full`
while the weight is LIVE and at a NaN placeholder (no storage) otherwise, so a
use without a gather shows up as NaN, never as stale data. Releasing frees the
storage itself (`resize_(0)`), also when autograd or an activation-checkpoint
recompute still holds views of it; the next gather fills the same storage, so
those views are valid again.

States (each method asserts the one it starts from):

    RELEASED --BucketGather(...)--> GATHERING --BucketGather.wait()--> LIVE
       ^                                                                 |
       +------------------------------- release() ----------------------+

`BucketGather` is one all-gather of several weights from a weight source: the
primary partition (`PrimaryWeights`: over all ranks, exact or qwZ) or hpZ's
secondary one (zeropp/techniques/hpz.py). Parameters of at most
`stage3_param_persistence_threshold` elements are persistent: whole on every
rank, none of this applies to them. `SavedWeightView` is how the
hooks (hooks.py, beside it) see a weight saved for backward.
"""
from __future__ import annotations

import enum

import torch

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import ShardGather
from zeropp.techniques.hpz import SecondarySlice, secondary_slice
from zeropp.stages.init import replace_data
from zeropp.collectives.partition import Partition, ShardedParam


class WeightState(enum.Enum):
    RELEASED = "released"      # only this rank's chunk exists
    GATHERING = "gathering"    # an all-gather for it is in flight
    LIVE = "live"              # `full` holds the whole weight and the Parameter points at it


class GatheredWeights:
    """The weights of one engine that are gathered now: their bytes (and the
    peak, against stage3_max_live_parameters) and which weight a storage
    belongs to (how the saved-tensor hook recognizes a view of a weight)."""

    def __init__(self):
        self.bytes = 0
        self.peak_bytes = 0
        self._by_storage: dict[int, Stage3Param] = {}

    def owner(self, t: torch.Tensor) -> Stage3Param | None:
        """The LIVE weight whose storage `t` views, if any."""
        if not self._by_storage:
            return None
        return self._by_storage.get(t.untyped_storage().data_ptr())

    def allocated(self, s: Stage3Param):
        self.bytes += s.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def live(self, s: Stage3Param):
        self._by_storage[s.full.untyped_storage().data_ptr()] = s

    def freed(self, s: Stage3Param):
        self._by_storage.pop(s.full.untyped_storage().data_ptr(), None)
        self.bytes -= s.nbytes


class Stage3Param(ShardedParam):
    """A weight's stage-3 layout (`place`) and gather state."""
    persistent: bool                     # whole on every rank; the fields below stay unused
    secondary_slice: SecondarySlice | None   # hpZ layout in the node group (None: no hpZ)
    shard: torch.Tensor | None           # compute dtype, [chunk] (padded): view of the engine's flat buffer
    full: torch.Tensor | None            # compute dtype, `shape`; storage only while GATHERING or LIVE
    state: WeightState
    bucket: BucketGather | None          # the gather bringing it, while GATHERING

    def __init__(self, *args):
        super().__init__(*args)
        self.persistent = False
        self.secondary_slice = None
        self.shard = self.full = None
        self.state = WeightState.RELEASED
        self.bucket = None
        self._gathered: GatheredWeights | None = None
        self._placeholder: torch.Tensor | None = None

    def place(self, persist_threshold: int, secondary: Partition | None):
        """Decide the layout (no memory; the planner calls this too): persistent
        (at most `persist_threshold` elements) or partitioned, and then hpZ's
        slice in the `secondary` partition."""
        self.persistent = self.numel <= persist_threshold
        if secondary is not None and not self.persistent:
            self.secondary_slice = secondary_slice(self.numel, secondary)

    def bind(self, shard: torch.Tensor, placeholder: torch.Tensor, gathered: GatheredWeights):
        """Give a partitioned weight its shard (a view of the engine's flat buffer)."""
        assert not self.persistent and self.shard is None
        self.shard, self._placeholder, self._gathered = shard, placeholder, gathered

    @property
    def nbytes(self) -> int:
        return self.numel * self.full.element_size()

    def set_shard(self, full_fp32: torch.Tensor):
        """New values (flat fp32, the whole weight): keep this rank's chunk. The
        first time, the Parameter's own data (whole, or on meta) gives way to
        the placeholder and `full` is made, without storage."""
        assert self.state is WeightState.RELEASED, self.state
        self.shard.zero_()
        self.shard[:self.valid].copy_(full_fp32[self.lo:self.hi])
        if self.full is None:
            self.full = torch.empty(self.shape, dtype=self.shard.dtype, device=self.shard.device)
            self.full.untyped_storage().resize_(0)
            replace_data(self.param, self._placeholder.expand(self.shape))

    def start_gather(self, bucket: BucketGather):
        assert self.state is WeightState.RELEASED, self.state
        self.full.untyped_storage().resize_(self.nbytes)
        self._gathered.allocated(self)
        self.state, self.bucket = WeightState.GATHERING, bucket

    def arrive(self, values: torch.Tensor):
        """The gather is done: `values` (flat, `numel`) become the weight."""
        assert self.state is WeightState.GATHERING, self.state
        if values.data_ptr() != self.full.data_ptr():
            self.full.view(-1).copy_(values)
        self.param.data = self.full
        self.state, self.bucket = WeightState.LIVE, None
        self._gathered.live(self)

    def wait(self):
        """Make a GATHERING weight LIVE (waits for its whole bucket)."""
        if self.state is WeightState.GATHERING:
            self.bucket.wait()

    def release(self):
        """Free the gathered copy (waiting first if it is still in flight)."""
        if self.persistent or self.state is WeightState.RELEASED:
            return
        self.wait()
        self._gathered.freed(self)
        self.full.untyped_storage().resize_(0)
        self.param.data = self._placeholder.expand(self.shape)
        self.state = WeightState.RELEASED


class PrimaryWeights:
    """The primary partition as a weight source: each rank's shard of every
    partitioned weight, gathered over all ranks with `gather` (exact, or qwZ's
    INT8 gather). Every weight that arrives is handed to `keeper.keep` when given:
    hpZ's secondary partition, or the weight deltas (which keep it there too), with
    whether its values are `exact`."""

    writes_weights = False

    def __init__(self, partition: Partition, flat: torch.Tensor, gather: ShardGather, keeper=None,
                 exact: bool = True):
        self.partition, self.flat, self.gather, self.keeper = partition, flat, gather, keeper
        self.exact = exact
        self.delivers_rows = gather.delivers_rows

    def holds(self, s: Stage3Param) -> bool:
        return True

    def bytes_per_element(self, elem_bytes: int) -> float:
        return self.gather.bytes_per_element(elem_bytes, self.partition.size)

    def fixed_bytes(self) -> int:
        return 0

    def tensors(self) -> list[torch.Tensor]:
        return []   # its shards are the parameter store's

    def plan(self, weights: list[Stage3Param], phase: str) -> list:
        return self.gather.plan(phase, sum(s.chunk for s in weights), self.flat.element_size(), self.partition.size)

    def chunk(self, s: Stage3Param) -> int:
        return s.chunk

    def slice(self, s: Stage3Param) -> torch.Tensor:
        return s.shard

    def start(self, weights, inp: torch.Tensor, phase: str, out: torch.Tensor, pool: BufferPool) -> Work:
        return self.gather.start(inp, self.partition, phase, out=out, pool=pool)

    def arrived(self, s: Stage3Param, full: torch.Tensor):
        if self.keeper is not None:
            self.keeper.keep(s, full, exact=self.exact)


class BucketGather:
    """One all-gather bringing RELEASED weights from `source` (PrimaryWeights,
    SecondaryPartition or WeightDeltas); they are GATHERING until `wait()`. Its input (when
    the slices are not adjacent) and its [N, total] rows come from `pool` and
    go back once the weights are out of them."""

    def __init__(self, weights: list[Stage3Param], source, phase: str, pool: BufferPool):
        self.weights, self.source, self.pool = weights, source, pool
        n = source.partition.size
        for s in weights:
            s.start_gather(self)
        chunks = [source.chunk(s) for s in weights]
        slices = [source.slice(s) for s in weights]
        flat = source.flat
        total = sum(chunks)
        self._taken = []
        if all(b.data_ptr() == a.data_ptr() + c * flat.element_size()
               for a, b, c in zip(slices, slices[1:], chunks)):   # adjacent in the flat buffer
            inp = flat.as_strided((total,), (1,), slices[0].storage_offset())
        else:
            inp = torch.cat(slices, out=pool.take(total, flat.dtype))
            self._taken.append(inp)
        # The weight deltas write into the weights themselves; one unpadded weight is gathered
        # straight into its own storage; a gather that delivers row by row (qwZ) writes each
        # row's pieces into the weights; else rows.
        first = weights[0]
        if source.writes_weights:
            out = None
        elif len(weights) == 1 and first.numel == chunks[0] * n:
            out = first.full.view(n, chunks[0])
        elif source.delivers_rows:
            out = self._deliver
        else:
            out = pool.take(n * total, flat.dtype).view(n, total)
            self._taken.append(out)
        self._work = source.start(weights, inp, phase, out, pool)
        self._done = False

    def _deliver(self, j: int, row: torch.Tensor):
        """Row j of the gather (member j's chunk of every weight) into the weights."""
        off = 0
        for s in self.weights:
            c = self.source.chunk(s)
            lo, hi = j * c, min((j + 1) * c, s.numel)
            if hi > lo:
                s.full.view(-1)[lo:hi].copy_(row[off:off + hi - lo])
            off += c

    def wait(self):
        if self._done:
            return
        self._done = True
        rows = self._work.wait()
        off = 0
        for s in self.weights:  # each weight out of the bucket into its own storage
            c = self.source.chunk(s)
            s.arrive(s.full.view(-1) if rows is None else rows[:, off:off + c].reshape(-1)[:s.numel])
            self.source.arrived(s, s.full)
            off += c
        for t in self._taken:
            self.pool.give(t)


class SavedWeightView:
    """What the pack hook stores for a saved view of a gathered weight."""
    __slots__ = ("weight", "tensor")

    def __init__(self, weight: Stage3Param, tensor: torch.Tensor):
        self.weight, self.tensor = weight, tensor
