"""Evaluation sets that share rows with the training set: found by content, refused unless opted in.

An evaluation computes its loss, metrics and predictions from its rows without noise and publishes them (log
lines, ``trainer_state.json``, the loggers, ``evaluate()``/``predict()`` results). On a row of the training
set that is a noiseless statistic of a private example: its loss under a model trained on it, the signal a
membership test reads. One shared row is enough, so a set is refused as soon as one row matches.

Rows are compared by content, never by position or row id: each row's canonical form (the values of the
columns both sets have: ``input_ids`` alone when both have it, so that an id column or a user column does not
hide an identical example, and of ``input_ids`` the tokens its ``attention_mask`` keeps, so that the same rows
tokenized again with ``padding="max_length"`` (left or right) are the training rows; numbers as float64 or
int64 bytes whatever holds them; each example of a row TRL packed, by its ``seq_lengths``) is hashed with
BLAKE2b-128 into a digest. The eval set's digests are held in memory (16 bytes and a set slot per row); the
training set is streamed once per eval set and the scan stops at the first match. ``input_ids`` are hashed as
int64 bytes, read from a ``datasets.Dataset`` as Arrow batches of 1024 rows (no Python lists): about 1.6 s per
100k training rows of 256 tokens on one CPU core; other columns through their Python form (several times
slower); any other map-style data set (``__len__`` and ``__getitem__``: a torch ``Dataset``, a list) item by
item, at the cost of its ``__getitem__``. The cost is paid once per eval set per trainer: the verdict is kept,
and for a set that is not a ``datasets.Dataset`` (its rows can be changed in place) only while its rows'
digests, hashed again at each evaluation, are those it was computed on. An eval set that cannot be enumerated
(an iterable data set) cannot be checked and is refused likewise. Nothing is published: the error names the
eval set, never a row, an index or a count.

``dp_allow_eval_on_training_rows=True`` is the explicit opt-in: the evaluation runs with a warning, and what
it publishes is outside the reported (epsilon, delta) (docs/threat_model.md).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_dpfilter.run.training_fields import TrainingFieldError

__all__ = ["ID_COLUMNS", "EvalRowsGuard", "NotEnumerable", "comparable_columns", "overlapping_rows",
           "row_digests", "shares_rows"]

#: columns that number the rows of a split rather than describe the example
ID_COLUMNS = frozenset({"idx", "id", "index", "__index_level_0__"})
#: TRL's column of the lengths of the examples packed in a row (its eval sets are packed by default): a packed
#: row is compared example by example
SEGMENTS_COLUMN = "seq_lengths"
#: the padding mask: a row's tokens are those it keeps (a copy padded to a fixed length is the same example)
MASK_COLUMN = "attention_mask"
#: rows of a ``datasets.Dataset`` read per batch
BATCH_ROWS = 1024


class NotEnumerable(TypeError):
    """The data set has no length or no item access: its rows cannot be compared."""


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover -- datasets is a dependency of the stack
        return False
    return isinstance(dataset, datasets.Dataset)


def _enumerable(dataset: Any) -> bool:
    return hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")


def _columns(dataset: Any) -> list[str] | None:
    """The named fields of the set's rows, or None for rows without names (tuples, tensors)."""
    if _is_hf_dataset(dataset):
        return list(dataset.column_names)
    if not _enumerable(dataset):
        raise NotEnumerable(type(dataset).__name__)
    if len(dataset) == 0:
        return []
    first = dataset[0]
    return list(first.keys()) if isinstance(first, Mapping) else None


def comparable_columns(train: Any, evaluation: Any) -> list[str] | None:
    """The fields both sets' rows are compared on: ``["input_ids"]`` when both have it, else their common
    fields less row ids; ``None``: whole rows (neither names its fields); ``[]``: nothing in common (rows
    never equal)."""
    a, b = _columns(train), _columns(evaluation)
    if a is None or b is None:
        return None if a is None and b is None else []
    common = set(a) & set(b)
    return ["input_ids"] if "input_ids" in common else sorted(common - ID_COLUMNS)


