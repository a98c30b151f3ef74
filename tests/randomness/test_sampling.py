"""Acceptance 2 and 3 of the core: noise statistics, seeding, Poisson sampling, empty batches, calibration."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import (
    DPTrainer,
    DPTrainingArguments,
    PoissonBatchSampler,
    UnprivatizedGradientError,
    make_dp_optimizer,
)
from hf_dpfilter.accounting.accountant import PrivacyAccountant, compute_epsilon


def _args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_sample_max_grad_norm=0.5,
        logical_batch_size=8,
        per_device_train_batch_size=4,
        max_steps=2,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
        dp_seed=123,
        logging_steps=1,
    )
    settings.update(overrides)
    return DPTrainingArguments(**settings)


def _train(tmp_path, examples, **overrides):
    model = tiny_roberta()
    model.eval()  # dropout is off anyway; keep the forward deterministic
    args = _args(tmp_path, **overrides)
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    after = [p.detach().clone() for p in model.parameters()]
    return flat(after) - flat(before), trainer


def test_noise_std_is_sigma_c_over_expected_batch(tmp_path):
    examples = make_examples(16, VOCAB, causal=False, seed=1)
    sigma, clip, batch = 3.0, 0.5, 8
    noisy, _ = _train(tmp_path / "a", examples, noise_multiplier=sigma, max_steps=1)
    clean, _ = _train(tmp_path / "b", examples, noise_multiplier=0.0, max_steps=1)
    noise = noisy - clean  # same dp_seed -> same batch; lr = 1 -> the update difference is -noise / B
    expected = sigma * clip / batch
    assert noise.numel() > 5000
    assert abs(noise.std().item() / expected - 1) < 0.03, (noise.std().item(), expected)
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())


def test_noise_of_the_optimizer_directly():
    param = torch.nn.Parameter(torch.zeros(200_000, dtype=torch.float64))
    opt = make_dp_optimizer([param], base=torch.optim.SGD, lr=1.0, noise_multiplier=2.0, per_sample_max_grad_norm=0.25,
                            expected_batch_size=10, sample_rate=0.01, seed=7)
    with pytest.raises(UnprivatizedGradientError):
        opt.step()  # nothing accumulated (not even an empty batch): nothing to release
    assert opt.accountant.steps == 0 and not param.detach().any()
    opt.accumulate(None, None, batch_size=0)  # an empty batch, declared: a noise-only step
    opt.step()
    std = 2.0 * 0.25 / 10
    assert abs(param.detach().std().item() / std - 1) < 0.03
    assert opt.accountant.steps == 1


def test_same_dp_seed_identical_runs_and_other_seed_differs(tmp_path):
    examples = make_examples(16, VOCAB, causal=False, seed=2)
    a, _ = _train(tmp_path / "a", examples, noise_multiplier=1.0)
    b, _ = _train(tmp_path / "b", examples, noise_multiplier=1.0)
    c, _ = _train(tmp_path / "c", examples, noise_multiplier=1.0, dp_seed=999)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_poisson_inclusion_rate_matches_q():
    n, q, steps = 2000, 0.05, 200
    sampler = PoissonBatchSampler(n, q, steps, seed=3)
    counts = torch.zeros(n)
    sizes = []
    for batch in sampler:
        counts[batch] += 1
        sizes.append(len(batch))
    rate = counts.sum().item() / (n * steps)
    # Binomial(n*steps, q): std of the rate is sqrt(q(1-q)/(n*steps)) ~ 1.1e-3
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (n * steps))
    assert len(set(sizes)) > 5  # variable batch sizes
    # each example's inclusion count ~ Binomial(steps, q)
    assert abs(counts.var().item() / (steps * q * (1 - q)) - 1) < 0.15


def test_sharded_poisson_union_is_one_sample():
    n, q = 101, 0.3
    full = list(PoissonBatchSampler(n, q, 5, seed=4))
    shards = [list(PoissonBatchSampler(n, q, 5, seed=4, rank=r, world_size=3)) for r in range(3)]
    for step in range(5):
        union = sorted(i for shard in shards for i in shard[step])
        assert union == sorted(full[step])


def test_empty_batches_take_noise_only_steps_that_are_counted(tmp_path):
    examples = make_examples(40, VOCAB, causal=False, seed=5)
    # q = 1/40: about 37% of the steps are empty
    sampler = PoissonBatchSampler(40, 1 / 40, 40, seed=11)
    sizes = [len(b) for b in sampler]
    assert 0 in sizes
    delta, trainer = _train(tmp_path, examples, noise_multiplier=1.0, logical_batch_size=1,
                            per_device_train_batch_size=1, max_steps=40, dp_seed=11, logging_steps=40)
    report = trainer.privacy_report()
    assert report["steps"] == 40 == trainer.state.global_step
    assert math.isclose(report["epsilon"], compute_epsilon([(1.0, 1 / 40, 40)], report["delta"], "prv"))


def test_calibrated_run_ends_within_one_percent_below_target(tmp_path):
    examples = make_examples(64, VOCAB, causal=False, seed=6)
    _, trainer = _train(tmp_path, examples, target_epsilon=3.0, logical_batch_size=8, max_steps=-1,
                        num_train_epochs=2)
    report = trainer.privacy_report()
    assert report["steps"] == report["planned_steps"] == 16
    assert 3.0 * 0.99 <= report["epsilon"] <= 3.0
    assert any("epsilon" in entry for entry in trainer.state.log_history)


def test_logged_epsilon_uses_the_planned_horizon_and_matches_the_report(tmp_path, monkeypatch):
    calls = []
    real = PrivacyAccountant.get_epsilon

    def spy(self, delta, horizon=None):
        calls.append((self.steps, horizon))
        return real(self, delta, horizon=horizon)

    monkeypatch.setattr(PrivacyAccountant, "get_epsilon", spy)
    examples = make_examples(40, VOCAB, causal=False, seed=7)
    _, trainer = _train(tmp_path, examples, noise_multiplier=1.0, logical_batch_size=4, max_steps=12,
                        logging_steps=4)
    during_training = list(calls)
    report = trainer.privacy_report()
    assert calls[len(during_training):] == [(12, None)]  # the report is exact
    entries = [entry for entry in trainer.state.log_history if "epsilon" in entry]
    # every log line passed the planned steps; the privacy ledger written at the end stays exact
    assert [c for c in during_training if c[1] is not None] == [(entry["step"], 12) for entry in entries]
    # exact at the end: the ledger, then the closing summary line (the accountant's cached value)
    assert [c for c in during_training if c[1] is None] == [(12, None), (12, None)]
    logged = {entry["step"]: entry["epsilon"] for entry in entries}
    # every 4 steps, and the end of the first epoch (10 steps of 4 of 40 examples)
    assert sorted(logged) == [4, 8, 10, 12] and logged[12] == round(report["epsilon"], 4)
    for step in (4, 8, 10):  # before the horizon: within 1 % of eps(H) of the exact value
        exact = compute_epsilon([(1.0, 0.1, step)], report["delta"], "prv")
        assert abs(logged[step] - exact) <= 0.01 * report["epsilon"]
