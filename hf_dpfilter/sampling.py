"""Poisson sampling of logical batches, on one process or sharded over several.

Each step includes every training example independently with probability q = logical_batch_size / N, so
batch sizes vary and a batch may be empty; this is the sampling the accountant assumes. Under several
processes, process r samples only the indices i with i % world_size == r, each with the same probability q,
so the union of the shards is one Poisson sample of rate q over the whole data set.

The sampler is deterministic given (seed, epoch), so a resumed run that skips the batches already seen
draws the same remaining batches as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps_per_epoch`` Poisson-sampled batches of indices (lists, possibly empty) per epoch."""

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        shard = torch.arange(self.rank, self.num_samples, self.world_size)
        for _ in range(self.steps_per_epoch):
            # Every process draws the full mask with the same generator and keeps its own shard, so the
            # shards of one step are disjoint parts of a single Poisson sample.
            mask = torch.rand(self.num_samples, generator=generator) < self.sample_rate
            yield shard[mask[shard]].tolist()
