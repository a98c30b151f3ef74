"""At ``privacy_unit='user'`` nothing a run publishes gives back its number of examples
(hf_dpfilter/trainers/trainer.py).

The number of users is the plan's public N; the number of examples is private: two runs, on D and on D without
one user, would otherwise give that user's example count. The Trainer counts the example-level data set
(``train_samples_per_second x train_runtime`` = examples x epochs), in the log lines, ``train()``'s
metrics, ``train_results.json``/``all_results.json``, ``trainer_state.json`` (final and checkpoints), every
``report_to`` logger and its "Num examples" start line.

* A user-level run on D and on D minus one user (several examples each): every log line, returned metric and
  published file (json, md, txt) holds no example or token count, each published speed times its runtime is
  the step count, and every published number other than wall-clock time is the same in both runs except those
  of the user count (epsilon, delta, q).
* Ways in: a resumed run, ``evaluate()``/``predict()``, a script's own ``train_samples`` through
  ``save_metrics``/``log_metrics``, TensorBoard's event files, token counting turned on after creation.
* ``dp_log_nonprivate_metrics=True`` keeps the Trainer's speed; example level keeps it (N is public there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_gpt2
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from hf_dpfilter import DPTrainer, DPTrainingArguments

#: examples per user in D; D minus one user drops USER (6 examples). 8 and 7 users both give 2 steps per epoch
#: with a logical batch of 3 users, so the runs differ only by what depends on the user count (q, epsilon)
PER_USER = (3, 5, 2, 4, 6, 3, 2, 4)
USER = 4
EPOCHS = 2
#: keys naming a count of training examples or tokens (the Trainer's, TRL's, Hugging Face's example scripts')
COUNT_KEYS = ("samples_per_second", "train_samples", "num_train_samples", "train_examples",
              "num_input_tokens_seen", "tokens_per_second", "num_tokens")
#: leaves that legitimately differ between D and D minus one user: the user count's (epsilon, delta, q and the
#: accountant's history of them), wall-clock time, and the random ids of a run
USER_COUNT_KEYS = ("epsilon", "delta", "sample_rate", "unit_sample_rate", "num_units", "history")
RANDOM_KEYS = ("run_id", "id")


class _Logs(TrainerCallback):
    """What every ``report_to`` logger receives: each log line (``on_log``)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.lines.append(dict(logs))


def _data(per_user: tuple[int, ...], drop: int | None = None) -> list[dict]:
    examples = make_examples(sum(per_user), VOCAB, causal=True, seed=5)
    users = [u for u, n in enumerate(per_user) for _ in range(n)]
    return [{**e, "user": f"user-{u}"} for e, u in zip(examples, users) if u != drop]


def _args(out: Path, **kw: Any) -> DPTrainingArguments:
    base = dict(
        output_dir=str(out), dp_method="dpsgd", noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=3, per_device_train_batch_size=4, num_train_epochs=EPOCHS, optim="sgd",
        learning_rate=0.1, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2, logging_steps=1,
        remove_unused_columns=False, dp_seed=0, seed=3, privacy_unit="user", user_id_column="user",
        max_examples_per_user=4,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(out: Path, data: list[dict], logs: _Logs | None = None, **kw: Any) -> DPTrainer:
    return DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(out, **kw),
                     train_dataset=ListDataset(data), data_collator=PadCollator(0),
                     callbacks=[logs] if logs is not None else None)


@contextlib.contextmanager
def _transformers_info() -> Iterator[list[str]]:
    """The messages of the ``transformers`` loggers at INFO (their root does not propagate to pytest's)."""
    messages: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root, handler, level = logging.getLogger("transformers"), _Handler(), hf_logging.get_verbosity()
    root.addHandler(handler)
    hf_logging.set_verbosity_info()
    try:
        yield messages
    finally:
        hf_logging.set_verbosity(level)
        root.removeHandler(handler)


def _run(out: Path, data: list[dict], **kw: Any) -> dict[str, Any]:
    """A user-level run the way a script publishes it; what it published (lines, metrics, files, messages)."""
    logs = _Logs()
    trainer = _trainer(out, data, logs, **kw)
    with _transformers_info() as messages:
        output = trainer.train()
        trainer.log_metrics("train", output.metrics)
        trainer.save_metrics("train", output.metrics)
        trainer.save_state()
        trainer.create_model_card(model_name="tiny")
    assert list(out.glob("checkpoint-*/trainer_state.json")), "checkpoints were saved"
    return {"logs": logs.lines, "metrics": dict(output.metrics), "files": _published_files(out),
            "messages": messages, "steps": trainer.state.global_step}


