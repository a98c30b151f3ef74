"""DPSeq2SeqTrainer / DPSeq2SeqTrainingArguments: Seq2SeqTrainer's script with the two-class swap.

Every field Seq2SeqTrainingArguments adds has a DP status (hf_dpfilter/trainers/seq2seq.py), the docs hold the
table, and a tiny T5 (LoRA on q and v; the upstream-style summarization script fine-tunes it fully) trains one
private step through DataCollatorForSeq2Seq and evaluates with ``predict_with_generate``;
``sortish_sampler=True`` leaves the Poisson sampler in place.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from models import SHIFTING_SEQ2SEQ, tiny_shifting_seq2seq, tiny_t5, tiny_tokenizer
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments, TrainingArguments

import hf_dpfilter
from hf_dpfilter.randomness.sampling import PoissonBatchSampler
from hf_dpfilter.run.training_fields import STATUSES
from hf_dpfilter.trainers.seq2seq import (
    SEQ2SEQ_FIELD_POLICIES,
    DPSeq2SeqTrainer,
    DPSeq2SeqTrainingArguments,
    render_markdown,
)

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "configuration.md")


def test_every_seq2seq_field_is_classified_and_no_row_is_stale():
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)} - base
    assert added == set(SEQ2SEQ_FIELD_POLICIES), added ^ set(SEQ2SEQ_FIELD_POLICIES)
    assert all(p.status in STATUSES and p.note for p in SEQ2SEQ_FIELD_POLICIES.values())


def test_the_docs_hold_the_table_and_the_names_are_exported():
    with open(DOCS) as f:
        match = re.search(r"<!-- seq2seq-fields:start -->\n(.*?)<!-- seq2seq-fields:end -->", f.read(), re.S)
    assert match and match.group(1) == render_markdown(), "paste hf_dpfilter.trainers.seq2seq.render_markdown() in the docs"
    assert {"DPSeq2SeqTrainer", "DPSeq2SeqTrainingArguments"} <= set(hf_dpfilter.__all__)
    assert hf_dpfilter.DPSeq2SeqTrainer is DPSeq2SeqTrainer


def _rows(tokenizer, sources, targets):
    return [{"input_ids": tokenizer(s)["input_ids"], "labels": tokenizer(text_target=t)["input_ids"]}
            for s, t in zip(sources, targets)]


def test_trains_and_evaluates_with_generate(tmp_path):
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    model = tiny_t5(vocab_size=len(tokenizer))
    train = Dataset.from_list(_rows(tokenizer, ["the cat sat on the mat", "a dog ran", "the bird flew over a "
        "tree",
                                                "a red cat", "the big dog sat"],
                                    ["cat mat", "dog", "bird tree", "red cat", "big dog"]))
    held_out = Dataset.from_list(_rows(tokenizer, ["a small bird", "the slow dog ran"],
                                       ["small bird", "slow dog"]))
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=4, per_device_train_batch_size=2,
        max_steps=1, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        predict_with_generate=True, generation_max_length=6, generation_num_beams=2, sortish_sampler=True,
    )
    seen = {}

    def compute_metrics(prediction):
        seen["shape"] = prediction.predictions.shape
        return {"n": float(len(prediction.predictions))}

    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                               data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
                               processing_class=tokenizer, compute_metrics=compute_metrics)
    assert isinstance(trainer.get_train_dataloader().batch_sampler, PoissonBatchSampler)  # sortish: no effect
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.accountant.steps == 1 and 0 < trainer.privacy_report()["epsilon"] < float("inf")
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    metrics = trainer.evaluate()
    assert metrics["eval_n"] == 2.0 and seen["shape"][0] == 2  # one generated sequence per held-out example
    # a training row in the evaluation set is refused, as any eval
    with pytest.raises(ValueError, match="share"):
        trainer.evaluate(eval_dataset=train.select([0, 1]))


def test_one_step_equals_the_per_example_reference_when_source_and_target_widths_coincide(tmp_path):
    """The padded sources of the logical batch are as long as its padded targets (12), and later micro-batches
    hold only short sources: the decoder's tensors and the labels keep their width (cut to the encoder's used
    columns, they lost target tokens and the re-check refused the step). Float64, noise 0, LoRA on T5: the
    reference sum."""
    from helpers import ListDataset, flat

    from hf_dpfilter.losses.tasks import per_example_loss
    from hf_dpfilter.optimizers.clipping import clip_factors

    tokenizer = tiny_tokenizer()
    model = tiny_t5(vocab_size=len(tokenizer)).double()
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero, which would make A's gradient vanish
            param.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(0)
    widths = [(12, 12), (5, 9), (5, 12), (4, 11), (6, 10)]
    rows = [{"input_ids": torch.randint(5, len(tokenizer), (s,), generator=g).tolist(),
             "labels": torch.randint(5, len(tokenizer), (t,), generator=g).tolist()} for s, t in widths]
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for row in rows:
        alone = collator([dict(row)])
        labels = alone.pop("labels")
        loss = per_example_loss(model(**alone).logits, labels, causal_lm=False)
        grads.append(flat(torch.autograd.grad(loss.sum(), params)))
    norms = torch.stack([x.norm() for x in grads])
    clip = float(norms.median())
    expected = sum(x * f for x, f in zip(grads, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=len(rows),
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        remove_unused_columns=False,
    )
    DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collator).train()
    got = -len(rows) * flat([p.detach() - b for p, b in zip(params, before)])
    assert (got - expected).abs().max().item() <= 1e-6
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9



def _relative_error_of_one_step(tmp_path, model, rows, collator, loss_alone, **extra) -> float:
    """One DPSeq2SeqTrainer step at noise 0 against the float64 reference: ``loss_alone(model, batch,
    labels)`` on each row collated alone, its gradient clipped, summed."""
    return _one_step(tmp_path, model, rows, collator, loss_alone, **extra)[0]


def _one_step(
    tmp_path, model, rows, collator, loss_alone, eval_dataset=None, **extra
) -> tuple[float, DPSeq2SeqTrainer]:
    """:func:`_relative_error_of_one_step`'s error, with the trainer (``eval_dataset`` given to it)."""
    from helpers import ListDataset, flat

    from hf_dpfilter.optimizers.clipping import clip_factors

    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for row in rows:
        alone = collator([dict(row)])
        labels = alone.pop("labels")
        grads.append(flat(torch.autograd.grad(loss_alone(model, alone, labels), params)))
    norms = torch.stack([x.norm() for x in grads])
    clip = float(norms.median())
    expected = sum(x * f for x, f in zip(grads, clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=len(rows),
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        remove_unused_columns=False,
        **extra,
    )
    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows),
                               data_collator=collator, eval_dataset=eval_dataset)
    trainer.train()
    got = -len(rows) * flat([p.detach() - b for p, b in zip(params, before)])
    return ((got - expected).norm() / expected.norm()).item(), trainer


