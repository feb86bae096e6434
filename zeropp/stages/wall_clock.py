"""DeepSpeed's `wall_clock_breakdown`: seconds per phase of the engine's work.

Phases (nested as they run): `forward`; `backward`, which holds
`backward_inner` (autograd, with the gradient reductions it launches on the way)
and, for ZeRO stages 1-3, `backward_allreduce` (after autograd: waiting for and
finishing the gradient reductions still in flight; at stage 0 DDP reduces
inside autograd, so none is measured apart); `step` (norm, clipping, the
optimizer, publishing the updated weights). On CUDA each boundary synchronizes
the device, as DeepSpeed's timers do, so the figures are the work's and not the
launches'; that costs time, hence off by default.
"""
from __future__ import annotations

import contextlib
import time

import torch

PHASES = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


class WallClock:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self._cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def paused(self):
        """Time nothing inside (evaluation is not training's time)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def _sync(self):
        if self._cuda:
            torch.cuda.synchronize()

    def read_and_reset(self) -> dict[str, float]:
        """Seconds per phase since the last call."""
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out
