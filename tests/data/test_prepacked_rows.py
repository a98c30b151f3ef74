"""A row the data set packed is one unit: never sampled per row and clipped per segment.

The sampler draws data-set rows. A padding collator keeps each row one example (its segments clipped together,
by construction); a padding-free collator makes every segment of ``position_ids`` its own clipped example, so
a pre-packed row (``position_ids`` restarting inside it, TRL's ``seq_lengths``) is refused on every collated
batch, before the step that would hold it -- also when it is first sampled at a later step. A row whose first
segment continues the previous row's positions used to make up for its extra segment in the segment count
(ratio 1.29).

Sensitivity at noise 0 in float32 through the public API: q = 1, SGD with lr 1, so the update is
-(1/B) x the clipped sum; D' = D plus one pre-packed row; ratio = |sum(D') - sum(D)| / C <= 1 + 1e-4 or
refused.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from helpers import ListDataset, make_examples, noise_free_args
from models import VOCAB, tiny_gpt2
from transformers import DataCollatorWithFlattening

from hf_dpfilter import DPTrainer
from hf_dpfilter.data.packing import PackingError

FIX = "Pack after sampling"
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None
                               and os.environ.get("HF_DPFILTER_NO_SKIP") != "1",
                               reason="needs trl (hf_dpfilter[trl])")
CLIP = 0.01  # every example clipped: each contributes a vector of norm C exactly


class PositionsPaddingCollator:
    """Right-pads one example per row and passes each row's own `position_ids` through (restarts kept)."""

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(r["input_ids"]) for r in rows)
        out = {k: torch.full((len(rows), longest), v, dtype=torch.long)
               for k, v in (("input_ids", 0), ("labels", -100), ("position_ids", 0), ("attention_mask", 0))}
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            positions = torch.as_tensor(r.get("position_ids", range(n)))
            out["input_ids"][i, :n], out["labels"][i,
                    :n] = torch.as_tensor(r["input_ids"]), torch.as_tensor(r["labels"])
            out["position_ids"][i, :n], out["attention_mask"][i, :n] = positions, 1
            out["position_ids"][i, n:] = positions[-1] + 1 + torch.arange(longest - n)
        return out


class PositionsFlatteningCollator:
    """Padding-free: the rows one after the other in one row, each with its own `position_ids` (0.. if
    none)."""

    def __call__(self, rows: list[dict]) -> dict:
        def cat(key):
            return torch.cat([torch.as_tensor(r[key]) if key in r else torch.arange(len(r["input_ids"]))
                              for r in rows]).unsqueeze(0)

        return {"input_ids": cat("input_ids"), "labels": cat("labels"), "position_ids": cat("position_ids")}


def prepacked_row(segments: list[dict], first_position: int = 0) -> dict:
    """Several examples packed in one data-set row, `position_ids` restarting at each (the first from
    ``first_position``: a row that continues the previous row's positions)."""
    starts = [first_position] + [0] * (len(segments) - 1)
    return {
        "input_ids": torch.cat([s["input_ids"] for s in segments]),
        "labels": torch.cat([s["labels"] for s in segments]),
        "position_ids": torch.cat([torch.arange(a, a + len(s["input_ids"])) for a,
                                   s in zip(starts, segments)]),
    }


def _args(tmp_path, n, **kw):
    return noise_free_args(tmp_path, n, CLIP, **kw)


def _trainer(tmp_path, rows, collator, **kw):
    return DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(tmp_path, len(rows), **kw),
                     train_dataset=ListDataset(rows), data_collator=collator)


def clipped_sum(tmp_path, rows, collator, **kw) -> torch.Tensor:
    """The step's clipped sum (q = 1, noise 0, SGD lr 1): -B x the update, B = the number of rows."""
    trainer = _trainer(tmp_path, rows, collator, **kw)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    trainer.train()
    assert trainer.num_train_examples == len(rows)  # the accounting counts the rows, what is sampled
    return torch.cat([(b - p.detach()).reshape(-1) for p, b in zip(params, before)]) * len(rows)


def ratio(tmp_path, rows, more_rows, collator, **kw) -> float:
    without = clipped_sum(tmp_path / "d", rows, collator, **kw)
    with_row = clipped_sum(tmp_path / "d_prime", more_rows, collator, **kw)
    return float((with_row - without).norm()) / CLIP


def _data(n=4, seed=3):
    return make_examples(n, VOCAB, causal=True, seed=seed)


def _segments(k=3):
    return make_examples(k, VOCAB, causal=True, seed=11, min_len=5, max_len=8)