def _t5_rows():
    tokenizer = tiny_tokenizer()
    model = tiny_t5(lora=False, vocab_size=len(tokenizer)).double()
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(5, len(tokenizer), (s,), generator=g).tolist(),
             "labels": torch.randint(5, len(tokenizer), (t,), generator=g).tolist()} for s,
             t in ((6, 3), (4, 5), (3, 2))]
    return tokenizer, model, rows


def test_label_smoothing_is_applied_per_example(tmp_path):
    """``label_smoothing_factor`` (run_summarization/run_translation's common 0.1): one step at noise 0 equals
    the reference with the Trainer's own LabelSmoother on each example alone (it was refused as ignored;
    without the smoothing the step is 7% away)."""
    from transformers.trainer_pt_utils import LabelSmoother

    tokenizer, model, rows = _t5_rows()
    error = _relative_error_of_one_step(
        tmp_path, model, rows, DataCollatorForSeq2Seq(tokenizer, model=model),
        lambda m, batch, labels: LabelSmoother(epsilon=0.1)(m(**batch), labels), label_smoothing_factor=0.1)
    assert error <= 1e-7  # full T5 in float64: ~1e-8


def test_a_collator_without_the_model_gets_the_decoder_inputs_from_each_example_labels(tmp_path):
    """``DataCollatorForSeq2Seq(tokenizer)`` without ``model=`` gives no ``decoder_input_ids``: the model
    builds them from its labels, which the trainer keeps out of its forward; they are built per row from the
    labels (``prepare_decoder_input_ids_from_labels``; it failed inside T5). The reference: HF's own loss,
    labels given."""
    tokenizer, model, rows = _t5_rows()
    error = _relative_error_of_one_step(tmp_path, model, rows, DataCollatorForSeq2Seq(tokenizer),
                                        lambda m, batch, labels: m(**batch, labels=labels).loss)
    assert error <= 1e-7


