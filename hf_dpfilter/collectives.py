"""The collective seam: every exchange between the processes of a DP run goes through one object.

The DP optimizer needs three collectives: the sum of the clipped sums over processes (each process holds the
examples of its shard of the Poisson sample), one noise draw shared by all processes (noise enters once in
total), and the sum of any other per-process private sum (DiceSGD's clipping residual). A sharded engine
(parameters split over processes) plugs in here by providing the same operations on its shards.

:class:`ProcessGroupCollectives` is plain data parallelism over ``torch.distributed`` (DDP); with one process
it does nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Collectives", "ProcessGroupCollectives", "default_collectives"]


class Collectives:
    """Single process: nothing to exchange."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over all processes, in place."""

    def share_(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` with process 0's value on every process (one shared draw)."""

    def agree_on_seed(self, seed: int) -> int:
        """Process 0's ``seed`` on every process."""
        return int(seed)


class ProcessGroupCollectives(Collectives):
    """Data parallelism over the default ``torch.distributed`` process group."""

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def share_(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)

    def agree_on_seed(self, seed: int) -> int:
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        value = torch.tensor([int(seed)], dtype=torch.int64, device=device)
        dist.broadcast(value, src=0)
        return int(value.item())


def default_collectives() -> Collectives:
    """:class:`ProcessGroupCollectives` when ``torch.distributed`` runs several processes, else a no-op."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGroupCollectives()
    return Collectives()
