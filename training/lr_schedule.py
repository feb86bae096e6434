"""Megatron's learning-rate schedule: linear warmup from 0, then decay to min_lr."""
from __future__ import annotations

import math


def learning_rate(iteration: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                  style: str) -> float:
    """LR for optimizer step `iteration` (0-based: the first step uses iteration 0)."""
    if warmup_iters > 0 and iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    if style == "constant":
        return lr
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / max(1, decay_iters - warmup_iters)
    if style == "linear":
        coeff = 1.0 - progress
    elif style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"--lr-decay-style {style!r}: use constant, linear or cosine")
    return min_lr + coeff * (lr - min_lr)
