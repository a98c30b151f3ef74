"""The budget guard: refuse a step that would take epsilon(target_delta) above target_epsilon, before it runs.

Opt-in (``hf_dpfilter.factory.make_optimizer(plan, ..., target_epsilon=..., target_delta=...)``). The DP
optimizer asks :meth:`BudgetGuard.check` at the start of every step, before any noise is drawn or released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_dpfilter.accounting.accountant import PrivacyAccountant

if TYPE_CHECKING:
    from hf_dpfilter.optimizers.method_config import PlanSettings

__all__ = ["BudgetGuard", "PrivacyBudgetExceededError"]


class PrivacyBudgetExceededError(RuntimeError):
    """A step would take the epsilon spent above ``target_epsilon``; the step was not taken."""


class BudgetGuard:
    """Whether the next step keeps the epsilon spent within ``target_epsilon`` (at ``target_delta``).

    The epsilon is evaluated a few steps ahead (doubling horizon, from the method's declared mechanisms) so
    that the accountant is not run at every step; near the end of the budget it is checked step by step.
    """

    def __init__(self, target_epsilon: float | None = None, target_delta: float | None = None) -> None:
        if (target_epsilon is None) != (target_delta is None):
            raise ValueError("Give both target_epsilon and target_delta (the budget guard needs both), or "
                             "neither.")
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self._safe_until = 0  # dp_steps up to which the budget is known to hold
        self._horizon = 1

    def check(self, accountant: PrivacyAccountant, plan: PlanSettings, dp_steps: int) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if step ``dp_steps + 1`` would spend more than the
        target."""
        if self.target_epsilon is None or plan.sample_rate is None or dp_steps < self._safe_until:
            return
        horizon = self._horizon
        while True:
            projected = accountant.copy()
            for sigma, q, n in plan.config.history(plan.noise, plan, horizon, start=dp_steps):
                projected.step(sigma, q, n)
            if projected.get_epsilon(self.target_delta) <= self.target_epsilon:
                self._safe_until = dp_steps + horizon
                self._horizon = 2 * horizon
                return
            if horizon == 1:
                raise PrivacyBudgetExceededError(
                    f"Step {dp_steps + 1} would take epsilon above target_epsilon={self.target_epsilon} "
                    f"(delta={self.target_delta}): {dp_steps} steps were already spent. Stop training here, "
                    "or recalibrate the noise for a larger budget (calibrate_noise_multiplier(..., "
                    "extra_history=accountant.history)) and say so when you report epsilon."
                )
            horizon //= 2
            self._horizon = horizon
