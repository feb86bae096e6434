"""Corpus statistics used as baselines in training logs."""
from __future__ import annotations

import numpy as np

from data.indexed_dataset import IndexedDataset


def unigram_entropy(prefix: str) -> float:
    """Entropy in nats of the token frequencies of a `.bin/.idx` dataset: the loss
    of a model that ignores context. A language model must go clearly below it."""
    ds = IndexedDataset(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=ds.dtype, mode="r")
    counts = np.bincount(tokens).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
