"""A micro-batch's padding columns are cut from the inputs that run along the tokens, and from the labels only
when the model's head declares them per token; never from a tensor because it is as wide as the row.

A batch padded to a multiple of 8 (``pad_to_multiple_of=8``, run_glue's fp16 default) is 8 columns wide; a
multi-label target of 8 classes is then as wide as the row by chance, and QA's (start, end) pair is as wide as
a micro-batch of 2 columns. Neither may lose label columns when the micro-batch drops its padding: one step at
noise 0 equals the per-example reference (each example alone, its gradient clipped, summed).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, flat
from models import tiny_bert
from test_question_answering import tiny_bert_qa

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.optimizers.clipping import clip_factors


def _pad(rows, multiple: int):
    """Right padding to a multiple of ``multiple`` columns (DataCollatorWithPadding's pad_to_multiple_of)."""
    width = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
    batch = {"input_ids": torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows]),
             "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))
                                             for r in rows])}
    for key in rows[0]:
        if key != "input_ids":
            batch[key] = torch.tensor([r[key] for r in rows])
    return batch


def _multi_label():
    model = tiny_bert(num_labels=8)
    model.config.problem_type = "multi_label_classification"
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(3, 90, (n,), generator=g).tolist(),
             "labels": torch.randint(0, 2, (8,), generator=g).double().tolist()} for n in (3, 5, 7)]
    return model, rows, lambda rows: _pad(rows, 8)


def _qa_two_columns():
    model = tiny_bert_qa()
    rows = [{"input_ids": [5, 6], "start_positions": 0, "end_positions": 1},
            {"input_ids": [7], "start_positions": 0, "end_positions": 0},
            {"input_ids": [8, 9], "start_positions": 1, "end_positions": 0}]
    return model, rows, lambda rows: _pad(rows, 1)


@pytest.mark.parametrize("case", [_multi_label, _qa_two_columns],
                         ids=["multi_label_8_of_8", "qa_pair_2_wide"])
def test_labels_as_wide_as_the_row_by_chance_keep_their_columns(case, tmp_path):
    model, rows, collate = case()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [flat(torch.autograd.grad(model(**collate([r])).loss, params)) for r in rows]
    norms = torch.stack([g.norm() for g in grads])
    clip = float(norms.max()) / 2  # some examples clipped, some not
    expected = sum(g * f for g, f in zip(grads, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=len(rows),
        per_device_train_batch_size=1, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
    )
    DPTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collate).train()
    got = -len(rows) * flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9


class _TextAndFeatures(torch.nn.Module):
    """A model of the user's own: a masked mean of token embeddings and a vector of 8 features per example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(97, 6, dtype=torch.float64)
        self.features = torch.nn.Linear(8, 6, dtype=torch.float64)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)

    def forward(self, input_ids, attention_mask, features, labels=None):
        mask = attention_mask.unsqueeze(-1).to(torch.float64)
        text = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.head(torch.tanh(text + self.features(features.to(torch.float64))))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def test_a_feature_vector_as_wide_as_the_row_keeps_its_columns(tmp_path):
    """A per-example input that does not run along the tokens (8 features, rows padded to 8 columns) is never
    cut with the padding columns: the micro-batch keeps its width (it was cut to the used columns and the step
    failed)."""
    model = _TextAndFeatures()
    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(3, 90, (n,), generator=g).tolist(),
             "features": torch.randn(8, generator=g).tolist(), "labels": n % 2} for n in (3, 5, 7)]
    collate = lambda rows: _pad(rows, 8)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [flat(torch.autograd.grad(model(**collate([r]))["loss"], params)) for r in rows]
    norms = torch.stack([g.norm() for g in grads])
    clip = float(norms.max()) / 2
    expected = sum(g * f for g, f in zip(grads, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=len(rows),
        per_device_train_batch_size=1, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        remove_unused_columns=False,
    )
    DPTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collate).train()
    got = -len(rows) * flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9


def test_left_padding_with_a_multi_label_target_as_wide_as_the_row_is_refused(tmp_path):
    """BERT's head reads the first column, a pad for every short example under left padding: refused on every
    micro-batch, also when the integer multi-label target (8 classes) is as wide as the row (8 tokens, the
    longest example): it was taken for a token-level label and the coupled step released (without the
    first-step check)."""
    from hf_dpfilter.proofs.padding import PaddingError

    model, _, _ = _multi_label()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 90, (n,), generator=g).tolist(),
             "labels": torch.randint(0, 2, (8,), generator=g).tolist()} for n in (3, 8, 5, 4)]

    def left(rows):
        width = max(len(r["input_ids"]) for r in rows)
        return {"input_ids": torch.tensor([[0] * (width - len(r["input_ids"])) + r["input_ids"]
                                           for r in rows]),
                "attention_mask": torch.tensor([[0] * (width - len(r["input_ids"])) + [1] * len(r["input_ids"])
                                                for r in rows]),
                "labels": torch.tensor([r["labels"] for r in rows])}

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
                               logical_batch_size=4, per_device_train_batch_size=2, max_steps=1, report_to=[],
                               use_cpu=True, save_strategy="no", dp_seed=0, dp_verify_first_step=False)
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=left)
    with pytest.raises(PaddingError, match="reads the first column"):
        trainer.train()
    assert trainer.accountant.steps == 0
