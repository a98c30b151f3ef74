"""What DPTrainer checks when it is created and when train() starts (hf_dpfilter/run/guard.py): accumulation
set after construction, a second train(), evaluation on training data, model_init and hyperparameter_search."""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from transformers import EarlyStoppingCallback

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.run.guard import overlapping_rows
from hf_dpfilter.run.training_fields import TrainingFieldError


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False,
                noise_multiplier=1.0, per_device_train_batch_size=4, max_steps=2, accountant="rdp", dp_seed=0,
                optim="sgd", learning_rate=0.1, logging_steps=1)
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, args=None, train=None, **kw):
    return DPTrainer(model=tiny_roberta(), args=args or _args(tmp_path),
                     train_dataset=train if train is not None
                     else ListDataset(make_examples(8, VOCAB, False)),
                     data_collator=PadCollator(1), **kw)


# ---------------------------------------------------------------- item 1: the plan is what the loop uses
def test_gradient_accumulation_set_after_creation_is_refused_before_any_step(tmp_path):
    trainer = _trainer(tmp_path)
    # With max_steps, the Trainer would take 2 Poisson batches per optimizer step: one noisy step, accounted
    # once.
    trainer.args.gradient_accumulation_steps = 2
    with pytest.raises(TrainingFieldError, match=r"gradient_accumulation_steps=2 was set "
                                                 r"after.*logical_batch_size"):
        trainer.train()
    assert trainer.accountant.steps == 0 and trainer.dp_optimizer is None


def test_accelerator_accumulation_set_after_the_arguments_is_refused_at_creation(tmp_path):
    args = _args(tmp_path)
    args.accelerator_config.gradient_accumulation_kwargs = {"num_steps": 3}
    # the Trainer copies num_steps into args.gradient_accumulation_steps when it builds its accelerator
    with pytest.raises(TrainingFieldError, match=r"gradient_accumulation_steps=3 was set after"):
        _trainer(tmp_path, args=args)


