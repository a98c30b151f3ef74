"""Extractive QA: the start/end loss per example, built in
(hf_dpfilter/losses/question_answering.py).

One DPTrainer step at noise 0 on a tiny float64 BERT QA model equals the per-example reference (each example
alone, its gradient clipped, summed) within 1e-6, with the Trainer's default ``remove_unused_columns`` and
nothing but the positions in the batch; the loss of an example does not change when it is padded further (HF's
QA head does not mask padding: its own loss does change), and a position on a padded column or past the row is
ignored, as alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, flat
from models import VOCAB

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.losses.question_answering import span_loss
from hf_dpfilter.optimizers.clipping import clip_factors


def tiny_bert_qa():
    from transformers import AutoConfig, AutoModelForQuestionAnswering

    config = AutoConfig.for_model("bert", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return AutoModelForQuestionAnswering.from_config(config).double()


def qa_examples():
    """Rows as run_qa's preprocessing gives them: ids, mask, one start and end position each. Example 3's end
    lies past its own tokens (on a padded column of its batch), example 4's both sides past every row:
    ignored."""
    g = torch.Generator().manual_seed(1)
    lengths, spans = [9, 5, 7, 4, 6], [(2, 4), (1, 1), (3, 6), (1, 7), (20, 30)]
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist(), "attention_mask": [1] * n,
             "start_positions": s, "end_positions": e} for n, (s, e) in zip(lengths, spans)]


def collate(rows, pad_to: int | None = None):
    """DataCollatorWithPadding's output for these rows (right padding with 0), optionally padded to
    ``pad_to``."""
    longest = max(pad_to or 0, max(len(r["input_ids"]) for r in rows))
    return {
        "input_ids": torch.tensor([r["input_ids"] + [0] * (longest - len(r["input_ids"])) for r in rows]),
        "attention_mask": torch.tensor([r["attention_mask"] + [0] * (longest - len(r["input_ids"]))
                                        for r in rows]),
        "start_positions": torch.tensor([r["start_positions"] for r in rows]),
        "end_positions": torch.tensor([r["end_positions"] for r in rows]),
    }


def _alone_loss(model, row):
    """HF's own QA loss of one example alone (no padding), each side 0 where HF would ignore it."""
    batch = collate([row])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    n = len(row["input_ids"])
    sides = [torch.nn.functional.cross_entropy(logits, batch[k].clamp(0, n)) if int(batch[k]) < n
             else logits.sum() * 0
             for logits, k in ((out.start_logits, "start_positions"), (out.end_logits, "end_positions"))]
    return (sides[0] + sides[1]) / 2


def test_alone_reference_is_hf_loss():
    model = tiny_bert_qa()
    row = qa_examples()[0]
    assert torch.allclose(_alone_loss(model, row), model(**collate([row])).loss, atol=1e-12)


def test_one_step_equals_the_per_example_reference(tmp_path):
    model = tiny_bert_qa()
    rows = qa_examples()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [flat([torch.zeros_like(p) if g is None else g for g, p in zip(
        torch.autograd.grad(_alone_loss(model, r), params, allow_unused=True), params)]) for r in rows]
    norms = torch.stack([g.norm() for g in grads])
    assert norms[-1] == 0 and (norms[:-1] > 0).all()  # both positions past the row: ignored, zero gradient
    clip = float(norms[:-1].median())  # some examples clipped, some not
    expected = sum(g * f for g, f in zip(grads, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=len(rows),
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
    )  # remove_unused_columns left at the Trainer's default: the positions are the model's declared labels
    with pytest.warns(UserWarning, match="Extractive QA at privacy_unit='example'"):  # the unit: one feature
        DPTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collate).train()
    got = -len(rows) * flat([p.detach() - b for p, b in zip(params, before)])
    assert (got - expected).abs().max().item() <= 1e-6
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9


