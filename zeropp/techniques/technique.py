"""What a technique says of itself. Each technique's module ends with its `TECHNIQUE`, and the
registry (zeropp/techniques/__init__.py) lists them; whatever composes, checks, plans or labels
a job asks them, never a technique's attribute names:
- its keys: a dataclass of its `zero_optimization` keys (DeepSpeed's names, defaults off), which
  zeropp/config composes into `ZeroConfig`, and their checks (`validate`, `validate_topology`);
- its part: `build(ctx)` fills its slot (zeropp/build.py; the FSDP2 plug-in too), and the part
  answers for itself (its collectives, memory and carried state: zeropp/collectives/protocols.py);
- its names: in run labels, and of the state it carries in a checkpoint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from common import ConfigError

AUTO = "auto"   # a key planner.auto chooses (measuring the links)

# The slots, in the order build.py fills them:
# - "rotation": the Hadamard block size qgZ's rows are rotated in (0: none);
# - "weight_gather": the gather of the primary partition (default: exact);
# - "secondary": a weight source inside the node that keeps what the primary gathers (hpZ);
# - "weight_deltas": a weight source that sends the primary partition's weights as deltas;
# - "gradient_reduction": the gradient reduction (default: the plain reduce-scatter); a later
#   technique of this slot builds on the earlier one's (LoCo on qgZ's).
SLOTS = ("rotation", "weight_gather", "secondary", "weight_deltas", "gradient_reduction")


def key(default, *, flag: str | None = None, auto: bool = False, section: type | None = None):
    """A technique's key (a field of its keys dataclass, named as DeepSpeed's JSON names it).
    `flag`: the command-line option that sets it (its argparse dest; training/deepspeed_args.py
    merges it); `auto`: it may be "auto"; `section`: the dataclass of a nested JSON object (LoCo's
    `zeropp_loco_param`), an explicit `flag` setting it to its defaults."""
    metadata = {"flag": flag, "auto": auto, "section": section}
    return dataclasses.field(default=default, metadata=metadata)


def switched_on(value) -> bool:
    """A technique's switch set on: true, a group of more than one rank (hpZ's size), a section's
    parameters (LoCo's), a setting other than 0; "auto" is not on until it is resolved."""
    if value is None or isinstance(value, str):
        return False
    if type(value) is int:   # a group's ranks: 1 is off
        return value > 1
    return bool(value)


def check_block_size(zero, where: str, name: str, least: int):
    """A quantization block size: a power of two >= `least`. A block's data bytes must be a
    multiple of 4 (INT8: 4 elements, INT4: 8), or the fp32 scales of the next row of a wire buffer
    start unaligned (zeropp/kernels/format.py, to_bytes)."""
    b = getattr(zero, name)
    if b < least or b & (b - 1):
        default = next(f.default for f in dataclasses.fields(zero) if f.name == name)
        raise ConfigError(f"{where}.{name} must be a power of two >= {least} (elements per fp32 scale; "
                          f"smaller blocks misalign the scales on the wire), got {b}; the default is {default}")


def check_bits(bits, key: str, flag: str, what: str):
    """The bits of what crosses nodes below ZeRO++'s defaults: 4 (the default) or 2."""
    if bits not in (4, 2) or isinstance(bits, bool):
        raise ConfigError(f"{key} ({flag}) must be 4 (the default) or 2 ({what}), got {bits!r}")


@dataclass
class BuildContext:
    """What a technique's `build` reads (the job, its process groups, the partitioned weights)
    and what the techniques built before it provided, by slot."""
    zero: object              # zeropp.config.ZeroConfig
    comm: object
    groups: object            # zeropp/build.py ProcessGroups (None under the FSDP2 plug-in)
    dtype: object
    device: object
    weights: list             # the partitioned Stage3Params, placed and bound to `flat`
    flat: object              # their compute-dtype shards, end to end
    rotation: int = 0
    weight_gather: object = None
    secondary: object = None
    weight_deltas: object = None
    gradient_reduction: object = None


def _nothing(*args):
    return None


@dataclass(frozen=True)
class Technique:
    name: str                                      # in run labels
    slot: str                                      # SLOTS
    keys: type                                     # its zero_optimization keys (a dataclass of `key`s)
    switch: str                                    # the key that turns it on
    build: Callable[[BuildContext], object]        # its part (None: nothing to add on this job)
    validate: Callable[[object, str], None] = _nothing   # (zero, where): a ConfigError naming the key and the fix
    validate_topology: Callable[[object, int, int], None] = _nothing   # (zero, ranks per node, world size)
    carries: dict = dataclasses.field(default_factory=dict)   # its parts' scalar-state keys -> their names in a line
    detail: Callable[[object], str] | None = None  # the name with its setting
    memory_key: str | None = None                  # its MemoryLine's name in memory_report()
    bits: Callable[[object], int] | None = None    # of what it sends, when a setting: "INT{bits} name"

    def enabled(self, zero) -> bool:
        """The configuration turns it on (`switched_on` its switch)."""
        return switched_on(getattr(zero, self.switch))
