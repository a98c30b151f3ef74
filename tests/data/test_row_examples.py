"""A row that visibly holds several examples is refused, unless dp_row_is_unit=True declares the row the unit.

The sampler draws rows and each row is clipped as one vector, so a row holding several examples
(position_ids restarting inside a padded row, its own packed columns, two chat conversations) is protected
as a row: adding an example to it is a change of that row (ratio 1.30 against the add/remove bound 1 at the
example level). Such rows are refused with both fixes on every training batch; with the declaration they
train and the privacy report, the start report and the model card say "add/remove one row (a row may hold
several examples)". Ordinary rows (one example, a multi-turn conversation) still train.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random

import pytest
import torch
from helpers import ListDataset, make_examples, noise_free_args
from models import VOCAB, tiny_gpt2
from transformers import DataCollatorWithFlattening

from hf_dpfilter import DPTrainer
from hf_dpfilter.data.packing import PackingError
from hf_dpfilter.proofs.row_examples import conversation_start_marker

_NO_TRL = importlib.util.find_spec("trl") is None and os.environ.get("HF_DPFILTER_NO_SKIP") != "1"
needs_trl = pytest.mark.skipif(_NO_TRL, reason="needs trl (hf_dpfilter[trl])")
FIXES = ("one example per row", "dp_row_is_unit=True")
ROW_RELATION = "add/remove one row (a row may hold several examples)"


class PaddingCollator:
    """One row per data-set row, padded on ``side``; each row's own `position_ids` passed through (0.. if it
    has none), pads at position ``pad_position``; with ``restart_at`` the collator itself restarts the
    positions after every token of that id (a collator that adds position_ids)."""

    def __init__(self, side: str = "right", pad_position: int = 0, restart_at: int | None = None,
                 positions: bool = True) -> None:
        self.side, self.pad_position = side, pad_position
        self.restart_at, self.positions = restart_at, positions

    def _own_positions(self, row: dict) -> torch.Tensor:
        n = len(row["input_ids"])
        if "position_ids" in row:
            return torch.as_tensor(row["position_ids"])
        if self.restart_at is None:
            return torch.arange(n)
        out, p = [], 0
        for token in torch.as_tensor(row["input_ids"]).tolist():
            out.append(p)
            p = 0 if token == self.restart_at else p + 1
        return torch.tensor(out)

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(r["input_ids"]) for r in rows)
        out = {k: torch.full((len(rows), longest), v, dtype=torch.long)
               for k, v in (("input_ids", 0), ("labels", -100), ("position_ids", self.pad_position),
                            ("attention_mask", 0))}
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            cols = slice(0, n) if self.side == "right" else slice(longest - n, longest)
            out["input_ids"][i, cols] = torch.as_tensor(r["input_ids"])
            out["labels"][i, cols] = torch.as_tensor(r["labels"])
            out["attention_mask"][i, cols] = 1
            out["position_ids"][i, cols] = self._own_positions(r)
        if not self.positions:
            del out["position_ids"]
        return out


def _packed_row(k: int = 3, seed: int = 11) -> dict:
    """k examples concatenated in one row, `position_ids` restarting at each (a data set packed before)."""
    segments = make_examples(k, VOCAB, causal=True, seed=seed, min_len=4, max_len=6)
    return {
        "input_ids": torch.cat([s["input_ids"] for s in segments]),
        "labels": torch.cat([s["labels"] for s in segments]),
        "position_ids": torch.cat([torch.arange(len(s["input_ids"])) for s in segments]),
    }


def _args(tmp_path, n, **kw):
    return noise_free_args(tmp_path, n, 0.01, **kw)


def _trainer(tmp_path, rows, collator, **kw):
    return DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(tmp_path, len(rows), **kw),
                     train_dataset=ListDataset(rows), data_collator=collator)


def _refused(trainer) -> str:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(PackingError) as refusal:
        trainer.train()
    message = str(refusal.value)
    assert all(fix in message for fix in FIXES), message
    assert trainer.accountant.steps == 0  # refused before the step was released
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    return message


def _data(n=4, seed=3):
    return make_examples(n, VOCAB, causal=True, seed=seed)


# ---------------------------------------------------------------------- padded rows with restarting positions
@pytest.mark.parametrize("where", [0, 3])
def test_padded_row_whose_positions_restart_is_refused_with_both_fixes(where, tmp_path):
    data = _data()
    rows = data[:where] + [_packed_row()] + data[where:]
    message = _refused(_trainer(tmp_path, rows, PaddingCollator()))
    assert "restart" in message


def test_declared_row_unit_trains_and_is_reported_in_the_report_the_banner_and_the_card(tmp_path, caplog):
    data = _data()
    rows = data[:3] + [_packed_row()] + data[3:]
    trainer = _trainer(tmp_path, rows, PaddingCollator(), dp_row_is_unit=True)
    with caplog.at_level(logging.WARNING, logger="hf_dpfilter.run.start_report"):
        trainer.train()
    assert trainer.accountant.steps == 1
    report = trainer.privacy_report()
    assert report["neighbouring_relation"] == ROW_RELATION and report["row_is_unit"] is True
    assert report["num_units"] == len(rows)  # N counts rows
    banner = caplog.text
    assert "protected unit: one row" in banner and "a row may hold several examples" in banner
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "row-level (ε, δ)" in card and ROW_RELATION in card and "example-level" not in card


def test_ordinary_padded_rows_train_without_the_declaration(tmp_path):
    """One example per row, pads at position 0 after the real tokens (a restart only in the padding)."""
    trainer = _trainer(tmp_path, _data(), PaddingCollator(pad_position=0))
    trainer.train()
    assert trainer.accountant.steps == 1
    report = trainer.privacy_report()
    assert report["neighbouring_relation"] == "add/remove one example" and "row_is_unit" not in report


def test_left_padded_ordinary_rows_train_and_left_padded_restarts_are_refused(tmp_path):
    """Leading pads at position 0 before positions 0.. are no restart; a restart among the real tokens is."""
    trainer = _trainer(tmp_path / "ok", _data(), PaddingCollator(side="left"))
    trainer.train()
    assert trainer.accountant.steps == 1
    rows = _data()[:2] + [_packed_row()] + _data()[2:]
    _refused(_trainer(tmp_path / "packed", rows, PaddingCollator(side="left")))


def test_positions_given_in_some_rows_only_are_read_from_the_row_itself(tmp_path):
    """Only the packed row carries `position_ids`; the collator either fills the others' (the batch
    restarts) or returns none at all (the row's own column says it is packed): refused both ways."""
    rows = _data()[:3] + [_packed_row()] + _data()[3:]
    _refused(_trainer(tmp_path / "filled", rows, PaddingCollator()))
    _refused(_trainer(tmp_path / "dropped", rows, PaddingCollator(positions=False)))


def test_collator_that_adds_restarting_positions_is_refused(tmp_path):
    """No column in the rows: the collator restarts the positions after a separator token it finds."""
    data = _data()
    separator = int(data[2]["input_ids"][1])
    message = _refused(_trainer(tmp_path, data, PaddingCollator(restart_at=separator)))
    assert "restart" in message


class SharedPositionsCollator(PaddingCollator):
    """Pads on the right and returns one row of `position_ids` for the whole batch (the model broadcasts it),
    restarting after ``restart_at`` tokens."""

    def __call__(self, rows: list[dict]) -> dict:
        out = super().__call__([{k: v for k, v in r.items() if k != "position_ids"} for r in rows])
        width = out["input_ids"].shape[1]
        cut = min(self.restart_at, width)
        out["position_ids"] = torch.cat([torch.arange(cut), torch.arange(width - cut)]).unsqueeze(0)
        return out


def test_collator_that_shares_one_restarting_row_of_positions_is_refused(tmp_path):
    """The probe sees the same (1, T) positions for copies of one row (a shared key): its restart still
    splits every row it falls inside."""
    message = _refused(_trainer(tmp_path, _data(), SharedPositionsCollator(restart_at=3)))
    assert "restart" in message


def test_packed_row_first_sampled_at_a_later_step_is_refused_before_that_step(tmp_path):
    """Checked on every batch, not only the probe's rows: the steps before it are released, not its own."""
    rows = _data(8, seed=5)
    index = 6
    rows = rows[:index] + [_packed_row()] + rows[index:]
    for seed in range(50):
        trainer = _trainer(tmp_path, rows, PaddingCollator(), logical_batch_size=3, max_steps=3, dp_seed=seed)
        trainer.get_train_dataloader()
        steps = [set(batch) for batch in trainer._dp_sampler]
        first = next((s for s, batch in enumerate(steps) if index in batch), None)
        if first is not None and first >= 1:
            break
    else:
        pytest.fail("no seed samples the packed row first at a later step")
    with pytest.raises(PackingError, match="dp_row_is_unit=True"):
        trainer.train()
    assert trainer.accountant.steps == first


def test_flattening_collator_that_renumbers_a_packed_row_is_refused_unless_declared(tmp_path):
    """DataCollatorWithFlattening drops the row's own `position_ids`: one segment, the row says it holds 3."""
    rows = _data()[:3] + [_packed_row()] + _data()[3:]
    _refused(_trainer(tmp_path / "refused", rows, DataCollatorWithFlattening()))
    trainer = _trainer(tmp_path / "declared", rows, DataCollatorWithFlattening(), dp_row_is_unit=True)
    trainer.train()
    assert trainer.accountant.steps == 1


def test_declaration_does_not_let_a_packed_batch_clip_a_rows_segments_apart(tmp_path):
    """Padding-free batches that keep the row's restarts clip each segment on its own: still refused."""
    from test_prepacked_rows import PositionsFlatteningCollator

    rows = _data()[:3] + [_packed_row()] + _data()[3:]
    with pytest.raises(PackingError, match="Pack after sampling"):
        _trainer(tmp_path, rows, PositionsFlatteningCollator(), dp_row_is_unit=True).train()


def test_user_level_rows_holding_several_examples_are_refused_unless_declared(tmp_path):
    data = [{**e, "user": f"u{i % 2}"} for i, e in enumerate(_data())]
    rows = data[:3] + [{**_packed_row(), "user": "u0"}] + data[3:]
    user = dict(privacy_unit="user", user_id_column="user", max_examples_per_user=3)
    _refused(DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(tmp_path / "r", 2, **user),
                       train_dataset=ListDataset(rows), data_collator=PaddingCollator()))
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), train_dataset=ListDataset(rows),
                        args=_args(tmp_path / "d", 2, dp_row_is_unit=True, **user),
                        data_collator=PaddingCollator())
    trainer.train()
    relation = trainer.privacy_report()["neighbouring_relation"]
    assert relation == "add/remove one user (all of their rows; a row may hold several examples)"


