"""Faults in the data get defined behaviour: NaN/inf examples are zeroed (counted, warned), one-example data
sets, all-ignored labels, over-long sequences and empty logical batches."""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_bert, tiny_gpt2, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine, make_dp_optimizer


def _args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        noise_multiplier=0.0, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
        max_steps=1, dp_seed=0, accountant="rdp",
    )
    base.update(kw)
    return DPTrainingArguments(**base)


# ------------------------------------------------------------------------------------ NaN and inf
def _linear_step(x: torch.Tensor, make_loss, warn: bool = True) -> tuple[torch.Tensor, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    opt = make_dp_optimizer(model.parameters(), torch.optim.SGD, lr=1.0, noise_multiplier=0.0,
                            per_sample_max_grad_norm=1.0,
                            expected_batch_size=1.0)
    opt.warn_nonfinite = warn  # the per-step warning is opt-in (a noiseless membership signal)
    opt.accumulate(engine, lambda values: make_loss(model(x)), batch_size=x.shape[0])
    assert all(p.grad is None for p in model.parameters())  # the clipped sum is in the optimizer's own buffer
    sums = opt._local_sums()
    return flat([sums[p] for p in model.parameters()]), opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_is_zeroed_counted_and_warned(bad):
    x = torch.randn(4, 3, dtype=torch.float64)
    clean, _ = _linear_step(x[[0, 1, 3]], lambda out: out.pow(2).sum(dim=1))
    x[2, 1] = bad
    with pytest.warns(RuntimeWarning, match="NaN or infinite"):
        got, opt = _linear_step(x, lambda out: out.pow(2).sum(dim=1))
    assert torch.isfinite(got).all()
    assert torch.allclose(got, clean, atol=1e-12)  # exactly the other examples' clipped sum
    assert opt.nonfinite_examples == 1


def test_nonfinite_examples_are_not_warned_about_by_default():
    """The count of zeroed examples is a noiseless function of the batch: no warning unless asked."""
    import warnings

    x = torch.randn(4, 3, dtype=torch.float64)
    x[2, 1] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, opt = _linear_step(x, lambda out: out.pow(2).sum(dim=1), warn=False)
    assert opt.nonfinite_examples == 1  # still counted in memory (inside the trust boundary)
    assert not make_dp_optimizer([torch.nn.Parameter(torch.zeros(1))], torch.optim.SGD, lr=1.0,
                                 noise_multiplier=0.0,
                                 per_sample_max_grad_norm=1.0, expected_batch_size=1.0).warn_nonfinite


def test_nonfinite_loss_with_finite_gradient_is_zeroed():
    x = torch.randn(3, 3, dtype=torch.float64)
    clean, _ = _linear_step(x[[0, 2]], lambda out: out.sum(dim=1))
    inf_shift = torch.tensor([0.0, float("inf"), 0.0], dtype=torch.float64)
    with pytest.warns(RuntimeWarning):
        got, opt = _linear_step(x, lambda out: out.sum(dim=1) + inf_shift)
    assert torch.allclose(got, clean, atol=1e-12)
    assert opt.nonfinite_examples == 1


def test_nan_label_in_trainer_is_zeroed_and_sensitivity_holds(tmp_path):
    """Regression with one NaN label: the update equals the run without that example (same divisor)."""
    examples = [{"input_ids": e["input_ids"], "labels": float(i) / 7} for i, e in
                enumerate(make_examples(7, VOCAB, causal=False, seed=2))]
    bad = [dict(e) for e in examples]
    bad[3]["labels"] = float("nan")

    class FloatLabels(PadCollator):
        def __call__(self, batch):
            out = super().__call__([{**e, "labels": 0} for e in batch])
            out["labels"] = torch.tensor([e["labels"] for e in batch], dtype=torch.float64)
            return out

    def run(data, sub):
        model = tiny_roberta(num_labels=1)
        before = flat([p.detach().clone() for p in model.parameters()])
        # dp_log_nonprivate_metrics: the per-step warning with the count is published only when asked
        trainer = DPTrainer(model=model,
                            args=_args(tmp_path / sub, logical_batch_size=7, per_device_train_batch_size=3,
                                                    dp_log_nonprivate_metrics=True),
                            train_dataset=ListDataset(data), data_collator=FloatLabels(1))
        trainer.train()
        return flat([p.detach() for p in model.parameters()]) - before, trainer

    with pytest.warns(RuntimeWarning, match="NaN or infinite"):
        with_nan, trainer = run(bad, "a")
    assert torch.isfinite(with_nan).all()
    assert trainer.dp_optimizer.nonfinite_examples == 1
    # Reference: the six other examples alone (divisor 6 instead of 7; noise 0, SGD lr 1).
    reference = [e for i, e in enumerate(examples) if i != 3]
    ref_model = tiny_roberta(num_labels=1)
    ref_before = flat([p.detach().clone() for p in ref_model.parameters()])
    ref_trainer = DPTrainer(model=ref_model, args=_args(tmp_path / "b", logical_batch_size=6,
                                                         per_device_train_batch_size=3),
                            train_dataset=ListDataset(reference), data_collator=FloatLabels(1))
    ref_trainer.train()
    ref_delta = flat([p.detach() for p in ref_model.parameters()]) - ref_before
    assert torch.allclose(with_nan * 7, ref_delta * 6, rtol=1e-6, atol=1e-10)


# ------------------------------------------------------------------------------------ data set edge cases
def test_one_example_dataset(tmp_path):
    examples = make_examples(1, VOCAB, causal=False)
    # The default delta N^-1.1 = 1 is meaningless for N = 1: a clear error names target_delta.
    with pytest.raises(ValueError, match="target_delta"):
        DPTrainer(model=tiny_roberta(), args=_args(tmp_path, logical_batch_size=1),
                  train_dataset=ListDataset(examples),
                  data_collator=PadCollator(1))
    trainer = DPTrainer(model=tiny_roberta(),
                        args=_args(tmp_path, logical_batch_size=1, max_steps=2, target_delta=0.5,
                                                         noise_multiplier=1.0),
                        train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    trainer.train()
    assert trainer.privacy_report()["steps"] == 2 and trainer.sample_rate == 1.0


def test_all_labels_ignored_gives_zero_loss_and_zero_update(tmp_path):
    examples = make_examples(4, VOCAB, causal=True, seed=1)
    for e in examples:
        e["labels"] = torch.full_like(e["labels"], -100)
    model = tiny_gpt2()
    before = flat([p.detach().clone() for p in model.parameters()])
    # the opt-in: without it train() returns no training loss (NaN), a noiseless statistic of the batches
    trainer = DPTrainer(model=model, args=_args(tmp_path, logical_batch_size=4, per_device_train_batch_size=2,
                                                dp_log_nonprivate_metrics=True),
                        train_dataset=ListDataset(examples), data_collator=PadCollator(0))
    out = trainer.train()
    assert out.training_loss == 0.0
    assert torch.equal(flat([p.detach() for p in model.parameters()]), before)
    assert trainer.dp_optimizer.nonfinite_examples == 0


def test_sequence_longer_than_model_maximum(tmp_path):
    examples = make_examples(3, VOCAB, causal=False, min_len=50, max_len=50)  # tiny_bert has 40 positions
    trainer = DPTrainer(model=tiny_bert(), args=_args(tmp_path, logical_batch_size=3),
                        train_dataset=ListDataset(examples), data_collator=PadCollator(0))
    with pytest.raises(ValueError,
                       match=r"length 50.*maximum of 40.*max_position_embeddings.*truncation=True"):
        trainer.train()


def test_roberta_position_offset_is_respected(tmp_path):
    # RoBERTa's positions start after the padding index: 40 embeddings allow 38 tokens.
    examples = make_examples(2, VOCAB, causal=False, min_len=39, max_len=39)
    trainer = DPTrainer(model=tiny_roberta(), args=_args(tmp_path, logical_batch_size=2),
                        train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    with pytest.raises(ValueError, match="maximum of 38"):
        trainer.train()


def test_empty_logical_batch_training_step(tmp_path):
    """An empty Poisson batch: no gradient, loss 0, and the optimizer step still adds noise and is counted."""
    examples = make_examples(5, VOCAB, causal=False)
    trainer = DPTrainer(model=tiny_roberta(),
                        args=_args(tmp_path, logical_batch_size=2, noise_multiplier=1.0),
                        train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    trainer.create_optimizer()
    empty = trainer.get_train_dataloader().collate_fn([])
    assert empty["input_ids"].shape[0] == 0
    loss = trainer.training_step(trainer.model, empty)
    assert float(loss) == 0.0
    assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.dp_optimizer._local_sums() == {}  # nothing accumulated, but the empty batch is declared
    before = flat([p.detach().clone() for p in trainer.model.parameters()])
    trainer.dp_optimizer.step()
    assert trainer.accountant.steps == 1
    assert not torch.equal(flat([p.detach() for p in trainer.model.parameters()]), before)  # noise was added


# ------------------------------------------------------------------------ rows that are not model inputs
def test_dptrainer_refuses_string_labels_before_any_collation(tmp_path):
    """Before: transformers' "activate truncation and/or padding" from inside the collator."""
    from helpers import ListDataset, PadCollator
    from models import tiny_bert, tiny_tokenizer

    from hf_dpfilter import DPTrainer, DPTrainingArguments
    from hf_dpfilter.data.row_checks import DataShapeError

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=2,
                               per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                               remove_unused_columns=False)
    from transformers import DataCollatorWithPadding

    from hf_dpfilter.data.row_checks import collator_reads_model_inputs

    rows = ListDataset([{"input_ids": [1, 5 + i, 2], "labels": "positive"} for i in range(4)])
    collator = DataCollatorWithPadding(tiny_tokenizer())
    with pytest.raises(DataShapeError, match="'labels' are strings"):
        DPTrainer(model=tiny_bert(), args=args, train_dataset=rows, data_collator=collator).train()
    # a custom collator may map labels (or tokenize) itself: its rows are its own business
    assert not collator_reads_model_inputs(PadCollator(1)) and collator_reads_model_inputs(collator)


def test_string_labels_are_refused_with_the_mapping_fix(tmp_path):
    from hf_dpfilter.data.row_checks import DataShapeError, check_training_rows

    rows = [{"input_ids": [1, 5, 2], "label": "positive"}, {"input_ids": [1, 6, 2], "label": "negative"}]
    with pytest.raises(DataShapeError, match=r"'label' are strings.*class_encode_column\('label'\)"):
        check_training_rows(rows)


def test_untokenized_text_is_refused_with_the_tokenize_fix(tmp_path):
    from hf_dpfilter.data.row_checks import DataShapeError, check_training_rows

    with pytest.raises(DataShapeError, match=r"never tokenized \(column 'sentence'.*tokenizer\(r\['sentence'\]"):
        check_training_rows([{"sentence": "a fine film", "label": 1}])
    check_training_rows([{"input_ids": [1, 2], "label": 1, "sentence": "kept beside its ids"}])  # tokenized


def test_a_datasets_column_of_text_labels_is_refused_from_its_type():
    """Before training, for every row at once: the declared column type, no row read."""
    import datasets

    from hf_dpfilter.data.row_checks import DataShapeError, check_training_columns

    labelled = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "label": ["positive"]})
    with pytest.raises(DataShapeError, match="'label' are strings"):
        check_training_columns(labelled)
    raw = datasets.Dataset.from_dict({"sentence": ["a fine film"], "label": [1]})
    with pytest.raises(DataShapeError, match="never tokenized \\(column 'sentence'"):
        check_training_columns(raw)
    check_training_columns(datasets.Dataset.from_dict({"input_ids": [[1, 2]], "label": [1]}))

