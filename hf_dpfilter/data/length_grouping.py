"""A step's sampled examples ordered by length, longest first, before they are cut into micro-batches.

The sum of the clipped per-example (per-unit) gradients does not depend on which micro-batch an example is
computed in, nor in which order: each example's clipped gradient is a function of the example and the
parameters only (the separation proofs check that its loss does not move with its micro-batch), and the sum is
order-invariant up to floating-point rounding, which the precision argument already covers. So the order is
free, and choosing it from the sampled examples' lengths costs no privacy: it changes which examples share a
padded micro-batch, never what any example contributes. Ordered longest first, each micro-batch holds examples
of similar length and is padded only to its own longest; an out-of-memory shows at the first micro-batch.

The length is read from what is declared, never guessed from a shape: the collated row's ``attention_mask``
sum when ``attention_mask`` is a probed per-example key (for an encoder-decoder, the source's), else the raw
row's ``input_ids`` length; with neither the sampled order is kept. Ties keep the sampled order (a stable
sort). With ``privacy_unit='user'`` each unit's examples stay together and consecutive (units ordered by their
longest example), as :func:`hf_dpfilter.data.units.unit_micro_batches` needs them. Under a token budget an
encoder-decoder's example counts its source or its target, whichever is longer (:func:`with_target_lengths`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["example_lengths", "longest_first", "micro_batch_groups", "padded_token_ratio",
           "with_target_lengths"]


def example_lengths(inputs: dict[str, Any], raw: Sequence[Any] | None, per_example: frozenset[str] | set[str]
                    ) -> list[int] | None:
    """Each example's length (its tokens that are not padding), or None when nothing declares it.

    ``inputs``: the collated logical batch (one row per example); ``raw``: the rows the collator got, in
    order; ``per_example``: the keys the probe found to carry the example axis."""
    count = len(raw) if raw is not None else None
    mask = inputs.get("attention_mask")
    if "attention_mask" in per_example and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if count is None or mask.shape[0] == count:
            return [int(n) for n in mask.ne(0).sum(dim=1).tolist()]
    if raw is None:
        return None
    lengths = []
    for row in raw:
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if ids is None or isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            return None
        lengths.append(len(ids))
    return lengths


def with_target_lengths(lengths: Sequence[int], raw: Sequence[Any]) -> list[int]:
    """An encoder-decoder's lengths for a token budget: each example's source length or its target's (the raw
    row's ``labels``, or ``decoder_input_ids``, which the model's config declares to run along the decoder's
    tokens), whichever is longer. A micro-batch's decoder side is padded to its longest target, so a budget
    counting the sources alone let short sources with long targets fill a micro-batch far over it (memory, not
    privacy: each example's gradient is the same in any micro-batch)."""
    out = []
    for n, row in zip(lengths, raw):
        for key in ("labels", "decoder_input_ids"):
            ids = row.get(key) if isinstance(row, dict) else None
            if isinstance(ids, torch.Tensor) and ids.dim() != 1:
                continue
            if ids is not None and not isinstance(ids, (str, bytes)) and hasattr(ids, "__len__"):
                n = max(n, len(ids))
        out.append(n)
    return out


def longest_first(lengths: Sequence[int], units: Sequence[int] | None = None) -> list[int]:
    """The examples' indices, longest first; ties in sampled order.

    ``units`` (privacy_unit='user': each example's unit, a unit's examples consecutive): the runs of one unit
    move together, ordered by their longest example; inside a run the sampled order is kept."""
    if units is None:
        return sorted(range(len(lengths)), key=lambda i: -lengths[i])  # sorted() is stable
    runs: list[list[int]] = []
    for i, unit in enumerate(units):
        if runs and units[runs[-1][0]] == unit:
            runs[-1].append(i)
        else:
            runs.append([i])
    runs.sort(key=lambda run: -max(lengths[i] for i in run))
    return [i for run in runs for i in run]


def micro_batch_groups(order: Sequence[int], lengths: Sequence[int], size: int,
                       token_budget: int | None = None
                       ) -> list[list[int]]:
    """``order`` cut into consecutive groups: ``size`` examples each, or with ``token_budget`` as many as keep
    ``examples x longest length <= token_budget`` (at least one example a group; ``size`` is then not a
    cap)."""
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            if token_budget is None:
                fits = len(group) < size
            else:
                fits = (len(group) + 1) * max(max(lengths[j] for j in group), lengths[i]) <= token_budget
            if fits:
                group.append(i)
                continue
        groups.append([i])
    return groups


def padded_token_ratio(lengths: Sequence[int], logical_batch: int, micro_batch: int, grouped: bool,
                       steps: int = 200,
                       seed: int = 0) -> float:
    """The token positions the forwards compute per real token, over ``steps`` Poisson samples of a data set
    with these example ``lengths`` (rate ``logical_batch / len(lengths)``), cut into micro-batches of
    ``micro_batch`` examples each padded to its own longest: in sampled order (the non-private Trainer's
    random micro-batches) or ``grouped`` longest first. The figure of docs/performance.md, 'Micro-batches
    grouped by length'."""
    import random

    rng = random.Random(seed)
    rate = logical_batch / len(lengths)
    padded = real = 0
    for _ in range(steps):
        sample = [n for n in lengths if rng.random() < rate]
        real += sum(sample)
        if grouped:
            sample = [sample[i] for i in longest_first(sample)]
        for group in micro_batch_groups(range(len(sample)), sample, micro_batch):
            padded += len(group) * max(sample[i] for i in group)
    return padded / max(real, 1)
