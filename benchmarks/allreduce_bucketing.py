"""Per-step cost of summing the clipped sums over processes: bucketed all-reduce vs one call per tensor.

Two gloo processes on CPU all-reduce fp32 tensors shaped like the trainable parameters of RoBERTa-base and
GPT-2 small, through :class:`hf_dpfilter.distributed.collectives.ProcessGroupCollectives` with its default
buckets (25 MiB flat buffers, as DDP) and with ``bucket_bytes=0`` (one ``all_reduce`` per tensor, the gloo
default). The variants are interleaved round by round and the figure is the median of the per-round ratios,
so drift in the machine's load cancels.

    python -m benchmarks allreduce-bucketing [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dpfilter.distributed.collectives import BUCKET_BYTES, ProcessGroupCollectives


def roberta_base_shapes() -> list[tuple[int, ...]]:
    d, ff, layers = 768, 3072, 12
    shapes: list[tuple[int, ...]] = [(50265, d), (514, d), (1, d), (d,), (d,)]
    for _ in range(layers):
        shapes += [(d, d), (d,)] * 4 + [(d,), (d,), (ff, d), (ff,), (d, ff), (d,), (d,), (d,)]
    return shapes + [(d, d), (d,), (2, d), (2,)]  # classification head


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    d, layers = 768, 12
    shapes: list[tuple[int, ...]] = [(50257, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
                   (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _time(collectives: ProcessGroupCollectives, tensors: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    collectives.sum_(tensors)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step waits for the slowest process
    return float(elapsed)


def _worker(rank: int, world: int, port: int, rounds: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    variants = {"bucketed": ProcessGroupCollectives(BUCKET_BYTES), "per_tensor": ProcessGroupCollectives(0)}
    results = {}
    for model, shapes in (("roberta-base", roberta_base_shapes()), ("gpt2-small", gpt2_small_shapes())):
        tensors = [torch.randn(s) for s in shapes]
        for collectives in variants.values():
            _time(collectives, tensors)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))  # interleaved
            for name in order:
                times[name].append(_time(variants[name], tensors))
        ratios = [p / b for p, b in zip(times["per_tensor"], times["bucketed"])]
        results[model] = {
            "tensors": len(shapes),
            "parameters": sum(t.numel() for t in tensors),
            "bucketed_s": statistics.median(times["bucketed"]),
            "per_tensor_s": statistics.median(times["per_tensor"]),
            "ratio_per_tensor_over_bucketed": statistics.median(ratios),
        }
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, args.rounds, queue), nprocs=2, start_method="spawn")
    results = queue.get()
    print("all-reduce of the clipped sums per step, 2 gloo processes (CPU), fp32, median over rounds")
    for model, r in results.items():
        print(
            f"{model:13s} {r['tensors']:4d} tensors {r['parameters'] / 1e6:6.1f}M params: bucketed "
            f"{r['bucketed_s'] * 1e3:8.1f} ms, per tensor {r['per_tensor_s'] * 1e3:8.1f} ms, "
            f"per-tensor / bucketed = {r['ratio_per_tensor_over_bucketed']:.2f}x (median of per-round ratios)"
        )

