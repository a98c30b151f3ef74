"""The run attacked through the public API (issue 29): hooks registered while a forward runs, evaluation sets that
repeat training rows in another form, what a run writes to the files a user publishes.

Each test is a way in that failed before its fix, or one no other test covers; the negative controls train.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.eval_overlap import overlapping_rows
from hf_dpfilter.proofs.hooks import GradientHookError
from hf_dpfilter.training_fields import TrainingFieldError


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=6, per_device_train_batch_size=6, max_steps=2, optim="sgd", learning_rate=0.5,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0, logging_steps=1,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, model=None, train=None, **kw):
    args_kw = {k: kw.pop(k) for k in list(kw) if k not in ("eval_dataset", "callbacks")}
    return DPTrainer(model=model if model is not None else tiny_bert(dtype=torch.float32),
                     args=_args(tmp_path, **args_kw),
                     train_dataset=train if train is not None else ListDataset(make_examples(6, VOCAB, False)),
                     data_collator=PadCollator(0), **kw)


# ------------------------------------------------------------------ hooks registered while a forward runs
@pytest.mark.parametrize("kind", ["parameter", "module"])
def test_gradient_hook_registered_inside_a_forward_is_refused_before_any_backward(tmp_path, kind):
    """A forward hook that hooks a gradient while the first forward runs: the check before the step saw no hook,
    and the first backward (the engine's check, the first-step check) reached the parameter unclipped, one example
    at a time (old code: 5 gradients seen, step 1 released, refused only at step 2)."""
    model = tiny_bert(dtype=torch.float32)
    seen = []

    def register(module, inputs, output):
        if kind == "parameter" and not model.classifier.weight._backward_hooks:
            model.classifier.weight.register_hook(lambda grad: seen.append(grad.clone()))
        if kind == "module" and not model.classifier._backward_hooks:
            model.classifier.register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].clone()))

    model.bert.embeddings.register_forward_hook(register)  # before the head runs: a hook on it takes this forward
    trainer = _trainer(tmp_path, model=model)
    with pytest.raises(GradientHookError, match="classifier"):
        trainer.train()
    assert seen == [] and trainer.accountant.steps == 0


# ------------------------------------------------------------------ evaluation on training rows, padded again
def _padded(examples, length=12, left=False):
    rows = []
    for e in examples:
        ids, pad = e["input_ids"].tolist(), length - len(e["input_ids"])
        mask = [0] * pad + [1] * len(ids) if left else [1] * len(ids) + [0] * pad
        rows.append({"input_ids": [0] * pad + ids if left else ids + [0] * pad, "attention_mask": mask,
                     "labels": e["labels"]})
    return rows


@pytest.mark.parametrize("form", ["datasets-right", "datasets-left", "torch-right"])
def test_training_rows_tokenized_again_with_padding_are_refused(tmp_path, form):
    """The training rows tokenized again with ``padding="max_length"`` (the masked tokens, the loss and metrics
    are the training rows'): old code compared the padded ``input_ids`` and evaluated them as a held-out set."""
    examples = make_examples(6, VOCAB, False)
    train = datasets.Dataset.from_list([{"input_ids": e["input_ids"].tolist(), "labels": e["labels"]} for e in examples])
    rows = _padded(examples[4:5], left=form.endswith("left"))
    if form.startswith("torch"):
        rows = ListDataset([{**r, "input_ids": torch.tensor(r["input_ids"])} for r in rows])
    held_out = _padded(make_examples(3, VOCAB, False, seed=7))
    trainer = _trainer(tmp_path, train=train)
    assert overlapping_rows(train, rows if form.startswith("torch") else datasets.Dataset.from_list(rows)) == 1
    with pytest.raises(TrainingFieldError, match="shares at least one identical row"):
        trainer.evaluate(rows if form.startswith("torch") else datasets.Dataset.from_list(rows))
    # negative control: a padded held-out set shares no row and is compared, not refused
    assert overlapping_rows(train, datasets.Dataset.from_list(held_out)) == 0
    trainer._run_guard.check_eval_set(trainer, datasets.Dataset.from_list(held_out), "held-out")
