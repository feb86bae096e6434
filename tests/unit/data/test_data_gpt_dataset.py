"""GPT samples: content, determinism, caching, splits, blends, and argument errors."""

import os

import numpy as np
import pytest

from data import gpt_dataset
from data.gpt_dataset import BlendedDataset, GPTDataset, build_train_valid_test_datasets, parse_split, split_ranges
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_dataset(prefix, num_docs=200, base=0, seed=0):
    """Documents of random length whose tokens say where they come from: base + doc * 1000 + position."""
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for doc in range(num_docs):
        builder.add_document(base + doc * 1000 + np.arange(rng.randint(1, 60)))
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def prefix(tmp_path):
    return make_dataset(str(tmp_path / "synthetic"))


def test_samples_are_overlapping_windows_of_the_shuffled_stream(prefix):
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(indexed, (10, 150), num_samples=300, seq_length=16, seed=1)
    assert len(ds) >= 300
    assert set(np.unique(ds.document_index)) == set(range(10, 150))
    stream = np.concatenate([indexed[d] for d in ds.document_index])
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (17,)
        j = ds.shuffle_index[i]  # position of this sample in the stream
        assert np.array_equal(sample, stream[j * 16: j * 16 + 17])
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))  # a permutation


def test_deterministic_in_the_seed(prefix):
    indexed = IndexedDataset(prefix)
    a, b, c = (GPTDataset(indexed, (0, 200), 500, 32, seed) for seed in (7, 7, 8))
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_is_reused(prefix, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    indexed = IndexedDataset(prefix)
    first = GPTDataset(indexed, (0, 200), 500, 32, seed=3, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and not [f for f in files if f.endswith(".tmp")]
    mtimes = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files}

    def fail(*args):
        raise AssertionError("index rebuilt although it is cached")

    monkeypatch.setattr(gpt_dataset, "build_indices", fail)
    second = GPTDataset(indexed, (0, 200), 500, 32, seed=3, cache_dir=cache)
    assert isinstance(second.shuffle_index, np.memmap)
    assert all(np.array_equal(first[i], second[i]) for i in range(len(first)))
    assert {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in os.listdir(cache)} == mtimes
    with pytest.raises(AssertionError, match="rebuilt"):  # anything else is a different cache entry
        GPTDataset(indexed, (0, 200), 500, 32, seed=4, cache_dir=cache)


def test_split_proportions(prefix):
    assert split_ranges(parse_split("949,50,1"), 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges(parse_split("98/2/0"), 200) == [(0, 196), (196, 200), (200, 200)]
    assert parse_split("1,0,0") == [1.0, 0.0, 0.0]
    train, valid, test = build_train_valid_test_datasets([prefix], "80,15,5", 8, (100, 20, 10), seed=0)
    doc_counts = [len(np.unique(d.document_index)) for d in (train, valid, test)]
    assert doc_counts == [160, 30, 10]
    assert min(train.document_index) == 0 and min(valid.document_index) == 160 and min(test.document_index) == 190
    train, valid, test = build_train_valid_test_datasets([prefix], "98,2,0", 8, (100, 20, 10), seed=0)
    assert test is None and len(valid) >= 20


def test_blend_proportions(tmp_path):
    a = make_dataset(str(tmp_path / "a"), base=0, seed=1)
    b = make_dataset(str(tmp_path / "b"), base=10_000_000, seed=2)
    train, valid, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "9,1,0", 8, (3000, 300, 0), seed=5,
                                                      cache_dir=str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and len(train) == 3000 and len(valid) == 300
    from_b = np.array([train[i][0] >= 10_000_000 for i in range(len(train))])
    assert abs(from_b.mean() - 0.7) < 0.01
    assert np.array_equal(from_b, train.dataset_index == 1)
    assert abs(np.mean(valid.dataset_index == 0) - 0.3) < 0.01


@pytest.mark.parametrize("split", ["a,b,c", "0,0,0", "1,2,3,4", "", "-1,2,0"])
def test_bad_split(prefix, split):
    with pytest.raises(ValueError, match="--split .* malformed.*949,50,1"):
        build_train_valid_test_datasets([prefix], split, 8, (10, 1, 1), seed=0)


@pytest.mark.parametrize("data_path, problem", [
    (["0.3", "a", "0.7"], "3 entries"),
    (["heavy", "a", "0.7", "b"], "non-numeric weight"),
])
def test_bad_blend(data_path, problem):
    with pytest.raises(ValueError, match=problem) as error:
        build_train_valid_test_datasets(data_path, "1,0,0", 8, (10, 0, 0), seed=0)
    assert "--data-path" in str(error.value) and "0.3 a_text_document 0.7 b_text_document" in str(error.value)


def test_split_too_small(tmp_path, prefix):
    with pytest.raises(ValueError, match="test split.*--seq-length 200.*different --split"):
        build_train_valid_test_datasets([prefix], "90,9,1", 200, (10, 1, 1), seed=0)


def _distributed_worker(rank, prefix, cache, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:  # only rank 0 may build; rank 1 must wait and load
        gpt_dataset.build_indices = lambda *args: (_ for _ in ()).throw(AssertionError("rank 1 built"))
    ds = GPTDataset(IndexedDataset(prefix), (0, 200), 500, 32, seed=3, cache_dir=cache)
    np.save(f"{cache}/../rank{rank}.npy", np.stack([ds[i] for i in range(20)]))
    dist.destroy_process_group()


def test_distributed_rank0_builds_others_load(prefix, tmp_path):
    import torch.multiprocessing as mp

    cache = str(tmp_path / "cache")
    # fork: the children reuse the imported torch instead of importing it again
    mp.start_processes(_distributed_worker, args=(prefix, cache, str(tmp_path / "init")), nprocs=2, start_method="fork")
    assert np.array_equal(np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy"))
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3
