"""Packing after sampling: each step's Poisson sample is packed, never the data set.

TRL's ``packing=True`` packs the *data set* into rows of ``max_length`` before training; a packed row would
then be what the sampler draws, and one example's influence would spread over whatever it was packed with.
Under DP the sampler draws examples (the privacy unit), the padding-free collator lays the sample out as
segments of one row (``position_ids`` restart at every example), and this module groups the sample's examples
into micro-batches of ``rows`` bins of at most ``capacity`` tokens each, best-fit decreasing. Each micro-batch
is then re-packed by the library's packed-row machinery (:mod:`hf_dpfilter.proofs.batch_structure`), which
recomputes ``cu_seq_lens``/ ``seq_idx`` for its own examples and clips every example separately
(:mod:`hf_dpfilter.data.packing`).

The grouping is a function of the sample's lengths only; each example's clipped gradient does not depend on it
(attention never crosses a segment boundary, and the per-example gradients are exact), so it changes the
speed, never what an example contributes.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from hf_dpfilter.data.packing import PackedLayout, PackingError
from hf_dpfilter.proofs.batch_structure import BatchStructure

__all__ = ["best_fit_decreasing", "micro_batch_bins", "pack_rows"]


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths``, each holding at most ``capacity`` tokens (an example longer than the
    capacity gets a bin of its own): longest first, each into the fullest bin it still fits in."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # (remaining capacity, bin id), sorted: the best fit is the first that fits
    free: list[tuple[int, int]] = []
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


def micro_batch_bins(lengths: list[int], capacity: int, rows: int) -> list[list[list[int]]]:
    """The bins (rows) of each micro-batch: ``rows`` best-fit-decreasing bins of ``capacity`` tokens each, the
    examples of every bin in the order of the sample."""
    bins = [sorted(b) for b in best_fit_decreasing(lengths, capacity)]
    rows = max(1, rows)
    return [bins[k : k + rows] for k in range(0, len(bins), rows)]


def pack_rows(
    structure: BatchStructure, inputs: dict[str, Any], labels: torch.Tensor, layout: PackedLayout,
    bins: list[list[int]],
) -> tuple[dict[str, Any], torch.Tensor, PackedLayout]:
    """The examples of ``bins`` (indices into ``layout``'s examples) as a micro-batch of one row per bin.

    Rows shorter than the longest are padded at the end with label -100 and ``position_ids`` that continue the
    row's last example: the padding joins that example's segment (the model's packed mask and
    :class:`PackedLayout` both read a new example only where positions restart), comes after all of its tokens
    so a causal model's outputs for them do not depend on it, and carries no loss, so it adds exactly nothing
    to the example's loss or gradient. No token of one example is ever in another's segment.
    """
    if "position_ids" not in structure.per_token:
        raise PackingError("Packing a step's sample needs the collator's per-token `position_ids`.")
    width = max(sum(layout.spans[i][2] - layout.spans[i][1] for i in b) for b in bins)
    keys = [key for key in structure.per_token if key in inputs]  # the labels are passed apart
    rows: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    label_rows = []
    for b in bins:
        spans = [layout.spans[i] for i in b]
        used = sum(stop - start for _, start, stop in spans)
        for key in keys:
            value = inputs[key]
            row = torch.cat([value[r, start:stop] for r, start, stop in spans])
            if key == "position_ids":
                tail = row[-1] + 1 + torch.arange(width - used, device=row.device, dtype=row.dtype)
            else:
                tail = row.new_zeros((width - used, *row.shape[1:]))
            rows[key].append(torch.cat([row, tail]))
        label_row = torch.cat([labels[r, start:stop] for r, start, stop in spans])
        label_rows.append(torch.cat([label_row, label_row.new_full((width - used,), -100)]))
    micro: dict[str, Any] = {key: torch.stack(value) for key, value in rows.items()}
    micro.update({key: value for key, value in inputs.items() if key in structure.shared})
    micro_labels = torch.stack(label_rows)
    micro_layout = PackedLayout.from_position_ids(micro["position_ids"])
    expected = [layout.spans[i][2] - layout.spans[i][1] for b in bins for i in b]
    got = micro_layout.lengths
    if len(got) != len(expected) or any(g < e for g, e in zip(got, expected)):
        raise PackingError("Packing a step's sample changed its example boundaries.")
    cumulative = [0] + [row * width + stop for row, _start, stop in micro_layout.spans]
    for key in structure.boundaries:
        original = inputs.get(key)
        dtype = original.dtype if isinstance(original, torch.Tensor) else torch.int32
        if key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            micro[key] = torch.tensor(cumulative, dtype=dtype, device=labels.device)
        elif key in ("max_length_q", "max_length_k"):
            micro[key] = micro_layout.max_length
        else:  # seq_idx: the example of each token, within this micro-batch
            micro[key] = micro_layout.token_example_index(labels.device).to(dtype)
    structure.check({**micro, "labels": micro_labels})
    micro_layout.check_flash_boundaries(micro)
    return micro, micro_labels, micro_layout
