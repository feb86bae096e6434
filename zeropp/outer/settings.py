"""The outer synchronization's settings (zeropp/outer/diloco.py) and the names its state and its
collectives go by."""
from __future__ import annotations

from dataclasses import dataclass

from zeropp.kernels.format import DEFAULT_BLOCK_SIZE

KEY = "outer_sync"
GLOBAL = KEY + ".global."   # + a parameter's name: its global values in checkpoints
PHASE = "outer_sync"
WARMUP = "outer_warmup"   # the warm-up's gradient all-reduce across the groups
DRIFT = "outer_drift"   # the drift's all-reduce inside a group (not across groups)


@dataclass(frozen=True)
class OuterSettings:
    interval: int                 # H: inner steps between two exchanges of a fragment
    lr: float = 0.7
    momentum: float = 0.9         # Nesterov
    fragments: int = 1
    quantization: str = "none"    # or "int4", "topk2"
    delay: int = 1                # inner steps between issuing an exchange and merging it (< H)
    merge_alpha: float = 0.5      # the share of the local values a delayed merge keeps
    block_size: int = DEFAULT_BLOCK_SIZE[4]
    warmup: int = 0               # inner steps trained as one synchronous job before the first exchange
    topk_fraction: float = 0.02   # topk2: the share of each chunk sent
    asynchronous: bool = False    # rounds over whoever reported, never waited for (zeropp/outer/rounds.py)
    max_staleness: int = 4        # asynchronous: a contribution older than this many outer steps is dropped

    @property
    def spacing(self) -> int:
        """Inner steps between two exchanges (of consecutive fragments), at least."""
        return self.interval // self.fragments

    def due(self, step: int) -> range:
        """The fragments exchanged after inner step `step`: f with step % H == f H // F (one at
        most when F <= H), in closed form (F may be large)."""
        H, F, r = self.interval, self.fragments, step % self.interval
        # f H // F == r  <=>  r F / H <= f < (r + 1) F / H
        return range(min(F, -(-r * F // H)), min(F, -(-(r + 1) * F // H)))


def saved_layout(s: OuterSettings) -> list:
    """What a saved outer state's shape and schedule depend on."""
    topk = [s.topk_fraction] if s.quantization == "topk2" else []   # what the masters hold unsent
    mode = ["async"] if s.asynchronous else []   # its own state: each group's base values
    return [s.interval, s.fragments, s.quantization, bool(s.momentum), s.delay] + topk + mode
