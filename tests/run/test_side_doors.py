"""Nothing noiseless leaves through the side doors.

7. ``train()``'s ``TrainOutput.training_loss`` is NaN and no ``train_loss`` is in its metrics, the saved
   metrics or ``trainer_state.json`` unless ``dp_log_nonprivate_metrics=True`` (the exact mean loss of the
   private batches).
8. Hooks that would see a gradient before the noise (a parameter's tensor or post-accumulate hook, a module
   backward hook) are refused by name when ``train()`` starts and at every step, so one added by a callback is
   refused before the step computes anything; ``WANDB_WATCH=gradients|all`` is refused. Frozen parameters and
   forward hooks train.
11. An evaluation or prediction set sharing one row with the training set (``datasets.Dataset``, a torch data
    set, mixed; DPSFTTrainer's prepared sets) is refused before anything is computed on it, unless
    ``dp_allow_eval_on_training_rows=True`` (then with a warning); a held-out split evaluates.
"""

from __future__ import annotations

import json
import math
import os

import datasets
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert
from transformers import TrainerCallback

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.hooks import GradientHookError
from hf_dpfilter.run.training_fields import TrainingFieldError

HEAD = "classifier.weight"


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=6, per_device_train_batch_size=6, max_steps=2, optim="sgd", learning_rate=0.5,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0,
        logging_steps=1,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, train=None, model=None, **kw):
    args_kw = {k: kw.pop(k) for k in list(kw) if k not in ("eval_dataset", "callbacks")}
    return DPTrainer(model=model if model is not None else tiny_bert(), args=_args(tmp_path, **args_kw),
                     train_dataset=train if train is not None
                     else ListDataset(make_examples(6, VOCAB, False)),
                     data_collator=PadCollator(0), **kw)


def _param(trainer, name=HEAD):
    return dict(trainer.model.named_parameters())[name]


# ------------------------------------------------------------------------- 7. train()'s training loss
def test_training_loss_is_nan_and_never_saved_by_default(tmp_path):
    trainer = _trainer(tmp_path)
    output = trainer.train()
    assert math.isnan(output.training_loss)  # was the exact mean loss of the private batches
    assert "train_loss" not in output.metrics and "loss" not in output.metrics
    trainer.save_metrics("train", output.metrics)  # what scripts save
    trainer.save_state()
    with open(os.path.join(tmp_path, "train_results.json")) as f:
        assert "train_loss" not in json.load(f)
    with open(os.path.join(tmp_path, "trainer_state.json")) as f:
        state = json.load(f)
    assert not any({"loss", "train_loss"} & set(entry) for entry in state["log_history"])
    assert state["total_flos"] == 0


def test_training_loss_with_the_opt_in_is_the_exact_mean(tmp_path):
    trainer = _trainer(tmp_path, dp_log_nonprivate_metrics=True)
    output = trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and math.isfinite(output.training_loss)
    assert output.training_loss == pytest.approx(sum(logged) / 2, rel=1e-6)
    assert output.metrics["train_loss"] == output.training_loss


# ------------------------------------------------------------------------------- 8. gradient hooks
def _register(trainer, kind, calls):
    param = _param(trainer)
    if kind == "tensor":
        return param.register_hook(lambda grad: calls.append(grad.norm()))
    if kind == "post_accumulate":
        return param.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.norm()))
    return trainer.model.classifier.register_full_backward_hook(lambda m, gi, go: calls.append(go[0].norm()))


