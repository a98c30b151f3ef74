"""The run attacked through the public API (issue 29): hooks registered while a forward runs, evaluation sets that
repeat training rows in another form, what a run writes to the files a user publishes.

Each test is a way in that failed before its fix, or one no other test covers; the negative controls train.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.hooks import GradientHookError


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
