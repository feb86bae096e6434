"""The techniques beyond ZeRO-3, one module each, and the one registry that says when each is
on, what it is called, and which part of a stage it provides. zeropp/build.py composes the
parts, the run labels (train.py, the planner) are read from here, and every part answers for
itself (its bytes, bounds, memory and checkpoint state: zeropp/collectives/protocols.py).

A technique is a module with a `build(ctx)` that returns its part from a `BuildContext`, and
one line below. Slots, in the order build.py fills them:
- "rotation": the Hadamard block size qgZ's rows are rotated in (0: none);
- "weight_gather": the gather of the primary partition (default: exact);
- "secondary": a weight source inside the node that keeps what the primary gathers (hpZ);
- "weight_deltas": a weight source that sends the primary partition's weights as deltas;
- "gradient_reduction": the gradient reduction (default: the plain reduce-scatter); a later
  technique of this slot builds on the earlier one's (LoCo on qgZ's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from zeropp.config import ZeroConfig
from zeropp.techniques import deltas, hadamard, hpz, loco, qgz, qwz

SLOTS = ("rotation", "weight_gather", "secondary", "weight_deltas", "gradient_reduction")


@dataclass
class BuildContext:
    """What a technique's `build` reads (the job, its process groups, the partitioned weights)
    and what the techniques built before it provided, by slot."""
    zero: ZeroConfig
    comm: object
    groups: object            # zeropp/build.py ProcessGroups
    dtype: object
    device: object
    weights: list             # the partitioned Stage3Params, placed and bound to `flat`
    flat: object              # their compute-dtype shards, end to end
    rotation: int = 0
    weight_gather: object = None
    secondary: object = None
    weight_deltas: object = None
    gradient_reduction: object = None


@dataclass(frozen=True)
class Technique:
    name: str                                     # in run labels
    slot: str
    enabled: Callable[[ZeroConfig], bool]
    build: Callable[[BuildContext], object]       # its part (None: nothing to add on this job)
    detail: Callable[[ZeroConfig], str] | None = None   # the name with its setting
    memory_key: str | None = None                 # its MemoryLine's name in memory_report()
    bits: Callable[[ZeroConfig], int] | None = None   # of what it sends, when a setting: "INT{bits} name"


REGISTRY = (
    Technique("qwZ", "weight_gather", lambda z: bool(z.zero_quantized_weights), qwz.build),
    Technique("hpZ", "secondary", lambda z: z.zero_hpz_partition_size > 1, hpz.build,
              lambda z: f"hpZ {z.zero_hpz_partition_size}", hpz.MEMORY_KEY),
    Technique("qgZ", "gradient_reduction", lambda z: bool(z.zero_quantized_gradients), qgz.build),
    Technique("LoCo", "gradient_reduction", lambda z: z.zeropp_loco_param is not None, loco.build,
              memory_key=loco.MEMORY_KEY),
    Technique("Hadamard", "rotation", lambda z: bool(z.zero_hadamard_gradients), hadamard.build),
    Technique("weight deltas", "weight_deltas", lambda z: bool(z.zero_quantized_weight_deltas), deltas.build,
              memory_key=deltas.MEMORY_KEY, bits=lambda z: z.zero_quantized_weight_deltas_bits),
)

MEMORY_KEYS = tuple(t.memory_key for t in REGISTRY if t.memory_key)   # 0 in a report when off


def enabled(zero: ZeroConfig) -> list[Technique]:
    """The techniques `zero` turns on, in the registry's order."""
    return [t for t in REGISTRY if t.enabled(zero)]


def names(zero: ZeroConfig, detailed: bool = False) -> list[str]:
    """Their names for a run label (with the bits they send where those are a setting); `detailed`:
    with their settings (hpZ's group size)."""
    return [t.detail(zero) if detailed and t.detail else f"INT{t.bits(zero)} {t.name}" if t.bits else t.name
            for t in enabled(zero)]


def fill_slots(ctx):
    """Each technique on builds its part into its slot, slot by slot (SLOTS)."""
    on = enabled(ctx.zero)
    for slot in SLOTS:
        for t in on:
            if t.slot == slot:
                setattr(ctx, slot, t.build(ctx))
