"""The precision sections of a DeepSpeed config (`fp16`, `bf16`, `data_types`) and DeepSpeed's
dtype spellings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0          # 0 = dynamic loss scaling
    initial_scale_power: int = 16    # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    auto_cast: bool = False          # false only: the model itself runs in fp16


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class DataTypesConfig:
    grad_accum_dtype: str | None = "fp32"   # fp32 only


def normalize_dtype(name: str) -> str | None:
    """DeepSpeed's dtype spellings -> "fp32" / "fp16" / "bf16"; None if unknown."""
    return {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
            "bf16": "bf16", "bfloat16": "bf16"}.get(str(name).lower())
