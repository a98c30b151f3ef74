"""Training rows that cannot be model inputs, refused with the fix before the collator's own error.

A row whose labels are strings, or whose text was never tokenized, otherwise fails deep inside one of
transformers' collators ("activate truncation and/or padding", "supply an encoding ... input_ids") with no
word of the data set's column. With those collators, each row of every logical batch is checked (a few
dictionary reads per row).

:func:`check_labels_fit_the_head` refuses, before training, targets that the classification head's
per-example loss (:mod:`hf_dpfilter.losses.tasks`, which follows ``config.problem_type`` as transformers
does) cannot read: float labels for a head of several classes (read as multi-label targets: a shape error
inside the first step), a multi-hot vector for a single-label head or of another width than ``num_labels``,
one class id per row for a multi-label head, and a training set without any label column (the target under
another name, ``sentiment``, which ``remove_unused_columns`` drops without a word).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DataShapeError", "check_labels_fit_the_head", "check_training_columns", "check_training_rows",
           "collator_reads_model_inputs"]

#: keys that carry a model's inputs once a row is tokenized (or an encoder's features)
MODEL_INPUT_KEYS = ("input_ids", "inputs_embeds", "input_features", "input_values", "pixel_values")
LABEL_KEYS = ("label", "labels", "label_ids")


class DataShapeError(ValueError):
    """A training row that no collator can turn into model inputs."""


def collator_reads_model_inputs(collator: Any) -> bool:
    """Whether ``collator`` is one of transformers' own, which read tokenized rows with class ids (a custom
    collator may tokenize the text or map the labels itself: its rows are not checked here)."""
    from transformers import default_data_collator

    return collator is default_data_collator or type(collator).__module__.startswith("transformers.")


def _string_labels(key: str) -> DataShapeError:
    return DataShapeError(
        f"The training rows' {key!r} are strings: the model needs class ids. Map them first, "
        f"e.g. dataset = dataset.class_encode_column({key!r}), or dataset.map(lambda r: "
        f"{{{key!r}: label2id[r[{key!r}]]}}) with the label2id of the model's config.")


def _untokenized(column: str) -> DataShapeError:
    return DataShapeError(
        f"The training rows hold text that was never tokenized (column {column!r}, no "
        f"input_ids): tokenize the data set first, e.g. dataset = dataset.map(lambda r: "
        f"tokenizer(r[{column!r}], truncation=True), remove_columns=[{column!r}]).")


def check_training_rows(rows: Iterable[Any]) -> None:
    """Refuse rows with string labels or untokenized text, naming the column and the fix.

    Args:
        rows: the data set's rows (mappings; other rows are the collator's business).
    """
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        for key in LABEL_KEYS:
            value = row.get(key)
            if isinstance(value, str) or (isinstance(value, (list, tuple)) and value
                                          and all(isinstance(v, str) for v in value)):
                raise _string_labels(key)
        if not any(key in row for key in MODEL_INPUT_KEYS):
            text = [key for key, value in row.items() if isinstance(value, str)]
            if text:
                raise _untokenized(text[0])


def check_training_columns(dataset: Any) -> None:
    """The same refusals from a ``datasets.Dataset``'s declared column types, for every row at once before
    training (no row is read).

    Args:
        dataset: the training set; anything without ``features`` is left to :func:`check_training_rows`.
    """
    features = getattr(dataset, "features", None)
    if not isinstance(features, Mapping):
        return

    def is_text(feature: Any) -> bool:
        return getattr(feature, "dtype", None) in ("string", "large_string")

    for key in LABEL_KEYS:
        if key in features and (is_text(features[key]) or is_text(getattr(features[key], "feature", None))):
            raise _string_labels(key)
    if not any(key in features for key in MODEL_INPUT_KEYS):
        text = [key for key, feature in features.items() if is_text(feature)]
        if text:
            raise _untokenized(text[0])


#: the columns of tokenized rows that are inputs, never a target under another name
_INPUT_COLUMNS = frozenset(MODEL_INPUT_KEYS) | {"attention_mask", "token_type_ids", "position_ids",
                                                "special_tokens_mask", "length", "idx", "id"}


def _classification_head(model: Any) -> str | None:
    """``"sequence"`` or ``"token"`` for transformers' classification heads (under PEFT too), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name.endswith("ForSequenceClassification"):
        return "sequence"
    if name.endswith("ForTokenClassification"):
        return "token"
    return None


