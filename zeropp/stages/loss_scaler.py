"""fp16 loss scaling, with DeepSpeed's semantics.

Dynamic: after an overflow the step is skipped; once `hysteresis` overflows
have been seen the scale is halved (never below `min_scale`). After `window`
clean steps in a row the scale doubles. A static scale (loss_scale > 0) never
changes. bf16 and fp32 use a scale of 1.
"""
from __future__ import annotations

from zeropp.config import FP16Config


class LossScaler:
    def __init__(self, cfg: FP16Config | None = None):
        cfg = cfg or FP16Config()
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        if not cfg.enabled:
            self.scale = 1.0
        elif cfg.loss_scale > 0:
            self.scale = float(cfg.loss_scale)
        else:
            self.scale = float(2 ** cfg.initial_scale_power)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.min_scale = cfg.min_loss_scale
        self._hysteresis_left = cfg.hysteresis
        self._clean_steps = 0

    def update(self, overflow: bool):
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "clean_steps": self._clean_steps}

    def load_state_dict(self, sd: dict):
        self.scale = sd["scale"]
        self._hysteresis_left = sd["hysteresis_left"]
        self._clean_steps = sd["clean_steps"]