@pytest.mark.parametrize("model_type", SHIFTING_SEQ2SEQ)
def test_models_that_shift_their_labels_in_the_forward_train_exactly_and_generate(tmp_path, model_type):
    """M2M100 (NLLB-200's architecture), Blenderbot, BlenderbotSmall, NLLB-MoE and SeamlessM4T's text-to-text
    have no ``prepare_decoder_input_ids_from_labels``: their forward shifts the labels with its module's
    ``shift_tokens_right`` (the config's decoder start, -100 read as pad). With a collator without ``model=``
    (no decoder inputs) they failed inside transformers; the same shift is done per row, so one step at noise
    0 equals the float64 reference (the model's own forward, labels given, on each example alone), and
    evaluation generates."""
    from helpers import ListDataset

    from hf_dpfilter.losses.tasks import per_example_loss

    tokenizer = tiny_tokenizer()
    model = tiny_shifting_seq2seq(model_type, vocab_size=len(tokenizer))
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(5, len(tokenizer), (s,), generator=g).tolist(),
             "labels": torch.randint(5, len(tokenizer), (t,), generator=g).tolist()}
            for s, t in ((6, 3), (4, 5), (3, 2))]
    held_out = ListDataset([{"input_ids": [7, 8, 9], "labels": [10, 11]},
                            {"input_ids": [12, 13], "labels": [14]}])

    def loss_alone(m, batch, labels):  # the model shifts the labels itself, as without the trainer
        return per_example_loss(m(**batch, labels=labels).logits, labels, causal_lm=False).sum()

    error, trainer = _one_step(
        tmp_path, model, rows, DataCollatorForSeq2Seq(tokenizer), loss_alone, eval_dataset=held_out,
        predict_with_generate=True, generation_max_length=5, generation_num_beams=1)
    assert error <= 1e-9  # float64: ~1e-14
    prediction = trainer.predict(held_out)
    assert prediction.predictions.shape[0] == 2 and prediction.metrics["test_loss"] > 0


