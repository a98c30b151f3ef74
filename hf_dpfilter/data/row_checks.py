"""Training rows that cannot be model inputs, refused with the fix before the collator's own error.

A row whose labels are strings, or whose text was never tokenized, otherwise fails deep inside one of
transformers' collators ("activate truncation and/or padding", "supply an encoding ... input_ids") with no
word of the data set's column. With those collators, each row of every logical batch is checked (a few
dictionary reads per row).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DataShapeError", "check_training_columns", "check_training_rows", "collator_reads_model_inputs"]

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
