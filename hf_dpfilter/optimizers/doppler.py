"""DOPPLER: a low-pass filter on the privatized gradient (Zhang, Bu, Hong, Razaviyayn, "DOPPLER:
Differentially Private Optimizers with Low-pass Filter for Privacy Noise Reduction", NeurIPS 2024,
arXiv:2408.13460, Alg. 2/3).

Per logical step t, with g_t the DP-SGD privatized gradient ``(sum_i clip(grad f(x_t; xi_i)) + N(0, sigma^2
C^2)) / B``::

    m_t     = - sum_{tau=1..n_a} a_tau m_{t-tau} + sum_{tau=0..n_b} b_tau g_{t-tau}   (zero initial state)
    c_t     = the same filter run on the unit step; m_hat_t = m_t / c_t               (bias correction)
    x_{t+1} = BaseOptimizerUpdate(x_t, m_hat_t)

``doppler_base="optimizer"`` (default) hands m_hat_t to the wrapped optimizer as its gradient: SGD gives the
paper's LP-DPSGD (an Adam/AdamW would filter again with its beta1 and normalize by the second moment of the
filtered gradient, which is not the paper's method). The paper's Adam variants replace Adam's first moment by
m_hat_t and keep the second moment of the unfiltered g_t: ``doppler_base="adam"`` is LP-DPAdam (Alg. 3,
``m_hat / max(sqrt(v_hat), eps)``) and ``doppler_base="adam_bc"`` LP-DPAdamBC (the DP-noise variance is
subtracted from v_hat), computed here and applied by a plain-SGD wrapped optimizer (``optim="sgd"``). The
filter and its presets (Tables 2 and 4 of the paper) are in :mod:`hf_dpfilter.optimizers.filters`; the default
is the first-order "ver.1" filter b = [1/11, 1/11], a = [-9/11]. Sign convention: scipy.signal.lfilter(b, [1,
*a]).

Privacy: the filter reads only the privatized g_t, once per logical step, so this is post-processing of
DP-SGD: same sensitivity C, same accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.optimizers.filters import LowPassConfig


@dataclass(frozen=True)
class DopplerConfig(LowPassConfig):
    """DOPPLER's settings (the filter's, :class:`~hf_dpfilter.optimizers.filters.LowPassConfig`; default
    filter ``"first_order_v1"``). Privacy: DP-SGD's (the filter is post-processing)."""

    name = "doppler"
    legacy_prefix = "doppler_"


class DopplerOptimizer(DPOptimizer):
    """DP-SGD/DP-Adam with DOPPLER's low-pass filter on the privatized gradient (settings:
    :class:`DopplerConfig`)."""

    method_name = "doppler"

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, plan, **kwargs)
        self.lowpass = self.config.make_postprocessor(optimizer)

    def postprocess(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        filtered = self.lowpass(list(grads.values()), noise_variance=self.noise_variance())
        return dict(zip(grads, filtered))

    def method_state_dict(self) -> dict[str, Any]:
        return {"lowpass": self.lowpass.state_dict(self.params)}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        self.lowpass.load_state_dict(state["lowpass"], self.params)


__all__ = ["DopplerConfig", "DopplerOptimizer"]
