"""The plan states the noise that is really added (DiceSGD's sensitivity C1 + 2 B C2,
DIFF2's restart and difference rounds) and an optimizer without a sample rate never reports epsilon 0 (item
5)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from hf_dpfilter import GhostClippingEngine, PrivacyPlan, make_dp_optimizer
from hf_dpfilter.accounting.accountant import compute_epsilon
from hf_dpfilter.optimizers.base import PrivacyBudgetExceededError

D = 10_000  # trainable parameters


def _plan(method, method_args=None, **kw):
    base = dict(num_examples=1000, logical_batch_size=64, epochs=20, method=method, method_args=method_args,
                seed=0,
                accountant="rdp")
    base.update(kw)
    with warnings.catch_warnings():
        # DIFF2 with Poisson minibatches warns that it is an unanalysed extension
        warnings.simplefilter("ignore")
        return PrivacyPlan.create(**base)


# ------------------------------------------------------------------------------------------- item 11: DiceSGD
def test_dicesgd_diagnostics_state_the_feedback_sensitivity():
    # C1 = C2 = 1 (the earlier default, mean scale), B = 64: Delta = 1 + 2 x 64 x 1 = 129
    plan = _plan("dicesgd", {"error_max_grad_norm": 1.0}, noise_multiplier=2.0)
    (round_,) = plan.noise_rounds()
    assert round_.noise_to_clip == pytest.approx(2.0 * 129 / 2)  # sigma Delta over the signal bound C1 + C2
    ratio = plan.noise_to_signal(D)
    assert ratio["per_step"] == pytest.approx(2.0 * 129 / 2 * math.sqrt(D) / 64)
    text = plan.describe(D)
    assert "C1 + 2 B C2 = 1 + 2 x 64 x 1 = 129" in text
    # the same sigma under DP-SGD is 64.5x quieter against the same signal
    dpsgd = _plan("dpsgd", noise_multiplier=2.0)
    assert ratio["per_step"] == pytest.approx(64.5 * dpsgd.noise_to_signal(D)["per_step"])
    # the default C2 = C1 / B = 1/64: Delta = 1 + 2 x 64 x (1/64) = 3, against a signal bound of 1 + 1/64
    default = _plan("dicesgd", noise_multiplier=2.0)
    assert default.noise_rounds()[0].noise_to_clip == pytest.approx(2.0 * 3 / (1 + 1 / 64))
    assert "C1 + 2 B C2 = 1 + 2 x 64 x 0.015625 = 3" in default.describe(D)


def test_dicesgd_cannot_learn_warning_fires_on_the_real_noise():
    plan = _plan("dicesgd", target_epsilon=8.0)
    sigma_only = plan.noise_multiplier * math.sqrt(D) / 64 / math.sqrt(plan.steps)
    assert sigma_only < 2.0  # what the warning looked at before: sigma alone, as if DP-SGD
    messages = plan.learnability_warnings(D)
    assert any("C1 + 2 B C2" in w and "below the noise" in w for w in messages), messages


def test_a_large_delta_is_stated_with_what_it_means():
    """The default delta N^-1.1 is 0.0509 for 15 units: a warning says one unit in 20 may be exposed."""
    small = _plan("dpsgd", num_examples=15, logical_batch_size=5, target_epsilon=8.0)
    assert small.delta == pytest.approx(15 ** -1.1)
    messages = small.learnability_warnings(D)
    assert any("delta = 0.0509 is large" in w and "one in 20 of the 15" in w and "target_delta" in w
               for w in messages), messages
    assert "WARNING: delta = 0.0509 is large" in small.describe(D)
    assert not any("delta =" in w for w in _plan("dpsgd", target_epsilon=8.0).learnability_warnings(D))


def test_dicesgd_without_feedback_is_dpsgd_noise():
    plan = _plan("dicesgd", {"error_max_grad_norm": 0.0}, noise_multiplier=2.0)
    assert plan.noise_rounds()[0].noise_to_clip == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------- item 11: DIFF2
def test_diff2_diagnostics_state_both_rounds_and_warn_on_the_louder():
    plan = _plan("diff2", {"difference_noise_multiplier": 4.0, "restart_every": 5,
                                  "difference_max_grad_norm": 2.0}, noise_multiplier=0.5)
    restart, difference = plan.noise_rounds()
    assert (restart.noise_multiplier, restart.fraction) == (0.5, pytest.approx(0.2))
    assert (difference.noise_multiplier, difference.fraction) == (4.0, pytest.approx(0.8))
    text = plan.describe(D)
    assert "restart rounds (1 in 5): sigma = 0.5" in text and "difference rounds (4 in 5): sigma = 4" in text
    ratio = plan.noise_to_signal(D)
    assert ratio["per_step"] == pytest.approx(4.0 * math.sqrt(D) / 64)
    # with d = 1e7, sigma = 0.5 alone (what the warning read before) gives 0.5 sqrt(d) / (64 sqrt(300)) = 1.4
    # < 2; the difference rounds' 4.0 gives 11
    messages = plan.learnability_warnings(D * 1000)
    assert any("difference rounds" in w for w in messages), messages


def test_diff2_replace_one_doubles_the_stated_noise():
    plan = _plan("diff2", {"neighbouring": "replace_one", "difference_max_grad_norm": 2.0}, num_examples=64,
                 noise_multiplier=1.0)
    assert [r.noise_to_clip for r in plan.noise_rounds()] == [2.0, 2.0]
    assert "x 2 (replace-one)" in plan.describe(D)


# ----------------------------------------------------------------------------- item 5: no sample rate, no
# epsilon 0
def _steps(optimizer, engine, model, steps):
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(steps):
        optimizer.accumulate(engine, lambda v: engine.call_model(v, x).pow(2).sum(1), batch_size=4)
        optimizer.step()


def test_optimizer_without_sample_rate_accounts_every_step_without_amplification():
    model = torch.nn.Linear(3, 2).double()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    with pytest.warns(UserWarning, match="No sample_rate was given.*sample_rate=B/N"):
        optimizer = make_dp_optimizer(model.parameters(), torch.optim.SGD, lr=0.1, noise_multiplier=1.0,
                                      per_sample_max_grad_norm=1.0, expected_batch_size=4, seed=0)
    _steps(optimizer, engine, model, 5)
    epsilon = optimizer.accountant.get_epsilon(1e-5)
    assert epsilon > 0 and math.isfinite(epsilon)
    assert epsilon == pytest.approx(compute_epsilon([(1.0, 1.0, 5)], 1e-5, "prv"))


def test_budget_guard_works_without_sample_rate():
    model = torch.nn.Linear(3, 2).double()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    with pytest.warns(UserWarning, match="No sample_rate"):
        optimizer = make_dp_optimizer(model.parameters(), torch.optim.SGD, lr=0.1, noise_multiplier=2.0,
                                      per_sample_max_grad_norm=1.0, expected_batch_size=4, seed=0, target_epsilon=3.0,
                                      target_delta=1e-5)
    with pytest.raises(PrivacyBudgetExceededError):
        _steps(optimizer, engine, model, 50)
    assert 0 < optimizer.accountant.get_epsilon(1e-5) <= 3.0
