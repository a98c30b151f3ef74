"""DP-PMLF: per-sample momentum + DOPPLER's low-pass filter (Xu, Ranbaduge, Wang, Rakotoarivelo, Smith,
"Enhancing DPSGD via Per-Sample Momentum and Low-Pass Filtering", Alg. 1).

Per logical step t, with K = min(k, t + 1) parameter points x_t, x_{t-1}, ..., x_{t-K+1} (the current
parameters and K - 1 stored copies) and weights w_j = beta^j / sum_{l<K} beta^l (j = lag, sum 1)::

    v_i     = sum_{j<K} w_j grad f(x_{t-j}; xi_i)                  (per example, combined BEFORE clipping)
    vbar_t  = (sum_i clip(v_i, C) + N(0, sigma^2 C^2 I)) / B       (one Gaussian mechanism, Delta = C)
    m_hat_t = DOPPLER filter of vbar_t with bias correction        (hf_dpfilter.optimizers.filters)
    x_{t+1} = BaseOptimizerUpdate(x_t, m_hat_t)                    (the paper: plain SGD)

``pmlf_base`` chooses how m_hat_t is used, as DOPPLER's ``doppler_base``: ``"optimizer"`` (the paper; with
SGD) or, as an extension not in the PMLF paper, DOPPLER's Adam variants ``"adam"``/``"adam_bc"`` (the filter
replaces Adam's first moment; needs ``optim="sgd"``).

The K forwards run on the same examples with the same dropout masks and are merged per example by the
clipping engine (the "virtual sequence" of K times the tokens), so each example contributes one vector of
norm <= C: the sensitivity is C and the accounting is DP-SGD's (unlike the public code, which clips each copy
separately). k = 1 is DOPPLER. The paper's defaults: k = 2, beta = 0.1, filter b = [0.1], a = [-0.9]
(MNIST; ``pmlf_preset="pmlf_cifar"`` is b = [0.15, -0.05], a = [-0.9]). Extra state: k - 1 parameter copies
plus the filter's buffers; compute: K forward/backward passes per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.optimizers.filters import LowPassConfig
from hf_dpfilter.optimizers.method_state import copy_all_
from hf_dpfilter.optimizers.point_values import Points, with_identity_gradient


@dataclass(frozen=True)
class PMLFConfig(LowPassConfig):
    """DP-PMLF's settings. Privacy: DP-SGD's (the k points are combined per example before clipping).

    Args:
        k: the number of parameter points k >= 1 (current + k - 1 past copies; k forward/backward passes).
        beta: the per-sample momentum decay beta >= 0 (weight beta^lag, normalized).
        preset, b, a, base, beta2, eps: the low-pass filter, as
            :class:`~hf_dpfilter.optimizers.filters.LowPassConfig` (default filter ``"pmlf_mnist"``).
    """

    name = "pmlf"
    legacy_prefix = "pmlf_"

    preset: str = "pmlf_mnist"
    k: int = 2
    beta: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.k, bool) or int(self.k) != self.k or self.k < 1:
            raise ValueError("pmlf: k (the number of parameter points) must be an integer >= 1, got "
                             f"{self.k}.")
        if not self.beta >= 0:
            raise ValueError(f"pmlf: beta (the per-sample momentum decay) must be >= 0, got {self.beta}.")


class PMLFOptimizer(DPOptimizer):
    """DP-PMLF around any base optimizer (settings: :class:`PMLFConfig`)."""

    method_name = "pmlf"

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, plan, **kwargs)
        self.k = int(self.config.k)
        self.beta = float(self.config.beta)
        self.lowpass = self.config.make_postprocessor(optimizer)
        self._snapshots: list[list[torch.Tensor]] = []  # x_{t-1}, x_{t-2}, ... (most recent first)

    def point_weights(self) -> list[float]:
        """w_j = beta^j / sum_l beta^l for the K = min(k, t + 1) points of the current step."""
        raw = [self.beta**j for j in range(len(self._snapshots) + 1)]
        total = sum(raw)
        return [w / total for w in raw]

    def gradient_points(self) -> Points:
        if not self._snapshots:
            return [(1.0, None)]
        weights = self.point_weights()
        points: Points = [(weights[0], None)]
        params = self.params
        # each point is differentiable in x (Jacobian I) with value = the stored copy exactly, without a copy,
        # so an ordinary backward of the combined loss equals the engine's per-example combination
        for weight, snapshot in zip(weights[1:], self._snapshots):
            points.append((weight, dict(zip(params, with_identity_gradient(params, snapshot)))))
        return points

    @torch.no_grad()
    def postprocess(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        if self.k > 1:  # x_t becomes x_{(t+1)-1}: push it, recycling the oldest copy's storage
            current = [p.detach() for p in grads]
            if len(self._snapshots) < self.k - 1:
                self._snapshots.insert(0, [x.clone() for x in current])
            else:
                oldest = self._snapshots.pop()
                copy_all_(oldest, current)
                self._snapshots.insert(0, oldest)
        filtered = self.lowpass(list(grads.values()), noise_variance=self.noise_variance())
        return dict(zip(grads, filtered))

    def method_state_dict(self) -> dict[str, Any]:
        params = self.params
        return {
            "snapshots": [dict(zip(params, snapshot)) for snapshot in self._snapshots],
            "lowpass": self.lowpass.state_dict(params),
        }

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        params = self.params
        if len(state["snapshots"]) > self.k - 1:  # the extra points would be used, silently, at every step
            raise ValueError(
                f"pmlf: the checkpoint holds {len(state['snapshots'])} parameter snapshots (k >= "
                f"{len(state['snapshots']) + 1}) and this run has k = {self.k}: resume with the checkpoint's "
                "k."
            )
        self._snapshots = [[snapshot[p] for p in params] for snapshot in state["snapshots"]]
        self.lowpass.load_state_dict(state["lowpass"], params)


__all__ = ["PMLFConfig", "PMLFOptimizer"]
