"""The collective seam: every exchange between the processes of a DP run goes through one object.

The DP optimizer needs these collectives: the sum of the clipped sums over processes (each process holds the
examples of its shard of the Poisson sample), one noise draw shared by all processes (noise enters once in
total), the sum of any other per-process private sum (DiceSGD's clipping residual), and norms of vectors
that are split over processes.

:class:`ProcessGroupCollectives` is data parallelism over ``torch.distributed``: replicated parameters (DDP)
get the sum by an all-reduce, bucketed under NCCL (a few flat buffers of about :data:`BUCKET_BYTES`, as DDP
does, instead of one call per parameter tensor); parameters sharded by FSDP2 (``fully_shard``: DTensors with a
``Shard(0)`` placement on a one-dimensional mesh over all processes) get only their own shard of the sum, by a
bucketed reduce-scatter. With one process it does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch builds without distributed tensors
    DTensor = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]

__all__ = [
    "BUCKET_BYTES",
    "as_layout_of",
    "Collectives",
    "ProcessGroupCollectives",
    "ShardingError",
    "default_collectives",
    "float64_squared_norm",
    "is_sharded",
    "shard_bounds",
]

#: size of one flat buffer of the bucketed all-reduce / reduce-scatter (DDP's default bucket is 25 MiB)
BUCKET_BYTES = 25 * 1024 * 1024


class ShardingError(ValueError):
    """A parameter is split over processes in a way the DP optimizer cannot sum and noise exactly."""


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor (a parameter, or a tensor laid out like one, split by FSDP2)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def shard_bounds(param: torch.Tensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 of the whole tensor that this process holds of the sharded ``param``.

    FSDP2 splits dim 0 as ``torch.chunk`` does (``ceil(n / W)`` rows per process, the last ones possibly
    short or empty). Any other layout (HSDP's 2-D mesh, tensor parallelism, ``Shard(1)``) is refused.
    """
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0],
                                                                Shard) or placements[0].dim != 0:
        raise ShardingError(
            f"hf_dpfilter supports FSDP2 parameters sharded on dim 0 over a one-dimensional mesh of all "
            f"processes, got placements {tuple(placements)} on a {mesh.ndim}-D mesh. Use fully_shard without "
            "HSDP / tensor parallelism (accelerate_configs/fsdp.yaml), or DDP."
        )
    rows, world, rank = param.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    local = param.to_local().shape
    if local[0] != stop - start or tuple(local[1:]) != tuple(param.shape[1:]):
        raise ShardingError(
            f"A sharded parameter of shape {tuple(param.shape)} holds a local shard of shape {tuple(local)} "
            f"on process {rank} of {world}, not the rows [{start}, {stop}) of torch.chunk's split that FSDP2 "
            "uses."
        )
    return start, stop


