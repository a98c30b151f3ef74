"""Which collated tensors carry the example axis: proven on the collator, never guessed from a batch's shapes.

A batch of size B may hold tensors whose leading dimension is B by coincidence (a table of B positions) or
that are shared by every example. Slicing a micro-batch by ``shape[0] == B`` would then cut a shared tensor
or leave a per-example one whole. Instead :func:`probe_batch_structure` collates one example, then the same
example two and three times, and classifies every key by how it follows the number of examples:

* ``per_example``: the leading dimension is the number of examples (1, 2, 3), the rest unchanged -- one row
  per example (padding collators);
* ``per_token``: the leading dimension stays 1 and the second grows 1x, 2x, 3x -- the examples concatenated
  along the tokens of one row (padding-free packing: ``DataCollatorWithFlattening``, TRL's padding-free mode);
* ``shared``: identical whatever the number of examples (passed unchanged to every micro-batch);
* ``boundaries``: FlashAttention's ``cu_seq_lens_*``/``max_length_*`` and ``seq_idx`` of a packed batch,
  recomputed for each micro-batch's own examples.

Every copy's row (or packed segment) of a per-example (per-token) key must equal the example collated alone,
and so must each row of a batch of two different examples (up to padding): a value computed over the batch
(weights normalised by the batch size or by its longest example) is refused with its key.

Any other behaviour is refused with the key's name: its relation to the examples is not declared. Nothing
computed here leaves the process: the probe only reads the structure of one training example's collation
(the trainer already collates one for the structure of an empty Poisson batch).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_dpfilter.data.packing import FLASH_BOUNDARY_KEYS, SEQ_IDX_KEY, PackedLayout, PackingError

__all__ = ["BatchStructure", "BatchStructureError", "probe_batch_structure", "random_keys"]


class BatchStructureError(ValueError):
    """A collated batch whose relation to the examples is not declared (or differs from the probed one)."""


@dataclass(frozen=True)
class BatchStructure:
    """How a collator's output relates to the examples it collated (see the module docstring)."""

    per_example: frozenset[str]
    per_token: frozenset[str]
    shared: frozenset[str]
    boundaries: frozenset[str]
    #: packed rows: the position id the collator gives each example's first token (structure, not data)
    position_start: int = 0
    #: per-example (per-token) keys the collator draws at random (masked-LM masking): they differ between
    #: collations of the same examples under different seeds. An example alone carries its batch row's draw of
    #: them (hf_dpfilter.proofs.collator_draws); every other key is compared with the example collated alone.
    random: frozenset[str] = frozenset()

    @property
    def packed(self) -> bool:
        return bool(self.per_token)

    @property
    def keys(self) -> frozenset[str]:
        return self.per_example | self.per_token | self.shared | self.boundaries

    def check(self, batch: dict[str, Any]) -> None:
        """Refuse a batch with keys the probe did not see (their relation to the examples is unknown)."""
        unknown = sorted(set(batch) - self.keys)
        if unknown:
            raise BatchStructureError(
                f"The training batch has keys {unknown} that the collator did not produce when its structure "
                f"was probed (per example: {sorted(self.per_example)}, packed per token: "
                f"{sorted(self.per_token)}, shared: {sorted(self.shared)}): which of them carry the example "
                "axis is not declared. Make the collator return the same keys for every batch."
            )

    # ------------------------------------------------------------------------------- micro-batches
    def micro_batches(
        self, inputs: dict[str, Any], labels: torch.Tensor, size: int, num_examples: int | None = None
    ) -> list[tuple[dict[str, Any], torch.Tensor, PackedLayout | None]]:
        """Split a collated batch into micro-batches of at most ``size`` examples, cut at example boundaries.

        Returns ``(inputs, labels, layout)`` per micro-batch; ``layout`` is None for one example per row.
        ``num_examples`` (how many examples the collator was given) is checked against the packed layout.
        """
        self.check({**inputs, "labels": labels})
        if self.packed:
            return self._packed_micro_batches(inputs, labels, size, num_examples)
        batch = labels.shape[0]
        if num_examples is not None and batch != num_examples:
            raise BatchStructureError(
                f"The collator was given {num_examples} examples but returned {batch} rows of labels."
            )
        out = []
        for start in range(0, batch, size):
            stop = min(start + size, batch)
            micro = {k: v[start:stop] if k in self.per_example else v for k, v in inputs.items()}
            for key in self.per_example & set(inputs):
                value = inputs[key]
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
                    raise BatchStructureError(
                        f"'{key}' carries the example axis (probed on the collator) but has shape "
                        f"{tuple(getattr(value, 'shape', ()))} in a batch of {batch} examples."
                    )
            out.append((micro, labels[start:stop], None))
        return out

    def _packed_micro_batches(
        self, inputs: dict[str, Any], labels: torch.Tensor, size: int, num_examples: int | None
    ) -> list[tuple[dict[str, Any], torch.Tensor, PackedLayout]]:
        if "position_ids" not in self.per_token:
            raise PackingError(
                "The collator packs several examples into one row but returns no `position_ids`: the example "
                "boundaries are unknown, so the examples could be neither clipped separately nor kept from "
                "attending to each other. Use DataCollatorWithFlattening(return_position_ids=True)."
            )
        mask = inputs.get("attention_mask")
        if mask is not None and "attention_mask" in self.per_token:
            raise PackingError(
                "A packed batch (several examples per row) with an `attention_mask`: transformers then "
                "builds the attention from the mask alone and ignores the restarts of `position_ids`, so "
                "every example would attend to the others in its row. Drop the attention mask from the "
                "packed batch (as DataCollatorWithFlattening does)."
            )
        layout = PackedLayout.from_position_ids(inputs["position_ids"])
        layout.check_flash_boundaries(inputs)
        if num_examples is not None and layout.num_examples != num_examples:
            raise PackingError(
                f"The collator was given {num_examples} examples but `position_ids` restart "
                f"{layout.num_examples} times: the packed rows do not hold one segment per example (a row "
                "the data set already packed, whose `position_ids` restart inside it; an example split "
                "across rows; or two examples whose positions continue each other). The sampler draws rows, "
                "so each must be one segment: pack after sampling (one example per row, with "
                "DataCollatorWithFlattening or DPSFTTrainer's packing=True), or use a padding collator (a "
                "row is then one example)."
            )
        for key in self.per_token:
            value = inputs.get(key)
            if value is not None and (not isinstance(value, torch.Tensor) or not layout.is_token_wise(value)):
                raise PackingError(
                    f"'{key}' is packed per token (probed on the collator) but has shape "
                    f"{tuple(getattr(value, 'shape', ()))}, not ({layout.rows}, {layout.length}, ...)."
                )
        out = []
        for first in range(0, layout.num_examples, size):
            spans = layout.spans[first : first + size]
            micro: dict[str, Any] = {}
            for key, value in inputs.items():
                if key in self.per_token:
                    micro[key] = torch.cat([value[row : row + 1, start:stop] for row, start, stop in spans],
                                           dim=1)
                elif key in self.shared:
                    micro[key] = value
            micro_labels = torch.cat([labels[row : row + 1, start:stop] for row, start, stop in spans], dim=1)
            lengths = [stop - start for _, start, stop in spans]
            micro.update(flash_boundaries(inputs, self.boundaries, lengths, labels.device))
            micro_layout = PackedLayout.from_position_ids(micro["position_ids"])
            if micro_layout.lengths != lengths:
                raise PackingError("Re-packing a micro-batch changed its example boundaries.")
            out.append((micro, micro_labels, micro_layout))
        return out


