"""The user ids of a user-level run, read from the declared column and refused unless they are clean.

Which examples are one user is *declared* by ``user_id_column``; the declaration is only as good as its
values, and a value that silently splits or merges people changes the unit the guarantee protects:

* **Missing ids are refused**: ``None``, NaN in any numeric form (Python float, NumPy floating scalars and 0-d
  arrays, 0-d torch tensors, pandas ``NA``/``NaT``) and strings that are empty or only whitespace. Python
  compares NaN unequal to itself, so each NaN row would have become a "user" of its own: a person whose rows
  have no id would be protected as many people, each with the full budget.
* **Mixed types are refused** (ints and strings, ints and floats, booleans and ints in one column): ``1`` and
  ``"1"`` would be two users, ``1`` and ``True`` (equal in Python) one. The column is not normalised behind
  the user's back: the fix (cast the column to one type) is theirs to make, since only they know which ids
  name the same person.
* **Strings that differ only by surrounding whitespace or Unicode normalisation** (``"a"`` and ``"a "``) are
  refused: they are either one person (and would be protected as two) or two people named ambiguously; the
  fix (strip and normalise the column, or rename one of them) states which.

Every refusal names the column, the first offending row, how many rows offend, and the fix. Nothing of the ids
leaves the process: messages show the offending *value* only for missing ids (which carry no identity).
"""

from __future__ import annotations

import math
import sys
import unicodedata
from typing import Any

__all__ = ["PrivacyUnitError", "checked_user_ids", "read_user_ids"]


class PrivacyUnitError(ValueError):
    """A privacy-unit declaration that is missing, inconsistent, or not honoured by the batch (re-exported by
    :mod:`hf_dpfilter.data.units`; defined here, the lowest module that raises it)."""


def read_user_ids(dataset: Any, column: str) -> list:
    """The raw values of ``column``, one per example (a ``datasets.Dataset`` column or each item's key)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):  # datasets.Dataset: read the column without decoding the other ones
        if column not in names:
            raise PrivacyUnitError(
                f"user_id_column={column!r} is not a column of the training set (columns: {names}). Name the "
                "column that holds each example's user."
            )
        return list(dataset[column])
    values = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict) or column not in item:
            keys = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise PrivacyUnitError(
                f"user_id_column={column!r} is not in example {i} of the training set (keys: {keys}). Every "
                "example must carry its user under that key."
            )
        values.append(item[column])
    return values


def _plain(value: Any) -> Any:
    """A torch tensor or NumPy value as the Python value it holds (a 0-d one as a scalar, else a tuple)."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 or value.numel() == 1 else tuple(value.flatten().tolist())
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        array = numpy.asarray(value)
        return array.item() if array.size == 1 else tuple(array.flatten().tolist())
    return value


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    pandas = sys.modules.get("pandas")  # only if the user's code imported it: a pandas NA then may appear
    if pandas is not None and (value is pandas.NA or value is pandas.NaT):
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, complex) and (math.isnan(value.real) or math.isnan(value.imag)):
        return True
    if isinstance(value, tuple):
        return any(_is_missing(v) for v in value)
    return isinstance(value, str) and not value.strip()


def _kind(value: Any) -> str:
    if isinstance(value, bool):  # before int: True == 1 in Python, so they would be one user
        return "bool"
    if isinstance(value, int):
        return "int"
    return type(value).__name__


def _rows(rows: list[int]) -> str:
    return f"row {rows[0]}" + (f" (and {len(rows) - 1} more)" if len(rows) > 1 else "")


def checked_user_ids(values: list, column: str) -> list:
    """The ids as plain hashable Python values, in row order; refuses missing, mixed-type or ambiguous ids."""
    ids = [_plain(v) for v in values]
    missing = [i for i, v in enumerate(ids) if _is_missing(v)]
    if missing:
        raise PrivacyUnitError(
            f"user_id_column={column!r} has no user for {len(missing)} example(s), first at row {missing[0]} "
            f"(value {ids[missing[0]]!r}): None, NaN and empty or whitespace-only ids name nobody, and each "
            "NaN row would count as a user of its own. Fill the column with each example's user, or drop "
            "those rows before creating the DPTrainer."
        )
    kinds: dict[str, list[int]] = {}
    for i, value in enumerate(ids):
        kinds.setdefault(_kind(value), []).append(i)
    if len(kinds) > 1:
        first, *others = sorted(kinds.items(), key=lambda item: -len(item[1]))
        found = ", ".join(f"{kind} ({len(rows)} rows, first at row {rows[0]})" for kind,
                          rows in kinds.items())
        odd = sorted(i for _, rows in others for i in rows)
        raise PrivacyUnitError(
            f"user_id_column={column!r} mixes id types: {found}. The {len(odd)} example(s) whose id is not a "
            f"{first[0]}, first at row {odd[0]}, are ambiguous: 1 and '1' would be two users, 1 and True "
            "one. Cast the column to one type (e.g. dataset.map(lambda e: {col: str(e[col])})) so that equal "
            "ids name the same person."
        )
    if kinds and next(iter(kinds)) == "str":
        _refuse_near_duplicates(ids, column)
    return ids


def _refuse_near_duplicates(ids: list[str], column: str) -> None:
    """Distinct string ids equal once stripped of surrounding whitespace and NFC-normalised: refused."""
    canonical: dict[str, str] = {}
    clashes: list[int] = []
    for i, value in enumerate(ids):
        key = unicodedata.normalize("NFC", value.strip())
        if canonical.setdefault(key, value) != value:
            clashes.append(i)
    if clashes:
        raise PrivacyUnitError(
            f"user_id_column={column!r} has ids that differ only by surrounding whitespace or Unicode "
            f"normalisation (e.g. 'a' and 'a '), in {len(clashes)} example(s), first at {_rows(clashes)}: "
            "they would be different users. Strip and normalise the column (e.g. "
            "unicodedata.normalize('NFC', id.strip())) if they name one person, or rename them if they name "
            "different people."
        )
