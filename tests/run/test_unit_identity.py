"""Users declared cleanly, the unit part of the run's identity, the ledger under a lock (cases 9,
10).

* **User ids** (hf_dpfilter/data/user_ids.py): NaN in every numeric form (float, NumPy float32/float64 scalars
  and 0-d arrays, 0-d torch tensors), None, empty and whitespace-only ids, ids of mixed types (int and str,
  bool and int) and strings equal but for surrounding whitespace are refused when the DPTrainer is created,
  naming the column, the first row, the count and the fix; clean ids of each type (str, int, torch and NumPy
  ints) are accepted and grouped as declared.
* **The unit on resume** (hf_dpfilter/run/unit_identity.py): a user-level or example-level run resumed with
  another unit, another ``user_id_column``, another k or another grouping of the examples into users (same
  column, same number of users) is refused before its first step; the same settings resume and count every
  step. The user partition's digest is kept out of the published files (the ledger, the checkpoints).
* **Two writers, one ledger** (hf_dpfilter/run/ledger.py): two sessions writing one output_dir's ledger at the
  same time (threads meeting at a barrier before every write) lose no release: the ledger's entries count the
  sum. A resume from an older checkpoint after another run wrote the ledger still counts the abandoned branch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading

import numpy as np
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.accounting.accountant import PrivacyAccountant
from hf_dpfilter.data.units import PrivacyUnitError
from hf_dpfilter.run.ledger import PrivacyLedger

PER_USER = (3, 1, 2, 2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    yield
    torch.set_num_threads(threads)


def _data(per_user=PER_USER, ids=None) -> list[dict]:
    """Examples of len(per_user) users, interleaved in the data set; ``ids`` names the users (default
    'user-u')."""
    examples = make_examples(sum(per_user), VOCAB, causal=True, seed=3)
    users = [u for u, n in enumerate(per_user) for _ in range(n)]
    names = ids or [f"user-{u}" for u in range(len(per_user))]
    order = sorted(range(len(examples)), key=lambda i: (i % 3, i))
    return [{**examples[i], "user": names[users[i]], "author": names[users[i]]} for i in order]


def _args(out, unit="user", **kw) -> DPTrainingArguments:
    base = dict(
        output_dir=str(out), dp_method="dpsgd", noise_multiplier=0.5, per_sample_max_grad_norm=1.0,
        logical_batch_size=2, per_device_train_batch_size=2, max_steps=2, optim="sgd", learning_rate=0.1,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
        remove_unused_columns=False, dp_seed=0, accountant="rdp",
    )
    if unit == "user":
        base.update(privacy_unit="user", user_id_column="user", max_examples_per_user=3)
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(out, data=None, unit="user", **kw) -> DPTrainer:
    return DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(out, unit, **kw),
                     train_dataset=ListDataset(data if data is not None else _data()),
                     data_collator=PadCollator(0))


# ---------------------------------------------------------------------------------------------- 9: user ids
def _with_id(row: int, value, data=None) -> list[dict]:
    data = data if data is not None else _data()
    data[row] = {**data[row], "user": value}
    return data


BAD_IDS = {
    "torch_nan": (lambda: _with_id(2, torch.tensor(float("nan"))), "no user for 1 example"),
    "torch_nan_float16": (lambda: _with_id(2, torch.tensor(float("nan"), dtype=torch.float16)), "no user for "
        "1"),
    "numpy_float32_nan": (lambda: _with_id(2, np.float32("nan")), "no user for 1 example"),
    "numpy_0d_array_nan": (lambda: _with_id(2, np.array(np.nan)), "no user for 1 example"),
    "float_nan": (lambda: _with_id(2, float("nan")), "no user for 1 example"),
    "pandas_na": (lambda: _with_id(2, __import__("pandas").NA), "no user for 1 example"),
    "none": (lambda: _with_id(2, None), "no user for 1 example"),
    "empty": (lambda: _with_id(2, ""), "no user for 1 example"),
    "whitespace": (lambda: _with_id(2, "  "), "no user for 1 example"),
    "two_nans": (lambda: _with_id(5, np.float32("nan"), _with_id(2, torch.tensor(float("nan")))),
                 r"no user for 2 example\(s\), first at row 2"),
    "mixed_int_str": (lambda: _with_id(2, 7), "mixes id types: str .*int .*first at row 2"),
    "mixed_torch_int_str": (lambda: _with_id(2, torch.tensor(7)), "mixes id types"),
    "mixed_bool_int": (lambda: [{**e, "user": True if i == 2 else i % 4} for i, e in enumerate(_data())],
                       "mixes id types"),
    "surrounding_whitespace": (lambda: _with_id(2, _data()[0]["user"] + " "), "surrounding whitespace"),
}


@pytest.mark.parametrize("form", list(BAD_IDS))
def test_missing_mixed_or_ambiguous_user_ids_are_refused_at_creation(form, tmp_path):
    make, match = BAD_IDS[form]
    with pytest.raises(PrivacyUnitError, match=match) as refused:
        _trainer(tmp_path, make())
    message = str(refused.value)
    assert "user_id_column='user'" in message and "row " in message  # names the column and the row
    assert any(fix in message for fix in ("Fill the column", "Cast the column", "Strip and normalise"))
    assert not os.path.exists(tmp_path / "privacy_ledger.json")  # nothing ran


CLEAN_IDS = {
    "str": lambda u: f"user-{u}",
    "int": lambda u: u,
    "torch_int": lambda u: torch.tensor(u),
    "numpy_int": lambda u: np.int64(u),
    "float": lambda u: float(u) + 0.5,
}


@pytest.mark.parametrize("form", list(CLEAN_IDS))
def test_clean_ids_of_one_type_are_grouped_as_declared(form, tmp_path):
    data = _data(ids=[CLEAN_IDS[form](u) for u in range(len(PER_USER))])
    trainer = _trainer(tmp_path, data)
    assert trainer.num_train_examples == 4  # 4 users, NaN-free, one type
    assert sorted(len(e) for e in trainer._user_index.examples) == sorted(PER_USER)


def test_a_datasets_column_with_a_missing_id_is_refused(tmp_path):
    import datasets

    rows = [{"input_ids": e["input_ids"].tolist(), "labels": e["labels"].tolist(), "user": float(i % 4)}
            for i, e in enumerate(_data())]
    rows[3]["user"] = float("nan")
    with pytest.raises(PrivacyUnitError, match="no user for 1 example.*row 3"):
        DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_args(tmp_path),
                  train_dataset=datasets.Dataset.from_list(rows), data_collator=PadCollator(0))


# ------------------------------------------------------------------------------------------ 10: unit on
# resume
def _first_run(out, unit="user", data=None) -> str:
    """Two released steps, checkpoint-2; returns the checkpoint."""
    _trainer(out, data, unit).train()
    return str(out / "checkpoint-2")


def _swapped_partition() -> list[dict]:
    """The same examples, column and number of users, grouped differently: (3, 1, 2, 2) -> (2, 2, 2, 2)."""
    data = _data()
    first = next(i for i, e in enumerate(data) if e["user"] == "user-0")
    data[first] = {**data[first], "user": "user-1", "author": "user-1"}
    return data


RESUME_CHANGES = {
    "example_to_user": ("example", {}, None, "privacy_unit='example'"),
    "user_to_example": ("user", {"unit": "example"}, None, "privacy_unit='user'"),
    "other_column": ("user", {"user_id_column": "author"}, None, "user_id_column='user'"),
    "other_k": ("user", {"max_examples_per_user": 2}, None, "max_examples_per_user=3"),
    "other_partition": ("user", {}, _swapped_partition, "another grouping of the examples into users"),
}


@pytest.mark.parametrize("change", list(RESUME_CHANGES))
def test_a_resume_that_changes_the_unit_is_refused_before_its_first_step(change, tmp_path):
    first_unit, kw, data, match = RESUME_CHANGES[change]
    checkpoint = _first_run(tmp_path, first_unit)
    ledger_before = (tmp_path / "privacy_ledger.json").read_text()
    kw = dict(kw)
    unit = kw.pop("unit", "user")
    trainer = _trainer(tmp_path, data() if data else None, unit, max_steps=4, **kw)
    with pytest.raises(PrivacyUnitError, match=f"Cannot resume run .*{match}.*start a fresh run"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.dp_optimizer.dp_steps == 2  # refused before the first step of the resume
    assert (tmp_path / "privacy_ledger.json").read_text() == ledger_before


def test_a_partition_change_is_refused_for_a_branch_resumed_into_another_output_dir(tmp_path):
    checkpoint = _first_run(tmp_path / "origin")
    trainer = _trainer(tmp_path / "branch", _swapped_partition(), max_steps=4)
    with pytest.raises(PrivacyUnitError, match="another grouping of the examples into users"):
        trainer.train(resume_from_checkpoint=checkpoint)


@pytest.mark.parametrize("unit", ["user", "example"])
def test_the_same_unit_resumes_and_counts_every_step(unit, tmp_path):
    """Negative control: the same unit, column, k and users resume; the checkpoint and the ledger record the
    public unit, never the partition's digest (kept in a "_" file, which the Trainer's Hub uploads skip)."""
    checkpoint = _first_run(tmp_path, unit)
    trainer = _trainer(tmp_path, None, unit, max_steps=4)
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.dp_optimizer.dp_steps == 4 and trainer.accountant.steps == 4
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 4 and ledger["privacy_unit"]["unit"] == unit
    state = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert state["dp"]["privacy_unit"] == ledger["privacy_unit"]
    private = tmp_path / "_privacy_unit_partitions.json"
    if unit == "user":
        assert ledger["privacy_unit"] == {"unit": "user", "user_id_column": "user",
                                          "max_examples_per_user": 3,
                                          "num_units": 4}
        digest = json.loads(private.read_text())[ledger["run_id"]]
        published = [tmp_path / "privacy_ledger.json", *(tmp_path / "checkpoint-4").iterdir()]
        assert all(digest.encode() not in path.read_bytes() for path in published if path.is_file())
    else:
        assert not private.exists()


# --------------------------------------------------------------------------------- two writers, one ledger
def released_steps(ledger: dict) -> int:
    """Every step the ledger file counts: its own entry's and its earlier runs'."""
    return ledger["steps"] + sum(run["steps"] for run in ledger.get("earlier_runs", []))


def _session(out, barrier, steps: int, totals, name: str) -> None:
    try:
        ledger = PrivacyLedger(str(out))
        accountant = PrivacyAccountant("rdp")
        ledger.open_session(f"run-{name}", accountant, None)
        barrier.wait()  # both sessions opened on the same (empty) ledger
        for _ in range(steps):
            accountant.step(1.0, 0.1)
            barrier.wait()  # the two writes of a round race each other
            ledger.record({"delta": 1e-5}, accountant, "step_in_flight")
        ledger.record({"delta": 1e-5}, accountant, "finished")
        totals[name] = accountant.steps
    except Exception as error:  # the other writer must not wait for this one at the barrier
        totals[name] = repr(error)
        barrier.abort()


@pytest.mark.parametrize("writers", ["threads", "processes"])
def test_two_sessions_writing_one_ledger_at_once_lose_no_release(writers, tmp_path):
    if writers == "threads":
        barrier, totals, start = threading.Barrier(2, timeout=60), {}, threading.Thread
    else:  # forked processes: nothing to import again, a lock between processes
        context = multiprocessing.get_context("fork")
        manager = context.Manager()
        barrier, totals, start = manager.Barrier(2, timeout=60), manager.dict(), context.Process
    workers = [start(target=_session, args=(tmp_path, barrier, 5, totals, name)) for name in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert dict(totals) == {"a": 5, "b": 5}, dict(totals)
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert released_steps(ledger) == 10  # the last writer's file keeps the other's entry
    assert sorted([ledger["run_id"], *(e["run_id"] for e in ledger["earlier_runs"])]) == ["run-a", "run-b"]


def test_a_rollback_after_another_run_wrote_the_ledger_still_counts_the_abandoned_branch(tmp_path):
    _trainer(tmp_path, max_steps=6).train()  # run A: 6 steps, checkpoints 2, 4, 6
    _trainer(tmp_path, max_steps=2, save_strategy="no").train()  # run B, fresh, in the same output_dir
    resumed = _trainer(tmp_path, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.accountant.steps == 6 + 4  # A's abandoned steps 3-6 stay counted
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 10 and released_steps(ledger) == 10 + 2


def test_the_checkpoint_keeps_its_unit_when_copied(tmp_path):
    """A checkpoint copied into a fresh output_dir (no ledger, no partition file): the public record still
    refuses another unit."""
    checkpoint = _first_run(tmp_path / "origin")
    copied = tmp_path / "elsewhere" / "checkpoint-2"
    shutil.copytree(checkpoint, copied)
    shutil.rmtree(tmp_path / "origin")
    trainer = _trainer(tmp_path / "elsewhere", None, "user", max_steps=4, max_examples_per_user=2)
    with pytest.raises(PrivacyUnitError, match=r"its checkpoint \(optimizer.pt\) counted"):
        trainer.train(resume_from_checkpoint=str(copied))
