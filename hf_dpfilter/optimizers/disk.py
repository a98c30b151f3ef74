"""DiSK: DP optimizer with a simplified Kalman filter (Zhang, Bu, Balle, Hong, Razaviyayn, Mirrokni, "DiSK:
Differentially Private Optimizer with Simplified Kalman Filter for Noise Reduction", arXiv:2410.03883, Alg.
2).

Per logical step t, with gain kappa in (0, 1], step gamma != 0 and c = (1 - kappa) / (kappa gamma)::

    v_i     = c grad f(x_t + gamma d_{t-1}; xi_i) + (1 - c) grad f(x_t; xi_i)   (per example, BEFORE clipping)
    g_t     = (sum_i clip(v_i, C) + N(0, sigma^2 C^2 I)) / B          (one Gaussian mechanism, Delta = C)
    g~_t    = (1 - kappa) g~_{t-1} + kappa g_t,   g~_0 = g_0          (weight kappa on the NEW gradient)
    x_{t+1} = BaseOptimizerUpdate(x_t, g~_t)                          (any torch optimizer)
    d_t     = x_{t+1} - x_t                                 (the REAL change, lr/Adam/decay included)

with d_{-1} = 0 (so the first step is plain DP-SGD). The default gamma = (1 - kappa) / kappa gives c = 1: a
single gradient evaluation at the look-ahead point x_t + gamma d_{t-1}, at DP-SGD's cost. Any other gamma
evaluates both points on the same examples with the same dropout masks; the engine merges the two
forwards per example, so the *combination* is clipped and each example contributes one vector of norm <= C.
The sensitivity is C and the accounting is DP-SGD's; g~, d and the base optimizer only see privatized values.
kappa = 1 is the base DP optimizer.

With Adam(W) as the base, the filter lowers the noise variance Adam's second moment sees to kappa / (2 -
kappa) of DP-Adam's, so each step is sqrt((2 - kappa) / kappa) times longer (1.36x at kappa = 0.7) while the
noise left in Adam's first moment barely changes (Adam's beta1 already averages it). A learning rate tuned for
DP-Adam should therefore be multiplied by sqrt(kappa / (2 - kappa)) (docs/results.md measures this on SST-2);
``adam_step_match=True`` does it at every step, so DP-Adam's tuned learning rate carries over unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.optimizers.method_config import MethodConfig
from hf_dpfilter.optimizers.method_state import copy_all_
from hf_dpfilter.optimizers.point_values import Points, with_identity_gradient


@dataclass(frozen=True)
class DiSKConfig(MethodConfig):
    """DiSK's settings. Privacy: DP-SGD's (one clipped vector per example, one subsampled Gaussian per step).

    Args:
        kappa: the Kalman gain in (0, 1], the weight on the new privatized gradient (paper: 0.7). 1 = the base
            DP optimizer. With Adam, multiply a DP-Adam-tuned learning rate by sqrt(kappa / (2 - kappa)).
        gamma: the finite-difference step (!= 0). None: (1 - kappa) / kappa, one gradient pass. The paper's
            two-point setting is 0.5.
        adam_step_match: scale the base optimizer's learning rate by sqrt(kappa / (2 - kappa)) at every step
            (Adam-family bases only), so that DiSK takes DP-Adam's step length at a learning rate tuned for
            DP-Adam. Post-processing: it changes no privacy figure.
    """

    name = "disk"
    legacy_prefix = "disk_"

    kappa: float = 0.7
    gamma: float | None = None
    adam_step_match: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.kappa <= 1.0:
            raise ValueError(
                "disk: kappa (the Kalman gain, weight on the new gradient) must be in (0, 1], got "
                f"{self.kappa}."
            )
        if self.gamma is not None and (self.gamma == 0 or not math.isfinite(self.gamma)):
            raise ValueError(
                f"disk: gamma must be a finite non-zero number, got {self.gamma}. Leave it unset (None) for "
                f"the one-pass default (1 - kappa) / kappa = {self.one_pass_gamma:.6g}."
            )

    @property
    def one_pass_gamma(self) -> float:
        return (1.0 - self.kappa) / self.kappa

    @property
    def adam_lr_factor(self) -> float:
        """sqrt(kappa / (2 - kappa)): the ratio of DiSK's filtered noise std to DP-Adam's, for white noise."""
        return math.sqrt(self.kappa / (2.0 - self.kappa))


class DiSKOptimizer(DPOptimizer):
    """DiSK around any base optimizer (settings: :class:`DiSKConfig`)."""

    method_name = "disk"

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, plan, **kwargs)
        config: DiSKConfig = self.config
        one_pass_gamma = config.one_pass_gamma
        self.kappa = float(config.kappa)
        self.gamma = float(one_pass_gamma if config.gamma is None else config.gamma)
        if config.kappa == 1.0:
            self.look_ahead_weight = 0.0  # no prediction term: the base DP optimizer
        elif math.isclose(self.gamma, one_pass_gamma, rel_tol=1e-9):
            self.look_ahead_weight = 1.0
        else:
            self.look_ahead_weight = one_pass_gamma / self.gamma
        self._filtered: list[torch.Tensor] | None = None  # g~_{t-1}
        # x_{t-1} between steps (d_{t-1} = x_t - x_{t-1}); from the step's first micro-batch to its optimizer
        # step the look-ahead point x_t + gamma d_{t-1} itself, formed in place (_anchor_is_point)
        self._anchor: list[torch.Tensor] | None = None
        self._anchor_is_point = False
        self.lr_factor = config.adam_lr_factor if config.adam_step_match else 1.0
        if config.adam_step_match and not all("betas" in group
                                              for group in self.original_optimizer.param_groups):
            raise ValueError(
                f"disk: adam_step_match=True rescales an Adam-family optimizer's learning rate, but the base "
                f"optimizer is {type(self.original_optimizer).__name__} (no `betas`). Use "
                "optim='adamw_torch' (or another Adam), or leave disk_adam_step_match off: with SGD the "
                "filter does not lengthen the steps."
            )

    def base_step(self) -> None:
        if self.lr_factor == 1.0:
            self.original_optimizer.step()
            return
        # Scale only for this update and restore, so LR schedulers and state_dict keep the user's values.
        groups = self.original_optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * self.lr_factor
        try:
            self.original_optimizer.step()
        finally:
            for group, lr in zip(groups, saved):
                group["lr"] = lr

    @property
    def one_pass(self) -> bool:
        return self.look_ahead_weight in (0.0, 1.0)

    def gradient_points(self) -> Points:
        c = self.look_ahead_weight
        if self._anchor is None or c == 0.0:
            return [(1.0, None)]  # d_{-1} = 0: both points are x_t
        params = self.params
        if not self._anchor_is_point:
            # x_t + gamma d_{t-1} = x_{t-1} + (1 + gamma) (x_t - x_{t-1}): one in-place pass over the stored
            # x_{t-1}, once per step (every micro-batch of the step evaluates the same point), no new tensor
            with torch.no_grad():
                torch._foreach_lerp_(self._anchor, [p.detach() for p in params], 1.0 + self.gamma)
            self._anchor_is_point = True
        # differentiable in x with Jacobian I (no copy) so an ordinary backward sees the combination
        shifted = dict(zip(params, with_identity_gradient(params, self._anchor)))
        if c == 1.0:
            return [(1.0, shifted)]
        return [(1.0 - c, None), (c, shifted)]

    @torch.no_grad()
    def postprocess(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        noisy = list(grads.values())
        if self._filtered is None:  # g~ in the clipped sums' dtype (float32, float64 for float64 parameters)
            self._filtered = [g.to(torch.float64 if p.dtype == torch.float64 else torch.float32, copy=True)
                              for p, g in grads.items()]
        else:
            # g~_t = (1 - kappa) g~_{t-1} + kappa g_t in one pass (lerp: g~ + kappa (g - g~)); g_t is float64
            # in the steps whose combination has a negative weight (c > 1, the engine's precise mode) and
            # float32 in the first one (one point): lerp takes one dtype, so it is rounded to g~'s (no copy
            # when the same)
            torch._foreach_lerp_(self._filtered, [g.to(f.dtype) for f, g in zip(self._filtered, noisy)],
                                 self.kappa)
            copy_all_(noisy, self._filtered)  # the base optimizer gets g~_t (in tensors it may own)
        # x_t becomes x_{(t+1)-1}: d_t = x_{t+1} - x_t is formed from it at the next step's point
        current = [p.detach() for p in grads]
        if self._anchor is None:
            self._anchor = [x.clone() for x in current]
        else:
            copy_all_(self._anchor, current)
        self._anchor_is_point = False
        return grads

    def method_state_dict(self) -> dict[str, Any]:
        params = self.params
        return {
            "filtered": None if self._filtered is None else dict(zip(params, self._filtered)),
            # x_{t-1}: d_{t-1} = x_t - x_{t-1} is formed from it exactly as in an uninterrupted run; inside a
            # step (a state_dict between the first micro-batch and the step) the look-ahead point itself,
            # flagged: x_{t-1} cannot be recovered from it exactly (the division by gamma magnifies the
            # rounding), the point is exactly what the rest of the step (at the same x_t) evaluates
            "anchor": None if self._anchor is None else dict(zip(params, self._anchor)),
            "anchor_is_point": self._anchor_is_point,
        }

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        params = self.params
        self._filtered = None if state["filtered"] is None else [state["filtered"][p] for p in params]
        self._anchor_is_point = False
        if "anchor" in state:
            self._anchor = None if state["anchor"] is None else [state["anchor"][p] for p in params]
            self._anchor_is_point = self._anchor is not None and bool(state.get("anchor_is_point", False))
        else:  # a checkpoint of an earlier version keeps d_{t-1}: x_{t-1} = x_t - d_{t-1}
            delta = state.get("delta")
            self._anchor = None if delta is None else torch._foreach_sub([p.detach() for p in params],
                                                                         [delta[p] for p in params])

__all__ = ["DiSKConfig", "DiSKOptimizer"]
