"""DiceSGD: DP-SGD with clipped error feedback (Zhang, Bu, Wu & Hong, "Differentially Private SGD Without
Clipping Bias: An Error-Feedback Approach", ICLR 2024, Algorithm 2).

Per logical step t with Poisson batch B_t (expected size B, sample rate q), per-example gradients g_i at x_t::

    alpha_i = clip factor of g_i at C1                 (min(1, C1/||g_i||), or automatic clipping)
    alpha_e = min(1, C2 / ||e_t||)                     (flat L2 norm over all trainable parameters)
    u_t     = (1/B) (sum_i alpha_i g_i + N(0, sigma^2 I)) + alpha_e e_t          # released, one noise draw
    x_{t+1} = BaseOptimizerUpdate(x_t, u_t)                                         # SGD, Adam(W), ... on u_t
    e_{t+1} = (1 - alpha_e) e_t + (1/B) sum_i (1 - alpha_i) g_i                   # noise-free, PRIVATE

e is ONE global buffer on the mean scale (fp32, fp64 for fp64 models), initialised to 0 and never reset.

Both sums come from the same backward work: :meth:`PerExampleGradients.weighted_sum` with the clip factors
(into ``p.grad``) and with ``1 - alpha_i`` (the residual, into the buffer), i.e. "with ones" minus the
clipped sum, without the cancellation. Under several processes both sums are all-reduced; e is identical on
every process and the noise is added once (base class).

**Default C2 = C1 / B** (B = the plan's expected logical batch ``logical_batch_size``, the fixed B that
divides the sums above, not the realised Poisson batch): the buffer is clipped at C1 on the SUM scale, the
authors' setting "C1 = C2" read on the scale of their analysis: Thm 3.7's constant is C = B C2, and App.
C.4's G~ = 3 C1^2 (the noise they state) holds at B C2 = C1. Alg. 2's C2 = C1 read on the mean scale
clips the feedback at B times that: the sensitivity below grows from 3 C1 to (1 + 2B) C1, and the noise
with it (measured: docs/results.md, "Defaults and their measurements").

**e is not private.** It is a function of every past unclipped gradient. It is never logged, and it is kept
out of ``state_dict()`` / checkpoints unless ``dice_save_error_buffer=True`` (with a warning: such checkpoints
must not be published). Without it, resuming from a checkpoint restarts the buffer at zero with a warning
(this is data-independent, so the privacy accounting is unaffected; the run is then not bit-identical to an
uninterrupted one).

**Accounting** (docs/privacy.md, "Accounting of DiceSGD and DIFF2"). The paper's Thm 3.7 noise formula is
not justified as stated: it applies subsampling amplification to the hidden buffer, whose dependence on a
sampled example persists in every later step whether or not the example is sampled again (docs/privacy.md,
"Accounting of DiceSGD and DIFF2"). The default accounting here:

* sum-scale release ``U = S_clip + B clip(e, C2) + N(0, sigma^2 I)`` with ``sigma = noise_multiplier * Delta``
  and ``Delta = C1 + 2 B C2`` (:meth:`sensitivity`): S_clip moves by <= C1, the feedback term by <= 2 B C2
  (two vectors in the ball of radius B C2) whatever the past data;
* for the epsilon, the one noise draw is split (in the analysis only) as ``w = w1 + w2`` with variances in
  the ratio C1 : 2 B C2; U is post-processing of (S_clip + w1, B clip(e) + w2). Conditioned on the released
  history the first is a Poisson-subsampled Gaussian (fresh coin), the second a mixture (over the hidden
  past coins) of Gaussians each shifted by <= 2 B C2, hence dominated by a Gaussian mechanism without
  amplification. The accountant composes, per step, ``(z sqrt(1 + k), q)`` and ``(z sqrt(1 + 1/k), 1)`` with
  ``k = 2 B C2 / C1`` (2 at the default C2 = C1 / B; :func:`dicesgd_history`), declared per step by
  :meth:`DiceSGDConfig.mechanisms`.

``dice_accounting="paper"`` calibrates sigma with the paper's formula
``sigma_mean^2 = 32 T G~ log(1/delta) / (N^2 eps^2)``, ``G~ = C1^2 + 2 (B C2)^2`` (Thm 3.7 with its constant
C = B C2 and G' unknown; the default C2 = C1 / B gives App. C.4's G~ = 3 C1^2). The accountant still records
the sound bound above, which is the ``epsilon`` reported; the paper's value is reported as
``epsilon_paper_claim`` ("per Zhang et al. Thm 3.7", not independently verified).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.distributed.collectives import is_sharded
from hf_dpfilter.engine import PerExampleGradients
from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.optimizers.method_config import (
    Mechanism,
    MethodConfig,
    NoiseRound,
    NoiseSettings,
    PlanSettings,
)
from hf_dpfilter.randomness.noise import noisy_averages

DICE_ACCOUNTINGS = ("default", "paper")

__all__ = [
    "DICE_ACCOUNTINGS",
    "DiceSGD",
    "DiceSGDConfig",
    "dicesgd_history",
    "dicesgd_paper_epsilon",
    "dicesgd_paper_sigma",
]


def dicesgd_history(
    noise_multiplier: float, sample_rate: float, steps: int, kappa: float
) -> list[tuple[float, float, int]]:
    """Accountant history of ``steps`` DiceSGD steps under the default (sound) accounting.

    ``noise_multiplier`` is the total noise std over ``Delta = C1 + 2 B C2``; ``kappa = 2 B C2 / C1``. The
    clipped sum (sensitivity C1, Poisson-subsampled) gets the variance share ``1/(1+kappa)``, the feedback
    term (sensitivity 2 B C2, no amplification) the share ``kappa/(1+kappa)``.
    """
    z = float(noise_multiplier)
    if kappa == 0:
        return [(z, sample_rate, steps)]
    return [(z * math.sqrt(1.0 + kappa), sample_rate, steps), (z * math.sqrt(1.0 + 1.0 / kappa), 1.0, steps)]


@dataclass(frozen=True)
class DiceSGDConfig(MethodConfig):
    """DiceSGD's settings and privacy declaration.

    Args:
        error_max_grad_norm: C2, the clip norm of the error buffer on the mean scale. None (default): C2 =
            C1 / B with B the plan's expected logical batch (``logical_batch_size``), the authors' sum-scale
            clip (Thm 3.7's C = B C2 = C1; App. C.4). Larger C2 removes more clipping bias but raises the
            sensitivity C1 + 2 B C2 and so the noise; 0 is exactly DP-SGD.
        accounting: ``"default"`` (the library's sound bound) or ``"paper"`` (sigma from the paper's Thm 3.7
            formula; the reported epsilon stays the sound bound, the claim is reported beside it).
        save_error_buffer: keep the (non-private) buffer in ``state_dict()`` for exact resumption.
    """

    name = "dicesgd"
    legacy_prefix = "dice_"

    error_max_grad_norm: float | None = None
    accounting: str = "default"
    save_error_buffer: bool = False

    def __post_init__(self) -> None:
        c2 = self.error_max_grad_norm
        if c2 is not None and not (math.isfinite(c2) and c2 >= 0):
            raise ValueError(
                f"dicesgd: error_max_grad_norm (C2) must be a finite number >= 0, got {c2}; leave it unset "
                "for C2 = per_sample_max_grad_norm / logical_batch_size (C1 / B, the authors' scale)."
            )
        if self.accounting not in DICE_ACCOUNTINGS:
            raise ValueError(f"dicesgd: accounting must be one of {DICE_ACCOUNTINGS}, got "
                             f"{self.accounting!r}.")

    def c2(self, plan: PlanSettings) -> float:
        """C2 on the mean scale: the configured value, else C1 / B (the sum-scale clip C1; module
        docstring)."""
        if self.error_max_grad_norm is None:
            return plan.max_grad_norm / plan.expected_batch_size
        return float(self.error_max_grad_norm)

    def kappa(self, plan: PlanSettings) -> float:
        """2 B C2 / C1: the feedback term's sensitivity relative to the clipped sum's."""
        return 2.0 * plan.expected_batch_size * self.c2(plan) / plan.max_grad_norm

    def sensitivity(self, plan: PlanSettings) -> float:
        """Sum-scale L2 sensitivity of the released ``S_clip + B clip(e, C2)``: ``C1 + 2 B C2``."""
        return plan.max_grad_norm + 2.0 * plan.expected_batch_size * self.c2(plan)

    def mechanisms(self, step: int, noise: NoiseSettings, plan: PlanSettings) -> list[Mechanism]:
        return [Mechanism(s, q) for s, q, _ in dicesgd_history(noise.noise_multiplier, plan.sample_rate, 1,
                                                               self.kappa(plan))]

    def noise_rounds(self, noise: NoiseSettings, plan: PlanSettings) -> list[NoiseRound]:
        """One round per step: noise sigma (C1 + 2 B C2) on the sum, against a signal of at most C1 + C2 per
        example (the clipped gradient and, on the mean scale, the clipped feedback)."""
        c1, c2, batch = plan.max_grad_norm, self.c2(plan), plan.expected_batch_size
        sensitivity = (f"C1 + 2 B C2 = {c1:g} + 2 x {batch:g} x {c2:g} = {self.sensitivity(plan):g} (error "
                       "feedback)")
        return [NoiseRound("every step", 1.0, noise.noise_multiplier, sensitivity,
                           noise.noise_multiplier * self.sensitivity(plan) / (c1 + c2))]

    def calibrate(self, target_epsilon: float, delta: float, plan: PlanSettings) -> NoiseSettings:
        if self.accounting == "paper":
            batch = plan.expected_batch_size
            sigma_mean = dicesgd_paper_sigma(target_epsilon, delta, plan.steps, batch / plan.sample_rate,
                                             plan.max_grad_norm, self.c2(plan), batch)
            return NoiseSettings(sigma_mean * batch / self.sensitivity(plan))
        return super().calibrate(target_epsilon, delta, plan)

    def report(self, noise: NoiseSettings, plan: PlanSettings, steps: int, delta: float) -> dict[str, Any]:
        sigma_sum = noise.noise_multiplier * self.sensitivity(plan)
        details: dict[str, Any] = {
            "dice_accounting": self.accounting,
            "epsilon_basis": "library bound (docs/privacy.md): clipped sum as a Poisson-subsampled Gaussian "
            "(sensitivity C1) composed with the error feedback as a Gaussian without amplification "
            "(sensitivity 2 B C2)",
            "sensitivity": self.sensitivity(plan),
            "noise_std_sum_scale": sigma_sum,
            "dice_error_max_grad_norm": self.c2(plan),
        }
        if plan.sample_rate is not None:
            details["epsilon_paper_claim"] = dicesgd_paper_epsilon(
                sigma_sum / plan.expected_batch_size, delta, steps,
                plan.expected_batch_size / plan.sample_rate,
                plan.max_grad_norm, self.c2(plan), plan.expected_batch_size,
            )
            details["epsilon_paper_claim_note"] = (
                "per Zhang et al. 2024 Thm 3.7 with G~ = C1^2 + 2 (B C2)^2; NOT independently verified (it "
                "applies subsampling amplification to the hidden error buffer)"
            )
        return details


def _gtilde(max_grad_norm: float, error_max_grad_norm: float, batch_size: float) -> float:
    """Thm 3.7's G~ = C1^2 + 2 min(C^2, G'^2) with C = B C2 and G' unknown (unverifiable)."""
    return max_grad_norm**2 + 2.0 * (batch_size * error_max_grad_norm) ** 2


