"""The interfaces the parts of an engine declare (zeropp/build.py composes them; the engine,
the memory report, the checkpoint code and the planner ask them, never attribute names).

- `WeightGather`: an all-gather of weight chunks (exact: collectives/exact.py `ShardGather`;
  qwZ's INT8 gather: techniques/qwz.py).
- `GradientReduction`: a reduce-scatter of gradient rows (exact `ShardReduce`; qgZ's INT4
  all-to-alls: techniques/qgz.py; with LoCo's error feedback: techniques/loco.py).
- `WeightSource`: where stage 3 gathers a weight from (the primary partition:
  stages/stage3/param.py `PrimaryWeights`; hpZ's secondary partition: techniques/hpz.py; the
  INT4 weight deltas: techniques/deltas.py).
- `CarriedState`: state carried from step to step besides the optimizer's (LoCo's error, the
  deltas' reference weights), committed only when a step is applied (ARCHITECTURE.md).
- `MemoryLine`: what a part keeps, for the memory report (zeropp/memory.py) and the planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.partition import FlatState, Partition


@dataclass
class PlannedCollective:
    """One collective of a step as the planner (planner/comm.py) costs it: what a part answers
    when asked for its collectives (`plan`)."""
    phase: str
    op: str            # all_gather, reduce_scatter, all_reduce, all_to_all (parallel/comm.py OPS)
    group: str         # world, secondary (hpZ group), intra (my node), inter (my local index on every node),
                       # strided (my index in every hpZ group)
    nbytes: int        # the size argument wire_bytes takes (see parallel/comm.py)
    quant_elements: int = 0   # elements through (de)quantization kernels around this collective
    quant_bits: int = 0       # 8 (qwZ) or 4 (qgZ)
    micro_step: int = 0
    # the collective issued when another stands in for `op`, charged as `op` (parallel/comm.py
    # `all_to_all(charge_as=...)`): gloo's reduce-scatter goes as the all-to-all of its rows, of
    # `nbytes` to each member. The bytes counted follow `op`, the time on the wire this one.
    sent_as: str = ""


@dataclass
class MemoryLine:
    name: str                  # its key in memory_report()
    kind: str                  # the model-state category it counts under: parameters, gradients
    tensors: list[torch.Tensor]
    bytes_per_param: float     # predicted, per parameter of the model (ZeRO's formula beside it)
    # what it keeps once every buffer it will make is made, from its layout (the planner's figure,
    # which the tensors measure; None: the tensors' bytes as they are)
    nbytes: int | None = None
    label: str = ""            # its row in train.py --dry-run's plan (default: its name)

    def planned_bytes(self) -> int:
        return self.nbytes if self.nbytes is not None else sum(t.numel() * t.element_size() for t in self.tensors)


class WeightGather(Protocol):
    delivers_rows: bool        # start() also takes out=deliver(j, row): each member's row in turn

    def start(self, inp: torch.Tensor, partition: Partition, phase: str, async_op: bool = True,
              out: torch.Tensor | None = None, plain: bool = True, pool: BufferPool | None = None) -> Work:
        """`inp` [total]: this member's chunks end to end; the result [N, total], row j from member j."""

    def bytes_per_element(self, elem_bytes: int, members: int) -> float:
        """Pool bytes per gathered element while in flight (its buffer bound)."""

    def plan(self, phase: str, total: int, elem_bytes: int, members: int) -> list[PlannedCollective]:
        """The collectives of gathering `total` elements a member over `members`."""


class GradientReduction(Protocol):
    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True, pool: BufferPool | None = None, key: int = 0) -> Work:
        """`rows` [N, total] summed over members, row j into member j's `out`. The Work may take
        several steps: `progress()` advances it without blocking (the reducer calls it as each
        gradient comes in), `wait()` finishes it. `key`: the gradient bucket."""

    def inflight_bytes(self, bucket_elems: int, elem_bytes: int = 4) -> int:
        """Pooled bytes of one bucket's reduction in flight besides its rows and result (its bound)."""

    def expect(self, bucket_totals: dict[int, int], topology, device):
        """The gradient buckets to come, before the first reduction."""

    def carried_parts(self) -> dict[str, CarriedState]:
        """The state it carries from step to step, by scalar-state key."""

    def plan(self, total: int, elem_bytes: int) -> list[PlannedCollective]:
        """The collectives of reducing a bucket of `total` elements a member."""


class WeightSource(Protocol):
    partition: Partition       # the group a gather from it runs over
    flat: torch.Tensor         # what it gathers from, end to end (`slice` views it)
    writes_weights: bool       # start() writes the gathered values into the weights itself
    delivers_rows: bool        # start() takes out=deliver(j, row)

    def holds(self, weight) -> bool:
        """The next gather of `weight` can come from here (the same answer on every rank)."""

    def chunk(self, weight) -> int: ...

    def slice(self, weight) -> torch.Tensor: ...

    def start(self, weights: list, inp: torch.Tensor, phase: str, out, pool: BufferPool) -> Work: ...

    def arrived(self, weight, full: torch.Tensor):
        """`weight` arrived whole from this source."""

    def bytes_per_element(self, elem_bytes: int) -> float:
        """Gather-pool bytes per gathered element (its buffer bound)."""

    def fixed_bytes(self) -> int:
        """Gather-pool bytes it needs whatever the size."""

    def plan(self, weights: list, phase: str) -> list[PlannedCollective]:
        """The collectives of one gather of `weights` from here."""


class CarriedState(Protocol):
    def end_step(self, applied: bool) -> str | None:
        """Commit what this step produced if it was applied; a line to report, if any."""

    def checkpoint_state(self, world: int) -> dict[str, FlatState]: ...

    def scalar_state(self) -> dict: ...

    def carried(self, saved: dict | None) -> bool:
        """A checkpoint's state (its scalar state `saved`) fits this job."""

    def load_scalar_state(self, saved: dict | None) -> str | None:
        """After a load: take it back, or reset and say so in one line."""

    def memory(self) -> MemoryLine: ...

    def peak_buffers(self) -> dict:
        """`<name>_peak` and `<name>_bound` bytes of the buffers it keeps between steps, if any."""

    def plan_step(self) -> list[PlannedCollective]:
        """Its collectives after an optimizer step."""

    def summary(self) -> str | None:
        """A line for the end of a run, if it has one to say."""


def uncarried_state(carried: dict[str, CarriedState], saved_scalar_state: dict, world: int) -> list[str]:
    """The checkpoint keys of the carried parts whose saved state does not fit this job (they
    start anew). A part that fits but was saved in an older format (LoCo's fp32 errors) swaps in
    staging tensors of that format among those of its last checkpoint_state()."""
    out = []
    for key, part in carried.items():
        saved = saved_scalar_state.get(key)
        if not part.carried(saved):
            out += list(part.checkpoint_state(world))
        elif hasattr(part, "stage_load"):   # read as saved, converted after the load
            part.stage_load(saved)
    return out
