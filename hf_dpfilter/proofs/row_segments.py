"""A data-set row is one unit: with packed (padding-free) batches, every segment must be one whole sampled
row.

The sampler draws data-set rows, and the accountant counts rows, so each row's contribution to a step must be
one vector clipped to C. Padded batches give that by construction (one row of the batch per data-set row,
clipped as one vector, whatever the row holds). Packed batches do not: the engine clips each *segment* of
``position_ids`` (:meth:`hf_dpfilter.data.packing.PackedLayout.from_position_ids`) as its own example, so a
row the data set already packed (``position_ids`` restarting inside it, TRL's ``seq_lengths``) becomes several
clipped vectors, and one sampled row moves the clipped sum by up to (its segments) x C. Counting the segments
of a batch against the rows it was given does not close it: a row whose first segment continues the previous
row's positions merges with that row and makes up for its extra segment (measured ratio 1.29 with C's bound
1).

:class:`RowSegmentsGuard` wraps the training collator and proves, on every sampled batch before it reaches a
step, that the segments of the packed batch are its rows, in order: each row collated alone is one segment,
and the batch's segments have exactly the alone lengths. A pre-packed row is refused with the fix (pack after
sampling: one example per row; or a padding collator, which keeps the row one example). The cost is one
collation per sampled row (no forward); padded batches are not re-collated.

Whether a row, padded or packed, holds several examples is checked next, on the same batch
(:mod:`hf_dpfilter.proofs.row_examples`): such a row is refused unless ``dp_row_is_unit=True`` declares the
row the unit. A packed row of several segments stays refused either way: its segments are clipped apart.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hf_dpfilter.data.packing import PackedLayout, PackingError
from hf_dpfilter.proofs.row_examples import check_rows_hold_one_example

__all__ = ["PrepackedRowError", "RowSegmentsGuard", "check_segments_are_rows"]

_FIX = (
    "Pack after sampling instead: give the trainer one example per row (DataCollatorWithFlattening then "
    "packs each step's Poisson sample, and DPSFTTrainer with packing=True packs it best-fit), or use a "
    "padding collator, which keeps each data-set row one example whose segments are clipped together."
)


class PrepackedRowError(PackingError):
    """A packed batch whose segments are not its data-set rows (a row the data set packed, or rows merged)."""


def _segment_lengths(batch: dict[str, Any]) -> list[int]:
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        raise PackingError(
            "A packed batch without 2-D `position_ids`: its example boundaries are unknown. Use "
            "DataCollatorWithFlattening(return_position_ids=True)."
        )
    return PackedLayout.from_position_ids(positions).lengths


def check_segments_are_rows(batch: dict[str, Any], alone: list[dict[str, Any]]) -> None:
    """Refuse unless the packed ``batch`` holds one segment per row, each as long as the row collated alone.

    ``alone[i]`` is row i collated alone. A row alone with several segments is pre-packed; a batch whose
    segment lengths differ from the rows' (in the collator's order) has a segment made of two rows or a row
    split.
    """
    lengths = []
    for row in alone:
        positions = row.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1:
            # one row alone: its segments without building a layout (this runs for every sampled row)
            flat = positions[0]
            segments = [flat.numel()] if bool((flat[1:] - flat[:-1] == 1).all()) else _segment_lengths(row)
        else:
            segments = _segment_lengths(row)
        if len(segments) != 1:
            raise PrepackedRowError(
                f"A sampled data-set row holds {len(segments)} segments (its `position_ids` restart inside "
                "it, e.g. a `position_ids` or `seq_lengths` column from packing the data set): the data set "
                "is pre-packed. The sampler draws rows and the accountant counts rows, but a packed batch "
                "clips each segment as its own example, so one sampled row would move the clipped sum by up "
                f"to {len(segments)} x C. "
                + _FIX
            )
        lengths.extend(segments)
    got = _segment_lengths(batch)
    if got != lengths:
        raise PrepackedRowError(
            f"The packed batch of {len(alone)} rows has {len(got)} segments of `position_ids` that are not "
            "those rows one after the other (each row collated alone): a segment holds tokens of two rows (a "
            "row whose `position_ids` continue the previous row's) or a row is split, so what is clipped as "
            "one example is not what the sampler drew. Each row must start a new segment of `position_ids` "
            "(as DataCollatorWithFlattening numbers them). " + _FIX
        )


class RowSegmentsGuard:
    """The training collator, with :func:`check_segments_are_rows` on every packed batch it collates, and
    :func:`~hf_dpfilter.proofs.row_examples.check_rows_hold_one_example` on every batch, padded or packed,
    unless ``row_is_unit`` (``dp_row_is_unit=True``: the run declares each row the unit, whatever it holds).

    ``structure`` (the :class:`~hf_dpfilter.proofs.batch_structure.BatchStructure` probed on this collator)
    is set by the trainer once probed; until then (the probe itself) batches pass unchecked. ``marker`` is
    the chat template's start of a conversation (None: no chat check).
    """

    def __init__(self, collate_fn: Callable[[list], dict[str, Any]], row_is_unit: bool = False,
                 marker: tuple[int, ...] | None = None) -> None:
        self.collate_fn = collate_fn
        self.structure: Any = None
        self.row_is_unit = bool(row_is_unit)
        self.marker = marker

    def __call__(self, rows: list) -> dict[str, Any]:
        batch = self.collate_fn(rows)
        if self.structure is None or not rows:
            return batch
        if self.structure.packed:
            self._check_packed(rows, batch)
        if not self.row_is_unit:
            # after the packed check: a packed row of several segments is refused with its own fix, which a
            # declaration does not change (each segment would still be clipped on its own)
            check_rows_hold_one_example(dict(batch), rows, self.structure, self.marker)
        return batch

    def _check_packed(self, rows: list, batch: dict[str, Any]) -> None:
        # the alone collations must not draw from the random streams the training batches use
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                alone = [dict(self.collate_fn([row])) for row in rows]
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        check_segments_are_rows(dict(batch), alone)
