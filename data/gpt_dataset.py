"""GPT training samples over an IndexedDataset, as in Megatron-core's GPTDataset.

A split is a contiguous range of documents. Three index arrays turn it into
fixed-length samples:

* document index: the split's document ids, tiled over enough epochs to
  provide the requested samples, then shuffled.
* sample index: row i = (position in the document index, token offset) where
  sample i starts. Reading the shuffled documents as one token stream, sample
  i is tokens [i*seq_length, (i+1)*seq_length] inclusive: seq_length + 1
  tokens, so consecutive samples share one boundary token and tokens=x[:-1],
  labels=x[1:] predicts every token of the stream exactly once.
* shuffle index: a permutation of the samples.

The arrays are cached as .npy files named by a hash of everything that
determines them; with torch.distributed, rank 0 builds and the others wait and
memory-map them. Like Megatron, the indexed dataset's sequences are the
"documents" here (our preprocessing writes one sequence per document).
"""

import hashlib
import json
import math
import os
import re

import numpy as np
import torch

from data.indexed_dataset import DataError, IndexedDataset

INDEX_FORMAT_VERSION = 1  # bump when the way the index arrays are built changes


# ----------------------------------------------------------------------------
# index building (pure numpy, no I/O)

def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    # The stream of E epochs yields (E * tokens - 1) // seq_length samples:
    # each sample needs seq_length new tokens plus one shared with the next.
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def build_document_index(documents, num_epochs, rng):
    document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(sizes, document_index, seq_length, num_samples):
    """[num_samples + 1, 2] int64 rows of (document-index position, offset); vectorized."""
    ends = np.cumsum(sizes[document_index], dtype=np.int64)  # stream position where each doc ends
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document containing stream position p is the first one ending after p
    # (side="right" also skips empty documents).
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - sizes[document_index[position]])
    return np.stack([position, offset], axis=1)


def build_indices(sizes, documents, num_samples, seq_length, seed):
    """All three index arrays of a GPTDataset; len(dataset) = every sample of the epochs used."""
    tokens_per_epoch = int(sizes[documents].sum())
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sizes, document_index, seq_length, total_samples)
    shuffle_index = rng.permutation(total_samples).astype(np.int64)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def build_blending_indices(weights, size):
    """Megatron's greedy blend: each sample goes to the dataset lagging its weight the most.

    Sequential by nature (each choice depends on the previous ones), so it is a
    loop; plain Python floats are faster than numpy on a few datasets, and the
    result is cached.
    """
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        chosen = errors.index(max(errors))  # first maximum, like np.argmax
        dataset_index.append(chosen)
        dataset_sample_index.append(counts[chosen])
        counts[chosen] += 1
    return {"dataset_index": np.array(dataset_index, dtype=np.int16),
            "dataset_sample_index": np.array(dataset_sample_index, dtype=np.int64)}


# ----------------------------------------------------------------------------
# caching

def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def cached_indices(cache_dir, description, names, build):
    """Return ``build()``'s dict of arrays ``names``, cached in ``cache_dir`` under a hash of ``description``.

    Rank 0 builds and saves (each file atomically); other ranks wait at a
    barrier and then memory-map the files, so ``cache_dir`` must be visible
    to all ranks. Without a cache_dir every rank builds in memory (the build
    is deterministic).
    """
    if cache_dir is None:
        return build()
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    paths = {name: os.path.join(cache_dir, f"{key}-{name}.npy") for name in names}
    description_path = os.path.join(cache_dir, f"{key}-description.json")  # for humans, and "done" marker

    if (not _distributed() or torch.distributed.get_rank() == 0) and not os.path.isfile(description_path):
        os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        for name, path in paths.items():
            with open(path + ".tmp", "wb") as f:
                np.save(f, arrays[name])
            os.replace(path + ".tmp", path)
        # Written last: its presence means every array file is in place.
        with open(description_path + ".tmp", "w") as f:
            json.dump(description, f, indent=2)
        os.replace(description_path + ".tmp", description_path)
    if _distributed():
        torch.distributed.barrier()
    return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}


def _file_identity(path):
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# ----------------------------------------------------------------------------
# datasets