def test_an_encoder_decoder_whose_rule_for_decoder_inputs_is_unknown_is_refused_before_any_step(tmp_path):
    """A model given no decoder inputs, without ``prepare_decoder_input_ids_from_labels`` and whose forward
    calls no recognised ``shift_tokens_right`` (here a subclass overriding the forward): the decoder inputs
    are not guessed; the step is refused, naming the collator that adds them."""
    from helpers import ListDataset

    from hf_dpfilter.data.decoder_inputs import DecoderInputsError

    base = type(tiny_shifting_seq2seq("m2m_100"))

    class Wrapped(base):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    tokenizer = tiny_tokenizer()
    model = Wrapped(tiny_shifting_seq2seq("m2m_100", vocab_size=len(tokenizer)).config).double()
    rows = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [10, 11], "labels": [12, 13, 14]}]
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0, logical_batch_size=2,
        per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        dp_seed=0, remove_unused_columns=False)
    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows),
                               data_collator=DataCollatorForSeq2Seq(tokenizer))
    with pytest.raises(DecoderInputsError, match=r"DataCollatorForSeq2Seq\(tokenizer, model=model\)"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_labels_padded_on_the_left_are_refused_on_every_micro_batch(tmp_path):
    """A tokenizer padding on the left makes DataCollatorForSeq2Seq pad the labels on the left: the decoder
    attends to those pads, as many as the batch's longest target asks. With sources of one length (no encoder
    padding to refuse) such a step was released coupled without the first-step check; the collator's declared
    side is refused on every micro-batch (not the labels' leading -100, which may be the example's own)."""
    from helpers import ListDataset

    from hf_dpfilter.proofs.padding import PaddingError

    tokenizer, model, _ = _t5_rows()
    tokenizer.padding_side = "left"
    rows = [{"input_ids": list(range(5, 10)), "labels": list(range(5, 5 + t))} for t in (3, 5, 2, 4)]
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0, logical_batch_size=4,
        per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        remove_unused_columns=False, dp_verify_first_step=False)
    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows),
                               data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    with pytest.raises(PaddingError, match="labels are padded on the left too"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_user_level_units_clip_each_users_source_and_target_rows_together(tmp_path):
    """privacy_unit='user' on T5 (full: the relative bias is a shared output, its per-unit gradient from the
    per-user losses): a user's encoder rows (the source width) and decoder rows (the target width) are each
    concatenated per user, so one step at noise 0 equals the float64 per-user reference (it was refused: the
    encoder's rows are not the labels' width)."""
    from helpers import ListDataset, flat

    from hf_dpfilter.losses.tasks import per_example_loss
    from hf_dpfilter.optimizers.clipping import clip_factors

    tokenizer, model, _ = _t5_rows()
    model.eval()
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(5, len(tokenizer), (s,), generator=g).tolist(),
             "labels": torch.randint(5, len(tokenizer), (t,), generator=g).tolist(), "user": u}
            for (s, t), u in zip(((6, 3), (4, 5), (3, 2), (5, 4), (2, 3)), "aabcc")]
    seq2seq = DataCollatorForSeq2Seq(tokenizer, model=model)

    def collator(features):
        return seq2seq([{k: v for k, v in f.items() if k != "user"} for f in features])

    params = [p for p in model.parameters() if p.requires_grad]
    per_user: dict[str, torch.Tensor] = {}
    for row in rows:
        alone = collator([row])
        labels = alone.pop("labels")
        loss = per_example_loss(model(**alone).logits, labels, causal_lm=False).sum()
        per_user[row["user"]] = per_user.get(row["user"], 0) + flat(torch.autograd.grad(loss, params))
    norms = torch.stack(list(per_user.values())).norm(dim=1)
    clip = float(norms.median())
    expected = sum(v * f for v, f in zip(per_user.values(), clip_factors(norms, clip)))
    before = [p.detach().clone() for p in params]
    args = DPSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip, logical_batch_size=3,
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0,
        remove_unused_columns=False,
        privacy_unit="user", user_id_column="user", max_examples_per_user=2,
    )
    DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows), data_collator=collator).train()
    got = -3 * flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-9


def test_a_token_budget_bounds_the_decoder_side_too(tmp_path):
    """dp_micro_batch_tokens=16 on short sources with long targets (2-3 source tokens, 8-10 target tokens):
    each grouped micro-batch's rows x padded width stays within the budget on the decoder side too (it counted
    the sources only: 5 rows of 3 source but 10 target tokens, 50 decoder positions), and one step at noise 0
    equals the ungrouped one (float64)."""
    from helpers import ListDataset, flat

    tokenizer, _, _ = _t5_rows()
    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(5, len(tokenizer), (2 + i % 2,), generator=g).tolist(),
             "labels": torch.randint(5, len(tokenizer), (8 + i % 3,), generator=g).tolist()}
             for i in range(8)]

    def step(**kw):
        _, model, _ = _t5_rows()
        seen = []
        model.register_forward_pre_hook(lambda m, a, k: seen.append(
            (k["input_ids"].shape[0], max(k["input_ids"].shape[1], k["decoder_input_ids"].shape[1]))),
            with_kwargs=True)
        args = DPSeq2SeqTrainingArguments(
            output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=0.5,
            logical_batch_size=8,
            per_device_train_batch_size=8, max_steps=1, optim="sgd", learning_rate=1.0, report_to=[],
            use_cpu=True,
            save_strategy="no", dp_seed=0, remove_unused_columns=False, dp_verify_first_step=False, **kw)
        DPSeq2SeqTrainer(model=model, args=args, train_dataset=ListDataset(rows),
                         data_collator=DataCollatorForSeq2Seq(tokenizer, model=model)).train()
        return flat([p.detach() for p in model.parameters()]), seen

    off, _ = step(dp_group_by_length=False)
    on, seen = step(dp_micro_batch_tokens=16)
    # [0]: the lead
    assert sum(n for n, _ in seen) == 8 and all(n * width <= 16 for n, width in seen[1:]), seen
    assert ((on - off).norm() / off.norm()).item() <= 1e-12