def flash_boundaries(inputs: dict[str, Any], keys: frozenset[str], lengths: list[int],
                device: torch.device) -> dict:
    """FlashAttention's boundary arguments and ``seq_idx`` for a micro-batch of examples of these lengths (one
    row)."""
    out: dict[str, Any] = {}
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)
    for key in keys:
        value = inputs[key]
        dtype = value.dtype if isinstance(value, torch.Tensor) else torch.int32
        if key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            out[key] = torch.tensor(cumulative, dtype=dtype, device=getattr(value, "device", device))
        elif key in ("max_length_q", "max_length_k"):
            out[key] = max(lengths)
        elif key == SEQ_IDX_KEY:
            index = [k for k, length in enumerate(lengths) for _ in range(length)]
            out[key] = torch.tensor([index], dtype=dtype, device=getattr(value, "device", device))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def _check_rows_are_their_examples(batches: list[dict[str, Any]], per_example: set, per_token: set) -> None:
    """Each copy's row (or packed segment) must be what the example gets collated alone.

    A value computed over the batch (weights normalised by the number of examples or of tokens, a rank within
    the batch) follows the number of examples like a per-example value, but an example's row then depends on
    the others: the micro-batches and the first-step check (which slices the batch) would carry that
    dependence unseen. Copies of one example make it visible without comparing padded rows of different
    lengths. (Keys the collator draws at random, e.g. masked-LM masking, are left out: their rows differ by
    design.)
    """
    one = batches[0]
    for n, batch in zip((2, 3), batches[1:]):
        for key in sorted(per_example | per_token):
            value, alone = batch[key], one[key]
            if key in per_example:
                parts = [value[k : k + 1] for k in range(n)]
            else:
                width = alone.shape[1]
                parts = [value[:, k * width : (k + 1) * width] for k in range(n)]
            if not all(_same(part, alone) for part in parts):
                raise BatchStructureError(
                    f"The collator's '{key}' for an example collated with {n - 1} copies of itself differs "
                    "from its value when the example is collated alone: it is computed over the batch (e.g. "
                    "weights normalised by the number of examples or tokens), so each example's row depends "
                    "on the others in its Poisson batch, which per-example clipping does not bound. Compute "
                    "it from each example alone in the collator, or in compute_per_example_loss from that "
                    "example's own inputs."
                )


