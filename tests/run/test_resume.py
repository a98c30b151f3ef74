"""Resuming from a checkpoint restores the run's state, for every available method, with fresh randomness.

An interrupted run (checkpoint in the middle of an epoch, so the Trainer skips batches) resumed with
``resume_from_checkpoint`` restores the accountant history, the method state and the base optimizer, and ends
with the epsilon of a run that was never interrupted. The noise and the Poisson sampling after the resume are
fresh (no seed or generator state is saved): a resumed run is not bit-reproducible. The privacy ledger is
written before every noisy step, and a resumed run cannot be extended beyond its target epsilon.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, available_methods

N = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    yield
    torch.set_num_threads(threads)


def _args(tmp_path, method: str, max_steps: int, **extra) -> DPTrainingArguments:
    extra = {"noise_multiplier": 0.8, **extra}
    return DPTrainingArguments(
        output_dir=str(tmp_path),
        dp_method=method,
        per_sample_max_grad_norm=0.5,
        logical_batch_size=4,  # q = 1/4: 4 steps per epoch, the checkpoint at step 3 is mid-epoch
        per_device_train_batch_size=3,
        max_steps=max_steps,
        optim="adamw_torch",
        learning_rate=0.01,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        save_steps=3,
        logging_steps=2,
        accountant="rdp",  # fast; the accountant's state round-trips the same way for every backend
        remove_unused_columns=False,
        dp_seed=5,
        seed=7,
        **extra,
    )


def _train(tmp_path, method: str, max_steps: int, resume: str | None = None, **extra) -> DPTrainer:
    model = tiny_roberta()
    examples = make_examples(N, VOCAB, causal=False, seed=11)
    trainer = DPTrainer(
        model=model,
        args=_args(tmp_path, method, max_steps, **extra),
        train_dataset=ListDataset(examples),
        data_collator=PadCollator(1),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _params(trainer: DPTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _stop_at(step: int):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True  # an interruption right after the checkpoint

    return Stop()


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("method", available_methods())
def test_resume_restores_the_state_and_draws_fresh_randomness(method, tmp_path):
    """An interrupted run resumed from its mid-epoch checkpoint restores the optimizer's state (base
    optimizer, method state, accountant, step count) and ends with the uninterrupted run's accounting. Its
    noise and its batches are fresh (no generator state is saved, docs/threat_model.md), so it is not
    bit-identical: earlier versions restored the noise generator, which let two branches from one checkpoint
    share noise."""
    # DiceSGD's error buffer is private and not checkpointed by default (it restarts at zero, with a warning);
    # save_error_buffer=True keeps it (checkpoints then stay inside the trust boundary).
    extra = {"dp_method_args": {"save_error_buffer": True}} if method == "dicesgd" else {}
    if method == "diff2":
        extra = {"dp_method_args": {"restart_every": 3, "difference_max_grad_norm": 2.0}}
    full = _train(tmp_path / "full", method, max_steps=7, **extra)
    model = tiny_roberta()
    examples = make_examples(N, VOCAB, causal=False, seed=11)
    interrupted = DPTrainer(model=model, args=_args(tmp_path / "cut", method, 7, **extra),
                            train_dataset=ListDataset(examples), data_collator=PadCollator(1),
                            callbacks=[_stop_at(3)])
    interrupted.train()
    saved = torch.load(tmp_path / "cut" / "checkpoint-3" / "optimizer.pt", weights_only=False)
    loaded = {}

    class Capture(DPTrainer):
        def _begin_privacy_session(self):
            loaded.update(copy.deepcopy(self.dp_optimizer.state_dict()))  # restored, before any step
            return super()._begin_privacy_session()

    resumed = Capture(model=tiny_roberta(), args=_args(tmp_path / "cut", method, 7, **extra),
                      train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert _same(loaded, saved), f"{method}: the restored optimizer state differs from the checkpoint's"
    assert resumed.accountant.history == full.accountant.history
    assert resumed.privacy_report()["steps"] == 7
    assert resumed.current_epsilon() == pytest.approx(full.current_epsilon(), rel=1e-12)
    assert not torch.equal(_params(resumed), _params(full)), f"{method}: the resumed run replayed the noise"


def test_resume_restores_the_fp16_loss_scale_before_any_step(tmp_path):
    """fp16: the DP loss scaler is attached when the optimizer is built, before the Trainer loads the
    checkpoint, so a scale lowered by a skipped step (a non-finite noised gradient) is the resumed run's first
    scale."""
    from transformers import TrainerCallback

    examples = make_examples(N, VOCAB, causal=False, seed=11)

    class Skip(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                kwargs["optimizer"].optimizer.loss_scaler.update(False)  # as after a non-finite noised step

    cut = DPTrainer(model=tiny_roberta(), args=_args(tmp_path, "dpsgd", 4, fp16=True),
                    train_dataset=ListDataset(examples), data_collator=PadCollator(1),
                    callbacks=[Skip(), _stop_at(3)])
    cut.train()
    seen = {}
    engine_scales: list[float] = []

    class Capture(DPTrainer):
        def _begin_privacy_session(self):
            seen.update(self.dp_optimizer.loss_scaler.state_dict())  # restored, before any step
            return super()._begin_privacy_session()

        def training_step(self, model, inputs, num_items_in_batch=None):
            out = super().training_step(model, inputs, num_items_in_batch)
            # the engine takes the scale at a per-example pass: none for an empty
            if inputs["labels"].shape[0]:
                engine_scales.append(self.engine.loss_scale)  # Poisson sample (1% here: (3/4)^16)
            return out

    resumed = Capture(model=tiny_roberta(), args=_args(tmp_path, "dpsgd", 4, fp16=True),
                      train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert seen == {"scale": 2.0**9, "finite_steps": 2, "skipped_steps": 1}
    assert all(scale == 2.0**9 for scale in engine_scales) and resumed.privacy_report()["steps"] == 4


def test_resume_draws_fresh_batches(tmp_path):
    """The batches after a mid-epoch resume are fresh Poisson samples, not the remaining batches of the first
    run's order (which dp_seed and the step would regenerate); two resumes differ as well."""
    seen: dict[str, list] = {"full": [], "resumed": [], "again": []}

    class Recording(DPTrainer):
        tag = "full"

        def training_step(self, model, inputs, num_items_in_batch=None):
            seen[self.tag].append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, num_items_in_batch)

    examples = make_examples(N, VOCAB, causal=False, seed=11)
    for tag, resume in (("full", None), ("resumed", str(tmp_path / "checkpoint-3")),
                        ("again", str(tmp_path / "checkpoint-3"))):
        Recording.tag = tag
        trainer = Recording(
            model=tiny_roberta(), args=_args(tmp_path, "dpsgd", 7), train_dataset=ListDataset(examples),
            data_collator=PadCollator(1),
        )
        trainer.train(resume_from_checkpoint=resume)
    assert len(seen["full"]) == 7 and len(seen["resumed"]) == 4 and len(seen["again"]) == 4

    def same_batches(a, b):
        return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))

    # each of 4 batches of N=16 at q=1/4 repeats by chance with probability 0.625^16 < 1e-3
    assert not same_batches(seen["full"][3:], seen["resumed"])
    assert not same_batches(seen["resumed"], seen["again"])