# -------------------------------------------------------------------------- route (a): DPTrainer, packed
# batches
@pytest.mark.parametrize(("segments", "where", "continues"), [(2, 3, True), (3, 3, False), (3, 0, False)])
def test_prepacked_row_in_padding_free_batches_is_refused_before_the_step(segments, where, continues,
                                                                          tmp_path):
    """D' = D plus one pre-packed row, in dataset[0] or later. ``continues``: its first segment continues the
    previous row's positions, which made the segment count match (old code: trained, ratio 1.29 > 1)."""
    data = _data()
    previous = len(data[where - 1]["input_ids"]) if continues else 0
    more = data[:where] + [prepacked_row(_segments(segments), first_position=previous)] + data[where:]
    trainer = _trainer(tmp_path, more, PositionsFlatteningCollator())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(PackingError, match=FIX) as refusal:
        trainer.train()
    assert "pre-packed" in str(refusal.value) or "continue the previous row" in str(refusal.value)
    assert trainer.accountant.steps == 0  # refused before the step was released
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))


def test_row_that_continues_the_previous_rows_positions_is_refused(tmp_path):
    """One segment alone, but merged with the row before it in the batch: not what the sampler drew."""
    data = _data()
    merged = {**data[2], "position_ids": torch.arange(len(data[2]["input_ids"])) + len(data[1]["input_ids"])}
    rows = data[:2] + [merged] + data[3:]
    with pytest.raises(PackingError, match="continue the previous row"):
        _trainer(tmp_path, rows, PositionsFlatteningCollator()).train()


def test_prepacked_row_first_sampled_at_a_later_step_is_refused_before_that_step(tmp_path):
    """Not in dataset[0]/[1] (the probe's rows) and not in step 1: refused at the step that samples it, after
    the steps before it were released normally (old code: trained through it)."""
    data = _data(8, seed=5)
    index = 5
    rows = data[:index] + [prepacked_row(_segments(2),
                                         first_position=len(data[index - 1]["input_ids"]))] + data[index:]
    for seed in range(50):
        trainer = _trainer(tmp_path, rows, PositionsFlatteningCollator(), logical_batch_size=3, max_steps=3,
                           dp_seed=seed)
        trainer.get_train_dataloader()
        steps = [set(batch) for batch in trainer._dp_sampler]  # one epoch: 3 steps
        first = next((s for s, batch in enumerate(steps) if index in batch), None)
        # with the row before it in that step: its positions continue that row's, so the segment count matches
        if first is not None and first >= 1 and index - 1 in steps[first]:
            break
    else:
        pytest.fail("no seed samples the pre-packed row first at a later step")
    with pytest.raises(PackingError) as refusal:
        trainer.train()
    assert trainer.accountant.steps == first  # the steps before it released, not the one that sampled it
    assert FIX in str(refusal.value)


@needs_trl
def test_trl_padding_free_collator_with_seq_lengths_is_refused_with_the_fix(tmp_path):
    """TRL's padding-free collator honours a row's `seq_lengths` (restarting positions inside the row)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    def as_lists(e, lengths=None):
        return {"input_ids": e["input_ids"].tolist(), "labels": e["labels"].tolist(),
                "seq_lengths": lengths or [len(e["input_ids"])]}

    segments = _segments(2)
    row = as_lists(prepacked_row(segments), [len(s["input_ids"]) for s in segments])
    rows = [as_lists(e) for e in _data()[:3]] + [row]
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    with pytest.raises(PackingError, match=FIX):
        _trainer(tmp_path, rows, collator).train()


# ------------------------------------------------------------------- route (a): rows kept whole, clipped
# together
def test_padding_collator_clips_a_prepacked_row_as_one_unit(tmp_path):
    """One data-set row = one row of the batch = one clipped vector, whatever it packs: ratio <= 1 over rows
    (declared with dp_row_is_unit; without it the row is refused, tests/data/test_row_examples.py)."""
    data = _data()
    more = data[:3] + [prepacked_row(_segments())] + data[3:]
    moved = ratio(tmp_path, data, more, PositionsPaddingCollator(), dp_row_is_unit=True)
    assert 0.5 < moved <= 1 + 1e-4, moved


def test_flattening_collator_keeps_a_prepacked_row_one_segment(tmp_path):
    """DataCollatorWithFlattening numbers each row's positions itself (the row's own are not used): the row is
    one segment, so one clipped vector (declared with dp_row_is_unit: its own column says it holds
    several)."""
    data = _data()
    more = data[:3] + [prepacked_row(_segments())] + data[3:]
    moved = ratio(tmp_path, data, more, DataCollatorWithFlattening(), dp_row_is_unit=True)
    assert 0.5 < moved <= 1 + 1e-4, moved


def test_one_example_per_row_trains_and_moves_the_sum_by_at_most_c(tmp_path):
    """Negative control: unpacked rows with the same padding-free collator, D' = D plus one example."""
    data = _data()
    extra = _segments(1)[0]
    moved = ratio(tmp_path, data, data[:3] + [extra] + data[3:], PositionsFlatteningCollator())
    assert 0.5 < moved <= 1 + 1e-4, moved


# ------------------------------------------------------------- route (b): DPSFTTrainer, skip_prepare_dataset
WORDS = "the cafe serves cheap italian food near riverside family friendly".split()