def _published_files(out: Path) -> dict[str, Any]:
    """Every text file of output_dir, JSON parsed. Not the "_" files: the Trainer's Hub pushes leave them out
    (``ignore_patterns=["_*"]``) and the library keeps its private user-partition digest there."""
    files: dict[str, Any] = {}
    for path in sorted(out.rglob("*")):
        if not path.is_file() or path.name.startswith("_") or path.suffix not in (".json", ".md", ".txt"):
            continue
        text = path.read_text()
        files[str(path.relative_to(out))] = json.loads(text) if path.suffix == ".json" else text
    return files


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _dicts(obj: Any) -> Iterator[dict]:
    if isinstance(obj, dict):
        yield obj
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            yield from _dicts(v)


def _assert_no_count_published(run: dict[str, Any]) -> None:
    """No key names a count; each speed x its runtime is the step count; the Trainer's line counts users."""
    published = {"logs": run["logs"], "metrics": run["metrics"], **run["files"]}
    for where, content in published.items():
        if isinstance(content, str):
            found = [key for key in COUNT_KEYS if key in content]
        else:  # TrainerState always has num_input_tokens_seen: 0 when nothing is counted
            found = [(path, value) for path, value in _leaves(content) for key in COUNT_KEYS
                     if any(key in str(k) for k in path) and value != 0]
        assert not found, f"{where} publishes {found}"
        for entry in _dicts(content):
            for key, speed in entry.items():
                if str(key).endswith("_per_second"):
                    runtime = entry[str(key).split("_")[0] + "_runtime"]
                    recovered = speed * runtime
                    steps = pytest.approx(run["steps"], abs=0.05)
                    assert key == "train_steps_per_second" and recovered == steps, (
                        f"{where}: {key} x runtime = {recovered:.2f}")
    started = "\n".join(run["messages"])
    assert "Num examples" in started, "the Trainer's start line was captured"
    assert f"Num examples = {len(PER_USER)}" in started or f"Num examples = {len(PER_USER) - 1}" in started


def _is_exempt(path: tuple) -> bool:
    key = next((k for k in reversed(path) if isinstance(k, str)), "")
    return (key in USER_COUNT_KEYS or key in RANDOM_KEYS or "history" in path[-3:-1]
            or key.endswith(("_runtime", "_per_second")))


def _published_numbers(run: dict[str, Any]) -> dict[Any, Any]:
    """Every published leaf but the exempt ones (see USER_COUNT_KEYS), keyed by where it is published."""
    out: dict[Any, Any] = {}
    for where, content in {"logs": run["logs"], "metrics": run["metrics"], **run["files"]}.items():
        if isinstance(content, str):  # the model card: its DP paragraph states epsilon, delta, N and q
            out[where] = content.split("## Differential privacy")[0]
            continue
        for path, value in _leaves(content):
            if not _is_exempt(path):
                out[(where, *path)] = value
    return out


# ---------------------------------------------------------------------------------------------------- the run
def test_user_level_run_publishes_no_example_count(tmp_path):
    """D: no log line, metric, file or Trainer message gives back its 29 examples (58 over 2 epochs)."""
    run = _run(tmp_path, _data(PER_USER))
    assert run["steps"] == 4 and any("epsilon" in line for line in run["logs"])
    assert {"train_results.json", "all_results.json", "trainer_state.json", "README.md",
            "checkpoint-2/trainer_state.json", "checkpoint-4/trainer_state.json"} <= set(run["files"])
    _assert_no_count_published(run)


def test_removing_a_user_changes_no_published_number_but_the_user_counts(tmp_path):
    """D and D minus one user (6 of its 29 examples): the same published numbers everywhere but wall-clock
    time, the random run ids and the quantities of the user count (epsilon, delta, q): the user's count is in
    none."""
    full = _run(tmp_path / "D", _data(PER_USER))
    without = _run(tmp_path / "D-1", _data(PER_USER, drop=USER))
    _assert_no_count_published(without)
    a, b = _published_numbers(full), _published_numbers(without)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b), key=str)
    differ = {where: (a[where], b[where]) for where in a if a[where] != b[where]}
    assert not differ, differ
    # the exempt leaves do differ where they should: epsilon and q follow the 8 vs 7 users
    assert full["logs"][-1]["epsilon"] != without["logs"][-1]["epsilon"]


# ------------------------------------------------------------------------------------------------ ways in
def test_a_resumed_user_level_run_publishes_no_example_count(tmp_path):
    """resume_from_checkpoint: the resumed call's speed covers its share of the steps; neither it nor the
    restored trainer_state.json gives back the examples."""
    data = _data(PER_USER)
    _trainer(tmp_path, data, max_steps=2).train()
    logs = _Logs()
    resumed = _trainer(tmp_path, data, logs)
    with _transformers_info() as messages:
        output = resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed.save_metrics("train", output.metrics)
    resumed.save_state()
    run = {"logs": logs.lines, "metrics": dict(output.metrics), "files": _published_files(tmp_path),
           "messages": messages, "steps": resumed.state.global_step - 2}
    assert resumed.state.global_step == 4
    _assert_no_count_published(run)