class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from documents ``doc_range`` of ``indexed_dataset``.

    ``len()`` is at least ``num_samples``: every sample of the epochs needed.
    """

    def __init__(self, indexed_dataset, doc_range, num_samples, seq_length, seed, cache_dir=None, name="train"):
        self.indexed_dataset = indexed_dataset
        self.name = name
        self.seq_length = seq_length
        start, end = doc_range
        sizes = indexed_dataset.sequence_lengths
        tokens = int(sizes[start:end].sum())
        if tokens < seq_length + 1:
            raise DataError(
                f"the {name} split of {indexed_dataset.prefix} (documents {start}..{end}) has {tokens} tokens, "
                f"fewer than one sample of --seq-length {seq_length} + 1; use a smaller --seq-length or a "
                f"different --split")
        description = {
            "class": "GPTDataset", "format_version": INDEX_FORMAT_VERSION,
            "index_file": _file_identity(indexed_dataset.prefix + ".idx"),
            "doc_range": [int(start), int(end)], "num_samples": int(num_samples),
            "seq_length": int(seq_length), "seed": int(seed),
        }
        indices = cached_indices(
            cache_dir, description, ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(sizes, np.arange(start, end), num_samples, seq_length, seed))
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, i):
        i = int(self.shuffle_index[i])
        (first, offset), (last, last_offset) = self.sample_index[i], self.sample_index[i + 1]
        doc = lambda position: int(self.document_index[position])  # noqa: E731
        if first == last:
            tokens = self.indexed_dataset.get(doc(first), int(offset), int(last_offset - offset + 1))
        else:
            pieces = [self.indexed_dataset.get(doc(first), int(offset))]
            pieces += [self.indexed_dataset.get(doc(p)) for p in range(first + 1, last)]
            pieces.append(self.indexed_dataset.get(doc(last), 0, int(last_offset + 1)))
            tokens = np.concatenate(pieces)
        return tokens.astype(np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets, weights, size, cache_dir=None):
        self.datasets = datasets
        weights = np.asarray(weights, dtype=np.float64)
        self.weights = weights / weights.sum()
        # The blend depends only on the weights and the size, not on the datasets.
        description = {"class": "BlendedDataset", "format_version": INDEX_FORMAT_VERSION,
                       "weights": self.weights.tolist(), "size": int(size)}
        indices = cached_indices(cache_dir, description, ("dataset_index", "dataset_sample_index"),
                                 lambda: build_blending_indices(self.weights, size))
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for dataset, count in zip(datasets, needed):
            if count > len(dataset):
                raise ValueError(f"blend needs {count} samples from a dataset of {len(dataset)}")

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, i):
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]


# ----------------------------------------------------------------------------
# train / valid / test from command-line style arguments

def parse_split(split):
    """'949,50,1' or '98/2/0' -> three fractions summing to 1."""
    parts = re.split(r"[,/]", split.strip()) if isinstance(split, str) else []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) == 0:
        raise DataError(f"--split {split!r} is malformed: expected up to three non-negative numbers that do not "
                         "all equal 0, separated by commas or slashes, e.g. 949,50,1")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(fractions, num_documents):
    """Contiguous [start, end) document ranges, rounded as Megatron does."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path):
    """['prefix'] or ['0.3', 'a', '0.7', 'b'] -> (prefixes, normalised weights)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    expected = "expected --data-path PREFIX or --data-path WEIGHT PREFIX [WEIGHT PREFIX ...], e.g. 0.3 a_text_document 0.7 b_text_document"
    if len(data_path) == 1:
        return list(data_path), [1.0]
    if len(data_path) == 0 or len(data_path) % 2:
        raise DataError(f"--data-path {' '.join(data_path)!r} has {len(data_path)} entries; {expected}")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise DataError(f"--data-path {' '.join(data_path)!r} has a non-numeric weight; {expected}") from None
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--data-path weights must be finite, non-negative and not all 0; {expected}")
    return list(data_path[1::2]), [w / sum(weights) for w in weights]


def build_train_valid_test_datasets(data_path, split, seq_length, num_samples, seed, cache_dir=None):
    """(train, valid, test) datasets; an entry is None when its split share or sample count is 0.

    ``cache_dir`` None puts the index cache beside the (first) dataset, in ``index-cache/``.
    """
    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    names = ("train", "valid", "test")

    def single(prefix, counts):
        indexed = IndexedDataset(prefix)
        ranges = split_ranges(fractions, len(indexed))
        return [GPTDataset(indexed, ranges[i], counts[i], seq_length, seed, cache_dir, names[i])
                if fractions[i] > 0 and counts[i] > 0 else None for i in range(3)]

    if len(prefixes) == 1:
        return tuple(single(prefixes[0], num_samples))

    # Ask each dataset for a little (1/200) more than its share so the greedy blend never runs out.
    per_dataset = [single(prefix, [math.ceil(n * w * 1.005) for n in num_samples])
                   for prefix, w in zip(prefixes, weights)]
    return tuple(
        BlendedDataset([parts[i] for parts in per_dataset], weights, num_samples[i], cache_dir)
        if fractions[i] > 0 and num_samples[i] > 0 else None for i in range(3))
