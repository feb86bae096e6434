"""Bucket sizes from the model, where the configuration sets none.

DeepSpeed's defaults (reduce_bucket_size and allgather_bucket_size 5e8 elements,
stage3_prefetch_bucket_size 5e7) hold a small model whole: one bucket per phase, so
no gradient reduction runs while backward goes on and no gather is prefetched while
forward computes. DeepSpeed's "auto" for these keys (the Hugging Face Transformers
integration) derives them from the hidden size (reduce_bucket_size = hidden^2,
stage3_prefetch_bucket_size = 0.9 hidden^2); here they come from the parameter
count, which the engine has for any module: 1/FRACTION of the model, capped at
DeepSpeed's defaults. A size the configuration sets is kept.
"""
from __future__ import annotations

import dataclasses

from zeropp.config import ZeroConfig
from zeropp.config.keys import BUCKET_DEFAULTS

FRACTION = 8   # buckets per model: on an emulated 100 Mbit/s link the demo's exposed communication halved,
               # one bucket -> 1/8 (docs/results.md, slow link)


def bucket_sizes(zero: ZeroConfig, num_params: int) -> ZeroConfig:
    """`zero` with every bucket size it leaves unset (None) derived from `num_params`."""
    derived = {key: min(cap, max(1, num_params // FRACTION)) for key, cap in BUCKET_DEFAULTS.items()
               if getattr(zero, key) is None}
    return dataclasses.replace(zero, **derived) if derived else zero


def describe(given: ZeroConfig, used: ZeroConfig, num_params: int) -> str | None:
    """The start-up line saying which sizes were derived (None if the configuration set all)."""
    derived = [key for key in BUCKET_DEFAULTS if getattr(given, key) is None]
    if not derived or used.stage == 0:   # stage 0 (DDP) has its own buckets
        return None
    sizes = ", ".join(f"{key} {getattr(used, key):,}" for key in derived)
    return (f"> buckets sized from the model ({num_params:,} parameters / {FRACTION}, at most DeepSpeed's "
            f"defaults): {sizes} elements; set them in zero_optimization to choose")