def test_privacy_ledger_written_before_each_step(tmp_path):
    trainer = _train(tmp_path, "dpsgd", max_steps=3)
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 3
    assert ledger["epsilon"] == pytest.approx(trainer.current_epsilon(), rel=1e-9)
    assert ledger["accountant"]["history"] == trainer.accountant.state_dict()["history"]
    assert ledger["delta"] == trainer.delta


@pytest.mark.parametrize("reserve", [True, False], ids=["reserving", "no-reserve"])
def test_ledger_never_under_reports_after_a_crash(tmp_path, reserve):
    """A crash inside a step (after the noisy release could have happened) leaves a ledger counting that
    step."""

    class Crash(RuntimeError):
        pass

    class Crashing(DPTrainer):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            original = optimizer.original_optimizer.step

            def crash_on_third(*a, **k):  # the base optimizer runs after the noise: crash "mid-release"
                if optimizer.dp_steps == 2:
                    raise Crash("simulated crash")
                return original(*a, **k)

            optimizer.original_optimizer.step = crash_on_third
            return optimizer

    trainer = Crashing(
        model=tiny_roberta(), args=_args(tmp_path, "dpsgd", 5),
        train_dataset=ListDataset(make_examples(N, VOCAB, False)),
        data_collator=PadCollator(1),
    )
    if not reserve:
        trainer.ledger_reserve_seconds = 0.0
    with pytest.raises(Crash):
        trainer.train()
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    # the third step's noise may have been released: it is counted, and possibly steps reserved after it
    assert 3 <= ledger["steps"] <= 5
    assert trainer.accountant.steps == 2
    if not reserve:
        assert ledger["steps"] == 3


