"""Acceptance 4 of the core: each impossible or meaningless input raises a clear error (one test each)."""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine, UnsupportedLayerError


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False)
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, n=10, **kw):
    return DPTrainer(
        model=tiny_roberta(),
        args=_args(tmp_path, **kw),
        train_dataset=ListDataset(make_examples(n, VOCAB, causal=False)),
        data_collator=PadCollator(1),
    )


def test_epsilon_not_positive(tmp_path):
    with pytest.raises(ValueError, match="target_epsilon must be a positive"):
        _args(tmp_path, target_epsilon=0.0)
    with pytest.raises(ValueError, match="target_epsilon must be a positive"):
        _args(tmp_path, target_epsilon=-1.0)


def test_delta_at_least_one_over_n(tmp_path):
    with pytest.raises(ValueError, match=r"delta .*1/N"):
        _trainer(tmp_path, n=10, target_epsilon=1.0, target_delta=0.2)


def test_sample_rate_above_one(tmp_path):
    with pytest.raises(ValueError, match="larger than the training set"):
        _trainer(tmp_path, n=10, target_epsilon=1.0, logical_batch_size=11)


def test_both_epsilon_and_noise_multiplier(tmp_path):
    with pytest.raises(ValueError, match=r"exactly one of target_epsilon and noise_multiplier \(both"):
        _args(tmp_path, target_epsilon=1.0, noise_multiplier=1.0)


def test_neither_epsilon_nor_noise_multiplier(tmp_path):
    with pytest.raises(ValueError, match=r"exactly one of target_epsilon and noise_multiplier \(neither"):
        _args(tmp_path)


def test_negative_noise_multiplier(tmp_path):
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        _args(tmp_path, noise_multiplier=-0.5)


def test_fp16_refused_with_a_method_whose_state_follows_every_step(tmp_path):
    # fp16 itself is supported (the DP loss scaler, tests/trainers/test_loss_scaling.py); not with DiSK
    with pytest.raises(ValueError, match="fp16=True is supported with dp_method in"):
        _args(tmp_path, noise_multiplier=1.0, fp16=True, dp_method="disk")


def test_gradient_accumulation_conflicting_with_logical_batch(tmp_path):
    with pytest.raises(ValueError, match="conflicts with logical_batch_size"):
        _args(tmp_path, noise_multiplier=1.0, gradient_accumulation_steps=2, per_device_train_batch_size=4,
              logical_batch_size=64)


def test_gradient_accumulation_is_translated(tmp_path):
    args = _args(tmp_path, noise_multiplier=1.0, gradient_accumulation_steps=4, per_device_train_batch_size=8)
    assert args.logical_batch_size == 32 and args.gradient_accumulation_steps == 1


def test_unknown_method_and_clipping(tmp_path):
    with pytest.raises(ValueError, match="dp_method must be one of"):
        _args(tmp_path, noise_multiplier=1.0, dp_method="dp-fancy")
    with pytest.raises(ValueError, match="clipping_fn must be one of"):
        _args(tmp_path, noise_multiplier=1.0, clipping_fn="soft")


def test_unsupported_trainable_layer_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(UnsupportedLayerError, match=r"'1\.weight'.*torch\.nn\.modules\.conv\.Conv1d.*Freeze "
                                                    r"it"):
        GhostClippingEngine(model)
    model[1].requires_grad_(False)  # frozen: fine, and costs nothing
    GhostClippingEngine(model)


def test_half_precision_trainable_parameters_refused():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 autocast"):
        GhostClippingEngine(model)


def test_parameter_used_outside_its_module_is_detected():
    class Sneaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            # uses the weight directly, bypassing the module's forward: invisible to the hooks
            return self.lin(x) + x[:, :2] @ self.lin.weight[:, :2]

    model = Sneaky().double()
    engine = GhostClippingEngine(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    with engine.record(batch_size=4):
        losses = model(x).pow(2).sum(dim=1)
    with pytest.raises(RuntimeError, match="do not add up to its ordinary gradient"):
        engine.per_example_gradients(losses)
