"""Extractive question answering (``*ForQuestionAnswering``, transformers' run_qa): the start/end loss per
example.

A QA model declares its labels in its forward signature, ``start_positions`` and ``end_positions`` (the
Trainer's default ``label_names`` for it, ``transformers.utils.find_labels``). The training collator's two
position columns are taken out of the model's inputs and passed as one ``labels`` tensor of shape (B, 2), so
that the micro-batches, the per-example checks and the clipping see one label row per example like any other
task (:class:`SpanLabels`); evaluation keeps the Trainer's own path (the model's loss on a held-out set).

Each example's loss is ``(CE(start) + CE(end)) / 2`` over that example's own real tokens:

* HF's QA heads do not mask padding (``BertForQuestionAnswering`` and its kin split ``qa_outputs(hidden)``
  into the two logits over every column), so the softmax of a padded row would run over the pad columns too,
  and an example's loss would change with the length of the longest example of its batch. Here the columns the
  attention mask marks as padding get the dtype's lowest value before the softmax (``exp`` of it underflows to
  exactly 0, and ``masked_fill`` passes no gradient to them): the loss and its gradient are those of the
  example alone.
* Positions are clamped to ``[0, T]`` and ``T`` is ignored, as HF does (``ignored_index``); a position on a
  padded column is ignored too, which is what the example alone gives (its own length is its ``T``). An
  ignored side contributes 0, so an example with both sides ignored has loss 0 and a zero gradient.

Positions index the collated row: right padding (the tokenizers' default for encoders), as with the plain
Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SPAN_LABEL_NAMES", "SpanLabels", "is_span_output", "span_loss", "with_span_labels"]

#: the label names a QA model's forward declares (transformers.utils.find_labels of a *ForQuestionAnswering)
SPAN_LABEL_NAMES = ("start_positions", "end_positions")


class SpanLabels:
    """A training collator whose ``start_positions``/``end_positions`` become ``labels`` of shape (B, 2)."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, rows: list) -> Any:
        batch = self.collate_fn(rows)
        if "labels" in batch or not all(name in batch for name in SPAN_LABEL_NAMES):
            # a collator of the user's own labels (read by an override of compute_per_example_loss)
            return batch
        batch = dict(batch)
        start, end = (torch.as_tensor(batch.pop(name)).reshape(-1) for name in SPAN_LABEL_NAMES)
        batch["labels"] = torch.stack([start, end], dim=1)
        return batch


def with_span_labels(collate_fn: Callable, label_names: Sequence[str] | None) -> Callable:
    """``collate_fn`` wrapped in :class:`SpanLabels` when the model's declared labels are QA's, else
    unchanged."""
    if label_names is not None and tuple(sorted(label_names)) == tuple(sorted(SPAN_LABEL_NAMES)):
        return SpanLabels(collate_fn)
    return collate_fn


def is_span_output(outputs: Any) -> bool:
    """Whether a model's outputs are a QA head's start and end logits (and no ``logits``)."""
    keys = outputs.keys() if hasattr(outputs, "keys") else ()
    return "start_logits" in keys and "end_logits" in keys and "logits" not in keys


def _side_loss(logits: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    steps = logits.shape[1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # the loss in fp32 under bf16 autocast
    # padding out of the softmax, no gradient
    logits = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
    positions = positions.to(logits.device).long().clamp(0, steps)  # HF's clamp; `steps` is its ignored_index
    inside = positions < steps
    target = torch.where(inside, positions, torch.zeros_like(positions))
    kept = inside & valid.gather(1, target.unsqueeze(1)).squeeze(1)  # a position on a padded column: ignored
    losses = F.cross_entropy(logits, target, reduction="none")
    return torch.where(kept, losses, torch.zeros_like(losses))


def span_loss(
    outputs: Any, labels: torch.Tensor, attention_mask: torch.Tensor | None, packed: bool = False,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-example QA loss, shape (B,): ``(CE(start) + CE(end)) / 2`` over each example's own real tokens (see
    the module docstring); ``labels`` (B, 2) holds the start and end positions, ``attention_mask`` marks the
    padding. ``label_smoothing`` (the Trainer's ``label_smoothing_factor``) is refused: the Trainer's
    LabelSmoother reads a ``logits`` output, which a QA head does not have, and smoothing over the pad columns
    would couple examples."""
    if label_smoothing:
        raise ValueError(
            f"label_smoothing_factor={label_smoothing} with extractive QA: the Trainer's label smoother "
            "applies to a model's `logits`, not to a QA head's start/end logits, and DPTrainer's per-example "
            "QA loss has no smoothing. Set label_smoothing_factor=0."
        )
    if packed:
        raise ValueError(
            "Extractive QA with packed rows: the start/end softmax runs over the whole row, across the "
            "examples packed in it. Use a padding collator (one example per row), e.g. "
            "DataCollatorWithPadding or default_data_collator on rows padded to max_length."
        )
    start_logits, end_logits = outputs["start_logits"], outputs["end_logits"]
    if labels.dim() != 2 or labels.shape != (start_logits.shape[0], 2):
        raise ValueError(
            f"Extractive QA: labels of shape {tuple(labels.shape)} for start logits of shape "
            f"{tuple(start_logits.shape)}; one (start, end) pair per example is needed (the collator's "
            "start_positions and end_positions, one integer each)."
        )
    valid = torch.ones_like(start_logits, dtype=torch.bool)
    if attention_mask is not None:
        if attention_mask.shape != start_logits.shape:
            raise ValueError(
                f"Extractive QA: attention_mask of shape {tuple(attention_mask.shape)} for start logits of "
                f"shape {tuple(start_logits.shape)}: the padding cannot be masked out of the softmax column "
                "by column."
            )
        valid = attention_mask.to(start_logits.device).bool()
    return (_side_loss(start_logits, labels[:, 0], valid) + _side_loss(end_logits, labels[:, 1], valid)) / 2
