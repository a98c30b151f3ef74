"""The first-step check verifies per example, and independence; the loss is built per example or refused.

Once per run (dp_verify_first_step), a few examples of the first micro-batch are recomputed alone: their
losses and per-example gradients must equal the in-batch ones. A rule wrong per example but right in sum
(which a batch-sum check passes) and a loss that couples examples through the documented hook are both caught
before any step is released. Losses defined over the batch (compute_loss override, compute_loss_func) are
refused unless compute_per_example_loss is overridden; label smoothing is exact per example; prompt learning
and logits/labels of different lengths are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import LeftPadCollator, ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert, tiny_gpt2
from torch import nn

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.engine.rules import _GRAD_RULES, OuterTerm, register_grad_rule
from hf_dpfilter.factory import make_sampler
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.proofs.first_step_check import PerExampleCheckError
from hf_dpfilter.proofs.loss_policy import LossPolicyError


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=6, per_device_train_batch_size=6, max_steps=1, optim="sgd", learning_rate=1.0,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, model=None, cls=DPTrainer, causal=False, **kw):
    model = model if model is not None else tiny_bert()
    return cls(model=model, args=_args(tmp_path, **kw),
               train_dataset=ListDataset(make_examples(6, VOCAB, causal)),
               data_collator=PadCollator(0))


class RolledLinear(nn.Linear):
    """A Linear whose (test-only) rule hands each example the gradient of the next one: right in sum only."""


def _rolled_rule(module, activations, grad_output):
    b, a = grad_output, activations
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    terms = {"weight": OuterTerm(left=b.roll(1, dims=0), right=a.roll(1, dims=0))}
    return terms


def test_rule_wrong_per_example_but_right_in_sum_is_caught_by_name(tmp_path):
    register_grad_rule(RolledLinear)(_rolled_rule)
    try:
        model = tiny_bert()
        head = model.classifier
        model.classifier = RolledLinear(head.in_features, head.out_features, bias=False).double()
        with torch.no_grad():
            model.classifier.weight.copy_(head.weight)
        trainer = _trainer(tmp_path, model)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(PerExampleCheckError, match="'classifier.weight'.*wrong per example"):
            trainer.train()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert trainer.accountant.steps == 0
        # the same rule passes a check of batch sums only: that is why the check is per example
        trainer = _trainer(tmp_path / "sums", model, dp_verify_first_step=False)
        trainer.engine.verify_first_backward = True
        trainer.train()
    finally:
        _GRAD_RULES.pop(RolledLinear, None)


class NudgedLinear(nn.Linear):
    """A Linear whose (test-only) rule is 0.1% too large: ten times the float32 tolerance."""


def _nudged_rule(module, activations, grad_output):
    b, a = grad_output, activations
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    return {"weight": OuterTerm(left=b * 1.001, right=a)}


def test_a_rule_wrong_by_a_tenth_of_a_percent_is_caught_in_float32(tmp_path):
    # the per-parameter floor (16 float32 ulps of the example's whole gradient, for parameters whose exact
    # gradient is 0) must not hide a small error of a parameter that carries gradient
    register_grad_rule(NudgedLinear)(_nudged_rule)
    try:
        model = tiny_bert(dtype=torch.float32)
        head = model.classifier
        model.classifier = NudgedLinear(head.in_features, head.out_features, bias=False)
        with torch.no_grad():
            model.classifier.weight.copy_(head.weight)
        trainer = _trainer(tmp_path, model)
        with pytest.raises(PerExampleCheckError, match="'classifier.weight'.*wrong per example"):
            trainer.train()
        assert trainer.accountant.steps == 0
    finally:
        _GRAD_RULES.pop(NudgedLinear, None)


class ContrastiveTrainer(DPTrainer):
    """In-batch negatives through the documented hook: each example's loss depends on the others."""

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        logits = model(**inputs).logits
        similarity = logits @ logits.t()
        return -F.log_softmax(similarity, dim=1).diagonal()


