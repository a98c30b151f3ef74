"""DP-Adam parity with Opacus 1.6 (docs/opacus_parity.md): the pieces of a step that must match.

* the clipped per-example sum of a BERT classifier equals Opacus's ghost-clipping sum (same norms, same
  Abadi factor ``min(1, C / (norm + 1e-6))``, same loss per example);
* the privatized gradient is ``(sum + N(0, sigma^2 C^2)) / B`` with the *expected* batch B, as Opacus's
  ``loss_reduction="mean"``, whatever the realized Poisson batch size;
* ``DPTrainer`` draws fresh Poisson batches every epoch (the Trainer's ``set_epoch`` reaches the sampler) and
  hands the Trainer's own AdamW (betas, eps, weight decay, constant lr) the privatized gradient, with the
  Trainer's batch-level clipping off.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, padded_batch, tiny_bert

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.factory import make_private
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.plan import PrivacyPlan

opacus = pytest.importorskip("opacus")


def _ours_clipped_sum(model, batch, max_grad_norm):
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=len(batch["labels"]), epochs=1,
                              noise_multiplier=0.0, per_sample_max_grad_norm=max_grad_norm, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=0.0)
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss_fn(values):
        logits = engine.call_model(values, **inputs).logits if values else model(**inputs).logits
        return per_example_loss(logits, batch["labels"], causal_lm=False)

    optimizer.accumulate(engine, loss_fn, batch_size=len(batch["labels"]))
    sums = optimizer._local_sums()
    return [sums[p] for p in model.parameters()]


def _opacus_clipped_sum(model, batch, max_grad_norm):
    from torch.utils.data import DataLoader, TensorDataset

    size = len(batch["labels"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(TensorDataset(torch.arange(size)), batch_size=size)
    model, optimizer, criterion, _ = opacus.PrivacyEngine(accountant="prv").make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=0.0, max_grad_norm=max_grad_norm, grad_sample_mode="ghost", poisson_sampling=False)
    model.train()
    optimizer.zero_grad()
    # Opacus clips (B, T) position ids only (the benchmark passes them explicitly too)
    seq = batch["input_ids"].shape[1]
    position_ids = torch.arange(seq).unsqueeze(0).repeat(size, 1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=position_ids).logits
    criterion(logits, batch["labels"]).backward()
    optimizer.accumulate()
    return [p.summed_grad for p in model._module.parameters()]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("max_grad_norm", [0.05, 1e6])  # every example clipped / none clipped
def test_clipped_sum_equals_opacus_ghost_clipping(max_grad_norm):
    base = tiny_bert()
    base.train()  # no dropout in the tiny model; Opacus records activations in train mode only
    batch = padded_batch(6, pad_id=0, seed=3)
    ours = _ours_clipped_sum(copy.deepcopy(base), batch, max_grad_norm)
    theirs = _opacus_clipped_sum(copy.deepcopy(base), batch, max_grad_norm)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_noisy_average_divides_by_expected_not_realized_batch():
    """Opacus (loss_reduction="mean") divides the noisy sum by expected_batch_size; so must we."""
    model = torch.nn.Linear(3, 1, bias=False).double()
    plan = PrivacyPlan.for_optimizer(noise_multiplier=0.0, per_sample_max_grad_norm=1e6, expected_batch_size=8.0,
                                     sample_rate=0.5, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=1.0)
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]], dtype=torch.float64)  # a realized batch of 2
    before = model.weight.detach().clone()
    optimizer.accumulate(engine, lambda values: model(x).squeeze(-1), batch_size=2)
    optimizer.step()
    torch.testing.assert_close(before - model.weight.detach(), x.sum(0, keepdim=True) / 8.0)


def _trainer(tmp_path, examples, trainer_class=DPTrainer, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_sample_max_grad_norm=0.5, logical_batch_size=10,
        per_device_train_batch_size=10, num_train_epochs=3, learning_rate=1e-3, lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dp_seed=7, noise_multiplier=1.0, logging_steps=100, disable_tqdm=True,
    )
    settings.update(overrides)
    return trainer_class(model=tiny_bert(), args=DPTrainingArguments(**settings),
                         train_dataset=ListDataset(examples),
                     data_collator=PadCollator(0))


@pytest.mark.filterwarnings("ignore::UserWarning")  # the plan's learnability warnings (12 steps)
def test_dptrainer_draws_fresh_poisson_batches_every_epoch(tmp_path):
    """A sampler that replayed epoch 0 would never show ~(1 - q)^steps of the data (37%) in the whole run."""
    examples = make_examples(40, VOCAB, causal=False, seed=2)
    for i, e in enumerate(examples):
        e["input_ids"][0] = 3 + i  # the first token names the example
    seen: list[list[int]] = []

    class Recording(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(sorted(int(t) - 3 for t in inputs["input_ids"][:, 0]))
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = _trainer(tmp_path, examples, trainer_class=Recording)
    trainer.train()
    steps = trainer.steps_per_epoch
    assert len(seen) == 3 * steps
    epochs = [seen[e * steps : (e + 1) * steps] for e in range(3)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dptrainer_steps_the_trainers_adamw_without_batch_clipping(tmp_path):
    examples = make_examples(40, VOCAB, causal=False, seed=2)
    trainer = _trainer(tmp_path, examples, optim="adamw_torch", adam_beta1=0.8, adam_beta2=0.99,
                       adam_epsilon=1e-7,
                       weight_decay=0.01)
    # the Trainer's global-norm clipping would distort the noisy step
    assert trainer.args.max_grad_norm == 0.0
    trainer.create_optimizer_and_scheduler(num_training_steps=trainer.planned_steps)
    base = trainer.dp_optimizer.original_optimizer
    assert isinstance(base, torch.optim.AdamW)
    group = base.param_groups[0]
    assert (group["betas"], group["eps"], group["lr"]) == ((0.8, 0.99), 1e-7, 1e-3)
    # HF: no decay on biases and LayerNorm
    assert {g["weight_decay"] for g in base.param_groups} == {0.0, 0.01}
    trainer.train()
    assert trainer.lr_scheduler.get_last_lr() == [1e-3] * len(base.param_groups)  # constant, no warm-up
