"""Reading train.py's log: Megatron's iteration and validation lines, as
bench/ drives training runs (train.py writes them through training/logger.py)."""
from __future__ import annotations

import math
import re

TRAIN_RE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|.*?"
    r"\| lm loss: ([-+\d.eE]+|nan|inf) \|.*?"
    r"intra-node MB: ([\d.]+) \| inter-node MB: ([\d.]+) \|")
GRAD_RE = re.compile(r"\| grad norm: ([-+\d.eEnaif]+) \|")  # absent after a skipped step, as in Megatron
# Megatron's wording: "validation loss at iteration N [on validation set | on test set] | lm loss value: X"
EVAL_RE = re.compile(r"validation loss at iteration (\d+)(?: on (validation|test) set)? \| "
                     r"lm loss value: ([-+\d.eE]+|nan|inf)")


def parse_log(text: str) -> dict:
    """{"train": [per logged iteration], "validation": [...], "test": {...} or None}."""
    train, valid, test = [], [], None
    for line in text.splitlines():
        m = TRAIN_RE.search(line)
        if m:
            train.append({"iteration": int(m[1]), "iter_ms": float(m[3]), "loss": float(m[4]),
                          "grad_norm": float(g[1]) if (g := GRAD_RE.search(line)) else math.nan,
                          "intra_mb": float(m[5]), "inter_mb": float(m[6])})
            continue
        m = EVAL_RE.search(line)
        if m:
            if m[2] == "test":
                test = {"iteration": int(m[1]), "loss": float(m[3])}
            elif not valid or valid[-1]["iteration"] != int(m[1]):
                valid.append({"iteration": int(m[1]), "loss": float(m[3])})
    return {"train": train, "validation": valid, "test": test}