class OwnLossTrainer(DPTrainer):
    """A per-example loss of the user's own (squared hinge), through the documented hook: accepted and
    verified."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise AssertionError("never used for training")

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        logits = model(**inputs).logits
        margin = logits.gather(1, labels[:, None]).squeeze(1) - logits.logsumexp(dim=1)
        return F.relu(1.0 - margin) ** 2


def test_loss_coupling_examples_through_the_hook_is_caught(tmp_path):
    trainer = _trainer(tmp_path, cls=ContrastiveTrainer)
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_own_per_example_loss_through_the_hook_is_accepted_and_verified(tmp_path):
    trainer = _trainer(tmp_path, cls=OwnLossTrainer)
    trainer.train()
    assert trainer.accountant.steps == 1 and trainer._per_example_checked


def test_compute_loss_override_is_refused_with_the_hook(tmp_path):
    class Override(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(LossPolicyError, match="overrides compute_loss.*compute_per_example_loss"):
        _trainer(tmp_path, cls=Override)


def test_compute_loss_func_is_refused(tmp_path):
    with pytest.raises(LossPolicyError, match="compute_loss_func"):
        DPTrainer(model=tiny_bert(), args=_args(tmp_path),
                  train_dataset=ListDataset(make_examples(6, VOCAB, False)),
                  data_collator=PadCollator(0), compute_loss_func=lambda outputs, labels,
                  num_items_in_batch: 0)


def test_label_smoothing_is_exact_per_example():
    """label_smoothing_factor: the Trainer's LabelSmoother applied to each example alone (not to the
    batch)."""
    from transformers.trainer_pt_utils import LabelSmoother

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, 4:] = -100
    labels[2, :2] = -100
    smoother = LabelSmoother(epsilon=0.1)
    ours = per_example_loss(logits, labels, causal_lm=True, label_smoothing=0.1)
    for i in range(3):
        alone = smoother({"logits": logits[i : i + 1]}, labels[i : i + 1], shift_labels=True)
        assert torch.allclose(ours[i], alone.double(), rtol=1e-6, atol=0), i
    classes = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1])
    ours = per_example_loss(classes, y, causal_lm=False, label_smoothing=0.2)
    for i in range(4):
        assert torch.allclose(ours[i],
                smoother.__class__(epsilon=0.2)({"logits": classes[i : i + 1]}, y[i : i + 1]).double())


def test_logits_and_labels_of_different_lengths_are_refused():
    logits = torch.randn(2, 9, 5)  # e.g. 4 virtual tokens prepended to 5 label positions
    labels = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="one prediction per label token"):
        per_example_loss(logits, labels, causal_lm=True)


def test_prompt_tuning_is_refused_before_the_first_step(tmp_path):
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(LossPolicyError, match="prompt-learning.*LoRA"):
        _trainer(tmp_path, model, causal=True)


def test_own_loss_with_the_check_turned_off_is_refused(tmp_path):
    """The hook is accepted because the first-step check verifies it: with the check off, a loss over the
    batch (in-batch negatives) would train silently, so the combination is refused before anything runs."""
    with pytest.raises(LossPolicyError, match="compute_per_example_loss and dp_verify_first_step=False"):
        _trainer(tmp_path, cls=ContrastiveTrainer, dp_verify_first_step=False)


class _TrainingOnlyCentering(nn.Module):
    """A hand-written batch normalisation: centres the features over the batch, in training mode only. The
    mean is read into Python and back (``.tolist()``), out of the batch-axis trace's sight: with the tensor
    itself, the tracer refuses the head first (tests/adversarial/test_verdict_attacks.py); this is the
    first-step check's case."""

    def forward(self, x):
        return x - torch.tensor(x.mean(dim=0, keepdim=True).tolist(), dtype=x.dtype) if self.training else x


class _CenteredClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.center = _TrainingOnlyCentering()
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        mask = attention_mask.unsqueeze(-1).to(torch.float32)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return {"logits": self.head(self.center(pooled))}


def test_coupling_only_in_training_mode_is_caught(tmp_path):
    """A module that couples examples only under self.training (no parameter, no buffer, not a BatchNorm; with
    the tensor mean itself it moved the pre-noise aggregate by 1.27 C when one example was added). The check
    used to run every module in eval mode, where the coupling is absent, and passed; the model is
    deterministic in training mode, so the check now runs in it and refuses before anything is released."""
    model = _CenteredClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, model, per_sample_max_grad_norm=0.01)
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        trainer.train()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert trainer.accountant.steps == 0 and model.center.training


def test_model_with_dropout_is_checked_in_training_mode(tmp_path):
    """With dropout (here also inside BERT's sdpa attention, a kernel argument read from ``self.dropout.p``)
    the losses in training mode are random. The check used to fall back to eval mode; it now turns dropout off
    in the modules and the kernel probability (element-wise: it cannot couple examples) and checks in training
    mode. A forward still random after that is refused (tests/proofs/test_separation.py)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=40, pad_token_id=0,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.3)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).double()
    trainer = _trainer(tmp_path, model)
    trainer.train()
    assert trainer.accountant.steps == 1 and trainer._per_example_checked
    assert {m.p for m in model.modules() if isinstance(m, nn.Dropout)} == {0.1, 0.3}  # restored



@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padding_with_absolute_positions_passes_the_check_by_construction(tmp_path, family):
    """GPT-2 numbers positions from the first column, so left padding gave each example positions that depend
    on the longest example of its batch: one long example added moved the pre-noise aggregate by 3.77 C (24
    short examples, float32, noise 0), and the check only caught it when the first micro-batch was padded.
    Every micro-batch now gets position_ids derived from its mask (hf_dpfilter.proofs.padding;
    tests/proofs/test_padding.py), so each example has its positions alone and the check, comparing with the
    example re-collated alone, passes. Llama's rotary positions are made exact the same way."""
    from models import tiny_decoder

    model = tiny_gpt2() if family == "gpt2" else tiny_decoder("llama")
    examples = make_examples(6, VOCAB, causal=True, seed=2)
    args = _args(tmp_path)
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=LeftPadCollator())
    trainer.train()
    assert trainer.accountant.steps == 1 and trainer._per_example_checked


