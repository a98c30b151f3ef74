"""Packing after sampling: each step's Poisson sample is packed, never the data set.

TRL's ``packing=True`` packs the *data set* into rows of ``max_length`` before training; a packed row would then
be what the sampler draws, and one example's influence would spread over whatever it was packed with. Under DP
the sampler draws examples (the privacy unit), the padding-free collator lays the sample out as segments of one
row (``position_ids`` restart at every example), and this module groups the sample's examples into micro-batches
of ``rows`` bins of at most ``capacity`` tokens each, best-fit decreasing. Each micro-batch is then re-packed by
the library's packed-row machinery (:mod:`hf_dpfilter.batch_structure`), which recomputes ``cu_seq_lens``/
``seq_idx`` for its own examples and clips every example separately (:mod:`hf_dpfilter.packing`).

The grouping is a function of the sample's lengths only; each example's clipped gradient does not depend on it
(attention never crosses a segment boundary, and the per-example gradients are exact), so it changes the speed,
never what an example contributes.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from hf_dpfilter.batch_structure import BatchStructure
from hf_dpfilter.packing import PackedLayout, PackingError

__all__ = ["best_fit_decreasing", "micro_batch_groups", "select_packed_examples"]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths``, each holding at most ``capacity`` tokens (an example longer than the
    capacity gets a bin of its own): longest first, each into the fullest bin it still fits in."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin id), sorted: the best fit is the first that fits
    for index in order:
        length = lengths[index]
        slot = bisect.bisect_left(free, (length, -1))
        if length <= capacity and slot < len(free):
            remaining, bin_id = free.pop(slot)
            bins[bin_id].append(index)
            bisect.insort(free, (remaining - length, bin_id))
            continue
        bins.append([index])
        if length < capacity:
            bisect.insort(free, (capacity - length, len(bins) - 1))
    return bins


def micro_batch_groups(lengths: list[int], capacity: int, rows: int) -> list[list[int]]:
    """The examples of each micro-batch: ``rows`` best-fit-decreasing bins of ``capacity`` tokens each, every
    group sorted by index (the order of the sample)."""
    bins = best_fit_decreasing(lengths, capacity)
    rows = max(1, rows)
    return [sorted(i for b in bins[k : k + rows] for i in b) for k in range(0, len(bins), rows)]


def select_packed_examples(
    structure: BatchStructure, inputs: dict[str, Any], labels: torch.Tensor, layout: PackedLayout, indices: list[int]
) -> tuple[dict[str, Any], torch.Tensor, PackedLayout]:
    """The examples ``indices`` of a packed batch as one micro-batch of one row (through
    :meth:`BatchStructure.micro_batches`, which recomputes the boundary keys and checks the layout)."""
    spans = [layout.spans[i] for i in indices]
    sub: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in structure.per_token:
            sub[key] = torch.cat([value[row : row + 1, start:stop] for row, start, stop in spans], dim=1)
        elif key in structure.boundaries:
            continue  # recomputed for the selected examples below
        else:
            sub[key] = value
    sub_labels = torch.cat([labels[row : row + 1, start:stop] for row, start, stop in spans], dim=1)
    lengths = [stop - start for _, start, stop in spans]
    cumulative = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=labels.device)
    for key in structure.boundaries:
        if key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            original = inputs.get(key)
            sub[key] = cumulative.to(original.dtype) if isinstance(original, torch.Tensor) else cumulative
        elif key in ("max_length_q", "max_length_k"):
            sub[key] = max(lengths)
        else:  # seq_idx: renumbered by BatchStructure.micro_batches from the lengths
            original = inputs.get(key)
            index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
            sub[key] = index.to(original.dtype if isinstance(original, torch.Tensor) else torch.int32)
    (micro, micro_labels, micro_layout), = structure.micro_batches(sub, sub_labels, len(indices), len(indices))
    if micro_layout.lengths != lengths:
        raise PackingError("Packing a step's sample changed its example boundaries.")
    return micro, micro_labels, micro_layout
