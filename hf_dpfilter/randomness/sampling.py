"""Batch samplers of the privacy plan: Poisson sampling (what the accountant assumes) and shuffled batches.

Poisson: each step includes every training example independently with probability q = logical_batch_size / N,
so batch sizes vary and a batch may be empty. Under several processes, process r samples only the indices i
with i % world_size == r, each with the same probability q, so the union of the shards is one Poisson sample
of rate q over the whole data set.

Which examples are in a batch must stay secret (subsampling amplification assumes it). With ``secure=True``
the coins come from the OS CSPRNG (each process flips the coins of its own shard). Otherwise they come from a
generator seeded with ``derive_seed(seed, "poisson-sampler", epoch)``: deterministic given the secret seed,
and a stream of its own, never the noise generator's. After a resume DPTrainer gives the sampler a fresh seed
from the OS CSPRNG (no generator state is saved), so the batches after a resume are fresh draws.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from hf_dpfilter.randomness.secure_rng import derive_seed, secure_uniform

__all__ = ["PoissonBatchSampler", "ShuffledBatchSampler"]


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps_per_epoch`` Poisson-sampled batches of indices (lists, possibly empty) per epoch."""

    #: the name of the seeded stream (each sampler kind draws from its own)
    stream = "poisson-sampler"

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        secure: bool = False,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.secure = secure
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def generator(self) -> torch.Generator:
        """The seeded generator of the current epoch (its own stream; unused with ``secure=True``)."""
        return torch.Generator().manual_seed(derive_seed(self.seed, self.stream, self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        shard = torch.arange(self.rank, self.num_samples, self.world_size)
        if self.secure:
            for _ in range(self.steps_per_epoch):
                yield shard[secure_uniform(len(shard)) < self.sample_rate].tolist()
            return
        generator = self.generator()
        for _ in range(self.steps_per_epoch):
            # Every process draws the full mask with the same generator and keeps its own shard, so the
            # shards of one step are disjoint parts of a single Poisson sample.
            mask = torch.rand(self.num_samples, generator=generator) < self.sample_rate
            yield shard[mask[shard]].tolist()


class ShuffledBatchSampler(Sampler[list[int]]):
    """Fixed-size shuffled batches (``poisson_sampling=False``, or non-private runs), per (seed, epoch)."""

    def __init__(
        self, num_samples: int, batch_size: int, steps_per_epoch: int, seed: int, rank: int = 0,
        world_size: int = 1
    ) -> None:
        # Every process must see the same permutation, so this sampler is always seeded (the plan's secret
        # DP seed); shuffled batches carry no proven guarantee anyway (the accountant assumes Poisson).
        self.num_samples, self.batch_size, self.steps_per_epoch = num_samples, batch_size, steps_per_epoch
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        seed = derive_seed(self.seed, "shuffled-sampler", self.epoch)
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed))
        for step in range(self.steps_per_epoch):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield batch[self.rank :: self.world_size].tolist()