class _ShrunkLinear(nn.Linear):
    """A Linear whose (test-only) rule gives each example 99% of its gradient: norms 1% low, clipping 1%
    weak."""


def _shrunk_rule(module, activations, grad_output):
    a, b = activations, grad_output
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    return {"weight": OuterTerm(left=0.99 * b, right=a)}


def test_bf16_set_after_creation_does_not_loosen_the_check(tmp_path):
    """The check's tolerance follows the precision the accelerator computes in: args.bf16 set after the
    trainer was created changes no computation (fp64 here) but used to widen the tolerance to 5e-2, letting a
    rule 1% wrong pass."""
    register_grad_rule(_ShrunkLinear)(_shrunk_rule)
    try:
        model = tiny_bert()
        head = model.classifier
        model.classifier = _ShrunkLinear(head.in_features, head.out_features, bias=False).double()
        trainer = _trainer(tmp_path, model)
        trainer.args.bf16 = True
        with pytest.raises(PerExampleCheckError, match="'classifier.weight'"):
            trainer.train()
        assert trainer.accountant.steps == 0
    finally:
        _GRAD_RULES.pop(_ShrunkLinear, None)


def test_own_loss_under_fsdp2_sharding_is_refused(tmp_path):
    """FSDP2 sharding skips the first-step check, so an overridden compute_per_example_loss would train
    unverified. (Sharding is simulated by marking the DP optimizer sharded; the refusal comes before any
    sharded code runs.)"""

    class ShardedOwnLoss(ContrastiveTrainer):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            self.dp_optimizer._sharded = True
            return optimizer

    trainer = _trainer(tmp_path, cls=ShardedOwnLoss)
    with pytest.raises(LossPolicyError, match="does not run under FSDP2 sharding"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_check_waits_for_a_micro_batch_of_two_examples(tmp_path):
    """A Poisson batch of one example equals itself alone: checked on it, a loss coupling examples (in-batch
    negatives) passed and then trained unverified on every later batch. The check now waits for a micro-batch
    of two examples or more (a micro-batch of one cannot couple examples, so the step before it is safe)."""
    args = _args(tmp_path, logical_batch_size=2, per_device_train_batch_size=4, max_steps=2, dp_seed=0)
    trainer = ContrastiveTrainer(model=tiny_bert(), args=args,
                                 train_dataset=ListDataset(make_examples(8, VOCAB, False)),
                                 data_collator=PadCollator(0))
    sizes = [len(batch) for batch in make_sampler(trainer.privacy_plan, rank=0, world_size=1)][:2]
    assert sizes == [1, 2]  # dp_seed=0 draws one example, then two
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        trainer.train()
    assert trainer.accountant.steps == 1


def test_loss_set_on_the_instance_is_held_to_the_same_policy(tmp_path):
    """compute_per_example_loss assigned on the trainer object (not a subclass) after creation, with the check
    off:
    the policy looked only at the class, so the in-batch-negatives loss trained unverified."""
    import types

    trainer = _trainer(tmp_path, dp_verify_first_step=False)
    trainer.compute_per_example_loss = types.MethodType(ContrastiveTrainer.compute_per_example_loss, trainer)
    with pytest.raises(LossPolicyError, match="dp_verify_first_step=False"):
        trainer.train()
    assert trainer.accountant.steps == 0


class _TailSwappedLinear(nn.Linear):
    """A Linear whose (test-only) rule swaps the last two examples' gradients: right in sum, wrong at the
    batch's end."""


def _tail_swapped_rule(module, activations, grad_output):
    a, b = activations, grad_output
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    order = list(range(a.shape[0]))
    order[-2:] = order[-2:][::-1]
    return {"weight": OuterTerm(left=b[order], right=a[order])}


def test_rule_wrong_only_at_the_end_of_the_batch_is_caught(tmp_path):
    """Examples 4 and 5 of a micro-batch of 6 were never compared (the first 4 only); the last one now is."""
    register_grad_rule(_TailSwappedLinear)(_tail_swapped_rule)
    try:
        model = tiny_bert()
        head = model.classifier
        model.classifier = _TailSwappedLinear(head.in_features, head.out_features, bias=False).double()
        trainer = _trainer(tmp_path, model)
        with pytest.raises(PerExampleCheckError, match="'classifier.weight' for example 5"):
            trainer.train()
        assert trainer.accountant.steps == 0
    finally:
        _GRAD_RULES.pop(_TailSwappedLinear, None)
