"""Targets that the classification head cannot learn from are refused when train() starts, before any step,
by hf_dpfilter's DataShapeError naming the column and the fix; the fix, applied, trains.

Before: float labels 0.0/1.0 for a 2-class head failed inside the first step with torch's "Target size
(torch.Size([1])) must be the same as input size (torch.Size([1, 2]))" (transformers reads float labels with
num_labels > 1 as multi-label targets); a multi-hot vector for a single-label head with "Expected input
batch_size (1) to match target batch_size (3)"; a target column named ``sentiment`` was dropped by
remove_unused_columns and the step said "needs `labels` in every batch", with no word of the column.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import ListDataset, PadCollator
from models import tiny_bert, tiny_tokenizer
from transformers import DataCollatorWithPadding

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.data.row_checks import DataShapeError

IDS = [[1, 5 + i, 2] for i in range(4)]


def _train(tmp_path, rows, model=None, collator=None) -> DPTrainer:
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=2,
                               per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                               save_strategy="no", dp_seed=0)
    trainer = DPTrainer(model=model or tiny_bert(), args=args, train_dataset=rows,
                        data_collator=collator or DataCollatorWithPadding(tiny_tokenizer()))
    trainer.train()
    return trainer


def _refused(tmp_path, rows, model=None, match: str = "") -> None:
    with pytest.raises(DataShapeError, match=match):
        _train(tmp_path / "refused", rows, model)


def _multi_label_head(num_labels: int = 3, problem_type: str | None = "multi_label_classification"):
    model = tiny_bert(num_labels=num_labels)
    model.config.problem_type = problem_type
    return model


# ------------------------------------------------------------------------------------ float class ids
def test_float_labels_for_a_two_class_head_are_refused_with_the_int_cast(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "label": [0.0, 1.0, 1.0, 0.0]})
    _refused(tmp_path, rows, match=r"'label' are floats.*num_labels=2.*"
                                   r"cast_column\('label', datasets.Value\('int64'\)\)")
    fixed = rows.cast_column("label", datasets.Value("int64"))
    assert _train(tmp_path / "cast", fixed).accountant.steps == 1
    # the other fix it names: a score to regress on, num_labels=1
    assert _train(tmp_path / "regression", rows, tiny_bert(num_labels=1)).accountant.steps == 1


def test_float_labels_in_a_list_of_rows_are_refused_with_the_column(tmp_path):
    rows = [{"input_ids": ids, "labels": float(i % 2)} for i, ids in enumerate(IDS)]
    _refused(tmp_path, ListDataset(rows), match=r"'labels' are floats.*int\(r\['labels'\]\)")
    fixed = [{**r, "labels": int(r["labels"])} for r in rows]
    _train(tmp_path / "cast", ListDataset(fixed))


# ------------------------------------------------------------------------- a target under another name
def test_a_target_column_under_another_name_is_refused_with_the_rename(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "sentiment": [0, 1, 1, 0]})
    _refused(tmp_path, rows, match=r"no labels.*'sentiment'.*rename_column\('sentiment', 'labels'\)")
    assert _train(tmp_path / "renamed", rows.rename_column("sentiment", "labels")).accountant.steps == 1


def test_rows_without_any_target_are_refused_before_any_step(tmp_path):
    rows = ListDataset([{"input_ids": ids} for ids in IDS])
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=2,
                               per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                               save_strategy="no")
    trainer = DPTrainer(model=tiny_bert(), args=args, train_dataset=rows,
                        data_collator=DataCollatorWithPadding(tiny_tokenizer()))
    with pytest.raises(DataShapeError, match=r"no labels \(columns: \['input_ids'\]\).*as 'labels'"):
        trainer.train()
    assert trainer.accountant.steps == 0


# ------------------------------------------------------------------ a multi-label target, the wrong head
def test_a_multi_hot_vector_for_a_single_label_head_is_refused_with_the_problem_type(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "labels": [[0.0, 1.0, 1.0]] * 4})
    _refused(tmp_path, rows, _multi_label_head(problem_type="single_label_classification"),
             match=r"'labels' hold 3 values per row.*problem_type = 'multi_label_classification'")
    assert _train(tmp_path / "fixed", rows, _multi_label_head()).accountant.steps == 1


def test_an_int_multi_hot_vector_is_refused_with_the_float_cast(tmp_path):
    """Int vectors and problem_type None: transformers (and the per-example loss) read one class id."""
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "labels": [[0, 1, 1]] * 4})
    _refused(tmp_path, rows, _multi_label_head(problem_type=None),
             match=r"'labels' hold 3 values per row.*float\(v\) for v in r\['labels'\]")
    fixed = rows.map(lambda r: {"labels": [float(v) for v in r["labels"]]})
    assert _train(tmp_path / "fixed", fixed, _multi_label_head()).accountant.steps == 1


def test_a_multi_hot_vector_of_another_width_than_the_head_is_refused(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "labels": [[0.0, 1.0, 1.0, 0.0]] * 4})
    _refused(tmp_path, rows, _multi_label_head(num_labels=3), match=r"4 values per row.*num_labels=4")
    _train(tmp_path / "fixed", rows, _multi_label_head(num_labels=4))


def test_one_class_id_for_a_multi_label_head_is_refused(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": IDS, "label": [0, 2, 1, 0]})
    _refused(tmp_path, rows, _multi_label_head(),
             match=r"'label' hold one value per row.*problem_type = 'single_label_classification'")
    _train(tmp_path / "fixed", rows, _multi_label_head(problem_type="single_label_classification"))


def test_a_custom_collator_keeps_its_own_targets(tmp_path):
    """A collator of the user's own may map the rows itself (here: float ids to ints): not refused."""

    class IntLabels(PadCollator):
        def __call__(self, rows):
            return super().__call__([{"input_ids": torch.tensor(r["input_ids"]), "labels": int(r["labels"])}
                                     for r in rows])

    rows = [{"input_ids": ids, "labels": float(i % 2)} for i, ids in enumerate(IDS)]
    _train(tmp_path, ListDataset(rows), collator=IntLabels(0))
