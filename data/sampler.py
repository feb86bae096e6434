"""Deterministic, resumable batching for data-parallel pretraining (Megatron's MegatronPretrainingSampler).

Samples are consumed in order, ``micro_batch_size * data_parallel_size`` at a
time; rank r takes the r-th slice of each such step. The dataset is already
shuffled (GPTDataset's shuffle index), so the sampler does not shuffle, and
resuming from a checkpoint's ``consumed_samples`` continues exactly where
training stopped.
"""

import torch


class PretrainingSampler:
    """Yields this rank's list of sample indices for each micro-batch."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                 drop_last=True):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is outside the dataset of {total_samples} samples; "
                             "train on more samples or resume from an earlier checkpoint")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size  # samples consumed per micro-step, all ranks
        self.drop_last = drop_last

    def __len__(self):
        remaining = self.total_samples - self.consumed_samples
        return remaining // self.step if self.drop_last else -(-remaining // self.step)

    def __iter__(self):
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.step):
            end = min(start + self.step, self.total_samples)
            if end - start < self.step and self.drop_last:
                return
            # This rank's slice of the step [start, end); may be short or empty at the ragged end.
            mine = first + (start - self.consumed_samples)
            indices = list(range(mine, min(mine + self.micro_batch_size, end)))
            if indices:
                yield indices


def build_data_loader(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers=0):
    """DataLoader yielding LongTensors [micro_batch_size, seq_length + 1]; None for a missing dataset."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # Its own generator: starting an iterator draws a seed, and drawing it from the
    # global RNG would shift dropout masks and break exact resume.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       generator=torch.Generator().manual_seed(0),
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0)