def test_evaluate_and_predict_publish_only_their_own_sets_counts(tmp_path):
    """evaluate()/predict() at user level: their speeds count the (public) evaluated set, none of training."""
    data, held_out = _data(PER_USER), make_examples(5, VOCAB, causal=True, seed=99)
    logs = _Logs()
    trainer = _trainer(tmp_path, data, logs, max_steps=2, per_device_eval_batch_size=2)
    trainer.train()
    evaluated = trainer.evaluate(eval_dataset=ListDataset(held_out))
    predicted = trainer.predict(ListDataset(held_out)).metrics
    trainer.save_metrics("eval", evaluated)
    trainer.save_metrics("test", predicted)
    for split, metrics in (("eval", evaluated), ("test", predicted)):
        runtime = metrics[f"{split}_runtime"]
        counted = metrics[f"{split}_samples_per_second"] * runtime
        # transformers rounds the runtime to 1e-4 s and the speed to 1e-3: on a run of a few ms that alone moves
        # the product by about 1% (4.94 seen in CI); a training count would be far outside this bound
        rounding = len(held_out) * 0.5e-4 / runtime + 0.5e-3 * runtime
        assert counted == pytest.approx(len(held_out), abs=0.05 + rounding), counted
        assert not [k for k in metrics if k.startswith("train") or "tokens" in k], metrics
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert "train_samples_per_second" not in results and "eval_samples_per_second" in results
    assert all("train_samples_per_second" not in line for line in logs.lines)


def test_a_scripts_own_train_samples_is_not_saved_nor_printed(tmp_path, capsys):
    """Hugging Face's example scripts add ``train_samples = len(train_dataset)`` (examples) to train()'s
    metrics and save and print them: at user level save_metrics and log_metrics leave it out."""
    data = _data(PER_USER)
    trainer = _trainer(tmp_path, data, max_steps=1, save_strategy="no")
    metrics = {**trainer.train().metrics, "train_samples": len(data)}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    assert "train_samples" not in capsys.readouterr().out
    for name in ("train_results.json", "all_results.json"):
        saved = json.loads((tmp_path / name).read_text())
        assert "train_samples" not in saved and "train_runtime" in saved, saved
    assert metrics["train_samples"] == len(data), "the caller's own dict is left as it was"


def test_tensorboard_event_files_hold_no_example_count(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(tmp_path, _data(PER_USER), max_steps=2, save_strategy="no", report_to=["tensorboard"]).train()
    events = list(tmp_path.rglob("*tfevents*"))
    assert events
    for path in events:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        scalars = accumulator.Tags()["scalars"]
        assert any("epsilon" in tag for tag in scalars), scalars
        assert not [tag for tag in scalars if any(key in tag for key in COUNT_KEYS)], scalars


# ------------------------------------------------------------------------------------------- kept knowingly
@pytest.mark.parametrize("level", ["user, opted in", "example"])
def test_the_trainers_speed_is_kept_with_the_opt_in_or_at_example_level(level, tmp_path):
    """``dp_log_nonprivate_metrics=True`` publishes the example count knowingly; at example level it is the
    plan's public N: in both the Trainer's speed times its runtime is examples x epochs."""
    data = _data(PER_USER)
    extra: dict[str, Any] = {"dp_log_nonprivate_metrics": True} if level.startswith("user") else {
        "privacy_unit": "example", "user_id_column": None, "max_examples_per_user": None}
    if not level.startswith("user"):
        data = [{k: v for k, v in e.items() if k != "user"} for e in data]
    metrics = _trainer(tmp_path, data, save_strategy="no", **extra).train().metrics
    speed = metrics["train_samples_per_second"] * metrics["train_runtime"]
    assert math.isclose(speed, len(data) * EPOCHS, abs_tol=0.05), speed


def test_token_counting_turned_on_after_creation_is_refused_before_training(tmp_path):
    """``include_num_input_tokens_seen`` set on the arguments after the trainer was created: refused when
    train() starts, as at creation (it logs and saves the token count of every secret Poisson batch)."""
    trainer = _trainer(tmp_path, _data(PER_USER), max_steps=1, save_strategy="no")
    trainer.args.include_num_input_tokens_seen = "all"
    with pytest.raises(ValueError, match="dp_log_nonprivate_metrics"):
        trainer.train()
    assert trainer.state.num_input_tokens_seen == 0 and trainer.accountant.steps == 0
