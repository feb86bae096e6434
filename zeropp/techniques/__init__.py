"""The techniques beyond ZeRO-3, one module each, and the one registry of them. A technique's
module declares what it is (its `TECHNIQUE`, zeropp/techniques/technique.py): its keys and their
checks, its slot and the `build(ctx)` of its part, its names. zeropp/config composes the keys
into `ZeroConfig`, zeropp/build.py fills the slots, the run labels and the planner ask here, and
every part answers for itself (its bytes, bounds, memory and checkpoint state:
zeropp/collectives/protocols.py).

Adding a technique: its module, and one line in REGISTRY (ARCHITECTURE.md, "Adding a technique").
"""
from __future__ import annotations

import contextlib

from zeropp.techniques import deltas, hadamard, hpz, loco, qgz, qwz
from zeropp.techniques.technique import AUTO, SLOTS, BuildContext, Technique

REGISTRY = (
    qwz.TECHNIQUE,
    hpz.TECHNIQUE,
    qgz.TECHNIQUE,
    loco.TECHNIQUE,
    hadamard.TECHNIQUE,
    deltas.TECHNIQUE,
)

_added: list[Technique] = []   # registered for a while (`registered`)


def registry() -> tuple[Technique, ...]:
    """Every technique, in the order their parts are built and their keys checked."""
    return REGISTRY + tuple(_added)


@contextlib.contextmanager
def registered(*added: Technique):
    """These techniques join the registry inside the block (an example technique in a test):
    their keys are accepted in zero_optimization (zeropp.config.zero_config_type) and their
    parts built, planned and checkpointed as the others'."""
    _added.extend(added)
    try:
        yield
    finally:
        for t in added:
            _added.remove(t)


def enabled(zero) -> list[Technique]:
    """The techniques `zero` turns on, in the registry's order."""
    return [t for t in registry() if t.enabled(zero)]


def names(zero, detailed: bool = False) -> list[str]:
    """Their names for a run label (with the bits they send where those are a setting); `detailed`:
    with their settings (hpZ's group size)."""
    return [t.detail(zero) if detailed and t.detail else f"INT{t.bits(zero)} {t.name}" if t.bits else t.name
            for t in enabled(zero)]


def memory_keys() -> tuple[str, ...]:
    """Their MemoryLines' names: 0 in a memory report when off."""
    return tuple(t.memory_key for t in registry() if t.memory_key)


def carried_names() -> dict[str, str]:
    """The state their parts carry in a checkpoint: scalar-state key -> its name in a line."""
    return {k: v for t in registry() for k, v in t.carries.items()}


def fill_slots(ctx: BuildContext):
    """Each technique on builds its part into its slot, slot by slot (SLOTS)."""
    on = enabled(ctx.zero)
    for slot in SLOTS:
        for t in on:
            if t.slot == slot:
                setattr(ctx, slot, t.build(ctx))


__all__ = ["AUTO", "REGISTRY", "SLOTS", "BuildContext", "Technique", "carried_names", "enabled", "fill_slots",
           "memory_keys", "names", "registered", "registry"]
