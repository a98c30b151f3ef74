"""Which collated tensors carry the example axis is proven on the collator, never guessed from a shape.

The old rule sliced every tensor whose leading dimension equalled the batch size: a tensor shared by all
examples whose length happens to equal B was cut into micro-batches. The probe collates 1, 2 and 3 copies of
one example and classifies each key by how it follows the number of examples.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LeftPadCollator, ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.batch_structure import BatchStructureError, probe_batch_structure


class SharedTableCollator(PadCollator):
    """Adds a table shared by every example (one entry per position): its length T may equal B by
    coincidence."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        batch["shared_positions"] = torch.arange(batch["input_ids"].shape[1])
        return batch


def test_padding_collator_keys_carry_the_example_axis():
    examples = make_examples(3, VOCAB, causal=False)
    structure = probe_batch_structure(PadCollator(1), examples[0])
    assert structure.per_example == {"input_ids", "attention_mask", "labels"}
    assert not structure.packed and not structure.shared


def test_shared_tensor_of_batch_length_is_not_sliced():
    """T == B: three examples of length 3. The shared table has shape (3,) and must reach every micro-batch
    whole."""
    examples = [{"input_ids": torch.arange(3, 6) + i, "labels": i % 2} for i in range(3)]
    collator = SharedTableCollator(1)
    structure = probe_batch_structure(collator, examples[0])
    assert structure.shared == {"shared_positions"}
    batch = collator(examples)
    assert batch["shared_positions"].shape[0] == batch["input_ids"].shape[0] == 3  # the coincidence
    labels = batch.pop("labels")
    micro = structure.micro_batches(batch, labels, size=2)
    assert [m[1].tolist() for m in micro] == [[0, 1], [0]]
    for inputs, _, _ in micro:
        assert torch.equal(inputs["shared_positions"], torch.arange(3))


def test_undeclared_structure_is_refused_with_the_key():
    def collate(examples):
        batch = PadCollator(1)(examples)
        batch["pairs"] = torch.zeros(2 * len(examples) + 1)  # follows the examples in no declared way
        return batch

    with pytest.raises(BatchStructureError, match=r"\['pairs'\]"):
        probe_batch_structure(collate, make_examples(1, VOCAB, causal=False)[0])


def test_batch_with_a_key_the_probe_did_not_see_is_refused(tmp_path):
    args = DPTrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        noise_multiplier=0.0, logical_batch_size=4, max_steps=1, per_device_train_batch_size=2,
    )
    trainer = DPTrainer(model=tiny_roberta(), args=args,
                        train_dataset=ListDataset(make_examples(4, VOCAB, False)),
                        data_collator=PadCollator(1))
    batch = trainer.get_train_dataloader().collate_fn([trainer.train_dataset[i] for i in range(4)])
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    trainer.create_optimizer()
    with pytest.raises(BatchStructureError, match="token_type_ids"):
        trainer.training_step(trainer.model, batch)


def test_packed_rows_with_one_label_per_example_are_refused():
    """A sequence-level label per example next to packed tokens (a classification head on packed rows): the
    head would pool over the whole row, mixing the examples; the structure is refused at the probe."""

    def collate(examples):
        return {
            "input_ids": torch.cat([e["input_ids"] for e in examples]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(e["input_ids"])) for e in examples]).unsqueeze(0),
            "labels": torch.tensor([e["labels"] for e in examples]),
        }

    with pytest.raises(BatchStructureError, match="either packed or one example per row"):
        probe_batch_structure(collate, make_examples(1, VOCAB, causal=False)[0])


class BatchNormalisedWeightsCollator(PadCollator):
    """Per-example loss weights normalised over the batch (1/B each): one per example, but each depends on
    B."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        batch["loss_weights"] = torch.full((len(examples),), 1.0 / len(examples), dtype=torch.float64)
        return batch


class WeightedLossTrainer(DPTrainer):
    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        inputs = dict(inputs)
        weights = inputs.pop("loss_weights")
        logits = model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights


def test_value_normalised_over_the_batch_is_refused_with_its_key(tmp_path):
    """The weights follow the number of examples like a per-example key, so the probe took them as one; the
    first-step check slices the batch (the example 'alone' keeps its 1/B weight) and passed. Adding an example
    changes every other example's weight: with 8 aligned unclipped gradients just under C and one opposite
    example added, the pre-noise aggregate moved by 1.76 C (float32, noise 0; the bound is ~2C). Refused
    before the first step, naming the key."""
    examples = make_examples(6, VOCAB, causal=False)
    with pytest.raises(BatchStructureError, match="'loss_weights'.*computed over the batch"):
        probe_batch_structure(BatchNormalisedWeightsCollator(1), examples[0])
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, logical_batch_size=6,
                               max_steps=1,
                               per_device_train_batch_size=6, report_to=[], use_cpu=True, save_strategy="no",
                               remove_unused_columns=False, dp_seed=0, optim="sgd", learning_rate=0.1)
    trainer = WeightedLossTrainer(model=tiny_roberta(), args=args, train_dataset=ListDataset(examples),
                                  data_collator=BatchNormalisedWeightsCollator(1))
    with pytest.raises(BatchStructureError, match="'loss_weights'"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_masked_lm_collator_with_random_masking_is_accepted(tmp_path):
    """Random masking differs between copies by design (independent per example): not taken for a batch
    value."""
    from transformers import BertTokenizerFast, DataCollatorForLanguageModeling

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(40)]]))
    collator = DataCollatorForLanguageModeling(BertTokenizerFast(vocab_file=str(vocab)), mlm=True,
                                               mlm_probability=0.5)
    structure = probe_batch_structure(collator, {"input_ids": list(range(5, 30))})
    assert {"input_ids", "labels"} <= structure.per_example


class LongestNormalisedWeightsCollator(PadCollator):
    """Per-example weights normalised by the longest example of the batch: copies of one example all get 1."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        lengths = torch.tensor([len(e["input_ids"]) for e in examples], dtype=torch.float64)
        batch["loss_weights"] = lengths / lengths.max()
        return batch


def test_value_normalised_by_the_batch_content_is_refused(tmp_path):
    """Copies of one example cannot show a normalisation by the longest example; two different examples do."""
    examples = make_examples(6, VOCAB, causal=False)
    assert len(examples[1]["input_ids"]) < len(examples[0]["input_ids"])
    probe_batch_structure(LongestNormalisedWeightsCollator(1), examples[0])  # copies alone: not seen
    with pytest.raises(BatchStructureError, match="'loss_weights'.*collated with another"):
        probe_batch_structure(LongestNormalisedWeightsCollator(1), examples[0], examples[1])
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=0.0, logical_batch_size=6,
                               max_steps=1,
                               per_device_train_batch_size=6, report_to=[], use_cpu=True, save_strategy="no",
                               remove_unused_columns=False, dp_seed=0, optim="sgd", learning_rate=0.1)
    trainer = WeightedLossTrainer(model=tiny_roberta(), args=args, train_dataset=ListDataset(examples),
                                  data_collator=LongestNormalisedWeightsCollator(1))
    with pytest.raises(BatchStructureError, match="'loss_weights'"):
        trainer.train()
    assert trainer.accountant.steps == 0



@pytest.mark.parametrize("collator", [PadCollator(1), LeftPadCollator(1), "flattening"])
def test_padding_either_side_and_packing_pass_the_pair_check(collator):
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening() if collator == "flattening" else collator
    examples = make_examples(3, VOCAB, causal=True)
    probe_batch_structure(collator, examples[0], examples[1])