def _shape_of(value: Any) -> tuple[str, int | None] | None:
    """(``"int"``/``"float"``, the vector's length or None for a scalar) of a label value; None otherwise."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # a tensor or an array (a 0-d one becomes its number)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return "int", None
    if isinstance(value, float):
        return "float", None
    numbers = isinstance(value, (list, tuple)) and value and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if numbers:
        return ("float" if any(isinstance(v, float) for v in value) else "int"), len(value)
    return None


def _head_mismatch(key: str, kind: str, length: int | None, num_labels: int,
                   problem_type: str | None) -> str | None:
    """Why labels of this kind and shape do not fit a sequence head of ``num_labels`` (None: they fit)."""
    head = f"the model's head has num_labels={num_labels} (config.problem_type={problem_type!r})"
    if length is None:
        if problem_type == "multi_label_classification":
            return (f"The training rows' {key!r} hold one value per row, but {head}, which needs a multi-hot "
                    f"vector of {num_labels} floats per row. For one class id per row, set "
                    "model.config.problem_type = 'single_label_classification' (and give int labels).")
        if kind == "float" and num_labels > 1 and problem_type in (None, "single_label_classification"):
            return (f"The training rows' {key!r} are floats, but {head}: a class id must be an int "
                    "(transformers reads float labels with num_labels > 1 as multi-label targets). Cast "
                    f"them, e.g. dataset = dataset.cast_column({key!r}, datasets.Value('int64')), or "
                    f"dataset.map(lambda r: {{{key!r}: int(r[{key!r}])}}); for a score to regress on, build "
                    "the model with num_labels=1.")
        return None
    if num_labels == 1 or problem_type == "regression":
        return (f"The training rows' {key!r} hold {length} values per row, but {head}, a regression on one "
                f"value per row. For a multi-label target, build the model with num_labels={length} and "
                "problem_type='multi_label_classification'.")
    if problem_type == "single_label_classification" or (problem_type is None and kind == "int"):
        return (f"The training rows' {key!r} hold {length} values per row (a multi-label target), but "
                f"{head}, a single-label head that needs one class id per row. For a multi-hot target, set "
                "model.config.problem_type = 'multi_label_classification' with float labels, e.g. "
                f"dataset.map(lambda r: {{{key!r}: [float(v) for v in r[{key!r}]]}}).")
    if length != num_labels:
        return (f"The training rows' {key!r} hold {length} values per row, but {head}: a multi-hot target "
                f"needs one value per class. Build the model with num_labels={length}, or fix the vectors.")
    return None


def check_labels_fit_the_head(model: Any, rows: Iterable[Any], label_names: Iterable[str] = ()) -> None:
    """Refuse, before training, labels that the model's classification head cannot learn from (see the module
    docstring), naming the column and the fix. Other models (causal LMs, whose collators may build the
    labels, QA, a model of the user's own) are left alone.

    Args:
        model: the model to train (a PEFT model is read through its base model).
        rows: a few rows of the training set as the user gave them (before unused columns are removed).
        label_names: the Trainer's ``label_names`` (columns that are targets besides ``label``/``labels``).
    """
    head = _classification_head(model)
    config = getattr(model, "config", None)
    if head is None or config is None:
        return
    known = set(LABEL_KEYS) | set(label_names)
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        keys = [k for k in known if k in row]
        if not keys:
            others = [k for k in row if k not in _INPUT_COLUMNS]
            if others:
                fix = (f"The column {others[0]!r} looks like it: rename it, e.g. dataset = "
                       f"dataset.rename_column({others[0]!r}, 'labels') (a list of rows: row['labels'] = "
                       f"row.pop({others[0]!r}))")
            else:
                fix = "Add each row's class id as 'labels'"
            raise DataShapeError(
                f"The training rows have no labels (columns: {sorted(row)}): the {type(model).__name__} "
                f"head has no target, and remove_unused_columns drops a target under another name. {fix}.")
        if head != "sequence":
            continue
        for key in keys:
            shape = _shape_of(row[key])
            if shape is not None:
                problem = _head_mismatch(key, shape[0], shape[1], int(config.num_labels),
                                         getattr(config, "problem_type", None))
                if problem is not None:
                    raise DataShapeError(problem)
