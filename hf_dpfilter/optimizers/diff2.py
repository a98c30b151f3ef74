"""DIFF2: DP optimization via clipped gradient differences (Murata & Suzuki, ICML 2023, Algorithm 1).

Round r = t + 1 (t = zero-based optimizer step), parameters x_{r-1}, batch B_r (expected size B)::

    restart round (t % T == 0):
        v~_r = ( sum_i clip(g_i(x_{r-1}), C1) + N(0, (z1 D1)^2 I) ) / B
    difference round:
        C_{2,r} = C2 * ||x_{r-1} - x_{r-2}||                      (flat norm over the trainable parameters)
        v~_r = v~_{r-1} + ( sum_i clip(g_i(x_{r-1}) - g_i(x_{r-2}), C_{2,r}) + N(0, (z2 D2)^2 I) ) / B
    x_r = BaseOptimizerUpdate(x_{r-1}, v~_r)                     (SGD = the paper's GD-Routine, DIFF2-GD)

with ``D1 = C1`` and ``D2 = C_{2,r}`` under add/remove neighbours, ``2 C1`` and ``2 C_{2,r}`` under
replace-one (the paper's relation): the noise is relative to the real sensitivity, so replace-one doubles it.
The per-example difference is ONE combination clipped once: :meth:`gradient_points` returns the current
parameters with weight +1 and x_{r-2} with weight -1, and the engine clips each example's combined gradient
(same micro-batch, same dropout masks at both points). A zero threshold (no movement) clips everything to 0
and adds no noise. Difference rounds always use min-clipping (the absolute 0.01 of automatic clipping has no
meaning at the scale of a difference); restart rounds use ``clipping_fn`` like DP-SGD.

**Batches.** The paper analyses full batch (DIFF2-GD): ``logical_batch_size = N`` gives q = 1 and every
example in every round. With Poisson minibatches (q < 1) each round is still a Poisson-subsampled Gaussian
mechanism given the released history, so the accounting below holds, but the algorithm (a SPIDER-like
minibatch estimator) is an **unanalysed extension** of the paper: no utility theory; it is labelled in
``privacy_report``. Replace-one is only offered for full batch (its subsampled accounting differs).
Under several processes each process is a client: the clipped sums are all-reduced and the noise is added
once per round (base class); v~ and x_{r-2} are identical replicas.

**Accounting.** Restart and difference rounds are separate Gaussian mechanisms, composed heterogeneously:
the accountant records ``(z1, q)`` per restart round and ``(z2, q)`` per difference round. With
``target_epsilon``, :meth:`calibrate` keeps the paper's budget split u (Prop. 4.1: z2 / z1 =
sqrt((R - k) / (k (u - 1))), k = ceil(R / T) restarts in R steps) and bisects z1 with the exact accountant
instead of the paper's loose RDP conversion.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.accounting import calibrate_noise_multiplier, calibrate_scale
from hf_dpfilter.clipping import clip_factors
from hf_dpfilter.engine import PerExampleGradients, accumulate_into_grad
from hf_dpfilter.optimizers import register_method
from hf_dpfilter.optimizers.base import DPOptimizer

DIFF2_NEIGHBOURINGS = ("add_remove", "replace_one")

__all__ = ["DIFF2_NEIGHBOURINGS", "Diff2", "diff2_history"]


def diff2_history(
    restart_noise_multiplier: float, difference_noise_multiplier: float, sample_rate: float, steps: int,
    restart_every: int,
) -> list[tuple[float, float, int]]:
    """Accountant history of ``steps`` DIFF2 rounds: ceil(steps / T) restarts, the rest difference rounds."""
    restarts = math.ceil(steps / restart_every)
    return [
        (restart_noise_multiplier, sample_rate, restarts),
        (difference_noise_multiplier, sample_rate, steps - restarts),
    ]


def _difference_factors(norms: torch.Tensor, threshold: float) -> torch.Tensor:
    """min(1, C / ||d_i||) with a relative margin, and 0 for a zero threshold (no NaN)."""
    if threshold <= 0:
        return torch.zeros_like(norms)
    return (threshold / (norms * (1.0 + 1e-6))).clamp(max=1.0)


@dataclass
class _Round:
    step: int
    restart: bool
    threshold: float  # C1 (restart) or C_{2,r} (difference), before the replace-one factor


@register_method
class Diff2(DPOptimizer):
    """DIFF2 around any base optimizer; see the module docstring.

    Args (besides :class:`DPOptimizer`'s; ``max_grad_norm`` is C1, ``noise_multiplier`` is z1):
        diff2_restart_every: restart period T (1 = DP-SGD / DP-GD).
        diff2_difference_max_grad_norm: C2, the coefficient of the threshold C2 ||x_{r-1} - x_{r-2}||.
        diff2_difference_noise_multiplier: z2 (None: z1).
        diff2_budget_split: u > 1, used by :meth:`calibrate` (reported here).
        diff2_neighbouring: ``"add_remove"`` or ``"replace_one"`` (doubles the sensitivity; full batch only).
    """

    method_name = "diff2"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        diff2_restart_every: int = 10,
        diff2_difference_max_grad_norm: float | None = None,
        diff2_difference_noise_multiplier: float | None = None,
        diff2_budget_split: float = 1.25,
        diff2_neighbouring: str = "add_remove",
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        if isinstance(diff2_restart_every, bool) or int(diff2_restart_every) != diff2_restart_every or (
            diff2_restart_every < 1
        ):
            raise ValueError(f"diff2_restart_every (T) must be an integer >= 1, got {diff2_restart_every}.")
        self.restart_every = int(diff2_restart_every)
        if self.restart_every > 1:
            if diff2_difference_max_grad_norm is None:
                raise ValueError(
                    "DIFF2 needs diff2_difference_max_grad_norm (C2, the threshold per unit of parameter "
                    "movement) when diff2_restart_every > 1; tune it (e.g. a high quantile of "
                    "||g_i(x) - g_i(x')|| / ||x - x'|| on public data)."
                )
            if not (math.isfinite(diff2_difference_max_grad_norm) and diff2_difference_max_grad_norm > 0):
                raise ValueError(
                    f"diff2_difference_max_grad_norm must be a finite number > 0, got {diff2_difference_max_grad_norm}."
                )
        self.difference_max_grad_norm = (
            None if diff2_difference_max_grad_norm is None else float(diff2_difference_max_grad_norm)
        )
        z2 = self.noise_multiplier if diff2_difference_noise_multiplier is None else diff2_difference_noise_multiplier
        if not z2 >= 0:
            raise ValueError(f"diff2_difference_noise_multiplier must be >= 0, got {diff2_difference_noise_multiplier}.")
        self.difference_noise_multiplier = float(z2)
        if not diff2_budget_split > 1:
            raise ValueError(f"diff2_budget_split (u) must be > 1, got {diff2_budget_split}.")
        self.budget_split = float(diff2_budget_split)
        if diff2_neighbouring not in DIFF2_NEIGHBOURINGS:
            raise ValueError(f"diff2_neighbouring must be one of {DIFF2_NEIGHBOURINGS}, got {diff2_neighbouring!r}.")
        self.neighbouring = diff2_neighbouring
        self.full_batch = self.sample_rate is not None and self.sample_rate >= 1.0
        if self.sample_rate is not None and not self.full_batch:
            if self.neighbouring == "replace_one":
                raise ValueError(
                    "diff2_neighbouring='replace_one' is only supported for full-batch DIFF2 (sample rate 1, "
                    "i.e. logical_batch_size = N): the accountant certifies replace-one only without "
                    "subsampling. Use 'add_remove' or a full batch."
                )
            if self.restart_every > 1:
                warnings.warn(
                    f"DIFF2 with Poisson minibatches (sample rate {self.sample_rate:.3g} < 1) is an unanalysed "
                    "extension of the paper's full-batch DIFF2-GD: the accounting holds, the utility theory "
                    "does not. Use logical_batch_size = N for the paper's algorithm.",
                    UserWarning,
                    stacklevel=2,
                )
        self._estimate: dict[nn.Parameter, torch.Tensor] | None = None  # v~_{r-1}
        self._previous: dict[nn.Parameter, torch.Tensor] | None = None  # x_{r-2}
        self._pending_previous: dict[nn.Parameter, torch.Tensor] | None = None
        self._round_cache: _Round | None = None
        self.restart_rounds = 0

    # ------------------------------------------------------------------------------ the round
    def current_round(self) -> _Round:
        """Kind and threshold of the round in progress (fixed at its first use, before the update)."""
        if self._round_cache is not None and self._round_cache.step == self.dp_steps:
            return self._round_cache
        restart = self.dp_steps % self.restart_every == 0 or self._previous is None or self._estimate is None
        if restart:
            threshold = self.max_grad_norm
        else:
            movement = math.sqrt(
                sum(float((p.detach().double() - self._previous[p].double()).pow(2).sum()) for p in self.params)
            )
            threshold = self.difference_max_grad_norm * movement
        self._round_cache = _Round(self.dp_steps, restart, threshold)
        return self._round_cache

    @property
    def _relation_factor(self) -> float:
        return 2.0 if self.neighbouring == "replace_one" else 1.0

    def gradient_points(self) -> list[tuple[float, dict[nn.Parameter, torch.Tensor] | None]]:
        if self.current_round().restart:
            return [(1.0, None)]
        # x_{r-2} exactly (no x - (x - x') rounding), as leaves that require grad so the clipping hooks see
        # the forward at that point too; their own gradients are never computed.
        previous = {p: v.detach().requires_grad_(True) for p, v in self._previous.items()}
        return [(1.0, None), (-1.0, previous)]

    def sensitivity(self) -> float:
        """L2 sensitivity of this round's pre-noise sum: C1 or C_{2,r}, doubled under replace-one."""
        return self._relation_factor * self.current_round().threshold

    def round_noise_multiplier(self) -> float:
        return self.noise_multiplier if self.current_round().restart else self.difference_noise_multiplier

    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        rnd = self.current_round()
        if rnd.restart:
            factors = clip_factors(grads.norms(), self.max_grad_norm, self.clipping_fn)
        else:
            factors = _difference_factors(grads.norms(), rnd.threshold)
        accumulate_into_grad(grads.weighted_sum(factors))
        self.examples_in_step += grads.batch_size

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        rnd = self.current_round()
        std = self.round_noise_multiplier() * self.sensitivity()
        self._pending_previous = {p: p.detach().clone() for p in self.params}  # x_{r-1}, before the update
        estimate = {} if rnd.restart else self._estimate
        for p, s in sums.items():
            increment = self.noisy_average(s, std)
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            if rnd.restart:
                estimate[p] = increment.to(dtype)
            else:
                estimate[p] = estimate[p] + increment.to(dtype)
        self._estimate = estimate
        return {p: v.clone() for p, v in estimate.items()}

    def after_step(self) -> None:
        self.current_round()  # fix this round's kind before x_{r-2} changes
        self._previous, self._pending_previous = self._pending_previous, None

    def record_privacy_step(self) -> None:
        self.restart_rounds += int(self.current_round().restart)
        if self.sample_rate is not None:
            self.accountant.step(self.round_noise_multiplier(), self.sample_rate)

    # ------------------------------------------------------------------------------ accounting
    @classmethod
    def calibrate(
        cls,
        target_epsilon: float,
        delta: float,
        sample_rate: float,
        steps: int,
        accountant: str = "prv",
        *,
        diff2_restart_every: int = 10,
        diff2_budget_split: float = 1.25,
        **_: Any,
    ) -> dict[str, float]:
        """``{"noise_multiplier": z1, "diff2_difference_noise_multiplier": z2}`` reaching ``target_epsilon``.

        The ratio z2 / z1 = sqrt((R - k) / (k (u - 1))) is the paper's budget split (Prop. 4.1); z1 is then
        the smallest value whose heterogeneous composition reaches the target. The noise multipliers are
        relative to the sensitivity, so they are the same for both neighbouring relations.
        """
        restarts = math.ceil(steps / diff2_restart_every)
        if restarts == steps:
            z = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant=accountant)
            return {"noise_multiplier": z, "diff2_difference_noise_multiplier": z}
        if not diff2_budget_split > 1:
            raise ValueError(f"diff2_budget_split (u) must be > 1, got {diff2_budget_split}.")
        ratio = math.sqrt((steps - restarts) / (restarts * (diff2_budget_split - 1.0)))

        def history(z1: float) -> list[tuple[float, float, int]]:
            return diff2_history(z1, ratio * z1, sample_rate, steps, diff2_restart_every)

        z1 = calibrate_scale(history, target_epsilon, delta, accountant)
        return {"noise_multiplier": z1, "diff2_difference_noise_multiplier": ratio * z1}

    def privacy_details(self, delta: float) -> dict[str, Any]:
        details: dict[str, Any] = {
            "steps": self.dp_steps,
            "neighbouring_relation": "replace one example" if self.neighbouring == "replace_one"
            else "add/remove one example",
            "diff2_restart_every": self.restart_every,
            "diff2_restart_noise_multiplier": self.noise_multiplier,
            "diff2_difference_noise_multiplier": self.difference_noise_multiplier,
            "diff2_difference_max_grad_norm": self.difference_max_grad_norm,
            "diff2_budget_split": self.budget_split,
            "diff2_full_batch": self.full_batch,
            "diff2_restart_rounds": self.restart_rounds,
            "diff2_difference_rounds": self.dp_steps - self.restart_rounds,
            "accountant_history": [list(e) for e in self.accountant.history],
        }
        if not self.full_batch:
            details["diff2_note"] = (
                "Poisson-minibatch DIFF2 is an unanalysed extension of the paper's full-batch DIFF2-GD "
                "(accounting holds; no utility theory)"
            )
        return details

    # ------------------------------------------------------------------------------ state
    def method_state_dict(self) -> dict[str, Any]:
        # v~ and x_{r-2} are functions of released outputs (post-processing): safe to save.
        return {"estimate": self._estimate, "previous": self._previous, "restart_rounds": self.restart_rounds}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        self._estimate = state.get("estimate")
        self._previous = state.get("previous")
        self._pending_previous = None
        self._round_cache = None
        self.restart_rounds = int(state.get("restart_rounds", 0))