def _canonical(value: Any) -> Any:
    """A form that depends on the content only: numbers of any container (a list, a tensor, an array; any
    width) as the digest of their shape and float64 or int64 bytes, 0-d values as Python scalars, mappings
    sorted, strings as they are."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, np.ndarray, np.generic)):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged
            return [_canonical(v) for v in value]
        if array.ndim == 0:
            return array.item()
        if array.dtype.kind in "biuf":
            wide = array.astype(np.float64 if array.dtype.kind == "f" else np.int64)
            return ("array", array.shape, hashlib.blake2b(wide.tobytes(), digest_size=16).hexdigest())
        return [_canonical(v) for v in value]
    return value


def _digest(values: Any) -> bytes:
    return hashlib.blake2b(repr(values).encode(), digest_size=16).digest()


def _numbers(values: Any, dtype: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype)


def _token_digest(ids: Any, mask: Any = None) -> bytes:
    """The digest of a token sequence (a list, a NumPy array or a tensor of integers): the int64 bytes of the
    tokens its ``attention_mask`` keeps (all of them without one), so that a padded copy of a row is that
    row."""
    tokens = _numbers(ids, np.int64)
    if mask is not None:
        keep = _numbers(mask, np.int64)
        if keep.shape == tokens.shape:  # another layout (a 4-d mask) is not a padding mask: all tokens kept
            tokens = tokens[keep != 0]
    return hashlib.blake2b(np.ascontiguousarray(tokens).tobytes(), digest_size=16).digest()


def _hf_token_digests(dataset: Any) -> Iterator[bytes]:
    """``input_ids`` of a ``datasets.Dataset`` read as Arrow batches (its row selection applied, no conversion
    to Python lists); each example of a packed row (``seq_lengths``) on its own. Another layout than a list of
    integers per row (fixed-size or nested lists) goes through Python lists, to the same digests."""
    import pyarrow as pa

    packed = SEGMENTS_COLUMN in dataset.column_names
    masked = MASK_COLUMN in dataset.column_names and not packed
    arrow_type = dataset.data.schema.field("input_ids").type
    flat = (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and pa.types.is_integer(
        arrow_type.value_type)
    if masked:
        mask_type = dataset.data.schema.field(MASK_COLUMN).type
        flat = flat and (pa.types.is_list(mask_type)
                         or pa.types.is_large_list(mask_type)) and pa.types.is_integer(
            mask_type.value_type)
    names = ["input_ids", MASK_COLUMN] if masked else ["input_ids"]
    if not flat:
        for row in dataset.with_format(None).select_columns(names).iter(batch_size=BATCH_ROWS):
            masks = row[MASK_COLUMN] if masked else [None] * len(row["input_ids"])
            yield from (_token_digest(ids, mask) for ids, mask in zip(row["input_ids"], masks))
        return
    view = dataset.select_columns(names + [SEGMENTS_COLUMN] if packed else names).with_format("arrow")
    for batch in view.iter(batch_size=BATCH_ROWS):
        values, offsets = _flat_numbers(batch.column("input_ids"))
        keep = None
        if masked:  # the padding's tokens dropped, row by row (a row whose mask has another length: all kept)
            mask, mask_offsets = _flat_numbers(batch.column(MASK_COLUMN))
            keep = None if mask.all() else (mask != 0, mask_offsets)
        lengths = batch.column(SEGMENTS_COLUMN).to_pylist() if packed else [None] * (len(offsets) - 1)
        for row, segments in enumerate(lengths):
            start, end = int(offsets[row]), int(offsets[row + 1])
            if keep is not None and keep[1][row + 1] - keep[1][row] == end - start:
                kept = values[start:end][keep[0][keep[1][row]:keep[1][row + 1]]]
                yield hashlib.blake2b(kept.tobytes(), digest_size=16).digest()
                continue
            for length in segments if segments is not None else [end - start]:
                yield hashlib.blake2b(values[start:start + length].tobytes(), digest_size=16).digest()
                start += length


def _flat_numbers(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow list column's values as int64 and its row offsets from 0."""
    column = column.combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    offsets = column.offsets.to_numpy() - column.offsets[0].as_py() if len(column) else np.zeros(1, np.int64)
    return values, offsets


def row_digests(dataset: Any, columns: list[str] | None) -> Iterator[bytes]:
    """One digest per row of ``dataset`` over ``columns`` (None: the whole row); ``["input_ids"]`` by the
    tokens' bytes (one digest per example of a packed row), other columns by their canonical form."""
    hf = _is_hf_dataset(dataset)
    if not hf and not _enumerable(dataset):
        raise NotEnumerable(type(dataset).__name__)
    if columns == ["input_ids"]:
        if hf:
            yield from _hf_token_digests(dataset)
        else:
            for index in range(len(dataset)):
                item = dataset[index]
                yield _token_digest(item["input_ids"],
                                    item.get(MASK_COLUMN) if isinstance(item, Mapping) else None)
        return
    if hf:
        names = list(dataset.column_names) if columns is None else columns
        for batch in dataset.with_format(None).select_columns(names).iter(batch_size=BATCH_ROWS):
            for values in zip(*(batch[c] for c in names)):
                yield _digest(tuple(_canonical(v) for v in values))
        return
    for index in range(len(dataset)):
        item = dataset[index]
        yield _digest(_canonical(item) if columns is None else tuple(_canonical(item[c]) for c in columns))


