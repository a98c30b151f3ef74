"""Padding never couples examples: checked on every micro-batch from the attention mask
(hf_dpfilter.proofs.padding).

Sensitivity tests at noise 0 in float32 on neighbouring data sets D, D' (ratio = ||clipped sum(D') - clipped
sum(D)|| / C, at most 1 for add/remove, 2 for replace-one), with an added example whose labels are all
ignored: it has no gradient of its own, so all it moves is the other examples' gradients, through the padding
it sets.

1. A collator that pads without an attention mask (BERT attends to the pads): one long example moved the
   clipped sum by several C, and the first-step check passed. Now every such batch is refused before its step
   is released; with the mask the same run is exact.
2. Left padding with GPT-2's absolute positions: positions shift with the longest example of the batch. With
   step 1 holding one length only and the long example first sampled at step 2, nothing was checked. Now every
   micro-batch gets position ids derived from the mask: exact, equal to the float64 per-example reference of
   each example alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LeftPadCollator, ListDataset, PadCollator, flat, make_examples, reference_clipped_sum
from models import VOCAB, tiny_bert, tiny_gpt2
from torch import nn

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.proofs.padding import PaddingError

LONG = 30


def _args(tmp_path, n, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=0.1,
        logical_batch_size=n, per_device_train_batch_size=n, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


class MasklessPadCollator(PadCollator):
    """Pads on the right like PadCollator but returns no attention mask (the model then attends to the
    pads)."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        batch.pop("attention_mask")
        return batch



def _long_example(causal: bool, seed: int = 7) -> dict:
    """A long example whose labels are all ignored: no loss, no gradient of its own."""
    ids = torch.randint(3, VOCAB, (LONG,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": torch.full((LONG,), -100) if causal else -100}


def _one_step_sum(tmp_path, model, examples, collator) -> torch.Tensor:
    """train() for one step at q = 1 (every example sampled), noise 0, SGD lr 1: the clipped sum is -B * the
    change."""
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples)), train_dataset=ListDataset(examples),
                        data_collator=collator)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert trainer.accountant.steps == 1
    return -len(examples) * flat([p.detach().double() - b.double() for p,
                                  b in zip(model.parameters(), before)])


# ------------------------------------------------------------------------- 1. padding without a mask
def _bert():
    """A tiny float32 BERT with weights of a trained model's scale (initializer_range 0.5): at the default
    0.02 the pads' embeddings are too small to move much; the coupling is the same."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=40, pad_token_id=0, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.5)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def test_padding_without_an_attention_mask_is_refused_before_the_step(tmp_path):
    """D: short examples of one length (no padding: trains). D' = D plus a long zero-loss example: every other
    row is padded to 30 columns the model attends to: the clipped sum moved by 2.13 C (add/remove bound: 1)
    and the first-step check passed. Now the batch is refused before its step, nothing released."""
    shorts = make_examples(6, VOCAB, causal=False, seed=1, min_len=5, max_len=5)
    _one_step_sum(tmp_path / "d", _bert(), shorts, MasklessPadCollator(0))
    model = _bert()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPTrainer(model=model, args=_args(tmp_path / "d2", 7), train_dataset=ListDataset(
        shorts + [_long_example(False)]), data_collator=MasklessPadCollator(0))
    with pytest.raises(PaddingError, match="returns no `attention_mask`.*return the attention mask from the "
                                           "collator"):
        trainer.train()
    assert trainer.accountant.steps == 0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_padding_without_a_mask_is_refused_when_training_starts(tmp_path):
    """The first two examples of the training set, of different widths, already show the maskless padding:
    refused when the training data loader is built, before the first step (every batch is still checked:
    above)."""
    shorts = make_examples(4, VOCAB, causal=False, seed=1, min_len=5, max_len=5)
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, 5), train_dataset=ListDataset(
        [_long_example(False)] + shorts), data_collator=MasklessPadCollator(0))
    with pytest.raises(PaddingError, match="returns no `attention_mask`"):
        trainer.get_train_dataloader()
    assert trainer.accountant.steps == 0


def test_padding_with_the_mask_is_within_sensitivity(tmp_path):
    """The negative control: the same D and D' with the attention mask move the clipped sum by at most C."""
    shorts = make_examples(6, VOCAB, causal=False, seed=1, min_len=3, max_len=6)
    d = _one_step_sum(tmp_path / "d", _bert(), shorts, PadCollator(0))
    d2 = _one_step_sum(tmp_path / "d2", _bert(), shorts + [_long_example(False)], PadCollator(0))
    ratio = float((d2 - d).norm()) / 0.1
    assert ratio <= 1 + 1e-4, f"the clipped sum moved by {ratio:.4f} C"