def _sft_rows(n, seed):
    """n conversations tokenized as TRL prepares them (assistant-only labels), for skip_prepare_dataset."""
    from recipes.common.offline_chat import byte_level_chat_tokenizer

    tokenizer = byte_level_chat_tokenizer()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, answer = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(2))
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = list(encoded["input_ids"])
        out.append({"input_ids": ids,
                    "labels": [t if m else -100 for t, m in zip(ids, encoded["assistant_masks"])]})
    return out, tokenizer


def _two_conversations(convs, first_position=0, column=None):
    row = {"input_ids": convs[0]["input_ids"] + convs[1]["input_ids"],
           "labels": convs[0]["labels"] + convs[1]["labels"]}
    if column == "position_ids":
        row["position_ids"] = (list(range(first_position, first_position + len(convs[0]["input_ids"])))
                               + list(range(len(convs[1]["input_ids"]))))
    elif column == "seq_lengths":
        row["seq_lengths"] = [len(c["input_ids"]) for c in convs]
    return row


def _sft_trainer(tmp_path, rows, tokenizer, collator=None, **kw):
    import datasets

    from hf_dpfilter import DPSFTConfig
    from recipes.common.offline_chat import small_llama

    args = DPSFTConfig(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=CLIP,
        logical_batch_size=len(rows),
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0, bf16=False,
        gradient_checkpointing=False, max_length=128, remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True}, **{"packing": True, **kw})
    model = small_llama(tokenizer, hidden_size=16, heads=4, max_positions=128, dtype=torch.float32)
    from hf_dpfilter import DPSFTTrainer

    return DPSFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=tokenizer, data_collator=collator)


def _sft_sum(tmp_path, rows, tokenizer, collator=None, **kw):
    trainer = _sft_trainer(tmp_path, rows, tokenizer, collator, **kw)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    trainer.train()
    assert trainer.num_train_examples == len(rows)
    return torch.cat([(b - p.detach()).reshape(-1) for p, b in zip(params, before)]) * len(rows)


@needs_trl
@pytest.mark.parametrize("continues", [False, True])
def test_sft_rows_of_two_conversations_with_their_own_positions_are_refused(continues, tmp_path):
    """skip_prepare_dataset, each pre-packed row two conversations with `position_ids` restarting inside it,
    and a padding-free collator that passes them through (old code with ``continues``: trained, ratio 1.08 >
    1)."""
    convs, tokenizer = _sft_rows(6, seed=1)
    single = [{**c, "position_ids": list(range(len(c["input_ids"])))} for c in convs[:4]]
    first = len(single[2]["input_ids"]) if continues else 0
    rows = single[:3] + [_two_conversations(convs[4:], first, "position_ids")] + single[3:]
    # TRL takes a collator of one's own only without its padding-free packing: DPTrainer's packed
    # micro-batches
    trainer = _sft_trainer(tmp_path, rows, tokenizer, PositionsFlatteningCollator(), packing=False)
    with pytest.raises(PackingError, match=FIX):
        trainer.train()
    assert trainer.accountant.steps == 0


@needs_trl
def test_sft_seq_lengths_column_is_refused_when_the_trainer_is_created(tmp_path):
    convs, tokenizer = _sft_rows(6, seed=1)
    rows = [{**c, "seq_lengths": [len(c["input_ids"])]} for c in convs[:4]]
    rows.append(_two_conversations(convs[4:], column="seq_lengths"))
    with pytest.raises(ValueError, match="packing=True"):
        _sft_trainer(tmp_path, rows, tokenizer)


@needs_trl
def test_sft_two_conversations_in_a_row_without_boundaries_are_one_unit(tmp_path):
    """TRL's collator numbers a row's positions 0.. itself: the row (two conversations) is one segment, one
    clipped vector, and the accounting counts rows. Ratio <= 1 over rows (declared with dp_row_is_unit;
    without it the row is refused by the chat template's start marker, tests/data/test_row_examples.py)."""
    convs, tokenizer = _sft_rows(7, seed=2)
    rows = convs[:4]
    more = rows[:2] + [_two_conversations(convs[4:6])] + rows[2:]
    without = _sft_sum(tmp_path / "d", rows, tokenizer, dp_row_is_unit=True)
    with_row = _sft_sum(tmp_path / "d_prime", more, tokenizer, dp_row_is_unit=True)
    moved = float((with_row - without).norm()) / CLIP
    assert 0.5 < moved <= 1 + 1e-4, moved


@needs_trl
def test_sft_packing_after_sampling_moves_the_sum_by_at_most_c(tmp_path):
    """Negative control: one conversation per row, DPSFTTrainer packs each step's sample; D' = D plus one."""
    convs, tokenizer = _sft_rows(5, seed=2)
    without = _sft_sum(tmp_path / "d", convs[:4], tokenizer)
    with_row = _sft_sum(tmp_path / "d_prime", convs, tokenizer)
    moved = float((with_row - without).norm()) / CLIP
    assert 0.5 < moved <= 1 + 1e-4, moved
