"""The re-check's forwards: a dropout-free model's re-check compares the loss its released gradient comes
from.

Through the public API (DPTrainer on a tiny float32 GPT-2, noise 0, every micro-batch re-checked): when the
training forward is the checking forward (no dropout to turn off), a re-check reuses the per-example losses of
the micro-batch's own training forward and runs one forward more (the example collated alone) instead of two;
with dropout on, the in-batch forward is run again with it off. Reusing the training forward also compares
what is released: a forward that couples the examples only while gradients are recorded (a no-grad re-check
forward would not see it) is refused before the step is released; without it, adding one example moves the
aggregate by more than C.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat
from models import VOCAB, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.separation import SeparationError


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=4, per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _example(length: int, seed: int, labelled: bool = True) -> dict:
    ids = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone() if labelled else torch.full_like(ids, -100)}


def _step(trainer: DPTrainer, examples: list[dict]) -> torch.Tensor:
    """One logical batch through the training collator and ``training_step``: the pre-noise clipped sum."""
    trainer.create_optimizer()
    trainer.training_step(trainer.model, trainer.get_train_dataloader().collate_fn(examples))
    local = trainer.dp_optimizer._local_sums()
    return flat([local[p].detach().double() for p in trainer.dp_optimizer.params])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_dropout_free_recheck_runs_one_forward_more(tmp_path, dropout):
    """Step 1 holds the first-step check; in step 2 both micro-batches (new shapes) are re-checked.
    Dropout-free:
    each micro-batch's forward, then its example alone (batch sizes 2, 1, 2, 1; the old code ran 2, 1, 2 per
    micro-batch). With dropout, before each micro-batch's forward: the micro-batch with dropout off, the
    example alone."""
    model = tiny_gpt2(torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)
    examples = [_example(n, seed) for seed, n in enumerate((5, 5, 7, 9, 4, 6, 8, 3))]
    trainer = DPTrainer(model=model, args=_args(tmp_path, dp_recheck_rate=1.0),
                        train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    _step(trainer, examples[:4])
    assert trainer._per_example_checked
    sizes.clear()
    before = trainer._separation.rechecks_run
    _step(trainer, examples[4:])
    assert trainer._separation.rechecks_run - before == 2
    assert sizes == ([2, 1, 2, 1] if dropout == 0.0 else [2, 1, 2, 2, 1, 2]), sizes


class _CapWhileRecording:
    """Reverses every example's embedding features when the micro-batch's norm exceeds ``limit``, only while
    gradients are recorded (a batch-wide branch that a no-grad forward does not take). The norm is read into
    Python, out of the batch-axis trace's sight: a tensor scale (``output * limit / output.norm()``) is
    refused by the tracer first (tests/adversarial/test_verdict_attacks.py); a branch on the values is the
    re-check's case."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, module, args, output):
        if not torch.is_grad_enabled():
            return output
        return output.flip(-1) if float(output.norm()) > self.limit else output


@pytest.mark.parametrize("cap", [True, False])
def test_a_coupling_only_while_recording_is_refused(tmp_path, cap):
    """The cap triggers only when the long example (no label: its bound is 0) is in micro-batch 2, and only in
    a forward that records gradients. Without the checks adding it moves the float32 aggregate by more than C;
    the old re-check (both forwards without gradients) passed it. Now the re-check of micro-batch 2's new
    shape compares the training forward's losses and refuses before the step is released. No cap: at most
    C."""
    shorts = [_example(4, seed) for seed in range(1, 8)]
    d_prime = [*shorts, _example(36, 9, labelled=False)]

    def make(name, **kw):
        model = tiny_gpt2(torch.float32)
        model.transformer.wpe.requires_grad_(False)  # position embeddings are called on (1, T): frozen here
        if cap:
            model.transformer.drop.register_forward_hook(_CapWhileRecording(0.5))
        # the hole in sampled order (grouped, the long example would be in micro-batch 1); the control grouped
        args = _args(tmp_path / name, logical_batch_size=8, per_device_train_batch_size=4,
                     per_sample_max_grad_norm=0.01, dp_group_by_length=not cap, **kw)
        return DPTrainer(model=model, args=args, train_dataset=ListDataset(d_prime),
                         data_collator=PadCollator(0))

    def ratio(**kw) -> float:
        base = _step(make("d", **kw), shorts)
        return float((_step(make("d_prime", **kw), d_prime) - base).norm()) / 0.01

    if not cap:
        assert ratio() <= 1 + 1e-4
        return
    assert ratio(dp_verify_first_step=False) > 1 + 1e-4  # the hole, with the checks off
    trainer = make("checked")
    with pytest.raises(SeparationError, match="micro-batch 2.*re-collated alone"):
        _step(trainer, d_prime)
    assert trainer._per_example_checked and trainer.accountant.steps == 0