def _same_up_to_padding(row: torch.Tensor, alone: torch.Tensor) -> bool:
    """``row`` (an example's row in a padded batch) equals ``alone`` on the columns they share, padded on the
    right or on the left."""
    if not isinstance(row, torch.Tensor) or not isinstance(alone, torch.Tensor):
        return _same(row, alone)
    if (row.shape == alone.shape or row.dim() < 2 or row.shape[2:] != alone.shape[2:]
        or row.shape[0] != alone.shape[0]):
        return _same(row, alone)
    width = min(row.shape[1], alone.shape[1])
    return _same(row[:, :width], alone[:, :width]) or _same(row[:, -width:], alone[:, -width:])


def _check_pair(
    collate_fn: Callable[[list], dict[str, Any]], example: Any, other: Any, per_example: set, per_token: set
) -> None:
    """Two different examples: each one's row (segment) in their batch is its collation alone, up to padding.
    Catches values normalised by the batch's content (e.g. by its longest example), which copies of one
    example cannot."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        alone = [dict(collate_fn([example])), dict(collate_fn([other]))]
        pair = dict(collate_fn([example, other]))
    for key in sorted(per_example | per_token):
        if key not in pair or any(key not in a for a in alone):
            continue
        value = pair[key]
        if key in per_example:
            parts = [value[k : k + 1] for k in range(2)]
            same = all(_same_up_to_padding(part, a[key]) for part, a in zip(parts, alone))
        else:
            width = alone[0][key].shape[1]
            same = _same(value[:, :width], alone[0][key]) and _same(value[:, width:], alone[1][key])
        if not same:
            raise BatchStructureError(
                f"The collator's '{key}' for an example collated with another differs from its value when "
                "the example is collated alone (beyond padding): it is computed over the batch (e.g. "
                "normalised by the longest example or the total of tokens), so each example's row depends on "
                "the others in its Poisson batch, which per-example clipping does not bound. Compute it from "
                "each example alone in the collator, or in compute_per_example_loss from that example's own "
                "inputs."
            )


def probe_batch_structure(
    collate_fn: Callable[[list], dict[str, Any]], example: Any, other: Any = None
) -> BatchStructure:
    """Collate ``example`` 1, 2 and 3 times and classify every key (see the module docstring); with ``other``
    (a second example), also check that each example's row in a batch of the two is its collation alone."""
    batches = [dict(collate_fn([example] * n)) for n in (1, 2, 3)]
    keys = set(batches[0])
    if any(set(b) != keys for b in batches[1:]):
        raise BatchStructureError(
            "The collator returns different keys for 1, 2 and 3 examples: which tensors carry the example "
            "axis cannot be established."
        )
    per_example, per_token, shared, boundaries, unknown = set(), set(), set(), set(), []
    packed = any(
        isinstance(b1, torch.Tensor) and b1.dim() >= 2 and b1.shape[0] == 1
        and tuple(batches[1][k].shape[:2]) == (1, 2 * b1.shape[1]) and b1.shape[1] > 0
        for k, b1 in batches[0].items()
        if isinstance(batches[1][k], torch.Tensor)
    )
    for key in sorted(keys):
        one, two, three = (b[key] for b in batches)
        if packed and (key in FLASH_BOUNDARY_KEYS or key == SEQ_IDX_KEY):
            boundaries.add(key)
        elif _same(one, two) and _same(one, three):
            shared.add(key)
        elif all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in (one, two, three)) and all(
            t.shape[0] == n and t.shape[1:] == one.shape[1:] for n, t in ((1, one), (2, two), (3, three))
        ):
            per_example.add(key)
        elif all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (one, two, three)) and all(
            t.shape[0] == 1 and t.shape[1] == n * one.shape[1] and t.shape[2:] == one.shape[2:]
            for n, t in ((1, one), (2, two), (3, three))
        ):
            per_token.add(key)
        else:
            unknown.append(key)
    not_torch = [k for k in unknown if isinstance(batches[0][k], (np.ndarray, list, tuple))]
    if not_torch:
        raise BatchStructureError(
            f"Collated keys {not_torch} are {type(batches[0][not_torch[0]]).__name__}s, not torch tensors: "
            "the Trainer moves only tensors to the device and the model cannot take them, and which row "
            "belongs to which example is read from tensors. Return torch tensors from the collator "
            "(return_tensors='pt', the default of transformers' collators)."
        )
    if unknown:
        raise BatchStructureError(
            f"Collated keys {unknown} follow the number of examples in no declared way (not one row per "
            "example, not packed along the tokens of one row, not shared): which part of them belongs to "
            "which example is unknown, so micro-batches cannot be cut from them. Leave them out of the "
            "collator's output."
        )
    if "labels" in keys and "labels" not in per_example | per_token:
        raise BatchStructureError("The collator's `labels` do not carry the example axis.")
    if per_token and per_example:
        raise BatchStructureError(
            f"The collator packs {sorted(per_token)} per token but returns {sorted(per_example)} one row per "
            "example: a batch is either packed or one example per row."
        )
    # keys drawn at random by the collator (masked-LM masking) differ between copies by design: not compared
    drawn = random_keys(collate_fn, example,
                        keys) | (random_keys(collate_fn, other, keys) if other is not None else set())
    _check_rows_are_their_examples(batches, per_example - drawn, per_token - drawn)
    if other is not None:
        _check_pair(collate_fn, example, other, per_example - drawn, per_token - drawn)
    start = 0
    if "position_ids" in per_token:
        start = int(batches[0]["position_ids"].reshape(-1)[0])
    return BatchStructure(
        frozenset(per_example), frozenset(per_token), frozenset(shared), frozenset(boundaries),
        position_start=start,
        random=frozenset(drawn & (per_example | per_token)),
    )


#: copies of the example and seeds the random-key probe collates: a mask drawn with probability 0.15 per token
#: on a short example is often empty in one collation of one copy (two such collations then agree by chance);
#: 16 copies under 4 seeds make a chance agreement negligible
_RANDOM_PROBE_COPIES, _RANDOM_PROBE_SEEDS = 16, 4


def random_keys(collate_fn: Callable[[list], dict[str, Any]], example: Any, keys: set) -> set:
    """The keys whose collation of the same examples differs between seeds (torch's; Python's and NumPy's
    streams are not seeded here, so a collator drawing from them differs too). The run's random streams are
    restored."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            draws = []
            for seed in range(_RANDOM_PROBE_SEEDS):
                # the CPU generator only, the one forked above (collators draw on the CPU): torch.manual_seed
                # would also re-seed every CUDA generator, unrestored, and on a CPU-only build queue a call
                # with a formatted stack per device type (~1 ms each, most of this probe's cost)
                torch.random.default_generator.manual_seed(seed)
                draws.append(dict(collate_fn([example] * _RANDOM_PROBE_COPIES)))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return {key for key in keys if any(not _same(draws[0].get(key), d.get(key)) for d in draws[1:])}