def _first_match(digests: Iterable[bytes], seen: set[bytes]) -> bool:
    return any(digest in seen for digest in digests)


def shares_rows(train: Any, evaluation: Any) -> bool:
    """Whether a row of ``evaluation`` is identical to a row of ``train`` (see the module docstring).

    Raises :class:`NotEnumerable` when either set cannot be read row by row."""
    if evaluation is train:
        return True
    columns = comparable_columns(train, evaluation)
    if columns == []:
        return False
    seen = set(row_digests(evaluation, columns))
    return bool(seen) and _first_match(row_digests(train, columns), seen)


def overlapping_rows(train: Any, evaluation: Any) -> int:
    """How many rows of ``evaluation`` are identical to a row of ``train`` (a whole pass; for tests and
    reports of one's own, never logged by the library)."""
    columns = comparable_columns(train, evaluation)
    if columns == []:
        return 0
    seen = set(row_digests(train, columns))
    return sum(digest in seen for digest in row_digests(evaluation, columns))


@dataclass
class _Verdict:
    dataset: Any  # held, so that its id is not reused by another set
    shared: bool | None  # None: cannot be compared row by row
    # the digests it was computed on (a set that is not a datasets.Dataset)
    rows: frozenset[bytes] | None = None
    warned: bool = False


def _eval_rows(train: Any, dataset: Any) -> frozenset[bytes] | None:
    """The digests of a mutable eval set's rows (a list, a torch data set: its rows can be changed in place
    after a verdict); None for a ``datasets.Dataset``, whose rows do not change, or a set that cannot be
    compared."""
    if _is_hf_dataset(dataset):
        return None
    try:
        columns = comparable_columns(train, dataset)
        return frozenset(row_digests(dataset, columns)) if columns != [] else frozenset()
    except NotEnumerable:
        return None


@dataclass
class EvalRowsGuard:
    """The decision for each evaluation or prediction set, computed once per set (the trainer holds one)."""

    verdicts: dict[int, _Verdict] = field(default_factory=dict, metadata={"help": "id(set) -> its verdict"})

    def _verdict(self, train: Any, dataset: Any) -> _Verdict:
        """The set's verdict, kept; recomputed when a set other than a ``datasets.Dataset`` now holds other
        rows (hashing its rows again costs less than evaluating them; the training set is streamed only
        then)."""
        verdict = self.verdicts.get(id(dataset))
        rows = _eval_rows(train, dataset)
        if verdict is None or verdict.dataset is not dataset or verdict.rows != rows:
            try:
                shared = shares_rows(train, dataset)
            except NotEnumerable:
                shared = None
            verdict = self.verdicts[id(dataset)] = _Verdict(dataset, shared, rows)
        return verdict

    def check(self, train: Any, dataset: Any, label: str, *, private: bool, allowed: bool, disjoint: bool,
              driven: list[str]) -> None:
        """Raise ``TrainingFieldError`` (with the fix) when ``dataset`` shares a row with ``train`` or cannot
        be compared, in a private run without ``allowed`` (``dp_allow_eval_on_training_rows``); warn once with
        it. A shared row is refused whatever ``allowed`` when evaluation-driven settings (``driven``) would
        steer the run by it under ``disjoint`` (``dp_eval_disjoint_from_train``, the user's declaration of a
        held-out set, which also stands for a set that cannot be compared)."""
        if not private and not (driven and disjoint):
            return
        verdict = self._verdict(train, dataset)
        if verdict.shared and driven and disjoint:
            raise TrainingFieldError(
                f"dp_eval_disjoint_from_train=True, but {label} shares at least one identical row with the "
                f"training set, and {', '.join(driven)} would select or steer the run by their noiseless "
                "metric. Remove the shared examples from the eval set (deduplicate the splits), or remove "
                "the evaluation-driven settings."
            )
        if not private or verdict.shared is False or (verdict.shared is None and disjoint):
            return
        problem = ("shares at least one identical row with the training set" if verdict.shared else
                   "cannot be compared with the training set row by row (it has no length or item access)")
        if not allowed:
            raise TrainingFieldError(
                f"{label} {problem}: its evaluation loss, metrics and predictions are computed from those "
                "private examples without noise and published (logs, trainer_state.json, the returned "
                "metrics), outside the reported epsilon. Evaluate a held-out split (e.g. the validation "
                "split, or train_test_split and train on the rest), or set "
                "dp_allow_eval_on_training_rows=True to publish them knowingly."
            )
        if not verdict.warned:
            verdict.warned = True
            warnings.warn(
                f"dp_allow_eval_on_training_rows=True: {label} {problem}; its loss, metrics and predictions "
                "are published without noise, outside the reported epsilon (docs/threat_model.md).",
                UserWarning, stacklevel=4,
            )
