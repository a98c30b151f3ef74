"""Gradient checkpointing with per-example clipping.

transformers' non-reentrant checkpointing recomputes every checkpointed layer inside the backward, and the
forward hooks fire again there. The engine records each layer call once per gradient point, so:

* one DPTrainer step with checkpointing equals the one-example-at-a-time reference (float64, noise 0);
* the parameters after a few steps equal the run without checkpointing, for GPT-2, a tiny Llama, LoRA, and
  DiSK with two gradient points per step (the second at other parameter values, recomputed at those values);
* reentrant checkpointing (which hides the layers from the hooks) is refused with a message, and a
  recomputation the engine cannot place at the right parameter values raises instead of training wrongly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, padded_batch, tiny_decoder, tiny_gpt2
from test_llama_family import assert_one_step_exact, lora_decoder
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.engine import CheckpointingError, GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss

NON_REENTRANT = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}

BUILDERS = {
    "gpt2": tiny_gpt2,
    "llama": lambda: tiny_decoder("llama"),
    "gemma": lambda: tiny_decoder("gemma"),
    "llama_lora": lambda: lora_decoder("llama"),
}


@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_step_with_checkpointing_equals_per_example_reference(name, clipping_fn, tmp_path):
    model = BUILDERS[name]()
    assert_one_step_exact(model, tmp_path, clipping_fn, **NON_REENTRANT)
    assert model.is_activation_checkpointing  # the Trainer did turn it on


def _train(model, tmp_path, checkpointing: bool, method="dpsgd", method_args=None, steps=3):
    examples = make_examples(6, VOCAB, causal=True, seed=3)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), dp_method=method, dp_method_args=method_args, noise_multiplier=0.0,
        per_sample_max_grad_norm=0.5, logical_batch_size=6, per_device_train_batch_size=2, max_steps=steps,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0, report_to=[],
        use_cpu=True,
        save_strategy="no", remove_unused_columns=False, dp_seed=0,
        **(NON_REENTRANT if checkpointing else {}),
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    trainer.train()
    return flat([p.detach() for p in model.parameters()])


CASES = [  # (model, method, method args)
    ("gpt2", "dpsgd", None),
    ("llama", "dpsgd", None),
    ("llama_lora", "dpsgd", None),
    ("llama", "disk", {"kappa": 0.7, "gamma": 0.5}),  # two points: x_t and x_t + gamma d_{t-1}
    ("llama", "disk", None),  # one point, at x_t + gamma d_{t-1} (other values than the model's)
    # the stored snapshots themselves (views) recomputed in the backward
    ("llama", "pmlf", {"k": 3, "beta": 0.9}),
]


@pytest.mark.parametrize("name,method,method_args", CASES)
def test_parameters_after_steps_equal_the_run_without_checkpointing(name, method, method_args, tmp_path):
    plain = _train(BUILDERS[name](), tmp_path / "plain", False, method, method_args)
    checkpointed = _train(BUILDERS[name](), tmp_path / "ckpt", True, method, method_args)
    initial = flat([p.detach() for p in BUILDERS[name]().parameters()])
    assert (plain - initial).norm() > 0  # it trained
    assert ((checkpointed - plain).norm() / (plain - initial).norm()).item() <= 1e-12


def _record_one_batch(model, values=None):
    engine = GhostClippingEngine(model, verify_first_backward=True)
    batch = padded_batch(3, causal=True, pad_id=0)
    recomputed = []

    def count_recomputation(module, inputs, output):
        if torch._C._current_graph_task_id() != -1:
            recomputed.append(module)

    handles = [m.register_forward_hook(count_recomputation) for m in model.modules()
               if isinstance(m, nn.Linear)]
    with engine.record(batch_size=3):
        out = engine.call_model(values, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        losses = per_example_loss(out.logits, batch["labels"], causal_lm=True)
    records = len(engine._records)
    grads = engine.per_example_gradients(losses)
    for handle in handles:
        handle.remove()
    return records, len(recomputed), grads.squared_norms()


def test_each_layer_recorded_once_per_point_although_recomputed():
    plain = tiny_decoder("llama")
    plain.train()
    checkpointed = tiny_decoder("llama")
    checkpointed.train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    records, recomputed, norms = _record_one_batch(plain)
    records_ckpt, recomputed_ckpt, norms_ckpt = _record_one_batch(checkpointed)
    assert recomputed == 0
    # The verification backward and the per-example backward each recompute both layers (up to the last saved
    # tensor: torch stops a recomputation early, here before down_proj, whose output nothing saves).
    assert recomputed_ckpt == 2 * 2 * 6
    assert records_ckpt == records
    assert torch.equal(norms_ckpt, norms)


def test_reentrant_checkpointing_is_refused():
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": True})
    model = tiny_decoder("llama")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    engine = GhostClippingEngine(model)
    with pytest.raises(CheckpointingError, match="use_reentrant"):
        with engine.record(batch_size=2):
            pass


class _SelfCheckpointed(nn.Module):
    """A model that calls torch.utils.checkpoint itself (the engine cannot reach its recomputation)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4).double()
        self.second = nn.Linear(4, 1).double()
        self.reentrant = reentrant

    def forward(self, x):
        return self.second(checkpoint(lambda h: torch.tanh(self.first(h)), x, use_reentrant=self.reentrant))


def test_unknown_checkpointing_at_other_values_raises_instead_of_training_wrongly():
    model = _SelfCheckpointed(reentrant=False)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with engine.record(batch_size=3):  # at the current values, a self-made checkpoint is fine
        out = engine.call_model(None, x)
    assert engine.per_example_gradients(out.squeeze(1)).squared_norms().shape == (3,)
    shifted = {p: p + 0.1 for p in engine.trainable_parameters}  # differentiable in p, as DiSK's point
    with engine.record(batch_size=3):
        out = engine.call_model(shifted, x)
    with pytest.raises(CheckpointingError, match="recomputed by a gradient checkpoint that the engine does "
                                                 "not know"):
        engine.per_example_gradients(out.squeeze(1))


def test_self_made_reentrant_checkpointing_raises():
    model = _SelfCheckpointed(reentrant=True)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with engine.record(batch_size=3):
        out = engine.call_model(None, x)
    with pytest.raises(CheckpointingError, match="ran without autograd inside engine.record"):
        engine.per_example_gradients(out.squeeze(1))


def _train_bf16(tmp_path, checkpointing: bool):
    model = tiny_decoder("llama", dtype=torch.float32)
    examples = make_examples(6, VOCAB, causal=True, seed=3)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=0.5, logical_batch_size=6,
        per_device_train_batch_size=2, max_steps=2, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dp_seed=0,
        bf16=True, **(NON_REENTRANT if checkpointing else {}),
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    trainer.train()
    return flat([p.detach() for p in model.parameters()])


def test_bf16_autocast_with_checkpointing_equals_the_run_without(tmp_path):
    """Under autocast the engine casts Linear inputs before the call; the recomputation (where it does not)
    must rebuild the same tensors: checkpointing changes nothing."""
    plain = _train_bf16(tmp_path / "plain", False)
    checkpointed = _train_bf16(tmp_path / "ckpt", True)
    initial = flat([p.detach() for p in tiny_decoder("llama", dtype=torch.float32).parameters()])
    assert (plain - initial).norm() > 0
    assert ((checkpointed - plain).norm() / (plain - initial).norm()).item() <= 1e-6
