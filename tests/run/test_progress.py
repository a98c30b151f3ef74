"""The run tells its story while it trains: epsilon in the log at every epoch's end and at the last step (also
when ``logging_steps`` is longer than the run), and, before a run that takes more than a few minutes, the
expected duration with how to shorten it, on the console only (a step's duration depends on its secret batch:
never in ``log_history`` or ``trainer_state.json``). The clock is a fake one: nothing here depends on the
speed of the machine.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.run import progress

N = 12


def _trainer(out, **extra) -> DPTrainer:
    args = dict(output_dir=str(out), noise_multiplier=0.8, per_sample_max_grad_norm=0.5, logical_batch_size=4,
                per_device_train_batch_size=4, num_train_epochs=2, learning_rate=0.01, report_to=[],
                use_cpu=True, save_strategy="no", logging_steps=500, accountant="rdp",
                remove_unused_columns=False, dp_seed=5, seed=7)
    args.update(extra)
    return DPTrainer(model=tiny_roberta(), args=DPTrainingArguments(**args),
                     train_dataset=ListDataset(make_examples(N, VOCAB, causal=False, seed=11)),
                     data_collator=PadCollator(1))


class _FakeClock:
    """Each read ``seconds`` later than the one before."""

    def __init__(self, seconds: float) -> None:
        self.now, self.seconds = 1000.0, seconds

    def __call__(self) -> float:
        self.now += self.seconds
        return self.now


def _step_lines(trainer: DPTrainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "train_runtime" not in e]


def test_epsilon_is_logged_at_every_epochs_end_and_the_last_step_when_logging_steps_exceed_the_run(tmp_path):
    trainer = _trainer(tmp_path)  # 3 steps per epoch, 2 epochs, logging_steps=500
    trainer.train()
    lines = _step_lines(trainer)
    assert [e["step"] for e in lines] == [3, 6], lines  # once per step: the last step is an epoch's end
    for line in lines:
        assert line["epsilon"] == pytest.approx(trainer.privacy_plan.epsilon(line["step"]), rel=1e-2)


def test_the_last_step_is_logged_when_it_ends_no_epoch(tmp_path):
    trainer = _trainer(tmp_path, max_steps=4, num_train_epochs=-1)  # stops one step into epoch 2
    trainer.train()
    assert [e["step"] for e in _step_lines(trainer)] == [3, 4]
    assert all("epsilon" in e for e in _step_lines(trainer))


def test_logging_strategy_no_is_kept(tmp_path):
    trainer = _trainer(tmp_path, logging_strategy="no")
    trainer.train()
    assert _step_lines(trainer) == []


def test_a_long_run_says_how_long_it_expects_and_how_to_shorten_it_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress, "_clock", _FakeClock(120.0))  # each step "takes" 120 s: 5 left = 10 min
    trainer = _trainer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hf_dpfilter.run.progress"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "Expected duration" in r.getMessage()]
    assert len(said) == 1, said
    assert "about 10 min for the 5 remaining steps" in said[0]
    for fix in ("num_train_epochs", "max_steps", "smaller training set", "per_device_train_batch_size"):
        assert fix in said[0], fix
    # each fix it names is a real field of the arguments, and a run with it is accepted
    for field in ("num_train_epochs", "max_steps", "per_device_train_batch_size"):
        assert field in DPTrainingArguments.__dataclass_fields__
    _trainer(tmp_path / "shorter", max_steps=1, per_device_train_batch_size=8)


def test_a_short_run_says_nothing_of_its_duration(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress, "_clock", _FakeClock(1.0))  # 5 s in all: below the threshold
    with caplog.at_level(logging.WARNING, logger="hf_dpfilter.run.progress"):
        _trainer(tmp_path).train()
    assert not [r for r in caplog.records if "Expected duration" in r.getMessage()]


def test_the_duration_never_reaches_the_log_history_or_trainer_state(tmp_path, monkeypatch):
    """The estimate is printed only: the log lines and the saved state of a slow run hold the same keys as a
    fast run's, and no word of the estimate."""
    keys = {}
    for name, seconds in (("slow", 600.0), ("fast", 0.001)):
        monkeypatch.setattr(progress, "_clock", _FakeClock(seconds))
        trainer = _trainer(tmp_path / name, save_strategy="steps", save_steps=3)
        trainer.train()
        keys[name] = [sorted(e) for e in trainer.state.log_history]
        for checkpoint in ("checkpoint-3", "checkpoint-6"):
            with open(os.path.join(tmp_path, name, checkpoint, "trainer_state.json")) as f:
                text = f.read()
            assert "Expected duration" not in text and "600" not in text
            assert all("duration" not in k for e in json.loads(text)["log_history"] for k in e)
    assert keys["slow"] == keys["fast"]
