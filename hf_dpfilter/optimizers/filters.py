"""The coordinate-wise IIR low-pass filter with bias correction shared by DOPPLER and DP-PMLF.

For a privatized gradient sequence g_0, g_1, ... (one per logical, noised step) and coefficients
``b = [b_0, ..., b_nb]``, ``a = [a_1, ..., a_na]`` (Zhang et al., DOPPLER, NeurIPS 2024, Sec. 3.1 / Alg. 2)::

    m_t     = - sum_{tau=1..n_a} a_tau m_{t-tau} + sum_{tau=0..n_b} b_tau g_{t-tau}   (m_{<0} = g_{<0} = 0)
    c_t     = the same recursion on the unit step (g_s = 1 for s >= 0)      (a host-side float64 scalar)
    m_hat_t = m_t / c_t

The sign convention is ``scipy.signal.lfilter(b, [1, a_1, ..., a_na], g)``. ``c_t`` is the cumulative impulse
response, so ``m_hat_t`` is a weighted average of g_0..g_t whose weights sum to 1 (``m_hat_0 = g_0``). The
filter must have unit DC gain (``sum(b) - sum(a) = 1``) and all poles strictly inside the unit circle; both
are checked. The state is the transposed direct form II: ``max(n_a, n_b)`` buffers per parameter (outputs
equal to the paper's n_a + n_b-state direct form I), updated with fused ``torch._foreach_*`` ops.

:class:`LowPassPostprocessor` applies it to the privatized gradients of all parameters, either handing
``m_hat`` to the wrapped optimizer (``base="optimizer"``/``"sgd"``: SGD gives LP-DPSGD; an Adam/AdamW would
take ``m_hat`` as its gradient, so its own beta1-EMA filters again and its second moment sees the filtered,
low-variance gradient) or computing the paper's Adam directions, where the filter REPLACES Adam's first
moment (Alg. 3 without GaLore)::

    v_t = beta2 v_{t-1} + (1 - beta2) g_t^2            (the UNFILTERED privatized gradient)
    v_hat_t = v_t / (1 - beta2^(t+1))
    d_t = m_hat_t / max(sqrt(v_hat_t), eps)            base="adam": LP-DPAdam (the literal Alg. 3)
    d_t = m_hat_t / sqrt(max(v_hat_t - Phi, eps))      base="adam_bc": LP-DPAdamBC, with
                                                       Phi = (sigma * Delta / B)^2, the DP-noise variance
                                                       (DPAdamBC, Tang et al. 2024)

which is then applied by a plain SGD step (its weight decay is then decoupled, as in AdamW). With the
momentum filter (b = [1 - beta1], a = [-beta1]) ``base="adam"`` is exactly DP-Adam.
Everything here reads only privatized gradients and public constants: post-processing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hf_dpfilter.optimizers.method_config import MethodConfig, as_tuple

# Name -> (b, a) in the paper's convention (a without the leading 1). DOPPLER Tables 2 and 4, DP-PMLF App. E.
FILTER_PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "sgd": ((1.0,), ()),
    "momentum": ((0.1,), (-0.9,)),
    "first_order_v1": ((1 / 11, 1 / 11), (-9 / 11,)),
    "first_order_v2": ((3 / 11, -1 / 11), (-9 / 11,)),
    "second_order": ((1 / 58, 2 / 58, 1 / 58), (-92 / 58, 38 / 58)),
    "f1": ((0.075, 0.025), (-0.9,)),
    "f2": ((0.025, 0.075), (-0.9,)),
    "f3": ((0.1, 0.1), (-0.8,)),
    "f4": ((0.2, 0.2), (-0.6,)),
    "f5": ((0.025, 0.05, 0.025), (-0.9,)),
    "f6": ((0.025, 0.025), (-1.8, 0.85)),
    "pmlf_mnist": ((0.1,), (-0.9,)),
    "pmlf_cifar": ((0.15, -0.05), (-0.9,)),
}

DC_GAIN_TOLERANCE = 1e-6
LOWPASS_BASES = ("optimizer", "sgd", "adam", "adam_bc")


class LowPassFilter:
    """IIR filter coefficients (paper/scipy convention), validated, plus the bias-correction recursion.

    Args:
        b: numerator ``[b_0, ..., b_nb]`` (``b_0 != 0``).
        a: denominator without the leading 1, ``[a_1, ..., a_na]`` (``a = [-0.9]`` is momentum 0.9).
        name: how errors refer to the coefficients (e.g. the argument names).
    """

    def __init__(self, b: Sequence[float], a: Sequence[float] = (), name: str = "filter") -> None:
        self.b = tuple(float(x) for x in b)
        self.a = tuple(float(x) for x in a)
        if not self.b:
            raise ValueError(f"{name}: b (the numerator) needs at least one coefficient, e.g. b=[1.0] for no "
                             "filter.")
        if not all(math.isfinite(x) for x in self.b + self.a):
            raise ValueError(f"{name}: coefficients must be finite, got b={list(self.b)}, a={list(self.a)}.")
        if self.b[0] == 0:
            raise ValueError(
                f"{name}: b_0 = 0 makes the bias correction c_0 = b_0 zero (division by zero at the first "
                "step). Use b_0 != 0 (a delay in front of the filter brings nothing)."
            )
        gain = sum(self.b) - sum(self.a)
        if abs(gain - 1.0) > DC_GAIN_TOLERANCE:
            raise ValueError(
                f"{name}: the filter must have unit DC gain, sum(b) - sum(a) = 1 (i.e. H(1) = 1), got "
                f"{gain:.8g} for b={list(self.b)}, a={list(self.a)}. Note the sign convention: a = [a_1, "
                "...] without the leading 1, as in scipy.signal.lfilter(b, [1, *a], x); momentum 0.9 is "
                "b=[0.1], a=[-0.9]. Rescale b (or use a preset)."
            )
        if self.a:
            poles = np.roots([1.0, *self.a])
            radius = float(np.abs(poles).max())
            if radius >= 1.0:
                raise ValueError(
                    f"{name}: the filter is unstable: pole(s) {np.round(poles, 6).tolist()} with |p| = "
                    f"{radius:.6g} "
                    ">= 1 (all roots of z^n_a + a_1 z^(n_a-1) + ... + a_n_a must lie strictly inside the "
                    "unit circle). Check the sign convention (a = [-0.9] is a pole at 0.9)."
                )
        self.order = max(len(self.a), len(self.b) - 1)
        self._b_padded = self.b + (0.0,) * (self.order + 1 - len(self.b))
        self._a_padded = self.a + (0.0,) * (self.order - len(self.a))
        self.state_scale = self._first_order_state_scale()

    def _first_order_state_scale(self) -> float | None:
        """k of the two-lerp form of a first-order filter (:meth:`filter_first_order_`), or None.

        With the state kept as s = z / k and k = (b_1 - a_1 b_0) / (1 + a_1), one step is two interpolations:
        L = s + w_1 (g - s) with w_1 = b_0 / (k + b_0), so that m = (k + b_0) L; and the new
        s = (b_1 / k) g - a_1 ((k + b_0) / k) L, whose weights sum to 1 by the choice of k, i.e. g + w_2 (L -
        g) with w_2 = -a_1 (k + b_0) / k. (1 + a_1 > 0: the pole -a_1 is inside the unit circle.)
        """
        if self.order != 1 or not self.a:
            return None
        b0, b1, a1 = self._b_padded[0], self._b_padded[1], self.a[0]
        k = (b1 - a1 * b0) / (1.0 + a1)
        if not math.isfinite(k) or abs(k) < 1e-6 or abs(k + b0) < 1e-6:
            return None  # no state to carry (b_1 = a_1 b_0) or a degenerate scale: the general form
        return k

    @classmethod
    def resolve(
        cls,
        preset: str | None,
        b: Sequence[float] | None,
        a: Sequence[float] | None,
        prefix: str = "doppler",
    ) -> LowPassFilter:
        """The filter from explicit coefficients (``b``, optional ``a``) if given, else from the named
        preset."""
        if b is not None:
            return cls(b, a if a is not None else (), name=f"{prefix}: b/a")
        if a is not None:
            raise ValueError(
                f"{prefix}: a was given without b: give both coefficient lists (b = [b_0, ...], "
                f"a = [a_1, ...]) or a preset from {sorted(FILTER_PRESETS)}."
            )
        if preset not in FILTER_PRESETS:
            raise ValueError(f"{prefix}: unknown preset {preset!r}; available: {sorted(FILTER_PRESETS)}.")
        preset_b, preset_a = FILTER_PRESETS[preset]
        return cls(preset_b, preset_a, name=f"{prefix}: preset={preset!r}")

    def bias_correction(self, t: int, history: list[float]) -> float:
        """c_t from c_{t-1..t-n_a} (``history``, most recent first, zeros before the start); updates
        ``history``."""
        c = sum(self.b[: min(len(self.b), t + 1)]) - sum(a * h for a, h in zip(self.a, history))
        if self.a:
            history.insert(0, c)
            del history[len(self.a) :]
        if abs(c) < 1e-12:
            raise ValueError(f"The filter's bias correction c_{t} is 0: the step response vanishes; use "
                             "another filter.")
        return c

    def filter_first_order_(
        self, state: list[torch.Tensor], grads: list[torch.Tensor], scale: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One step of a first-order filter with the state kept as s = z / k (:attr:`state_scale` = k):
        ``(scale * m_t, new s)``, in three memory passes and no new tensor.

        Both lists are overwritten: the output is written into ``state``'s tensors and the new state into
        ``grads``' (the general form takes four passes and a new parameter-sized output).
        """
        k, b0, a1 = self.state_scale, self._b_padded[0], self.a[0]
        torch._foreach_lerp_(state, grads, b0 / (k + b0))  # L, so that m = (k + b0) L
        torch._foreach_lerp_(grads, state, -a1 * (k + b0) / k)  # the new s
        factor = scale * (k + b0)
        if factor != 1.0:
            torch._foreach_mul_(state, factor)
        return state, grads

    def filter_(self, buffers: list[list[torch.Tensor]],
                grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """One transposed-direct-form-II step for every tensor at once.

        ``buffers[i]`` is the list (over tensors) of the state ``z_i``; returns ``(m_t, new buffers)``.
        ``m_t`` is a new list of tensors; the state tensors are updated in place (and rotated, no copies).
        """
        b, a, n = self._b_padded, self._a_padded, self.order
        if n == 0:
            return torch._foreach_mul(grads, b[0]), buffers
        m = torch._foreach_add(buffers[0], grads, alpha=b[0])  # m = b_0 g + z_0
        recycled = buffers[0]  # z_0 is consumed: its storage becomes the new z_{n-1}
        if n == 1:
            # first order (the common presets): new z_0 = b_1 g - a_1 m = (b_1 - a_1 b_0) g - a_1 z_0, in
            # place in two passes instead of zero + two adds (the filter's state update is pure memory
            # traffic)
            torch._foreach_mul_(recycled, -a[0])
            torch._foreach_add_(recycled, grads, alpha=b[1] - a[0] * b[0])
            return m, [recycled]
        for i in range(1, n):  # new z_{i-1} = z_i + b_i g - a_i m
            if b[i] != 0:
                torch._foreach_add_(buffers[i], grads, alpha=b[i])
            if a[i - 1] != 0:
                torch._foreach_add_(buffers[i], m, alpha=-a[i - 1])
        torch._foreach_zero_(recycled)  # new z_{n-1} = b_n g - a_n m
        if b[n] != 0:
            torch._foreach_add_(recycled, grads, alpha=b[n])
        if a[n - 1] != 0:
            torch._foreach_add_(recycled, m, alpha=-a[n - 1])
        return m, buffers[1:] + [recycled]


class LowPassPostprocessor:
    """Filter state for a list of parameters: ``m_hat_t`` (or the LP-DPAdamBC direction) from ``g_t``.

    Args:
        lowpass: the filter.
        base: ``"optimizer"`` (hand ``m_hat`` to the wrapped optimizer; ``"sgd"`` is the same, with a check of
            the wrapped optimizer's type done by the owner), ``"adam"`` (LP-DPAdam direction) or ``"adam_bc"``
            (LP-DPAdamBC direction); the two Adam directions are applied by a plain-SGD wrapped optimizer.
        beta2, eps: the Adam directions' second-moment decay and floor (see the module docstring).
    """

    def __init__(
        self,
        lowpass: LowPassFilter,
        base: str = "optimizer",
        beta2: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        if base not in LOWPASS_BASES:
            raise ValueError(f"Unknown filter base {base!r}; choose one of {LOWPASS_BASES}.")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 (the second-moment decay) must be in [0, 1), got {beta2}.")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}.")
        self.lowpass = lowpass
        self.adam_direction = base in ("adam", "adam_bc")
        self.bias_correct_noise = base == "adam_bc"
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.t = 0
        self.c_history = [0.0] * len(lowpass.a)
        self.buffers: list[list[torch.Tensor]] | None = None
        self.second_moment: list[torch.Tensor] | None = None
        #: first-order filter handing m_hat on: the two-lerp form, the state kept as z / k in ``buffers``
        #: (the Adam directions read the unfiltered gradient after filtering, so they keep the general form)
        self.scaled_state = lowpass.state_scale is not None and not self.adam_direction

    def __call__(self, grads: list[torch.Tensor], noise_variance: float = 0.0) -> list[torch.Tensor]:
        """Filtered (bias-corrected) gradients; ``noise_variance`` = Phi of LP-DPAdamBC (per coordinate).

        ``grads`` are the step's own privatized tensors and are consumed: in the first-order form they receive
        the filter's new state (the methods pass the noise buffers, which nothing reads afterwards)."""
        if self.buffers is None:
            self.buffers = [[torch.zeros_like(g) for g in grads] for _ in range(self.lowpass.order)]
        c = self.lowpass.bias_correction(self.t, self.c_history)
        if self.scaled_state:
            # the privatized gradients are this step's own tensors: the new state is written into them
            m, state = self.lowpass.filter_first_order_(self.buffers[0], grads, 1.0 / c)
            self.buffers = [state]
        else:
            m, self.buffers = self.lowpass.filter_(self.buffers, grads)
            torch._foreach_div_(m, c)
        if self.adam_direction:
            if self.second_moment is None:
                self.second_moment = [torch.zeros_like(g) for g in grads]
            v = self.second_moment
            torch._foreach_mul_(v, self.beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - self.beta2)
            v_hat = torch._foreach_div(v, 1.0 - self.beta2 ** (self.t + 1))
            if self.bias_correct_noise:
                torch._foreach_sub_(v_hat, noise_variance)
                torch._foreach_clamp_min_(v_hat, self.eps)
                torch._foreach_sqrt_(v_hat)
            else:
                torch._foreach_sqrt_(v_hat)
                torch._foreach_clamp_min_(v_hat, self.eps)
            torch._foreach_div_(m, v_hat)
        self.t += 1
        return m

    def state_dict(self, params: list[nn.Parameter]) -> dict[str, Any]:
        return {
            "t": self.t,
            "c_history": list(self.c_history),
            "buffers": None if self.buffers is None else [dict(zip(params, z)) for z in self.buffers],
            # the buffers hold z / state_scale (the two-lerp form), or z when None
            "state_scale": self.lowpass.state_scale if self.scaled_state else None,
            "second_moment": None if self.second_moment is None else dict(zip(params, self.second_moment)),
        }

    def load_state_dict(self, state: dict[str, Any], params: list[nn.Parameter]) -> None:
        self.t = int(state["t"])
        self.c_history = [float(x) for x in state["c_history"]]
        buffers = state["buffers"]
        if buffers is not None and len(buffers) != self.lowpass.order:
            # the state of another filter would be read as this one's (or not fit it): refused before any step
            raise ValueError(
                f"The checkpoint's low-pass filter is of order {len(buffers)} and this run's of order "
                f"{self.lowpass.order} (preset/b/a in dp_method_args): resume with the settings the "
                "checkpoint was written with."
            )
        self.buffers = None if buffers is None else [[z[p] for p in params] for z in buffers]
        saved_scale = state.get("state_scale")  # None: z itself (the general form, and older checkpoints)
        scale = self.lowpass.state_scale if self.scaled_state else None
        # another form: convert (exact when the same form)
        if self.buffers is not None and saved_scale != scale:
            if saved_scale is not None:
                self.buffers = [torch._foreach_mul(z, saved_scale) for z in self.buffers]
            if scale is not None:
                self.buffers = [torch._foreach_div(z, scale) for z in self.buffers]
        moment = state["second_moment"]
        self.second_moment = None if moment is None else [moment[p] for p in params]


def check_filter_base(base: str, optimizer: torch.optim.Optimizer, argument: str) -> None:
    """Raise a clear error when the wrapped optimizer does not fit the requested filter base."""
    if base not in LOWPASS_BASES:
        raise ValueError(f"{argument} must be one of {LOWPASS_BASES}, got {base!r}.")
    name = type(optimizer).__name__
    if base == "optimizer" and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # Measured on SST-2 (docs/results.md): at DP-Adam's tuned lr this collapses to chance, the Adam
        # variant does not. Allowed (it is still post-processing), but not what the paper does.
        warnings.warn(
            f"{argument}='optimizer' hands the low-passed gradient to {name}: its beta1-EMA filters it again "
            f"and its second moment is of the filtered gradient, which is not the DOPPLER paper's Adam. For "
            f"that, use {argument}='adam' (LP-DPAdam) or 'adam_bc' (LP-DPAdamBC) with optim='sgd' "
            f"(or base=torch.optim.SGD).",
            stacklevel=3,
        )
    if base in ("adam", "adam_bc", "sgd"):
        plain = isinstance(optimizer, torch.optim.SGD) and all(
            g.get("momentum", 0) == 0 and not g.get("nesterov", False) for g in optimizer.param_groups
        )
        if not plain:
            what = ("LP-DPSGD and" if base == "sgd"
                    else f"the {'LP-DPAdamBC' if base == 'adam_bc' else 'LP-DPAdam'} direction itself and")
            raise ValueError(
                f"{argument}={base!r} computes {what} needs plain SGD (momentum 0) as the wrapped optimizer, "
                f"got {name}. Use optim='sgd' in the TrainingArguments (or base=torch.optim.SGD), or "
                f"{argument}='optimizer' to hand the filtered gradient to {name}."
            )


@dataclass(frozen=True)
class LowPassConfig(MethodConfig):
    """The low-pass filter settings DOPPLER and DP-PMLF share (their configs extend this one).

    ``preset`` names a filter (``FILTER_PRESETS``), ignored when ``b`` is given; ``b``/``a`` are explicit
    coefficients ``[b_0, ...]``/``[a_1, ...]``; ``base`` is how the filtered gradient is used
    (``"optimizer"``, ``"sgd"``, ``"adam"`` = LP-DPAdam, ``"adam_bc"`` = LP-DPAdamBC); ``beta2``/``eps`` are
    the Adam variants' second-moment decay and floor.
    """

    preset: str = "first_order_v1"
    b: tuple[float, ...] | None = None
    a: tuple[float, ...] | None = None
    base: str = "optimizer"
    beta2: float = 0.999
    eps: float = 1e-8

    @property
    def argument_prefix(self) -> str:
        """How messages name this method's settings: ``"<method>: <field>"`` (the fields of
        ``dp_method_args``)."""
        return self.name

    def __post_init__(self) -> None:
        object.__setattr__(self, "b", as_tuple(self.b))
        object.__setattr__(self, "a", as_tuple(self.a))
        if self.base not in LOWPASS_BASES:
            raise ValueError(f"{self.argument_prefix}: base must be one of {LOWPASS_BASES}, got "
                             f"{self.base!r}.")
        self.lowpass_filter()  # validates the filter early

    def lowpass_filter(self) -> LowPassFilter:
        return LowPassFilter.resolve(self.preset, self.b, self.a, prefix=self.argument_prefix)

    def make_postprocessor(self, optimizer: torch.optim.Optimizer) -> LowPassPostprocessor:
        """The filter state for ``optimizer``'s parameters (checks that the wrapped optimizer fits
        ``base``)."""
        check_filter_base(self.base, optimizer, f"{self.argument_prefix}: base")
        return LowPassPostprocessor(self.lowpass_filter(), base=self.base, beta2=self.beta2, eps=self.eps)


__all__ = ["FILTER_PRESETS", "LOWPASS_BASES", "LowPassConfig", "LowPassFilter", "LowPassPostprocessor",
           "check_filter_base"]
