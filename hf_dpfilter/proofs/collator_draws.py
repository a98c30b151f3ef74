"""An example alone "with the same randomness" when the training collator draws at random (masked-LM masking).

A collator such as transformers' ``DataCollatorForLanguageModeling`` (or ``DataCollatorForWholeWordMask``, or
a random augmentation) draws part of each example's row at random: which tokens are masked, and so its
``input_ids`` and ``labels``. The per-example checks (:mod:`hf_dpfilter.proofs.separation`) compare an
example's loss in its micro-batch with its loss re-collated alone; a fresh collation alone draws a *different*
mask, the two losses differ for a correct model and loss, and a correct masked-LM run would be refused.

The keys the collator draws at random are found by the collator probe (``BatchStructure.random``: collations
of copies of the training set's first examples under different seeds differ on them, and only on them), and
again on the checked example's own row (a first example with nothing to mask, an empty line, shows no random
key): at the first-step check, and for a re-check only when its loss differs (the copies cost tens of ms of
CPU collation). For those keys, and only those, the example alone carries the draw its row got in the batch:
:func:`with_batch_draws` takes the example's row (its packed segment) of each random key from the micro-batch,
cropped to the example's own width on the side its padding is on; every other key (the attention mask, token
types, anything deterministic) comes from the example's collation alone, as before. The padding side is not
guessed: it is the side on which every deterministic per-example key of the batch row equals the alone
collation; when none does (or the widths cannot be aligned), the alone keeps its own draw, and a coupling or a
mismatch is then refused by the check as before (a refusal, never a pass).

What this proves and what it does not: the checks still prove that the model and the loss compute the
example's loss from its own row only (the same draw in the batch and alone, the rest collated alone). The
collator's draw for a row is taken as drawn: a collator whose *random* draw for one example depends on the
others (a fixed number of masks over the whole batch) is not seen by these checks; the deterministic keys of
every row are still checked against the example alone (the probe, and the re-collation here).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["KeyedDrawsError", "keyed_draws", "own_generators", "seeded_streams", "untouched_streams",
           "with_batch_draws"]

#: attributes through which a collator holds the one it wraps (the trainer's wrappers, transformers'
#: RemoveColumnsCollator, TRL's): searched for the wrapped collators' own generators
_WRAPPED = ("collate_fn", "data_collator", "collator")


def own_generators(collate_fn: Any, depth: int = 6) -> list:
    """The random generators the collator (or one it wraps) holds as ``generator`` (transformers' collators
    given a ``seed``: a torch.Generator, or a NumPy Generator for ``return_tensors='np'``)."""
    found, seen, todo = [], set(), [collate_fn]
    for _ in range(depth):
        following = []
        for obj in todo:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            generator = getattr(obj, "generator", None)
            if isinstance(generator, (torch.Generator, np.random.Generator)):
                found.append(generator)
            following.extend(getattr(obj, name, None) for name in _WRAPPED)
        todo = following
    return found


@contextlib.contextmanager
def untouched_streams(collate_fn: Any) -> Iterator[None]:
    """Run the block (the checks' own collations) without moving any random stream the run's batches draw
    from:
    torch's global one (forked), Python's and NumPy's global ones and the collator's own generators
    (restored). A seeded run then gets the same masks, dropout and batches with or without the checks."""
    own = [(g, g.get_state() if isinstance(g, torch.Generator) else g.bit_generator.state)
           for g in own_generators(collate_fn)]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        for generator, state in own:
            if isinstance(generator, torch.Generator):
                generator.set_state(state)
            else:
                generator.bit_generator.state = state


@contextlib.contextmanager
def seeded_streams(collate_fn: Any, seed: int) -> Iterator[None]:
    """Run the block (one collation) with every random stream a collator may draw from seeded from ``seed``:
    torch's CPU generator, Python's and NumPy's global ones and the collator's own generators; all restored
    afterwards (:func:`untouched_streams`), so the run's streams do not move."""
    with untouched_streams(collate_fn):
        torch.random.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        for generator in own_generators(collate_fn):
            if isinstance(generator, torch.Generator):
                generator.manual_seed(seed)
            else:
                generator.bit_generator.state = type(generator.bit_generator)(seed).state
        yield


def _example_row(value: Any, index: int, layout: Any) -> Any:
    """Example ``index``'s row of a micro-batch value (its segment of a packed row), or None."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    if layout is None:
        return value[index : index + 1] if value.shape[0] > index else None
    row, start, stop = layout.spans[index]
    return value[row : row + 1, start:stop] if value.dim() >= 2 else None


def _side(alone: dict[str, Any], row: dict[str, Any], keys: set[str]) -> str | None:
    """The side ("right", "left" or "same" for equal widths) on which every deterministic key of the batch row
    equals the alone collation on their shared columns; None when no key shows it or none agrees."""
    compared = [k for k in sorted(keys) if isinstance(alone.get(k), torch.Tensor)
                and isinstance(row.get(k), torch.Tensor)
                and alone[k].dim() >= 2 and row[k].dim() == alone[k].dim()
                and row[k].shape[2:] == alone[k].shape[2:]]
    if not compared:
        return None
    widths = {(alone[k].shape[1], row[k].shape[1]) for k in compared}
    if len(widths) != 1:
        return None
    (wa, wb), = widths
    w = min(wa, wb)
    if wa == wb and all(torch.equal(alone[k], row[k].to(alone[k].device)) for k in compared):
        return "same"
    if all(torch.equal(alone[k][:, :w], row[k][:, :w].to(alone[k].device)) for k in compared):
        return "right"
    if all(torch.equal(alone[k][:, -w:], row[k][:, -w:].to(alone[k].device)) for k in compared):
        return "left"
    return None


def _carry(alone: torch.Tensor, drawn: torch.Tensor, side: str | None) -> torch.Tensor:
    """``alone`` with the drawn values of the batch row on the columns they share (padding side ``side``)."""
    drawn = drawn.to(device=alone.device, dtype=alone.dtype)
    if alone.shape == drawn.shape and side in ("same", None):
        return drawn.clone()
    if (side is None or alone.dim() < 2 or alone.shape[2:] != drawn.shape[2:]
        or alone.shape[0] != drawn.shape[0]):
        # cannot be aligned: keeps its own draw (the check then compares, and refuses a mismatch)
        return alone
    out, w = alone.clone(), min(alone.shape[1], drawn.shape[1])
    if side in ("right", "same"):
        out[:, :w] = drawn[:, :w]
    else:
        out[:, -w:] = drawn[:, -w:]
    return out


def with_batch_draws(
    structure: Any, inputs: dict[str, Any], labels: torch.Tensor, micro_batch: tuple, index: int,
    random_keys: set[str],
) -> tuple[dict[str, Any], torch.Tensor]:
    """The alone collation ``(inputs, labels)`` of example ``index`` of ``micro_batch`` (``(inputs, labels,
    layout)``), with the keys the collator draws at random (``random_keys``: the probe's ``structure.random``
    and those found on this example's own row) taken from the example's row in the micro-batch (see the module
    docstring). Unchanged when the collator draws nothing at random."""
    if not random_keys:
        return inputs, labels
    batch_inputs, batch_labels, layout = micro_batch
    alone = {**inputs, "labels": labels}
    batch = {**batch_inputs, "labels": batch_labels}
    row = {k: _example_row(v, index, layout) for k, v in batch.items()}
    deterministic = (set(structure.per_example) | set(structure.per_token)) - random_keys
    side = "same" if layout is not None else _side(alone, row, deterministic)
    out = dict(alone)
    for key in sorted(random_keys & set(alone)):
        if isinstance(alone[key], torch.Tensor) and isinstance(row.get(key), torch.Tensor):
            out[key] = _carry(alone[key], row[key], side)
    out_labels = out.pop("labels")
    return out, out_labels


class KeyedDrawsError(RuntimeError):
    """A collator's random draws that cannot be keyed to each example."""


def keyed_draws(collate_fn: Any, batch: dict[str, Any], raws: list, row_seeds: list[int], side: str,
                probe_seeds: tuple[int, int], spans: tuple | None = None) -> dict[str, Any]:
    """``batch`` (the collation of ``raws``) with each example's random draws its own: the keys the collator
    draws at random replaced, row by row, by the example's collation alone under its own seed.

    Which keys are random is shown on this very batch (every step, not a sample): the collation of ``raws``
    under two seeds (``probe_seeds``) differs on them. Example i's row of such a key then holds its collation
    alone under ``row_seeds[i]`` (a keyed hash of its content and the step:
    hf_dpfilter/randomness/example_keys.py) on its own columns, on the declared padding ``side``; the row's
    other columns must be the same under both seeds (padding) and take that value. A draw over the whole batch
    (a fixed number of masks over all rows) is thereby replaced by each example's draw alone, whatever the
    other examples.

    Args:
        collate_fn: the training collator.
        batch: its collation of ``raws`` (the logical batch, or a micro-batch of it).
        raws: the examples, in the batch's row order.
        row_seeds: one seed per example.
        side: ``"right"`` or ``"left"``, the declared padding side.
        probe_seeds: two seeds of the step, to find the random keys.
        spans: packed rows: example i's ``(row, start, stop)`` (the packing's layout), its segment of every
            key that runs along the tokens.

    Returns:
        The batch with the random keys replaced (the same dict when the collator draws nothing at random).
    """
    with seeded_streams(collate_fn, probe_seeds[0]):
        first = dict(collate_fn(list(raws)))
    with seeded_streams(collate_fn, probe_seeds[1]):
        second = dict(collate_fn(list(raws)))
    drawn = sorted(
        k for k, v in first.items() if isinstance(v, torch.Tensor) and k in batch
        and not (isinstance(second.get(k), torch.Tensor) and second[k].shape == v.shape
                 and torch.equal(second[k], v))
    )
    if not drawn:
        return batch
    out = dict(batch)
    if spans is not None:
        return _keyed_segments(collate_fn, out, raws, row_seeds, drawn, first, second, spans)
    for key in drawn:
        if not isinstance(batch[key],
                          torch.Tensor) or batch[key].shape != first[key].shape or batch[key].dim() < 1 \
                or batch[key].shape[0] != len(raws):
            raise KeyedDrawsError(
                f"The training collator draws '{key}' at random, in a shape that does not give one row per "
                f"example ({tuple(first[key].shape)} for {len(raws)} examples), so each example's draw "
                "cannot be its own. Fix: a collator whose random draws are made row by row, or no random "
                "collator for private training.")
        out[key] = batch[key].clone()
    for i, (raw, seed) in enumerate(zip(raws, row_seeds)):
        with seeded_streams(collate_fn, seed):
            alone = dict(collate_fn([raw]))
        for key in drawn:
            value, target = alone.get(key), out[key]
            if not isinstance(value, torch.Tensor) or value.shape[0] != 1 or value.dim() != target.dim() or (
                    value.dim() >= 2
                    and (value.shape[2:] != target.shape[2:] or value.shape[1] > target.shape[1])):
                raise KeyedDrawsError(
                    f"The training collator draws '{key}' at random, and an example collated alone does not "
                    f"give one row of the batch's (alone {None if value is None else tuple(value.shape)}, "
                    f"batch {tuple(target.shape)}), so its draw cannot be its own. Fix: a collator that pads "
                    "each row on one declared side, or no random collator for private training.")
            value = value.to(device=target.device, dtype=target.dtype)
            if value.dim() == 1:
                target[i] = value[0]
                continue
            width, total = value.shape[1], target.shape[1]
            own = slice(0, width) if side == "right" else slice(total - width, total)
            rest = slice(width, total) if side == "right" else slice(0, total - width)
            if not torch.equal(first[key][i, rest], second[key][i, rest]):
                raise KeyedDrawsError(
                    f"The training collator draws '{key}' at random outside an example's own columns (its "
                    "padding), so those draws are not the example's own. Fix: a collator that leaves padding "
                    "deterministic.")
            target[i, own] = value[0]
            target[i, rest] = first[key][i, rest].to(device=target.device, dtype=target.dtype)
    return out


def _keyed_segments(collate_fn: Any, out: dict[str, Any], raws: list, row_seeds: list[int], drawn: list[str],
                    first: dict[str, Any], second: dict[str, Any], spans: tuple) -> dict[str, Any]:
    """:func:`keyed_draws` for packed rows: example i's segment of each random key is its collation alone."""
    if len(spans) != len(raws):
        raise KeyedDrawsError(f"A packed batch of {len(raws)} examples has {len(spans)} segments: each "
                              "example's random draws cannot be placed in its own segment.")
    covered = {}
    for key in drawn:
        if out[key].shape != first[key].shape or out[key].dim() < 2:
            raise KeyedDrawsError(f"The training collator draws '{key}' at random in packed rows of shape "
                                  f"{tuple(first[key].shape)}: not one column per token, so each example's "
                                  "draw cannot be its own. Fix: no random collator for private training.")
        out[key] = out[key].clone()
        covered[key] = torch.zeros(out[key].shape[:2], dtype=torch.bool)
    for (row, start, stop), raw, seed in zip(spans, raws, row_seeds):
        with seeded_streams(collate_fn, seed):
            alone = dict(collate_fn([raw]))
        for key in drawn:
            value = alone.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[:2] != (1,
                                                                                             stop - start) \
                    or value.shape[2:] != out[key].shape[2:]:
                raise KeyedDrawsError(f"An example collated alone gives '{key}' of shape "
                                      f"{None if value is None else tuple(value.shape)}, not its packed "
                                      f"segment of {stop - start} tokens: its random draw cannot be its own.")
            out[key][row, start:stop] = value[0].to(device=out[key].device, dtype=out[key].dtype)
            covered[key][row, start:stop] = True
    for key in drawn:
        if not torch.equal(first[key][~covered[key]], second[key][~covered[key]]):
            raise KeyedDrawsError(f"The training collator draws '{key}' at random outside the examples' "
                                  "segments.")
    return out