def test_ledger_reserves_steps_ahead_only_as_far_as_asked(tmp_path, monkeypatch):
    """Fast steps: the ledger is rewritten only when the step in flight passes what it already counts."""
    from types import SimpleNamespace

    from transformers import TrainerCallback

    import hf_dpfilter.run.session as trainer_module

    clock = iter(range(1000))
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(monotonic=lambda: 0.1 * next(clock)))
    seen = []

    class ReadLedger(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
            entry = (ledger["steps"], ledger["steps_reserved_ahead"])
            if not seen or seen[-1] != entry:
                seen.append(entry)

    trainer = DPTrainer(model=tiny_roberta(), args=_args(tmp_path, "dpsgd", 9),
                        train_dataset=ListDataset(make_examples(N, VOCAB, causal=False, seed=11)),
                        data_collator=PadCollator(1), callbacks=[ReadLedger()])
    trainer.ledger_reserve_seconds = 0.25  # each ledger call is 0.1 s after the last: two steps ahead
    trainer.train()
    # step 1 (no step time yet), step 2 reserving 3-4, step 5 reserving 6-7, step 8 reserving 9 (the plan
    # ends)
    assert seen == [(1, 0), (4, 2), (7, 2), (9, 1)]
    final = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert final["status"] == "finished" and final["steps"] == 9 and final["steps_reserved_ahead"] == 0
    assert final["accountant"]["history"] == trainer.accountant.state_dict()["history"]


def test_resumed_run_cannot_exceed_target_epsilon(tmp_path):
    common = dict(noise_multiplier=None, target_epsilon=3.0, target_delta=1e-3)
    _train(tmp_path, "dpsgd", max_steps=6, **common)
    # Extending the run (more steps than the noise was calibrated for) would overspend: refused.
    with pytest.raises(ValueError, match="target_epsilon"):
        _train(tmp_path, "dpsgd", max_steps=12, resume=str(tmp_path / "checkpoint-6"), **common)


def test_optimizer_refuses_step_beyond_target():
    from hf_dpfilter import PrivacyAccountant, make_dp_optimizer
    from hf_dpfilter.accounting.budget import PrivacyBudgetExceededError

    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_dp_optimizer([p], torch.optim.SGD, lr=0.1, noise_multiplier=2.0, per_sample_max_grad_norm=1.0,
                            expected_batch_size=10, sample_rate=0.1, target_epsilon=1.5, target_delta=1e-5,
                            accountant=PrivacyAccountant("rdp"))
    steps = 0
    with pytest.raises(PrivacyBudgetExceededError, match="target_epsilon=1.5"):
        for _ in range(1000):
            # noise-only steps (empty batches), accounted all the same
            opt.accumulate(None, None, batch_size=0)
            opt.step()
            steps += 1
    assert steps >= 10  # the guard stops at the budget, not before
    assert opt.accountant.get_epsilon(1e-5) <= 1.5
    from hf_dpfilter.accounting.accountant import compute_epsilon

    # the refused step would have overspent
    assert compute_epsilon([(2.0, 0.1, steps + 1)], 1e-5, "rdp") > 1.5
    assert opt.dp_steps == steps
