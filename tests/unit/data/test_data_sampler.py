"""Resumable data-parallel sampling and the data loader."""

import numpy as np
import pytest
import torch

from data.sampler import PretrainingSampler, build_data_loader


def batches(consumed, rank, total=103, mbs=4, dp=2, drop_last=True):
    return list(PretrainingSampler(total, consumed, mbs, rank, dp, drop_last))


def test_resume_continues_exactly():
    for rank in (0, 1):
        full = batches(0, rank)
        assert len(full) == 103 // 8  # ragged tail dropped
        for steps in (1, 5, 12):
            assert batches(steps * 8, rank) == full[steps:]


def test_ranks_are_disjoint_and_cover_each_step():
    rank0, rank1 = batches(16, 0), batches(16, 1)
    assert len(rank0) == len(rank1) == len(PretrainingSampler(103, 16, 4, 0, 2))
    for step, (mine, theirs) in enumerate(zip(rank0, rank1)):
        assert len(mine) == len(theirs) == 4 and not set(mine) & set(theirs)
        assert sorted(mine + theirs) == list(range(16 + 8 * step, 16 + 8 * (step + 1)))


def test_keep_last_partial_step():
    assert batches(96, 0, drop_last=False) == [[96, 97, 98, 99]]
    assert batches(96, 1, drop_last=False) == [[100, 101, 102]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="consumed_samples=103"):
        PretrainingSampler(103, 103, 4, 0, 2)
    with pytest.raises(ValueError, match="rank 2"):
        PretrainingSampler(103, 0, 4, 2, 2)


class Counting(torch.utils.data.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return np.arange(i, i + 9, dtype=np.int64)


def test_data_loader_batches():
    loader = build_data_loader(Counting(), consumed_samples=8, micro_batch_size=3, dp_rank=1, dp_size=2)
    first = next(iter(loader))
    assert first.dtype == torch.int64 and first.shape == (3, 9)
    assert first[:, 0].tolist() == [11, 12, 13]  # step [8, 14): rank 1 takes the second half
    assert build_data_loader(None, 0, 3, 0, 1) is None