def test_logical_batch_changed_after_creation_is_refused(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.args.per_device_train_batch_size = 8  # logical batch = 8 x 1 process, the plan says 4
    with pytest.raises(TrainingFieldError, match=r"logical batch is now 8 .* computed for 4"):
        trainer.train()


@pytest.mark.parametrize(("name", "value"), [("noise_multiplier", 0.1), ("per_sample_max_grad_norm", 5.0),
                                             ("logical_batch_size", 6), ("dp_seed", 1234567)])
def test_planned_dp_settings_changed_after_creation_are_refused(tmp_path, name, value):
    trainer = _trainer(tmp_path)
    setattr(trainer.args, name, value)
    with pytest.raises(TrainingFieldError, match=rf"args\.{name} was changed") as info:
        trainer.train()
    assert "1234567" not in str(info.value)  # never the seed in a message
    assert trainer.accountant.steps == 0


# ------------------------------------------------------------------------------- item 8: one run per trainer
def test_second_train_is_refused_and_the_epsilon_stays_the_planned_one(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    planned = trainer.privacy_plan.epsilon()
    assert trainer.accountant.steps == 2
    assert trainer.current_epsilon() == pytest.approx(planned)
    with pytest.raises(RuntimeError, match=r"already run on this DPTrainer and released 2 noisy steps.*new "
                                           r"DPTrainer"):
        trainer.train()
    assert trainer.accountant.steps == 2
    assert trainer.current_epsilon() == pytest.approx(planned)


def test_second_train_with_a_target_epsilon_is_refused_within_the_target(tmp_path):
    trainer = _trainer(tmp_path, args=_args(tmp_path, noise_multiplier=None, target_epsilon=3.0))
    trainer.train()
    spent = trainer.current_epsilon()
    assert spent <= 3.0
    with pytest.raises(RuntimeError, match=r"target_epsilon=3\.0"):
        trainer.train()
    assert trainer.current_epsilon() == spent


def test_train_after_a_refusal_is_allowed(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.args.gradient_accumulation_steps = 2
    with pytest.raises(TrainingFieldError):
        trainer.train()
    trainer.args.gradient_accumulation_steps = 1  # nothing was released: the run can start
    trainer.train()
    assert trainer.accountant.steps == 2


@pytest.mark.parametrize("what", ["model", "train_dataset", "compute_loss_func"])
def test_model_loss_or_training_set_replaced_after_creation_is_refused(tmp_path, what):
    """Set on the trainer after creation: a new model (the clipping engine stays on the first one; the error
    was an unclear 'Nothing was recorded'), a training set of another size (the plan's N: sample rate, delta),
    a compute_loss_func (a loss over the batch, silently replaced by the library's own)."""
    trainer = _trainer(tmp_path)
    if what == "model":
        trainer.model, match = tiny_roberta(), "trainer.model was replaced"
    elif what == "train_dataset":
        trainer.train_dataset, match = ListDataset(make_examples(80, VOCAB,
                                                                 False)), "now has 80 examples.*for 8"
    else:
        trainer.compute_loss_func, match = (lambda outputs, labels,
                                            num_items_in_batch=None: 0), "compute_loss_func"
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert trainer.accountant.steps == 0


# ------------------------------------------------------------------- item 18: model_init,
# hyperparameter_search
def test_model_init_is_refused(tmp_path):
    with pytest.raises(TrainingFieldError, match=r"model_init is not supported.*Pass model=\.\.\."):
        DPTrainer(model_init=lambda: tiny_roberta(), args=_args(tmp_path),
                  train_dataset=ListDataset(make_examples(8, VOCAB, False)), data_collator=PadCollator(1))


def test_hyperparameter_search_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hyperparameter_search is not supported by DPTrainer"):
        _trainer(tmp_path).hyperparameter_search(n_trials=2)


# ------------------------------------------------------------------------ item 14: evaluation on training
# data
def _hf_dataset(examples):
    return datasets.Dataset.from_list(
        [{"input_ids": e["input_ids"].tolist(), "labels": e["labels"], "idx": i} for i,
         e in enumerate(examples)]
    )


def test_eval_dataset_that_is_the_training_set_is_refused(tmp_path):
    train = ListDataset(make_examples(8, VOCAB, False))
    with pytest.raises(TrainingFieldError, match="eval_dataset is the training set"):
        _trainer(tmp_path, args=_args(tmp_path, eval_strategy="steps", eval_steps=1), train=train,
                 eval_dataset=train)
    hf_train = _hf_dataset(make_examples(8, VOCAB, False))
    with pytest.raises(TrainingFieldError, match=r"eval_dataset\['dev'\] is the training set"):
        _trainer(tmp_path, train=hf_train, eval_dataset={"dev": hf_train})


def test_overlapping_eval_set_cannot_drive_checkpoints_or_the_lr(tmp_path):
    examples = make_examples(12, VOCAB, False, seed=1)
    train, held_out = _hf_dataset(examples[:8]), _hf_dataset(examples[8:])
    # one training example
    overlapping = datasets.concatenate_datasets([held_out, _hf_dataset(examples[2:3])])
    assert overlapping_rows(train, held_out) == 0 and overlapping_rows(train, overlapping) == 1
    driven = [
        dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
             load_best_model_at_end=True),
        dict(eval_strategy="steps", eval_steps=1, save_strategy="best", metric_for_best_model="loss"),
        dict(eval_strategy="steps", eval_steps=1, lr_scheduler_type="reduce_lr_on_plateau"),
    ]
    for kw in driven:
        with pytest.raises(TrainingFieldError, match="dp_eval_disjoint_from_train=True"):
            _args(tmp_path, **kw)  # without the declaration: refused at the arguments
        args = _args(tmp_path, dp_eval_disjoint_from_train=True, **kw)
        with pytest.raises(TrainingFieldError, match=r"shares at least one identical row"):
            _trainer(tmp_path, args=args, train=train, eval_dataset=overlapping)
        _trainer(tmp_path, args=args, train=train, eval_dataset=held_out)  # a held-out split is allowed


def test_early_stopping_needs_the_declaration(tmp_path):
    examples = make_examples(12, VOCAB, False, seed=1)
    train, held_out = _hf_dataset(examples[:8]), _hf_dataset(examples[8:])
    trainer = _trainer(tmp_path, args=_args(tmp_path, eval_strategy="steps", eval_steps=1), train=train,
                       eval_dataset=held_out)
    trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=1))
    with pytest.raises(TrainingFieldError, match=r"EarlyStoppingCallback.*dp_eval_disjoint_from_train=True"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_plain_evaluation_of_a_held_out_set_is_allowed(tmp_path):
    examples = make_examples(12, VOCAB, False, seed=1)
    pad = PadCollator(1)
    trainer = DPTrainer(model=tiny_roberta(), args=_args(tmp_path, eval_strategy="steps", eval_steps=1),
                        train_dataset=_hf_dataset(examples[:8]), eval_dataset=_hf_dataset(examples[8:]),
                        data_collator=lambda rows: pad([{**r, "input_ids": torch.tensor(r["input_ids"])}
                                                        for r in rows]))
    trainer.train()
    assert any("eval_loss" in entry for entry in trainer.state.log_history)
