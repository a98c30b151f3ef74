"""A row that visibly holds several examples is refused, unless the run declares the row the unit.

The sampler draws data-set rows and the accountant counts rows, so whatever a row holds is clipped as one
vector (padded batches by construction; packed batches once :mod:`hf_dpfilter.proofs.row_segments` proved
each segment one row). The guarantee is then about rows. A row that holds several examples -- a data set
packed before the trainer, two chat conversations in one row -- makes that guarantee weaker than it reads at
the example level: adding an example to an existing row is a *change* of that row, not an added unit
(measured ratio 1.30 against the add/remove bound 1, about twice the stated epsilon for that example). What
a row holds is never inferred from a shape; it is read from what the row itself declares, on every collated
training batch, before the step:

* ``position_ids`` that restart inside a row of a padded batch (between its first and last real token, as
  the per-example attention mask marks them; one row of positions shared by the batch, too), the boundaries
  transformers' packed attention reads;
* a raw row's own ``position_ids`` column restarting, or a ``seq_lengths`` column of several lengths, also
  when the collator drops them (``DataCollatorWithFlattening`` renumbers each row 0..);
* the tokenizer's chat template's own start of a conversation (:func:`conversation_start_marker`, rendered
  from probe conversations, never from the data) found more than once in a row or packed segment: a
  consecutive repeat (a BOS doubled by tokenizing rendered text) counts once.

Such a row is refused with both fixes: one example per row, or ``dp_row_is_unit=True``, which declares the
row the unit; the privacy report, the start report and the model card then say "add/remove one row (a row
may hold several examples)". The checks read tensors already collated: no collation, no forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_dpfilter.data.packing import PackedLayout, PackingError

__all__ = [
    "RowHoldsSeveralExamplesError",
    "check_rows_hold_one_example",
    "conversation_start_marker",
    "marker_runs",
]

_FIXES = (
    "Fix: give the trainer one example per row (for packed training, pack after sampling: "
    "DataCollatorWithFlattening, or DPSFTTrainer with packing=True, then clip each example on its own), "
    "or declare that a whole row is the unit with dp_row_is_unit=True: the guarantee is then add/remove "
    "one row, and the privacy report, the start report and the model card say that a row may hold several "
    "examples."
)

#: probe conversations: one turn, several turns (a marker must appear once in each), a system message
_PROBES = (
    ({"role": "user", "content": "alpha"}, {"role": "assistant", "content": "bravo"}),
    ({"role": "user", "content": "charlie"}, {"role": "assistant", "content": "delta"},
     {"role": "user", "content": "echo"}, {"role": "assistant", "content": "foxtrot"}),
    ({"role": "system", "content": "golf"}, {"role": "user", "content": "hotel"},
     {"role": "assistant", "content": "india"}),
)
_MULTI_TURN = 1


class RowHoldsSeveralExamplesError(PackingError):
    """A sampled row declares several examples (restarting positions, several conversations) in a run that
    counts rows as examples."""


def _ids(rendered: Any) -> list[int]:
    if hasattr(rendered, "keys"):  # transformers 5 returns a BatchEncoding
        rendered = rendered["input_ids"]
    if isinstance(rendered, torch.Tensor):
        rendered = rendered.reshape(-1).tolist()
    if rendered and isinstance(rendered[0], (list, tuple)):
        rendered = rendered[0]
    return [int(t) for t in rendered]


def _occurrences(ids: Sequence[int], marker: Sequence[int]) -> int:
    m = len(marker)
    return sum(1 for i in range(len(ids) - m + 1) if list(ids[i : i + m]) == list(marker))


def conversation_start_marker(tokenizer: Any) -> tuple[int, ...] | None:
    """The token sequence that starts every conversation the tokenizer's chat template renders, or None.

    Rendered from public probe conversations (a one-turn, a multi-turn and one with a system message; a
    probe the template refuses is left out): their longest common prefix is the start of a conversation (a
    BOS token, a system block's header), and the marker is its shortest prefix found exactly once in every
    probe, so a turn header repeated by every user turn of one conversation is never taken for a new
    conversation. None when the template has no such start (ChatML without a default system block: two
    conversations one after the other render exactly as one conversation of more turns), or there is no
    chat template.

    Args:
        tokenizer: the trainer's ``processing_class``; anything without ``apply_chat_template`` and a
            ``chat_template`` gives None.
    """
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return None
    rendered: dict[int, list[int]] = {}
    for index, probe in enumerate(_PROBES):
        try:
            rendered[index] = _ids(tokenizer.apply_chat_template(list(probe), tokenize=True))
        except Exception:  # noqa: BLE001
            continue  # a template may refuse a role (no system role): that probe is left out
    if _MULTI_TURN not in rendered or len(rendered) < 2:
        return None
    renders = list(rendered.values())
    common = 0
    while all(common < len(r) for r in renders) and len({r[common] for r in renders}) == 1:
        common += 1
    for length in range(1, common + 1):
        marker = renders[0][:length]
        if all(_occurrences(r, marker) == 1 for r in renders):
            return tuple(marker)
    return None


def marker_runs(ids: torch.Tensor, marker: Sequence[int]) -> torch.Tensor:
    """``(rows, T)`` bool: where a run of the marker starts (the marker at t, not also right before it).

    Args:
        ids: ``(rows, T)`` token ids.
        marker: the token sequence (:func:`conversation_start_marker`).
    """
    rows, width = ids.shape
    m = len(marker)
    hits = torch.zeros((rows, width), dtype=torch.bool, device=ids.device)
    if m == 0 or width < m:
        return hits
    found = torch.ones((rows, width - m + 1), dtype=torch.bool, device=ids.device)
    for j, token in enumerate(marker):
        found &= ids[:, j : width - m + 1 + j] == int(token)
    hits[:, : width - m + 1] = found
    repeat = torch.zeros_like(hits)
    repeat[:, m:] = hits[:, :-m]  # a BOS doubled by tokenizing rendered text is one start, not two
    return hits & ~repeat


def _real_span(mask: torch.Tensor | None, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the columns from its first to its last real token (the whole row without a mask, or with a
    mask of another shape)."""
    if mask is None or tuple(mask.shape[:2]) != (rows, width):
        return torch.zeros(rows, dtype=torch.long), torch.full((rows,), width, dtype=torch.long)
    real = mask.detach().cpu().ne(0)
    if real.dim() > 2:
        real = real.reshape(rows, width, -1).any(dim=-1)
    lead = real.long().cumsum(dim=1).eq(0).sum(dim=1)
    trail = real.flip(1).long().cumsum(dim=1).eq(0).sum(dim=1)
    return lead, width - trail


def _declared_segments(row: Any) -> int:
    """The examples a raw data-set row declares in its own columns (``position_ids``, ``seq_lengths``)."""
    row = getattr(row, "item", row)  # a user-level run's rows are tagged with their unit
    if not isinstance(row, dict):
        return 1
    lengths = row.get("seq_lengths")
    if lengths is not None and len(torch.as_tensor(lengths).reshape(-1)) > 1:
        return len(torch.as_tensor(lengths).reshape(-1))
    positions = row.get("position_ids")
    if positions is None:
        return 1
    flat = torch.as_tensor(positions).reshape(-1)
    return 1 + int((flat[1:] - flat[:-1] != 1).sum()) if flat.numel() > 1 else 1


def _refuse(what: str) -> None:
    raise RowHoldsSeveralExamplesError(
        f"A sampled data-set row holds several examples: {what}. The sampler draws rows and the accountant "
        "counts rows, so each row is clipped as one vector: adding an example to a row is a change of that "
        "row, not an added unit, and the epsilon stated per example would not hold for it (about twice as "
        "much for that example). " + _FIXES
    )


def check_rows_hold_one_example(
    batch: dict[str, Any], rows: list, structure: Any, marker: Sequence[int] | None
) -> None:
    """Refuse a collated training batch any of whose rows holds several examples (see the module docstring).

    Args:
        batch: the collated batch, as the training collator returned it.
        rows: the raw data-set rows it was collated from, in order.
        structure: its probed :class:`~hf_dpfilter.proofs.batch_structure.BatchStructure`.
        marker: the chat template's start of a conversation, or None (no chat check).
    """
    several = [n for n in (_declared_segments(r) for r in rows) if n > 1]
    if several:
        _refuse(f"its own columns declare {max(several)} (a `position_ids` column restarting inside the "
                "row, or a `seq_lengths` column of several lengths: a data set packed before the trainer)")
    ids, positions = batch.get("input_ids"), batch.get("position_ids")
    if structure.packed:
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            return  # refused by the packed-batch checks: no boundaries
        # each segment is one sampled row (proven before this runs, proofs/row_segments.py)
        spans = PackedLayout.from_position_ids(positions).spans
        starts = None
        if marker and isinstance(ids, torch.Tensor) and tuple(ids.shape) == tuple(positions.shape):
            starts = marker_runs(ids.detach().cpu(), marker)
        for row, start, stop in spans if starts is not None else ():
            # only the markers that lie inside the segment
            count = int(starts[row, start : stop - len(marker) + 1].sum())
            if count > 1:
                _refuse(f"the chat template's start of a conversation appears {count} times in it (several "
                        "conversations in one row)")
        return
    mask = batch.get("attention_mask") if "attention_mask" in structure.per_example else None
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() >= 2 else None
    declared = "position_ids" in structure.per_example or "position_ids" in structure.shared
    if declared and isinstance(positions, torch.Tensor) and positions.dim() == 2:
        pos = positions.detach().cpu()
        if pos.shape[0] == 1 and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            # one row of positions shared by every row (broadcast by the model): each row gets its restarts
            pos = pos.expand(ids.shape[0], -1)
        lead, end = _real_span(mask, *pos.shape)
        restart = (pos[:, 1:] - pos[:, :-1]) != 1  # the rule of transformers' packed attention
        columns = torch.arange(1, pos.shape[1]).unsqueeze(0)
        # a restart into column c counts when c and c - 1 are both real-token columns (pads left out)
        inside = (columns > lead.unsqueeze(1)) & (columns < end.unsqueeze(1))
        counts = (restart & inside).sum(dim=1)
        if bool((counts > 0).any()):
            _refuse(f"its `position_ids` restart {int(counts.max())} time(s) inside it (a row packed before "
                    "the trainer: each restart begins another example)")
    tokens_per_row = "input_ids" in structure.per_example and isinstance(ids, torch.Tensor) and ids.dim() == 2
    if marker and tokens_per_row:
        tokens = ids.detach().cpu()
        lead, end = _real_span(mask, *tokens.shape)
        columns = torch.arange(tokens.shape[1]).unsqueeze(0)
        inside = (columns >= lead.unsqueeze(1)) & (columns + len(marker) <= end.unsqueeze(1))
        counts = (marker_runs(tokens, marker) & inside).sum(dim=1)
        if bool((counts > 1).any()):
            _refuse(f"the chat template's start of a conversation appears {int(counts.max())} times in it "
                    "(several conversations in one row)")