def test_evaluation_batches_are_not_refused(tmp_path):
    """Evaluation releases no training step: a packed eval row is evaluated as the plain Trainer would."""
    trainer = _trainer(tmp_path, _data(), PaddingCollator())
    metrics = trainer.evaluate(eval_dataset=ListDataset([_packed_row(seed=21), _packed_row(2, seed=22)]))
    assert "eval_loss" in metrics


def test_declaration_is_part_of_a_resumes_identity(tmp_path):
    from hf_dpfilter.run.unit_identity import unit_record

    # unchanged for runs that never set it (and for the records of earlier versions)
    assert unit_record(_args(tmp_path, 4), None) == {"unit": "example"}
    declared = unit_record(_args(tmp_path, 4, dp_row_is_unit=True), None)
    assert declared == {"unit": "example", "row_is_unit": True}


# ---------------------------------------------------------------------------------------- chat conversations
WORDS = "the cafe serves cheap italian food near riverside family friendly".split()


def _tokenizer(template: str | None = None):
    from recipes.common.offline_chat import byte_level_chat_tokenizer

    tokenizer = byte_level_chat_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _conversation_rows(tokenizer, n, seed, turns=1, system=False):
    """n conversations tokenized as TRL prepares them (assistant-only labels), for skip_prepare_dataset."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "be brief"}] if system else []
        for _ in range(turns):
            question, answer = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
                                for _ in range(2))
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = list(encoded["input_ids"])
        labels = [t if m else -100 for t, m in zip(ids, encoded["assistant_masks"])]
        out.append({"input_ids": ids, "labels": labels})
    return out


def _two(rows):
    return {key: rows[0][key] + rows[1][key] for key in ("input_ids", "labels")}


def _sft_trainer(tmp_path, rows, tokenizer, **kw):
    import datasets

    from hf_dpfilter import DPSFTConfig, DPSFTTrainer
    from recipes.common.offline_chat import small_llama

    args = DPSFTConfig(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=0.01,
        logical_batch_size=len(rows), per_device_train_batch_size=2, max_steps=1, optim="sgd",
        learning_rate=1.0, lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0, bf16=False,
        gradient_checkpointing=False, max_length=128, remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True}, **{"packing": True, **kw})
    model = small_llama(tokenizer, hidden_size=16, heads=4, max_positions=256, dtype=torch.float32)
    return DPSFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=tokenizer)


def test_chat_template_start_marker_is_the_conversation_start_not_a_turn_header():
    tokenizer = _tokenizer()
    assert conversation_start_marker(tokenizer) == (tokenizer.bos_token_id,)
    # a default system block starts every conversation; each user turn's header does not
    default_system = ("{% if messages[0]['role'] != 'system' %}<|system|>default<|end|>{% endif %}"
                      "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                      "{% endfor %}")
    system = tokenizer.convert_tokens_to_ids("<|system|>")
    assert conversation_start_marker(_tokenizer(default_system)) == (system,)
    # ChatML-like without BOS or default system: two conversations render as one of more turns, no marker
    turns_only = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                  "{% endfor %}")
    assert conversation_start_marker(_tokenizer(turns_only)) is None
    assert conversation_start_marker(object()) is None


@needs_trl
@pytest.mark.parametrize("packing", [True, False])
def test_sft_rows_of_two_conversations_are_refused_and_train_when_declared(packing, tmp_path):
    tokenizer = _tokenizer()
    convs = _conversation_rows(tokenizer, 6, seed=1)
    rows = convs[:3] + [_two(convs[4:6])] + convs[3:4]
    message = _refused(_sft_trainer(tmp_path / "refused", rows, tokenizer, packing=packing))
    assert "conversation" in message
    trainer = _sft_trainer(tmp_path / "declared", rows, tokenizer, packing=packing, dp_row_is_unit=True)
    trainer.train()
    assert trainer.accountant.steps == 1
    assert trainer.privacy_report()["neighbouring_relation"] == ROW_RELATION


@needs_trl
@pytest.mark.parametrize("packing", [True, False])
def test_sft_multi_turn_and_system_conversations_train_without_the_declaration(packing, tmp_path):
    """One conversation per row, several turns (a turn header repeated), a system message, a doubled BOS."""
    tokenizer = _tokenizer()
    rows = _conversation_rows(tokenizer, 2, seed=3, turns=3)
    rows += _conversation_rows(tokenizer, 2, seed=4, system=True)
    bos = tokenizer.bos_token_id
    rows.append({"input_ids": [bos] + rows[0]["input_ids"], "labels": [-100] + rows[0]["labels"]})
    trainer = _sft_trainer(tmp_path, rows, tokenizer, packing=packing)
    trainer.train()
    assert trainer.accountant.steps == 1
    assert trainer.privacy_report()["neighbouring_relation"] == "add/remove one example"