def as_layout_of(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this process's shard of a tensor of ``param``'s shape) as a DTensor laid out like
    ``param``."""
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


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

    def max_over_processes(self, value: int) -> int:
        """The largest ``value`` of all processes (FSDP2: every process runs as many micro-batches as the
        most)."""
        return int(value)

    def sum_as_params(self, params: Sequence[torch.Tensor],
                      tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum whole-size ``tensors`` (one per parameter) over processes, each returned laid out like its
        parameter.

        A replicated parameter gets the whole sum; a sharded one (FSDP2) only this process's shard of it, as a
        DTensor. The inputs may be overwritten.
        """
        return [self.shard_of(p, t) if is_sharded(p) else t for p, t in zip(params, tensors)]

    def shard_of(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This process's shard of ``whole`` (a tensor of ``param``'s whole shape), laid out like ``param``.

        Nothing is exchanged: every process slices its own rows (the noise is drawn whole and sliced).
        """
        if not is_sharded(param):
            return whole
        start, stop = shard_bounds(param)
        return as_layout_of(param, whole[start:stop].contiguous())

    def squared_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """``sum ||t||^2`` over the whole (unsharded) tensors, in float64, the same on every process."""
        return float64_squared_norm([_local(t) for t in tensors])


#: elements converted to float64 at a time by :func:`float64_squared_norm` on CPU (4 MiB, cache-sized)
_NORM_CHUNK = 1 << 19


def float64_squared_norm(tensors: Sequence[torch.Tensor]) -> float:
    """``sum ||t||^2`` accumulated in float64 (one host sync), without a float64 copy of the tensors on CPU.

    On CUDA one fused ``_foreach_norm`` in float64. On CPU that fused norm first writes a float64 copy of
    every tensor (for DiceSGD's error buffer, twice its size in fresh memory at every step: 5x the time of the
    norm itself on RoBERTa-base); here each piece of :data:`_NORM_CHUNK` elements is converted into one reused
    float64 buffer and its squares are summed there (``torch.dot`` in float64), so every product and partial
    sum is a float64 operation as before.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return 0.0
    if any(t.device.type != "cpu" for t in tensors):
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
        return float(torch.stack([n.to(norms[0].device) for n in norms]).pow(2).sum())
    total = torch.zeros((), dtype=torch.float64)
    buffer = torch.empty(min(_NORM_CHUNK, max(t.numel() for t in tensors)), dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _NORM_CHUNK):
            piece = flat[start : start + _NORM_CHUNK]
            converted = buffer[: piece.numel()]
            converted.copy_(piece)
            total += torch.dot(converted, converted)
    return float(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_sharded(tensor) else tensor


def _buckets(tensors: list[torch.Tensor], sizes: list[int], bucket_bytes: int) -> Iterator[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in order, each group of at most ``bucket_bytes``."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    for indices in groups.values():
        bucket: list[int] = []
        used = 0
        for i in indices:
            size = sizes[i] * tensors[i].element_size()
            if bucket and used + size > bucket_bytes:
                yield bucket
                bucket, used = [], 0
            bucket.append(i)
            used += size
        if bucket:
            yield bucket


class ProcessGroupCollectives(Collectives):
    """Data parallelism over the default ``torch.distributed`` process group.

    Args:
        bucket_bytes: the size of one flat buffer of the all-reduce (0: one call per tensor). None (default):
            :data:`BUCKET_BYTES` under NCCL, where each call has a fixed latency that many small tensors would
            pay again and again; one call per tensor under gloo, where the copies into and out of the flat
            buffers cost more than the calls save (2 CPU processes: bucketing is 1.5-2x slower,
            `python -m benchmarks allreduce-bucketing`). The FSDP2 reduce-scatter is always bucketed (its send
            buffer is a copy anyway, in FSDP2's own layout).
    """

    def __init__(self, bucket_bytes: int | None = None) -> None:
        if bucket_bytes is None:
            bucket_bytes = BUCKET_BYTES if dist.get_backend() == "nccl" else 0
        self.bucket_bytes = int(bucket_bytes)

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        if self.bucket_bytes <= 0:
            for tensor in tensors:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return
        for bucket in _buckets(tensors, [t.numel() for t in tensors], self.bucket_bytes):
            if len(bucket) == 1:  # one tensor (or one larger than a bucket): reduce it where it is, no copy
                dist.all_reduce(tensors[bucket[0]], op=dist.ReduceOp.SUM)
                continue
            flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for i, piece in zip(bucket, flat.split([tensors[i].numel() for i in bucket])):
                tensors[i].copy_(piece.view_as(tensors[i]))

    def share_(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)

    def agree_on_seed(self, seed: int) -> int:
        value = torch.tensor([int(seed)], dtype=torch.int64, device=self._device())
        dist.broadcast(value, src=0)
        return int(value.item())

    def max_over_processes(self, value: int) -> int:
        tensor = torch.tensor([int(value)], dtype=torch.int64, device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def _device(self) -> torch.device:
        backend = dist.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def sum_as_params(self, params: Sequence[torch.Tensor],
                      tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sharded = [i for i, p in enumerate(params) if is_sharded(p)]
        replicated = [i for i, p in enumerate(params) if not is_sharded(p)]
        out: list[torch.Tensor] = list(tensors)
        self.sum_([tensors[i] for i in replicated])
        if sharded:
            for i, local in zip(sharded, self._reduce_scatter([params[i] for i in sharded],
                                                              [tensors[i] for i in sharded])):
                out[i] = as_layout_of(params[i], local)
        return out

    def _reduce_scatter(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This process's rows of the sum over processes of each whole tensor: bucketed reduce-scatters.

        One bucket is laid out as FSDP2 lays out its own: process r's segment holds, for every tensor of the
        bucket, its rows of that tensor padded to ``ceil(n / W)`` rows, so one ``reduce_scatter_tensor``
        leaves each process its own segment summed over processes. (gloo and NCCL both implement it.)
        """
        world = self.world_size
        group = params[0].device_mesh.get_group()
        if params[0].device_mesh.size() != world:
            raise ShardingError(
                f"FSDP2 shards the parameters over {params[0].device_mesh.size()} of the {world} processes; "
                "the DP sum needs every process's examples. Shard over all processes (one-dimensional mesh), "
                "or use DDP."
            )
        bounds = [shard_bounds(p) for p in params]
        rows = [max(1, math.ceil(p.shape[0] / world)) for p in params]
        widths = [math.prod(p.shape[1:]) for p in params]
        padded = [r * w for r, w in zip(rows, widths)]
        results: list[torch.Tensor | None] = [None] * len(params)
        for bucket in _buckets(tensors, [world * n for n in padded], BUCKET_BYTES * world):
            segment = sum(padded[i] for i in bucket)
            first = tensors[bucket[0]]
            send = torch.zeros(world * segment, dtype=first.dtype, device=first.device)
            for r in range(world):
                offset = r * segment
                for i in bucket:
                    whole = tensors[i].reshape(tensors[i].shape[0], -1)
                    n = whole.shape[0]
                    start, stop = min(r * rows[i], n), min((r + 1) * rows[i], n)
                    piece = whole[start:stop].reshape(-1)
                    send[offset:offset + piece.numel()] = piece
                    offset += padded[i]
            received = torch.empty(segment, dtype=first.dtype, device=first.device)
            dist.reduce_scatter_tensor(received, send, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for i in bucket:
                start, stop = bounds[i]
                shape = (stop - start, *tensors[i].shape[1:])
                results[i] = received[offset:offset + (stop - start) * widths[i]].view(shape).clone()
                offset += padded[i]
        return results  # type: ignore[return-value]

    def squared_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        local = float64_squared_norm([_local(t) for t in tensors if is_sharded(t)])
        whole = float64_squared_norm([t for t in tensors if not is_sharded(t)])
        if not any(is_sharded(t) for t in tensors):
            return whole
        value = torch.tensor([local], dtype=torch.float64, device=self._device())
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return float(value.item()) + whole


def default_collectives() -> Collectives:
    """:class:`ProcessGroupCollectives` when ``torch.distributed`` runs several processes, else a no-op."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGroupCollectives()
    return Collectives()
