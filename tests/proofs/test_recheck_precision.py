"""The re-check's argument for a small float32 loss mismatch: the example's clipped gradient, in the run's
precision.

A run that reaches very confident predictions (or diverges) has large activations; the same example in its
micro-batch and collated alone then goes through other accumulation orders (other padded lengths, other row
counts), and in float32 its loss can differ by more than the check's 1e-4 (measured: 1.6e-4 on MiniLM's top
layers with LoRA at lr 0.03, the run the trainer stopped). A mismatch under ROUNDING_BOUND (1e-2) is then
settled by what is released: the example's clipped gradient in the micro-batch (the engine's, from a recorded
forward that reproduces the compared loss) within GRADIENT_TOLERANCE (1e-4) C of its clipped gradient alone,
both in the run's precision. The earlier argument recomputed both losses in float64: a forward branching on
the dtype coupled the examples in float32 only, passed it, and moved the aggregate by 2.03 / 2.52 / 3.45 C
(micro-batches of 4 / 8 / 16). Every checking forward records gradients as training does, so a branch on the
grad mode shows too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import ListDataset, PadCollator
from models import tiny_gpt2
from test_separation import _args, _example, _ratio, _step
from torch import nn

from hf_dpfilter import DPTrainer
from hf_dpfilter.proofs.separation import (
    GRADIENT_TOLERANCE,
    LOSS_ROUNDING_FLOOR,
    ROUNDING_BOUND,
    SeparationChecks,
    SeparationError,
)


class RoundsByRowCount(nn.Module):
    """Per-example scores; in float32 only, a relative error of 1e-3 whenever the micro-batch has several rows
    (standing for another accumulation order, amplified); exact in float64. No example affects another."""

    def __init__(self, coupled: bool = False, float32_error: float = 1e-3) -> None:
        super().__init__()
        self.float32_error = float32_error
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, 4))
        self.register_buffer("offset", torch.tensor(0.25))
        self.coupled = coupled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = x @ self.weight + self.offset
        if self.coupled:  # a statistic over the micro-batch: a real coupling, in every precision
            score = score + 0.5 * (x @ self.weight).mean()
        if score.dtype == torch.float32 and x.shape[0] > 1:
            score = score * (1 + self.float32_error)
        return score


def checks_for(model: nn.Module) -> SeparationChecks:
    def loss_fn(inputs, labels):
        return (model(inputs["x"]) - labels) ** 2 + 1.0

    def alone(raw, micro_batch, index, each_row):
        return {"x": raw["x"][None]}, raw["label"][None], None

    return SeparationChecks(None, loss_fn, lambda layout: contextlib.nullcontext(), alone, first_step=False,
                            rechecks=True, rate=0.0, min_examples=2)


def micro_batch():
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7.0
    labels = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 1.5])
    return ({"x": x}, labels, None), [{"x": x[i], "label": labels[i]} for i in range(6)]


def test_without_a_gradient_argument_a_small_mismatch_refuses_and_the_weights_are_untouched():
    """Checks with no engine and no clipping (a stand-alone SeparationChecks) have no gradient to settle a
    mismatch with: a float32-only loss mismatch under ROUNDING_BOUND refuses."""
    model = RoundsByRowCount()
    weight, storage = model.weight, model.weight.data_ptr()
    checks = checks_for(model)
    batch, raw = micro_batch()
    with pytest.raises(SeparationError, match="another loss in the micro-batch than re-collated alone"):
        checks.recheck(model, batch, raw, "a new shape")
    assert checks.rounding_rechecks == 0
    assert (model.weight is weight and model.weight.data_ptr() == storage
            and model.weight.dtype == torch.float32)


def test_a_coupling_refuses():
    model = RoundsByRowCount(coupled=True)
    batch, raw = micro_batch()
    with pytest.raises(SeparationError, match="another loss in the micro-batch than re-collated alone"):
        checks_for(model).recheck(model, batch, raw, "a new shape")


def test_a_float32_mismatch_too_large_for_rounding_refuses():
    model = RoundsByRowCount(float32_error=5e-2)
    batch, raw = micro_batch()
    checks = checks_for(model)
    with pytest.raises(SeparationError):
        checks.recheck(model, batch, raw, "a new shape")
    assert checks.rounding_rechecks == 0


# ------------------------------------------------------------------ through the public API: DPTrainer, noise
# 0
class _WidthCoupledLoss(DPTrainer):
    """Own-count token NLL; while the micro-batch is padded beyond 10 tokens, every example's loss is scaled
    by 1 + 1e-3 (the long example's presence reaches the short one's loss): in float32 only (``float32_only``)
    or in every precision (a small real coupling, below ROUNDING_BOUND, above the 1e-4 tolerance);
    ``value_only``: the loss's value moves, its gradient not (a stand-in for rounding: a confident model's
    sits in the log-softmax's value, and no example reaches another's gradient)."""

    float32_only, value_only = True, False

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        logits, targets = outputs["logits"][:, :-1], labels[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none").sum(1)
        nll = nll / (targets != -100).sum(1).clamp(min=1).to(nll.dtype)
        if inputs["input_ids"].shape[1] > 10 and (nll.dtype == torch.float32 or not self.float32_only):
            nll = nll + 1e-3 * (nll.detach() if self.value_only else nll)
        return nll


class _SmallRealCoupling(_WidthCoupledLoss):
    float32_only = False


def _make(tmp_path, cls, examples, clip=2.0):
    def make(name):
        # sampled order: micro-batch 1 holds the two equal examples (the first-step check), micro-batch 2 the
        # short and the long one (a new shape: its re-check). The long one has no label (loss 0), so the
        # re-check draws the short one, whose loss the long one's width moves
        args = _args(tmp_path / name, per_sample_max_grad_norm=clip, dp_recheck_rate=0.0,
                     dp_group_by_length=False)
        return cls(model=tiny_gpt2(torch.float32), args=args, train_dataset=ListDataset(examples),
                   data_collator=PadCollator(0))
    return make


class _LossValueRounding(_WidthCoupledLoss):
    value_only = True


@pytest.mark.parametrize(
    "cls, clip", [(_LossValueRounding, 2.0), (_WidthCoupledLoss, 0.01), (_SmallRealCoupling, 2.0)])
def test_a_loss_mismatch_that_moves_no_clipped_gradient_trains_within_1e_4_C(tmp_path, cls, clip):
    """Micro-batch 2's loss mismatch (1e-3) is settled by the gradients: a rounding of the loss's value alone,
    a float32 scale of a gradient clipped anyway (C = 0.01), or a real scale by 1 + 1e-3 in every precision,
    whose released vector moves by under 1e-4 C (the earlier test refused it: a loss criterion). Adding the
    long example then moves the pre-noise aggregate by at most C (1 + 1e-4): the bound is about what is
    summed."""
    equal = [_example(6, seed, causal=True) for seed in (1, 2)]
    d = [*equal, _example(3, 3, causal=True)]
    d_prime = [*d, _example(30, 4, causal=True, labelled=False)]
    trainers = []

    def make(name):
        trainers.append(_make(tmp_path, cls, d_prime, clip)(name))
        return trainers[-1]

    assert _ratio(make, d, d_prime) <= 1 + GRADIENT_TOLERANCE
    assert trainers[-1]._separation.rounding_rechecks == 1


class _ConfidentLossRounding(_WidthCoupledLoss):
    """A confident example's loss (the NLL scaled to about 1e-6) whose float32 value in the wide micro-batch is
    off by an absolute 2e-7 (about two float32 ulps of 1, as log(1 + x) rounds: relative 0.2, past
    ROUNDING_BOUND) while its gradient is not."""

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        logits, targets = outputs["logits"][:, :-1], labels[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none").sum(1)
        nll = 1e-6 * nll / (targets != -100).sum(1).clamp(min=1).to(nll.dtype)
        if inputs["input_ids"].shape[1] > 10 and nll.dtype == torch.float32:
            # the labelled rows only: the long example without labels keeps its loss 0 (never drawn)
            nll = nll + 2e-7 * (targets != -100).any(1).to(nll.dtype)
        return nll


def test_a_confident_examples_absolute_rounding_gets_the_gradient_argument(tmp_path):
    """A loss near 0 rounds in absolute terms: its relative mismatch (0.2) is past ROUNDING_BOUND, but under
    ROUNDING_BOUND x LOSS_ROUNDING_FLOOR absolute, so the gradient argument settles it (it refused the step
    before) and the aggregate moves by at most C (1 + 1e-4)."""
    assert ROUNDING_BOUND * LOSS_ROUNDING_FLOOR >= 2e-7
    equal = [_example(6, seed, causal=True) for seed in (1, 2)]
    d = [*equal, _example(3, 3, causal=True)]
    d_prime = [*d, _example(30, 4, causal=True, labelled=False)]
    trainers = []

    def make(name):
        trainers.append(_make(tmp_path, _ConfidentLossRounding, d_prime, 2.0)(name))
        return trainers[-1]

    assert _ratio(make, d, d_prime) <= 1 + GRADIENT_TOLERANCE
    assert trainers[-1]._separation.rounding_rechecks == 1


# ------------------------------------------- a coupling in float32 only that turns the gradients, and its
# disguises
class _Wiggle:
    """On the final hidden states, beyond 10 tokens (the long example's presence): ``h + 0.3 sin(10 h)``, a
    loss footprint of 4e-4 to 2e-3 (under ROUNDING_BOUND) and a Jacobian that turns every example's gradient.
    ``when``: what else the model reads to take the branch only where the checks do not look."""

    def __init__(self, when: str) -> None:
        self.when = when

    def __call__(self, module, args, out):
        if out.dtype != torch.float32:
            return out  # float32 only: the earlier float64 argument saw nothing
        wide = out.shape[1] > 10
        take = {
            "dtype": wide,
            # the earlier no-grad in-batch forward saw nothing
            "grad_enabled": wide and torch.is_grad_enabled(),
            "requires_grad": wide and out.requires_grad,
            # alone without gradients (the earlier loss check's alone forward): the coupled value, mimicked
            "mimicked_alone": wide or not torch.is_grad_enabled(),
        }[self.when]
        return out + 0.3 * torch.sin(10 * out) if take else out


def _wiggling(tmp_path, when, examples, m, **kw):
    def make(name):
        model = tiny_gpt2(torch.float32)
        if when in ("grad_enabled", "requires_grad"):  # dropout: the in-batch forward is the check's own
            model.transformer.drop.p = 0.1
        model.transformer.ln_f.register_forward_hook(_Wiggle(when))
        args = _args(tmp_path / name, per_sample_max_grad_norm=0.01, dp_recheck_rate=0.0,
                     dp_group_by_length=False, logical_batch_size=2 * m, per_device_train_batch_size=m, **kw)
        return DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                         data_collator=PadCollator(0))
    return make


def _wiggle_data(m):
    equal = [_example(6, seed, causal=True) for seed in range(1, m + 1)]
    d = [*equal, *[_example(3 + s % 4, 100 + s, causal=True) for s in range(m - 1)]]
    return d, [*d, _example(30, 7, causal=True, labelled=False)]


def test_a_float32_only_coupling_that_turns_the_gradients_is_refused(tmp_path):
    """Micro-batches of 4: the first holds equal lengths (the first-step check), the second three short
    examples and the long one with no label (a new shape: its re-check). Unchecked, adding the long example
    moves the aggregate by 2.03 C (the earlier float64 argument passed it: the same); checked, the gradient
    argument refuses."""
    d, d_prime = _wiggle_data(4)
    assert _ratio(_wiggling(tmp_path, "dtype", d_prime, 4, dp_verify_first_step=False), d, d_prime) > 1.5
    trainer = _wiggling(tmp_path, "dtype", d_prime, 4)("checked")
    with pytest.raises(SeparationError, match="micro-batch 2.*re-collated alone"):
        _step(trainer, d_prime)
    assert trainer._per_example_checked and trainer.accountant.steps == 0
    assert trainer._separation.rounding_rechecks == 0


@pytest.mark.parametrize("when", ["grad_enabled", "requires_grad", "mimicked_alone"])
def test_a_coupling_that_reads_the_grad_mode_is_refused(tmp_path, when):
    """The branch also reads whether gradients are recorded: taken only while recording (the earlier re-check
    ran a dropout model's in-batch forward without gradients) or mimicked by an example alone without
    gradients (the earlier re-check's alone forward, against a dropout-free model's training losses). Every
    checking forward now records gradients as training does: refused before the step is released."""
    d, d_prime = _wiggle_data(4)
    trainer = _wiggling(tmp_path, when, d_prime, 4)("checked")
    with pytest.raises(SeparationError, match="micro-batch 2.*re-collated alone"):
        _step(trainer, d_prime)
    assert trainer.accountant.steps == 0