# ------------------------------------------------------------------------- 2. left padding, absolute
# positions
def _step_two_sums(tmp_path, collator, model, step_one, *steps_two):
    """The clipped sums of later steps after a first step on ``step_one`` (whose micro-batch the first-step
    check verifies): each a training_step on its own sample at the same parameters (noise 0, nothing
    released)."""
    examples = step_one + [e for step in steps_two for e in step]
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(step_one), max_steps=2),
                        train_dataset=ListDataset(examples), data_collator=collator)
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    trainer.training_step(trainer.model, trainer._padding_collator(step_one))  # raw rows attached
    assert trainer._per_example_checked
    sums = []
    for sample in steps_two:
        trainer.dp_optimizer.zero_grad()
        trainer.training_step(trainer.model, trainer._padding_collator(sample))
        local = trainer.dp_optimizer._local_sums()
        sums.append(flat([local[p].detach().double() for p in trainer.dp_optimizer.params]))
    return sums


@pytest.mark.parametrize("collator", [LeftPadCollator(), PadCollator(0)], ids=["left", "right"])
def test_long_example_first_sampled_at_step_two_is_within_replace_one(tmp_path, collator):
    """Step 1: eight examples of one length (no padding, checked). Step 2 replaces one example by a long one
    with every label ignored: under left padding GPT-2's positions shifted for all the others (ratio 2.54 > 2,
    unchecked). Now positions come from the mask on every micro-batch: within 2 C, like right padding (the
    control)."""
    shorts = make_examples(9, VOCAB, causal=True, seed=2, min_len=6, max_len=6)
    step_one, kept, replaced = shorts[:8], shorts[:8], shorts[8]
    d, d2 = _step_two_sums(tmp_path, collator, tiny_gpt2(dtype=torch.float32), step_one,
                           kept + [replaced], kept + [_long_example(True)])
    ratio = float((d2 - d).norm()) / 0.1
    assert ratio <= 2 + 1e-4, f"the clipped sum moved by {ratio:.4f} C"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padded_step_equals_the_per_example_reference(tmp_path, family):
    """float64: the clipped sum of a left-padded micro-batch equals the sum of each example's clipped gradient
    computed alone, unpadded (helpers.reference_clipped_sum). Llama's rotary attention is shift-invariant only
    up to rounding; with the positions from the mask it is exact too."""
    from models import tiny_decoder

    examples = make_examples(5, VOCAB, causal=True, seed=3, min_len=3, max_len=9)
    model = tiny_gpt2() if family == "gpt2" else tiny_decoder("llama")
    model.eval()
    _, norms = reference_clipped_sum(model, examples, True, max_grad_norm=1.0)
    clip = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, examples, True, clip)
    shorts = make_examples(4, VOCAB, causal=True, seed=4, min_len=5, max_len=5)
    trainer = DPTrainer(model=model, args=_args(tmp_path, 4, per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(shorts + examples), data_collator=LeftPadCollator())
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    # the training collator: raw rows attached
    trainer.training_step(model, trainer._padding_collator(shorts))
    trainer.dp_optimizer.zero_grad()
    trainer.training_step(model, trainer._padding_collator(examples))
    local = trainer.dp_optimizer._local_sums()
    got = flat([local[p] for p in trainer.dp_optimizer.params])
    expected = flat([reference[p] for p in trainer.dp_optimizer.params])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10


# ------------------------------------------------------------------------- declared position schemes
class _NoConfigLM(nn.Module):
    """A causal LM of no declared family (no config): its positions are a table on the columns."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.positions = nn.Embedding(LONG, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, T), broadcast
        return {"logits": self.head(self.embed(input_ids) + self.positions(columns))}


@pytest.mark.parametrize("collator", [LeftPadCollator(), PadCollator(0)], ids=["left", "right"])
def test_left_padding_with_an_undeclared_model_is_refused(tmp_path, collator):
    examples = make_examples(4, VOCAB, causal=True, seed=5, min_len=3, max_len=8)
    model = _NoConfigLM()
    trainer = DPTrainer(model=model, args=_args(tmp_path, 4), train_dataset=ListDataset(examples),
                        data_collator=collator)
    if not isinstance(collator, LeftPadCollator):  # the control: right padding trains
        trainer.train()
        assert trainer.accountant.steps == 1
        return
    with pytest.raises(PaddingError, match="not declared.*padding_side = \"right\""):
        trainer.train()
    assert trainer.accountant.steps == 0


def _tiny_roberta_tokens(dtype=torch.float64):
    from transformers import RobertaConfig, RobertaForTokenClassification

    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=40, pad_token_id=1, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
    )
    torch.manual_seed(0)
    return RobertaForTokenClassification(config).to(dtype)


def _token_examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 8 if i == 0 else int(torch.randint(3, 8, (1,), generator=g))
        out.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=g),
                    "labels": torch.randint(0, 3, (length,), generator=g)})
    return out


class RobertaLeftPad(LeftPadCollator):
    def __call__(self, examples):
        batch = super().__call__(examples)
        batch["input_ids"][batch["attention_mask"] == 0] = 1  # RoBERTa's pad_token_id
        return batch


def test_roberta_left_padding_is_exact_without_injected_positions(tmp_path):
    """RoBERTa counts positions over the tokens that are not pad_token_id: left padding with its pad token is
    exact as is (no position_ids are added: an arange there would be wrong), equal to each example alone,
    unpadded."""
    examples = _token_examples(5, seed=6)
    model = _tiny_roberta_tokens()
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for e in examples:
        logits = model(input_ids=e["input_ids"][None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, e["labels"])
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    grads = [[torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)] for gs in grads]
    norms = torch.stack([flat(g).norm() for g in grads])
    clip = float(norms.median())
    expected = sum(flat(g) * factor for g, factor in zip(grads, clip_factors(norms, clip)))
    trainer = DPTrainer(model=model, args=_args(tmp_path, 5, per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(examples), data_collator=RobertaLeftPad())
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    batch = RobertaLeftPad()(examples)
    assert "position_ids" not in next(iter(trainer._micro_batches(
        {k: v for k, v in batch.items() if k != "labels"}, batch["labels"])))[0]
    trainer.training_step(model, trainer._padding_collator(examples))
    local = trainer.dp_optimizer._local_sums()
    got = flat([local.get(p, torch.zeros_like(p)) for p in params])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10
    # leading pads that are not pad_token_id would shift RoBERTa's positions: refused
    with pytest.raises(PaddingError, match="pad_token_id"):
        trainer.training_step(model, LeftPadCollator()(examples))


def test_bert_sequence_head_with_left_padding_is_refused(tmp_path):
    """BERT's pooler reads the first column: a pad for every shorter example under left padding."""
    examples = make_examples(4, VOCAB, causal=False, seed=8, min_len=3, max_len=8)

    class LeftPadSequence(PadCollator):
        def __call__(self, examples):
            batch = super().__call__(examples)
            n = batch["attention_mask"].sum(1)
            for i in range(len(examples)):
                for key in ("input_ids", "attention_mask"):
                    batch[key][i] = batch[key][i].roll(int(batch[key].shape[1] - n[i]))
            return batch

    trainer = DPTrainer(model=tiny_bert(), args=_args(tmp_path, 4), train_dataset=ListDataset(examples),
                        data_collator=LeftPadSequence(0))
    with pytest.raises(PaddingError, match="reads the first column"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_positions_from_the_mask_are_each_rows_own():
    """Left-padded, right-padded, unpadded and empty rows: each real token gets its index from the row's first
    real token (an example's own masked token keeps its column), pads a valid index."""
    from hf_dpfilter.proofs.padding import leading_padding, positions_from_mask

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]])
    assert leading_padding(mask).tolist() == [2, 0, 0, 1, 5]
    assert positions_from_mask(mask).tolist() == [
        [0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 0, 0]]


def test_an_added_example_whose_label_is_ignored_moves_nothing(tmp_path):
    """D' = D plus a classification example labelled -100 (ignored), sampled in the same micro-batch: its loss
    is 0 and it never switches the other rows' loss to another formula, so the clipped sum moves by rounding
    only (the shorter rows are padded to its width), not by up to C. In float64, so that rounding is not read
    as a move."""
    shorts = make_examples(6, VOCAB, causal=False, seed=1, min_len=3, max_len=6)
    d = _one_step_sum(tmp_path / "d", _bert().double(), shorts, PadCollator(0))
    d2 = _one_step_sum(tmp_path / "d2", _bert().double(), shorts + [_long_example(False)], PadCollator(0))
    moved = float((d2 - d).norm()) / 0.1
    assert moved < 1e-9, f"the clipped sum moved by {moved:.2e} C"
