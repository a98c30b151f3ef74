"""hf_dpfilter.accounting.budget: the guard refuses the step that would overspend, and only that one."""

from __future__ import annotations

import pytest

from hf_dpfilter.accounting.accountant import PrivacyAccountant, compute_epsilon
from hf_dpfilter.accounting.budget import BudgetGuard, PrivacyBudgetExceededError
from hf_dpfilter.plan import PrivacyPlan


def test_the_guard_needs_both_targets():
    with pytest.raises(ValueError, match="both target_epsilon and target_delta"):
        BudgetGuard(target_epsilon=1.0)
    BudgetGuard().check(PrivacyAccountant("rdp"), None, 10**9)  # off: nothing checked


def test_the_guard_stops_at_the_first_overspending_step():
    plan = PrivacyPlan.for_optimizer(noise_multiplier=2.0, per_sample_max_grad_norm=1.0, expected_batch_size=10.0,
                                     sample_rate=0.1, seed=0)
    guard, accountant = BudgetGuard(1.5, 1e-5), PrivacyAccountant("rdp")
    steps = 0
    with pytest.raises(PrivacyBudgetExceededError, match="target_epsilon=1.5"):
        for _ in range(1000):
            guard.check(accountant, plan, steps)
            accountant.step(2.0, 0.1, 1)
            steps += 1
    assert compute_epsilon([(2.0, 0.1, steps)], 1e-5, "rdp") <= 1.5 < compute_epsilon([(2.0, 0.1, steps + 1)],
                                                                                      1e-5, "rdp")