def dicesgd_paper_sigma(
    target_epsilon: float, delta: float, steps: int, num_examples: float, max_grad_norm: float,
    error_max_grad_norm: float, batch_size: float,
) -> float:
    """The paper's (Thm 3.7) mean-scale noise std: sqrt(32 T G~ log(1/delta)) / (N eps)."""
    gt = _gtilde(max_grad_norm, error_max_grad_norm, batch_size)
    return math.sqrt(32.0 * steps * gt * math.log(1.0 / delta)) / (num_examples * target_epsilon)


def dicesgd_paper_epsilon(
    sigma_mean: float, delta: float, steps: int, num_examples: float, max_grad_norm: float,
    error_max_grad_norm: float, batch_size: float,
) -> float:
    """The epsilon the paper's Thm 3.7 claims for ``steps`` steps at mean-scale noise std ``sigma_mean``."""
    if steps == 0:
        return 0.0
    if sigma_mean <= 0:
        return math.inf
    gt = _gtilde(max_grad_norm, error_max_grad_norm, batch_size)
    return math.sqrt(32.0 * steps * gt * math.log(1.0 / delta)) / (num_examples * sigma_mean)



class DiceSGD(DPOptimizer):
    """DiceSGD (clipped error feedback) around any base optimizer; see the module docstring.

    Settings: :class:`DiceSGDConfig`. The plan's ``max_grad_norm`` is C1 and its ``noise_multiplier`` is
    relative to :meth:`sensitivity` = C1 + 2 B C2.
    """

    method_name = "dicesgd"

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, plan, **kwargs)
        config: DiceSGDConfig = self.config
        self.error_max_grad_norm = config.c2(plan)
        self.dice_accounting = config.accounting
        self.save_error_buffer = bool(config.save_error_buffer)
        if self.save_error_buffer:
            warnings.warn(
                "dicesgd: save_error_buffer=True: checkpoints will contain DiceSGD's error buffer, a "
                "NON-private function of the training data. Keep them inside the trust boundary; never "
                "publish them.",
                UserWarning,
                stacklevel=2,
            )
        self._error: dict[nn.Parameter, torch.Tensor] = {}
        self._residual: dict[nn.Parameter, torch.Tensor] = {}

    @property
    def kappa(self) -> float:
        return self.config.kappa(self.plan)

    def sensitivity(self) -> float:
        """Sum-scale L2 sensitivity of the released ``S_clip + B clip(e, C2)``: ``C1 + 2 B C2``."""
        return self.config.sensitivity(self.plan)

    # ------------------------------------------------------------------------------ the buffer
    def _buffer(self) -> dict[nn.Parameter, torch.Tensor]:
        for p in self.params:
            if p not in self._error:
                dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                # laid out like p: under FSDP2 each process keeps the buffer's rows of its own shard
                self._error[p] = (torch.zeros_like(p, dtype=dtype) if is_sharded(p)
                                  else torch.zeros(p.shape, dtype=dtype, device=p.device))
        return self._error

    def feedback_factor(self) -> float:
        """alpha_e = min(1, C2 / ||e||) for the current buffer (0 when C2 = 0)."""
        if self.error_max_grad_norm == 0:
            return 0.0
        norm = math.sqrt(self.collectives.squared_norm(list(self._buffer().values())))
        if norm <= self.error_max_grad_norm:
            return 1.0
        # The small margin keeps ||alpha_e e|| <= C2 despite rounding in fp32.
        return self.error_max_grad_norm / (norm * (1.0 + 1e-6))

    def feedback(self) -> dict[nn.Parameter, torch.Tensor]:
        """``clip(e, C2)`` (mean scale) that the next step adds to the release. Private: for tests only."""
        alpha = self.feedback_factor()
        return {p: e * alpha for p, e in self._buffer().items()}

    # ------------------------------------------------------------------------------ the step
    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        factors = self.clip_factors(grads)
        self.add_to_sums(grads.weighted_sum(factors))
        # the last sum of the batch frees each layer's terms as it goes (the sums replace them in memory)
        for p, r in grads.weighted_sum(1.0 - factors, release=True).items():
            if p in self._residual:
                self._residual[p].add_(r)
            else:
                self._residual[p] = r

    def _summed_residual(self) -> dict[nn.Parameter, torch.Tensor]:
        residual, self._residual = self._residual, {}
        if self.collectives.world_size > 1 or self.sharded:
            params = self.params
            full = []
            for p in params:
                dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                r = residual.get(p)
                full.append(torch.zeros(p.shape, dtype=dtype, device=p.device) if r is None else r.to(dtype))
            residual = dict(zip(params, self.collectives.sum_as_params(params, full)))
        return residual

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._residual = {}

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """``u = (S_clip + N(0, sigma^2)) / B + alpha_e e``, then ``e <- (1 - alpha_e) e + S_res / B``."""
        error = self._buffer()
        alpha = self.feedback_factor()
        std = self.noise_multiplier * self.sensitivity()
        batch = self.expected_batch_size
        released = noisy_averages(sums, std, batch, self.noise_source())
        if alpha > 0:
            params = list(released)
            torch._foreach_add_([released[p] for p in params],
                                [error[p].to(released[p].dtype) for p in params],
                                alpha=alpha)
        residual = self._summed_residual()
        if alpha > 0:
            torch._foreach_mul_(list(error.values()), 1.0 - alpha)
        with_residual = [p for p in error if p in residual]
        if with_residual:
            torch._foreach_add_([error[p] for p in with_residual],
                                [residual[p].to(error[p].dtype) for p in with_residual], alpha=1.0 / batch)
        return released

    # ------------------------------------------------------------------------------ state
    def method_state_dict(self) -> dict[str, Any]:
        if not self.save_error_buffer:
            return {"error_buffer_saved": False}
        return {"error_buffer_saved": True, "error_buffer": dict(self._buffer())}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        self._residual = {}
        buffer = state.get("error_buffer")
        if buffer is not None:
            self._error = {}
            for p, e in self._buffer().items():
                e.copy_(buffer[p])
            return
        self._error = {}
        if self.dp_steps > 0:
            warnings.warn(
                "DiceSGD resumed from a checkpoint without its error buffer (it is private and not saved "
                "unless dice_save_error_buffer=True): the buffer restarts at zero. Training continues with "
                "the same privacy accounting but is not identical to an uninterrupted run.",
                UserWarning,
                stacklevel=2,
            )
