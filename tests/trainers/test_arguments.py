"""Every refused configuration raises a clear error (docs/configuration.md lists them all).

Complements tests/proofs/test_validators.py (epsilon/delta/sample-rate/both-or-neither/negative
noise/fp16/gradient accumulation conflict/unknown method or clipping/unsupported layer/half-precision
parameters/hidden parameter use), which are not repeated here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from transformers import TrainingArguments

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine, make_dp_optimizer


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False)
    base.update(kw)
    return DPTrainingArguments(**base)


ARGUMENT_ERRORS = [
    (dict(noise_multiplier=1.0, gradient_checkpointing=True,
          gradient_checkpointing_kwargs={"use_reentrant": True}),
     "use_reentrant=True is not supported"),
    (dict(noise_multiplier=1.0, activation_checkpointing=True,
          activation_checkpointing_kwargs={"preserve_rng_state": True}),
     "use_reentrant=True is not supported"),
    (dict(noise_multiplier=1.0, accountant="moments"), "accountant must be one of"),
    (dict(noise_multiplier=1.0, per_sample_max_grad_norm=0.0), "per_sample_max_grad_norm must be > 0"),
    (dict(noise_multiplier=1.0, per_sample_max_grad_norm=-1.0), "per_sample_max_grad_norm must be > 0"),
    (dict(noise_multiplier=1.0, logical_batch_size=0), "logical_batch_size must be >= 1"),
    (dict(target_epsilon=float("inf")), "target_epsilon must be a positive finite number"),
    (dict(noise_multiplier=1.0, target_delta=1.5), r"target_delta must be in \(0, 1/N\)"),
    (dict(noise_multiplier=1.0, target_delta=0.0), r"target_delta must be in \(0, 1/N\)"),
]


@pytest.mark.parametrize(("kwargs", "message"), ARGUMENT_ERRORS, ids=[m for _, m in ARGUMENT_ERRORS])
def test_refused_training_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **kwargs)


def test_dp_method_none_needs_no_privacy_parameters(tmp_path):
    assert _args(tmp_path, dp_method="none").dp_method == "none"


def _trainer(tmp_path, dataset=None, args=None):
    return DPTrainer(
        model=tiny_roberta(),
        args=args or _args(tmp_path, noise_multiplier=1.0),
        train_dataset=dataset if dataset is not None else ListDataset(make_examples(8, VOCAB, False)),
        data_collator=PadCollator(1),
    )


def test_empty_training_set(tmp_path):
    with pytest.raises(ValueError, match="The training set is empty"):
        _trainer(tmp_path, dataset=ListDataset([]))


def test_training_set_without_length(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from make_examples(4, VOCAB, False)

    with pytest.raises(ValueError, match="train_dataset with a length"):
        _trainer(tmp_path, dataset=Stream(), args=_args(tmp_path, noise_multiplier=1.0, max_steps=2))


def test_plain_training_arguments_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="DPTrainer needs DPTrainingArguments"):
        DPTrainer(model=tiny_roberta(), args=args, train_dataset=ListDataset(make_examples(8, VOCAB, False)))


def test_batch_without_labels(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.create_optimizer()
    with pytest.raises(ValueError, match="needs `labels` in every batch"):
        trainer.training_step(trainer.model, {"input_ids": torch.ones(2, 3, dtype=torch.long)})


def test_changing_max_steps_after_creation(tmp_path):
    trainer = _trainer(tmp_path, args=_args(tmp_path, noise_multiplier=1.0, max_steps=2, accountant="rdp"))
    trainer.args.max_steps = 5
    with pytest.raises(RuntimeError, match="noise was calibrated for 2"):
        trainer.train()


# ------------------------------------------------------------------------------- the optimizer factory
def _opt(**kw):
    base = dict(lr=0.1, noise_multiplier=1.0, per_sample_max_grad_norm=1.0, expected_batch_size=4)
    base.update(kw)
    return make_dp_optimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD, **base)


OPTIMIZER_ERRORS = [
    (dict(noise_multiplier=-1.0), "noise_multiplier must be >= 0"),
    (dict(per_sample_max_grad_norm=0.0),
     r"per_sample_max_grad_norm must be > 0, got 0.0: it is the per-example clipping norm C"),
    (dict(max_grad_norm=1.0), r"make_dp_optimizer: 'max_grad_norm' was renamed 'per_sample_max_grad_norm'"),
    (dict(expected_batch_size=0), "expected_batch_size must be > 0"),
    (dict(clipping_fn="soft"), "clipping_fn must be one of"),
    (dict(target_epsilon=1.0), "Give both target_epsilon and target_delta"),
    (dict(method="dp-fancy"), "Unknown dp_method 'dp-fancy'"),
]


@pytest.mark.parametrize(("kwargs", "message"), OPTIMIZER_ERRORS, ids=[m for _, m in OPTIMIZER_ERRORS])
def test_refused_optimizer_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _opt(**kwargs)


def test_base_optimizer_instance_with_settings():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="base is an optimizer instance"):
        make_dp_optimizer(None, torch.optim.SGD([p], lr=0.1), lr=0.2, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                          expected_batch_size=4)


def test_base_is_not_an_optimizer():
    with pytest.raises(TypeError, match="base must be a torch.optim.Optimizer"):
        make_dp_optimizer([torch.nn.Parameter(torch.zeros(2))], base=object, noise_multiplier=1.0,
                          per_sample_max_grad_norm=1.0,
                          expected_batch_size=4)


def test_loading_a_non_dp_optimizer_state():
    with pytest.raises(ValueError, match="not a DPOptimizer state dict"):
        _opt().load_state_dict(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1).state_dict())


def test_loading_another_methods_state():
    state = _opt().state_dict()
    state["dp"]["method"] = "disk"
    with pytest.raises(ValueError, match="written by method 'disk'"):
        _opt().load_state_dict(state)


# ---------------------------------------------------------------------------------------- the engine
def _engine():
    model = torch.nn.Linear(3, 2).double()
    return model, GhostClippingEngine(model, verify_first_backward=False)


def test_per_example_loss_must_be_a_vector():
    model, engine = _engine()
    with engine.record(batch_size=4):
        out = model(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"per_example_loss must have shape \(batch,\)"):
        engine.per_example_gradients(out.sum())


def test_loss_batch_differs_from_recorded_batch():
    model, engine = _engine()
    with engine.record(batch_size=4):
        out = model(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="recorded batch has 4"):
        engine.per_example_gradients(out.sum(dim=1)[:3])


def test_nothing_recorded():
    model, engine = _engine()
    out = model(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="Nothing was recorded"):
        engine.per_example_gradients(out.sum(dim=1))


def test_not_batch_first():
    model, engine = _engine()
    with pytest.raises(RuntimeError, match="batch-first"):
        with engine.record(batch_size=4):
            model(torch.randn(5, 3, dtype=torch.float64))


def test_model_without_trainable_parameters():
    model = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        GhostClippingEngine(model)