KINDS = {"tensor": (HEAD, "Tensor.register_hook"),
         "post_accumulate": (HEAD, "Tensor.register_post_accumulate_grad_hook"),
         "module_backward": ("classifier", "Module.register_full_backward_hook")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_gradient_hook_is_refused_by_name_before_training(tmp_path, kind):
    trainer = _trainer(tmp_path)
    calls = []
    _register(trainer, kind, calls)
    name, what = KINDS[kind]
    with pytest.raises(GradientHookError, match=rf"'{name}' \({what}: .*Remove the hook"):
        trainer.train()
    assert calls == [] and trainer.accountant.steps == 0  # the first-step check fired a tensor hook 5 times


class _HookingCallback(TrainerCallback):
    """Registers a tensor hook on the head, as wandb.watch does from WandbCallback.on_train_begin, or
    later."""

    def __init__(self, trainer, at_step: int | None) -> None:
        self.trainer, self.at_step, self.calls = trainer, at_step, []

    def _hook(self):
        _param(self.trainer).register_hook(lambda grad: self.calls.append(grad.norm()))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.at_step is None:
            self._hook()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            self._hook()


@pytest.mark.parametrize("at_step", [None, 1])
def test_a_hook_added_by_a_callback_during_training_is_refused_before_the_next_step(tmp_path, at_step):
    trainer = _trainer(tmp_path, max_steps=3)
    callback = _HookingCallback(trainer, at_step)
    trainer.add_callback(callback)
    with pytest.raises(GradientHookError, match=rf"'{HEAD}' \(Tensor.register_hook"):
        trainer.train()
    released = 0 if at_step is None else at_step
    assert callback.calls == [] and trainer.accountant.steps == released


@pytest.mark.parametrize("value", ["gradients", "all"])
def test_wandb_watch_of_gradients_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv("WANDB_WATCH", value)
    with pytest.raises(GradientHookError, match=r"WANDB_WATCH=false, or WANDB_WATCH=parameters"):
        _trainer(tmp_path)
    monkeypatch.setenv("WANDB_WATCH", "parameters")  # the released parameters are public
    _trainer(tmp_path, max_steps=1).train()


def test_frozen_parameter_forward_and_synchronisation_hooks_train(tmp_path):
    model = tiny_bert()
    frozen = model.bert.embeddings.word_embeddings.weight
    calls = []
    # never runs once frozen: no gradient reaches it
    frozen.register_hook(lambda grad: calls.append("frozen"))
    frozen.requires_grad_(False)
    model.classifier.register_forward_hook(lambda m, i, o: calls.append("forward"))
    trainer = _trainer(tmp_path, model=model)

    def synchronise(param):  # stands for DDP's or FSDP2's gradient hooks (torch.distributed), the run's own
        calls.append("synchronise")

    synchronise.__module__ = "torch.nn.parallel.distributed"
    _param(trainer).register_post_accumulate_grad_hook(synchronise)
    trainer.train()
    assert trainer.accountant.steps == 2 and calls.count("forward") > 0 and set(calls) == {"forward"}


# ------------------------------------------------------------------------ 11. evaluation on training rows
def _hf(examples, start=0):
    return datasets.Dataset.from_list(
        [{"input_ids": e["input_ids"].tolist(), "labels": e["labels"], "idx": start + i} for i,
         e in enumerate(examples)])


def _pad_lists(pad):
    return lambda rows: pad([{**r, "input_ids": torch.as_tensor(r["input_ids"])} for r in rows])


SPLITS = {  # (training set, eval set with one training row, held-out eval set)
    "datasets": lambda ex: (_hf(ex[:6]), _hf(ex[6:9] + ex[2:3], start=100), _hf(ex[6:9], start=100)),
    "torch": lambda ex: (ListDataset(ex[:6]), ListDataset(ex[6:9] + ex[2:3]), ListDataset(ex[6:9])),
    "mixed": lambda ex: (ListDataset(ex[:6]), _hf(ex[6:9] + ex[2:3], start=100), _hf(ex[6:9], start=100)),
}


@pytest.mark.parametrize("kind", list(SPLITS))
def test_an_eval_set_sharing_one_training_row_is_refused(tmp_path, kind):
    train, overlapping, held_out = SPLITS[kind](make_examples(9, VOCAB, False, seed=3))
    collator = _pad_lists(PadCollator(0))
    with pytest.raises(TrainingFieldError, match=r"eval_dataset shares at least one identical row.*held-out "
                                                 r"split"):
        DPTrainer(model=tiny_bert(), args=_args(tmp_path, eval_strategy="steps", eval_steps=1),
                  train_dataset=train,
                  eval_dataset=overlapping, data_collator=collator)
    trainer = DPTrainer(model=tiny_bert(), args=_args(tmp_path), train_dataset=train, data_collator=collator)
    for call in (trainer.evaluate, trainer.predict):  # before anything is computed on it
        with pytest.raises(TrainingFieldError, match=r"shares at least one identical row"):
            call(overlapping)
    with pytest.raises(TrainingFieldError, match=r"shares at least one identical row"):
        trainer.evaluate({"dev": overlapping, "test": held_out})
    assert math.isfinite(trainer.evaluate(held_out)["eval_loss"])  # a held-out split evaluates
    trainer.predict(held_out)


def test_the_opt_in_evaluates_training_rows_with_a_warning(tmp_path):
    train, overlapping, _ = SPLITS["datasets"](make_examples(9, VOCAB, False, seed=3))
    trainer = DPTrainer(model=tiny_bert(), args=_args(tmp_path, dp_allow_eval_on_training_rows=True),
                        train_dataset=train, data_collator=_pad_lists(PadCollator(0)))
    with pytest.warns(UserWarning, match=r"dp_allow_eval_on_training_rows=True: the evaluation set shares at "
                                         r"least one identical row"):
        metrics = trainer.evaluate(overlapping)
    assert math.isfinite(metrics["eval_loss"])


def test_an_eval_set_that_cannot_be_enumerated_needs_a_declaration(tmp_path):
    examples = make_examples(9, VOCAB, False, seed=3)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(examples[6:9])

    trainer = _trainer(tmp_path, train=ListDataset(examples[:6]))
    with pytest.raises(TrainingFieldError, match=r"cannot be compared with the training set row by row"):
        trainer.evaluate(Stream())


def test_dpsfttrainer_refuses_an_eval_set_sharing_a_conversation(tmp_path):
    pytest.importorskip("trl")
    from test_sft import chat_rows, config

    from hf_dpfilter import DPSFTTrainer
    from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama

    rows = chat_rows(8, seed=5)
    tokenizer = byte_level_chat_tokenizer()

    def make(eval_rows):
        return DPSFTTrainer(model=small_llama(tokenizer, hidden_size=16), args=config(tmp_path, 6),
                            train_dataset=datasets.Dataset.from_list(rows[:6]),
                            eval_dataset=datasets.Dataset.from_list(eval_rows), processing_class=tokenizer)

    with pytest.raises(TrainingFieldError, match=r"eval_dataset shares at least one identical row"):
        make(rows[6:] + rows[1:2])
    make(rows[6:])  # a held-out split is allowed