@pytest.mark.parametrize("index", [0, 2, 3])
def test_loss_and_gradient_do_not_depend_on_the_padding(index):
    model = tiny_bert_qa()
    row = qa_examples()[index]
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for pad_to in (None, len(row["input_ids"]) + 5):
        batch = collate([row], pad_to=pad_to)
        labels = torch.stack([batch.pop("start_positions"), batch.pop("end_positions")], dim=1)
        loss = span_loss(model(**batch), labels, batch["attention_mask"])
        results.append((loss.detach(), flat(torch.autograd.grad(loss.sum(), params))))
    (loss_short, grad_short), (loss_long, grad_long) = results
    assert torch.allclose(loss_short, loss_long, rtol=0, atol=1e-12)
    assert (grad_short - grad_long).abs().max().item() <= 1e-12
    if index == 0:  # HF's head leaves the pad columns in the softmax: its loss moves with the padding
        assert abs(model(**collate([row])).loss - model(**collate([row],
                pad_to=len(row["input_ids"]) + 5)).loss) > 1e-6


def test_packed_rows_are_refused():
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="packed rows"):
        span_loss({"start_logits": logits, "end_logits": logits}, torch.zeros(1, 2, dtype=torch.long), None,
                  packed=True)


def test_the_features_of_one_example_are_clipped_as_one_unit(tmp_path):
    """run_qa's long contexts give several rows (features) per example: with the example's id as the user, its
    features' gradients are summed and clipped as one vector (the QA head is token-wise: the engine regroups
    it)."""
    model = tiny_bert_qa()
    rows = [{**r, "example_id": u} for r, u in zip(qa_examples()[:4], ["a", "a", "b", "c"])]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [flat(torch.autograd.grad(_alone_loss(model, r), params)) for r in rows]
    units = [grads[0] + grads[1], grads[2], grads[3]]
    norms = torch.stack([g.norm() for g in units])
    clip = float(norms.max()) / 2
    expected = sum(g * f for g, f in zip(units, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip, logical_batch_size=3,
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0, privacy_unit="user",
        user_id_column="example_id", max_examples_per_user=2,
    )
    DPTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collate).train()
    got = -3 * flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9


def test_an_overflow_mapping_at_example_level_is_refused(tmp_path):
    from datasets import Dataset

    from hf_dpfilter.data.units import PrivacyUnitError

    rows = [{**r, "overflow_to_sample_mapping": i // 2} for i, r in enumerate(qa_examples()[:4])]
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                               logical_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                               save_strategy="no")
    with pytest.raises(PrivacyUnitError, match="privacy_unit='user', user_id_column='example_id'"):
        DPTrainer(model=tiny_bert_qa(), args=args, train_dataset=Dataset.from_list(rows),
                  data_collator=collate).train()


def test_label_smoothing_is_refused_for_the_span_loss():
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 with extractive QA"):
        span_loss({"start_logits": logits, "end_logits": logits}, torch.zeros(1, 2, dtype=torch.long), None,
                  label_smoothing=0.1)


def test_left_padding_is_refused_on_every_micro_batch(tmp_path):
    """Positions from the tokenizer count from the example's first token; padded on the left, the collated row
    moves them by the batch's longest example: a Llama QA head (its positions scheme does not read the first
    column) was released coupled without the first-step check. Refused on the micro-batch, before any
    release."""
    from transformers import LlamaConfig, LlamaForQuestionAnswering

    from hf_dpfilter.proofs.padding import PaddingError

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForQuestionAnswering(config).double()

    def left(rows):
        batch = collate(rows)
        lengths = batch["attention_mask"].sum(1).tolist()
        return {k: torch.stack([torch.cat([row[n:], row[:n]]) for row, n in zip(v, lengths)]) if v.dim() == 2
                else v
                for k, v in batch.items()}

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
                               logical_batch_size=5, per_device_train_batch_size=2, max_steps=1, report_to=[],
                               use_cpu=True, save_strategy="no", dp_seed=0, dp_verify_first_step=False)
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(qa_examples()), data_collator=left)
    with pytest.raises(PaddingError, match="extractive QA"):
        trainer.train()
    assert trainer.accountant.steps == 0
