"""DIFF2: DP optimization via clipped gradient differences (Murata & Suzuki, "DIFF2: Differential Private
Optimization via Gradient Differences for Nonconvex Distributed Learning", ICML 2023, Algorithm 1).

Round r = t + 1 (t = zero-based optimizer step), parameters x_{r-1}, batch B_r (expected size B)::

    restart round (t % T == 0):
        v~_r = ( sum_i clip(g_i(x_{r-1}), C1) + N(0, (z1 D1)^2 I) ) / B
    difference round:
        C_{2,r} = C2 * ||x_{r-1} - x_{r-2}||                      (flat norm over the trainable parameters)
        v~_r = v~_{r-1} + ( sum_i clip(g_i(x_{r-1}) - g_i(x_{r-2}), C_{2,r}) + N(0, (z2 D2)^2 I) ) / B
    x_r = BaseOptimizerUpdate(x_{r-1}, v~_r)                     (SGD = the paper's GD-Routine, DIFF2-GD)

with ``D1 = C1`` and ``D2 = C_{2,r}`` under add/remove neighbours, ``2 C1`` and ``2 C_{2,r}`` under
replace-one (the paper's relation): the noise is relative to the real sensitivity, so replace-one doubles it.
C2 (``Diff2Config.difference_max_grad_norm``) has no default: the paper tunes it on a grid with C1, T and the
step size, and a rule without a search (C2 = C1 / ||x_1 - x_0||, earlier versions) was measured far below a
searched C2 (docs/results.md, "Defaults and their measurements").
The per-example difference is ONE combination clipped once: :meth:`gradient_points` returns the current
parameters with weight +1 and x_{r-2} with weight -1, and the engine clips each example's combined gradient
(same micro-batch, same dropout masks at both points). The difference has cancellation, so the engine computes
it in precise mode (float64 terms, a proven upper bound of each norm; see
:class:`hf_dpfilter.engine.PerExampleGradients` and docs/privacy.md, "Precision of the clip"): the clip holds
in float32 and under bf16 autocast for any step size. A zero threshold (no movement) clips everything to 0
and adds no noise. Difference rounds always use min-clipping (the absolute 0.01 of automatic clipping has no
meaning at the scale of a difference); restart rounds use ``clipping_fn`` like DP-SGD.

**Precision of the difference rounds** (``Diff2Config.difference_precision``). Write d^_j(D) for example j's
difference AS COMPUTED inside batch D (the terms the forwards and the backward produce, in whatever dtype).
For neighbours D and D' = D u {x}, at noise 0, clipping being 1-Lipschitz,

    || sum_{j in D'} clip(d^_j(D'), C_r) - sum_{j in D} clip(d^_j(D), C_r) ||
        <= C_r + sum_{j in D} || d^_j(D') - d^_j(D) ||,

where "clip" is the engine's: a factor from a proven UPPER bound of ||d^_j|| (precise mode), so each clipped
term is <= C_r whatever the rounding of d^_j. The first term is the sensitivity; the second is zero exactly
when each example's computed difference does not depend on the batch it is computed in (batch-invariance),
whatever its precision. A float32 forward of a batch is not batch-invariant (kernels block by the batch's
size, and the difference amplifies that rounding by ||g|| / ||g(x) - g(x')||, 10^4 and more at small step
sizes), so some route must make the second term vanish or be negligible:

* ``"batch_invariant"`` (default): each example's difference is computed in a micro-batch of its own, collated
  from that example alone (DPTrainer cuts a difference round's sample so and declares it,
  ``accumulate(..., alone=True)``), in the model's own dtype (float32, or bf16 autocast). The arithmetic of
  example j then reads only j's inputs, the parameters and x_{r-2}: the same operations on the same values in
  D and in D', hence the same d^_j bit for bit (deterministic kernels), and the second term is 0. Where a
  kernel is not deterministic run to run (CUDA atomics), d^_j is a random variable whose law depends on j's
  own inputs only: coupling the draws of D and D' example by example bounds every coupled pair by C_r, and the
  mechanism's output, a mixture over the couplings, keeps the Gaussian mechanism's guarantee (joint convexity
  of the divergence) -- as for dropout masks, which are keyed to each example
  (hf_dpfilter/randomness/example_keys.py). The rounding then only costs utility (d^_j's relative error about
  u ||g|| / ||d||, u = 2^-24 in float32), never privacy. A micro-batch of several examples, or one not
  declared collated alone, falls back to float64 (below): the route never trusts a shape for the privacy.
* ``"float64"``: both points of every difference micro-batch run the whole model in float64 (batched). This is
  not exactly batch-invariant, but the batch-dependent rounding is 2^-29 times float32's, far inside the
  clip's relative margin of 1e-6. Needed where examples cannot be computed alone; costs float64 copies of the
  model's tensors during the round. On one CPU thread it costs about what the batch-invariant route does (a
  float64 GEMM there is little slower than float32, and a micro-batch of one less efficient than a batch;
  docs/performance.md); on a GPU float64 runs at a fraction of the bf16 tensor-core rate.
* A threshold lowered by a bound on the float32 error of the difference, from the two points' norms, was
  considered and rejected: a rigorous forward error bound of a whole transformer forward and backward
  (softmax, layer norm, GELU, attention over the batch's padded width) is not available in closed form, an
  empirical factor is not a proof, and the bound would be a function of the private per-example norms.

Under FSDP2 sharding the points are written into the shards: no float64 copy is made there, and only the
``"batch_invariant"`` route with micro-batches declared alone is batch-invariant, so a float32/bf16 sharded
model is refused with the fix on the ``"float64"`` route (at its first micro-batch) and for a difference
micro-batch not declared alone (before that round is released); FSDP2's padding micro-batch, which releases
nothing, runs as it is. "A float64 model" is the whole model (every floating parameter and buffer, frozen ones
included; float64 adapters on a float32 base are not one). On both routes the round's sums are float64; the
noise is drawn in float32 (as DP-SGD's) and added to them in float64, so the sums are not rounded before the
noise (:meth:`Diff2.privatize`).

**Batches.** The paper analyses full batch (DIFF2-GD): ``logical_batch_size = N`` gives q = 1 and every
example in every round. With Poisson minibatches (q < 1) each round is still a Poisson-subsampled Gaussian
mechanism given the released history, so the accounting below holds, but the algorithm (a SPIDER-like
minibatch estimator) is an **unanalysed extension** of the paper: no utility theory; it is labelled in
``privacy_report``. Replace-one is only offered for full batch (its subsampled accounting differs).
Under several processes each process is a client: the clipped sums are all-reduced and the noise is added
once per round (base class); v~ and x_{r-2} are identical replicas.

**Accounting.** Restart and difference rounds are separate Gaussian mechanisms, composed heterogeneously:
:meth:`Diff2Config.mechanisms` declares ``(z1, q)`` for a restart round and ``(z2, q)`` for a difference
round. With ``target_epsilon``, the calibration (:meth:`Diff2Config.noise_for_scale`) keeps the paper's budget
split u (Prop. 4.1: z2 / z1 = sqrt((R - k) / (k (u - 1))), k = ceil(R / T) restarts in R steps) and bisects z1
with the exact accountant instead of the paper's loose RDP conversion.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.engine import PerExampleGradients
from hf_dpfilter.engine.points import CurrentFloat64Point, Float64Point
from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.optimizers.method_config import (
    Mechanism,
    MethodConfig,
    NoiseRound,
    NoiseSettings,
    PlanSettings,
)
from hf_dpfilter.randomness.noise import noisy_averages

DIFF2_NEIGHBOURINGS = ("add_remove", "replace_one")
#: routes of the difference rounds' precision (module docstring, "Precision of the difference rounds")
DIFF2_PRECISIONS = ("batch_invariant", "float64")

__all__ = ["DIFFERENCE_NORM_REQUIRED", "DIFF2_NEIGHBOURINGS", "DIFF2_PRECISIONS", "Diff2", "Diff2Config",
           "diff2_history"]

#: DIFF2 under FSDP2 with a float32/bf16 model, a difference micro-batch not declared alone (or the float64
#: route)
_SHARDED_REFUSAL = (
    "DIFF2 under FSDP2 sharding writes the difference round's points into the shards, in the model's dtype "
    "(no float64 copy of a sharded model is made), so only an example computed alone is batch-invariant "
    "there; a micro-batch of several examples (or not declared alone), or difference_precision='float64', "
    "would let one example move the others' clipped differences beyond the sensitivity. Fix: keep "
    "difference_precision='batch_invariant' with DPTrainer at example level (it computes each example of a "
    "difference round alone and declares it), call accumulate(..., batch_size=1, alone=True) for one example "
    "collated alone in a loop of your own, or train a float64 model."
)


#: the refusal of a DIFF2 config with difference rounds and no C2 (Diff2Config.difference_max_grad_norm)
DIFFERENCE_NORM_REQUIRED = (
    "diff2: set difference_max_grad_norm (C2, the coefficient of the difference rounds' clip threshold "
    "C2 ||x_{{r-1}} - x_{{r-2}}||): with restart_every={t} there are difference rounds, and C2 has no "
    "default. Tune it like the learning rate, on data you may tune on; on SST-2 (full batch, SGD) C2 = 2 was "
    "the best of {{2, 10}}, e.g. dp_method_args={{'restart_every': {t}, 'difference_max_grad_norm': 2.0}}; "
    "the rule of earlier versions, C2 = C1 / ||x_1 - x_0||, scored 51.6% (epsilon 3) and 66.4% (epsilon 5) "
    "against 78% with C2 searched (docs/results.md, \"Defaults and their measurements\"). restart_every=1 "
    "(DP-GD) needs no C2."
)


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


@dataclass(frozen=True)
class Diff2Config(MethodConfig):
    """DIFF2's settings and privacy declaration.

    Args:
        restart_every: restart period T (1 = DP-SGD / DP-GD).
        difference_max_grad_norm: C2, the coefficient of the threshold C2 ||x_{r-1} - x_{r-2}||, a bound on
            the per-example smoothness ||g_i(x) - g_i(x')|| / ||x - x'||. Required when there are difference
            rounds (``restart_every`` > 1); it has no default because the paper tunes it (its experiments
            search C2 with C1, T and the step size) and no rule was found that works without a search: the
            rule C2 = C1 / ||x_1 - x_0|| of earlier versions scored 51.6% / 66.4% against 78% with C2 searched
            on SST-2 (docs/results.md, "Defaults and their measurements"). Choose it like the learning rate,
            on data you may tune on: there C2 = 2 was the best of {2, 10} (full batch, SGD, lr 0.5).
        difference_noise_multiplier: z2 when the noise multiplier is fixed (None: z1). With target_epsilon
            both are calibrated (``budget_split``).
        budget_split: u > 1, the paper's split (restarts get 1/u of the budget; Prop. 4.1).
        neighbouring: ``"add_remove"`` or ``"replace_one"`` (the paper; doubles the sensitivity; full batch
            only).
        difference_precision: how a difference round computes each example's g_i(x_{r-1}) - g_i(x_{r-2}) so
            that it does not depend on the other examples of the batch (see the module docstring, "Precision
            of the difference rounds"). ``"batch_invariant"`` (default): each example in a micro-batch of its
            own, collated alone, in the model's dtype; a micro-batch of several examples (or one not declared
            alone) falls back to float64. ``"float64"``: every difference micro-batch in float64, batched.
        float64_differences: the earlier switch, kept for compatibility: True selects ``"float64"``; False
            selects ``"batch_invariant"`` (float32 points of a batch of several examples are no longer
            offered: they are not batch-invariant); None (default): ``difference_precision`` decides.
    """

    name = "diff2"
    legacy_prefix = "diff2_"

    restart_every: int = 10
    difference_max_grad_norm: float | None = None
    difference_noise_multiplier: float | None = None
    budget_split: float = 1.25
    neighbouring: str = "add_remove"
    difference_precision: str = "batch_invariant"
    float64_differences: bool | None = None

    def __post_init__(self) -> None:
        t = self.restart_every
        if isinstance(t, bool) or int(t) != t or t < 1:
            raise ValueError(f"diff2: restart_every (T) must be an integer >= 1, got {t}.")
        c2 = self.difference_max_grad_norm
        if c2 is None and t > 1:
            raise ValueError(DIFFERENCE_NORM_REQUIRED.format(t=t))
        if c2 is not None and not (isinstance(c2, (int, float)) and math.isfinite(c2) and c2 > 0):
            raise ValueError(f"diff2: difference_max_grad_norm must be a finite number > 0, got {c2}.")
        z2 = self.difference_noise_multiplier
        if z2 is not None and not z2 >= 0:
            raise ValueError(f"diff2: difference_noise_multiplier must be >= 0, got {z2}.")
        if not self.budget_split > 1:
            raise ValueError(f"diff2: budget_split (u) must be > 1, got {self.budget_split}.")
        if self.neighbouring not in DIFF2_NEIGHBOURINGS:
            raise ValueError(f"diff2: neighbouring must be one of {DIFF2_NEIGHBOURINGS}, got "
                             f"{self.neighbouring!r}.")
        if self.difference_precision not in DIFF2_PRECISIONS:
            raise ValueError(f"diff2: difference_precision must be one of {DIFF2_PRECISIONS}, got "
                             f"{self.difference_precision!r}.")
        if self.float64_differences is not None and not isinstance(self.float64_differences, bool):
            raise ValueError("diff2: float64_differences must be True, False or None, got "
                             f"{self.float64_differences!r}.")
        if self.float64_differences is False and self.difference_precision == "float64":
            raise ValueError("diff2: float64_differences=False contradicts difference_precision='float64' "
                             "(the earlier switch would select 'batch_invariant'); give difference_precision "
                             "alone.")

    @property
    def precision_route(self) -> str:
        """The route of the difference rounds: ``float64_differences`` (when given) or
        ``difference_precision``."""
        if self.float64_differences is not None:
            return "float64" if self.float64_differences else "batch_invariant"
        return self.difference_precision

    @property
    def mechanism_period(self) -> int:  # type: ignore[override]
        return int(self.restart_every)

    def is_restart(self, step: int) -> bool:
        return step % int(self.restart_every) == 0

    def check_plan(self, plan: PlanSettings) -> None:
        full_batch = plan.sample_rate is not None and plan.sample_rate >= 1.0
        if plan.sample_rate is not None and not full_batch:
            if self.neighbouring == "replace_one":
                raise ValueError(
                    "diff2: neighbouring='replace_one' is only supported for full-batch DIFF2 (sample rate "
                    "1, i.e. logical_batch_size = N): the accountant certifies replace-one only without "
                    "subsampling. Use 'add_remove' or a full batch."
                )
            if self.restart_every > 1:
                warnings.warn(
                    f"DIFF2 with Poisson minibatches (sample rate {plan.sample_rate:.3g} < 1) is an "
                    "unanalysed extension of the paper's full-batch DIFF2-GD: the accounting holds, the "
                    "utility theory does not. Use logical_batch_size = N for the paper's algorithm.",
                    UserWarning,
                    stacklevel=4,
                )

    def mechanisms(self, step: int, noise: NoiseSettings, plan: PlanSettings) -> list[Mechanism]:
        if self.is_restart(step):
            return [Mechanism(noise.noise_multiplier, plan.sample_rate)]
        z2 = noise.get("difference_noise_multiplier", noise.noise_multiplier)
        return [Mechanism(z2, plan.sample_rate)]

    def noise_rounds(self, noise: NoiseSettings, plan: PlanSettings) -> list[NoiseRound]:
        """Restart rounds (1 in T): z1 x D1 over a signal clipped to C1; difference rounds: z2 x D2 over a
        difference clipped to C_{2,r} = C2 ||x_{r-1} - x_{r-2}||; D = the threshold, doubled under
        replace-one."""
        factor = 2.0 if self.neighbouring == "replace_one" else 1.0
        z1 = noise.noise_multiplier
        z2 = noise.get("difference_noise_multiplier", z1)
        relation = " x 2 (replace-one)" if factor == 2.0 else ""
        period = int(self.restart_every)
        rounds = [NoiseRound(f"restart rounds (1 in {period})", 1.0 / period, z1,
                             f"C1 = {plan.max_grad_norm:g}{relation}",
                             z1 * factor)]
        if period > 1:
            rounds.append(NoiseRound(
                f"difference rounds ({period - 1} in {period})", (period - 1) / period, float(z2),
                f"C_2,r = C2 ||x_r-1 - x_r-2||{relation}", float(z2) * factor))
        return rounds

    def fixed_noise(self, noise_multiplier: float, plan: PlanSettings) -> NoiseSettings:
        z2 = (noise_multiplier if self.difference_noise_multiplier is None
              else self.difference_noise_multiplier)
        return NoiseSettings(noise_multiplier, (("difference_noise_multiplier", float(z2)),))

    def noise_for_scale(self, scale: float, plan: PlanSettings) -> NoiseSettings:
        """z1 = scale and z2 / z1 = sqrt((R - k) / (k (u - 1))), k = ceil(R / T) restarts in R steps (Prop.
        4.1).

        The noise multipliers are relative to the sensitivity, so they are the same for both relations."""
        steps = plan.steps
        restarts = math.ceil(steps / self.restart_every)
        ratio = (1.0 if restarts == steps
                 else math.sqrt((steps - restarts) / (restarts * (self.budget_split - 1.0))))
        return NoiseSettings(float(scale), (("difference_noise_multiplier", ratio * float(scale)),))

    def report(self, noise: NoiseSettings, plan: PlanSettings, steps: int, delta: float) -> dict[str, Any]:
        restarts = math.ceil(steps / self.restart_every) if steps else 0
        full_batch = plan.sample_rate is not None and plan.sample_rate >= 1.0
        details: dict[str, Any] = {
            "neighbouring_relation": "replace one example" if self.neighbouring == "replace_one"
            else "add/remove one example",
            "diff2_restart_every": self.restart_every,
            "diff2_restart_noise_multiplier": noise.noise_multiplier,
            "diff2_difference_noise_multiplier": noise.get("difference_noise_multiplier"),
            "diff2_difference_max_grad_norm": self.difference_max_grad_norm,
            "diff2_budget_split": self.budget_split,
            "diff2_full_batch": full_batch,
            "diff2_restart_rounds": restarts,
            "diff2_difference_rounds": steps - restarts,
        }
        if not full_batch:
            details["diff2_note"] = (
                "Poisson-minibatch DIFF2 is an unanalysed extension of the paper's full-batch DIFF2-GD "
                "(accounting holds; no utility theory)"
            )
        return details


@dataclass
class _Round:
    step: int
    restart: bool
    threshold: float  # C1 (restart) or C_{2,r} (difference), before the replace-one factor


class Diff2(DPOptimizer):
    """DIFF2 around any base optimizer; see the module docstring. Settings: :class:`Diff2Config` (the plan's
    ``max_grad_norm`` is C1, its ``noise_multiplier`` z1)."""

    method_name = "diff2"

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, plan, **kwargs)
        config: Diff2Config = self.config
        self.restart_every = int(config.restart_every)
        self.difference_max_grad_norm = config.difference_max_grad_norm
        self.difference_noise_multiplier = float(plan.noise.get("difference_noise_multiplier",
                                                                self.noise_multiplier))
        self.budget_split = float(config.budget_split)
        self.neighbouring = config.neighbouring
        self.precision_route = config.precision_route
        self._alone = False  # the micro-batch being accumulated is one example collated alone (declared)
        self._discarded = False  # the micro-batch being run is FSDP2's padding (run_without_contributing)
        self._float64_seen: tuple[Any, bool] | None = None  # (engine, whether its whole model is float64)
        self._points_cache: tuple[tuple[int, bool], list] | None = None  # this round's points (_round_points)
        self.full_batch = self.sample_rate is not None and self.sample_rate >= 1.0
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
        restart = self.config.is_restart(self.dp_steps)
        if restart:
            threshold = self.max_grad_norm
        else:
            if self._previous is None or self._estimate is None:
                raise RuntimeError(
                    f"DIFF2 step {self.dp_steps} is a difference round but the optimizer holds no previous "
                    "point or estimate (a checkpoint without the method state?). Resume from a full "
                    "DPOptimizer state_dict."
                )
            # a function of released values only (public): computed in the parameters' dtype, summed in
            # float64
            movement = math.sqrt(self.collectives.squared_norm(
                [p.detach() - self._previous[p] for p in self.params]
            ))
            threshold = self.difference_max_grad_norm * movement
        self._round_cache = _Round(self.dp_steps, restart, threshold)
        return self._round_cache

    @property
    def _relation_factor(self) -> float:
        return 2.0 if self.neighbouring == "replace_one" else 1.0

    def gradient_points(self) -> list[tuple[float, dict[nn.Parameter, torch.Tensor] | None]]:
        if self.current_round().restart:
            return [(1.0, None)]
        batch_invariant = self._alone and self.precision_route == "batch_invariant"
        float64_model = self._float64_model()
        if self.sharded and not (batch_invariant or float64_model or self._discarded):
            # FSDP2 writes the points into the shards (no float64 copy): a batch of several examples would run
            # in the model's dtype, batched, which is not batch-invariant (module docstring, "Precision")
            raise ValueError(_SHARDED_REFUSAL)
        native = batch_invariant or self.sharded or float64_model
        # both points in float64 otherwise, the whole model (engine.call_model): the "float64" route, and the
        # fallback of a micro-batch of several examples (or not declared alone); module docstring, "Precision"
        return self._round_points(native)

    def _round_points(self, native: bool) -> list[tuple[float, dict[nn.Parameter, torch.Tensor] | None]]:
        """The round's two points, built once per round and shared by its micro-batches (the parameters do not
        change within a step; each costs passes over every parameter, which per micro-batch of one example
        would cost more than the example). Their graph saves no tensor (add, sub, casts), so several backwards
        may pass through it."""
        key = (self.dp_steps, native)
        if self._points_cache is not None and self._points_cache[0] == key:
            return self._points_cache[1]
        # x_{r-2} exactly (no x - (x - x') rounding): "+ (p - p.detach())" (= 0) keeps the value and makes it
        # differentiable in x, so the clipping hooks see that forward too and the first-backward check (an
        # ordinary backward of the combined loss) sees the difference g(x) - g(x_{r-2}) the engine clips.
        previous = {p: v + (p - p.detach()) for p, v in self._previous.items()}
        if native:
            points = [(1.0, None), (-1.0, previous)]
        else:
            here = CurrentFloat64Point({p: p.double() for p in previous})
            points = [(1.0, here), (-1.0, Float64Point({p: v.double() for p, v in previous.items()}))]
        self._points_cache = (key, points)
        return points

    def wants_examples_alone(self) -> bool:
        """True in a difference round of the ``"batch_invariant"`` route (a float32/bf16 model): the caller
        should give each example as a micro-batch of its own, collated alone, with ``accumulate(...,
        alone=True)``."""
        if self.precision_route != "batch_invariant" or self.current_round().restart:
            return False
        return not self._float64_model()

    def _float64_model(self) -> bool:
        """Whether the whole model is float64, every floating parameter (trainable or frozen) and buffer of
        the engine's model: only then does a batch run natively in float64. The trainable parameters alone do
        not say it (float64 adapters on a float32 base compute the base in float32, batched); before an engine
        is seen (a resumed run's first cut) nothing is proven, and examples are computed alone."""
        engine = self._engine_checked
        model = getattr(engine, "model", None)
        if model is None:
            return False
        # once per engine, not per example
        if self._float64_seen is None or self._float64_seen[0] is not engine:
            tensors = [*model.parameters(), *model.buffers()]
            self._float64_seen = (engine,
                                  all(t.dtype == torch.float64 for t in tensors if t.is_floating_point()))
        return self._float64_seen[1]

    def accumulate(self, engine: Any, loss_fn: Any, batch_size: int, alone: bool = False,
                   **keys: Any) -> torch.Tensor:
        """:meth:`DPOptimizer.accumulate`; ``alone=True`` declares that the micro-batch is ONE example (one
        privacy unit) collated from itself alone (its own padding and width, nothing read from other
        examples): a difference round of the ``"batch_invariant"`` route then computes it in the model's
        dtype. Without the declaration (or with several examples) a difference round runs in float64. The
        declaration is the caller's: DPTrainer makes it only for the micro-batches it collated alone."""
        self._alone = bool(alone) and batch_size == 1
        if self.sharded and self.precision_route == "float64" and batch_size > 0:
            self._check_engine(engine)  # its model says whether the whole model is float64
            if not self._float64_model():
                raise ValueError(_SHARDED_REFUSAL)  # at the first micro-batch of the run, before any release
        try:
            return super().accumulate(engine, loss_fn, batch_size, **keys)
        finally:
            self._alone = False

    def run_without_contributing(self, engine: Any, loss_fn: Any, batch_size: int, **keys: Any) -> None:
        """:meth:`DPOptimizer.run_without_contributing`: FSDP2's padding micro-batch runs at the round's
        points in the shards' dtype (nothing of it is released, so its precision is free)."""
        self._discarded = True
        try:
            super().run_without_contributing(engine, loss_fn, batch_size, **keys)
        finally:
            self._discarded = False

    def sensitivity(self) -> float:
        """L2 sensitivity of this round's pre-noise sum: C1 or C_{2,r}, doubled under replace-one."""
        return self._relation_factor * self.current_round().threshold

    def round_noise_multiplier(self) -> float:
        """This round's noise multiplier, as the config declares the round's mechanism."""
        return self.mechanisms()[0].noise_multiplier

    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        rnd = self.current_round()
        if rnd.restart:
            factors = self.clip_factors(grads)
        else:
            # precise mode (the points have weights +1 and -1): clipping_norms() bounds the exact difference
            factors = _difference_factors(grads.clipping_norms(), rnd.threshold)
        self.add_to_sums(grads.weighted_sum(factors, release=True))

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        rnd = self.current_round()
        std = self.round_noise_multiplier() * self.sensitivity()
        self._points_cache = None  # the round's points (their float64 copies) are not needed any more
        self._pending_previous = {p: p.detach().clone() for p in self.params}  # x_{r-1}, before the update
        estimate = {} if rnd.restart else self._estimate
        # a difference round's sums are float64 (precise mode): the noise is drawn in float32, as DP-SGD's,
        # and noise + sum / B is computed in float64 and rounded once to the estimate's float32 (the sums are
        # not rounded before the noise; that rounding is post-processing)
        noise_dtype = None if all(p.dtype == torch.float64 for p in self.params) else torch.float32
        for p, increment in noisy_averages(sums, std, self.expected_batch_size, self.noise_source(),
                                           noise_dtype).items():
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
        super().record_privacy_step()

    # ------------------------------------------------------------------------------ state
    def method_state_dict(self) -> dict[str, Any]:
        # v~ and x_{r-2} are functions of released outputs (post-processing): safe to save.
        return {"estimate": self._estimate, "previous": self._previous, "restart_rounds": self.restart_rounds}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        self._estimate = state.get("estimate")
        self._previous = state.get("previous")
        self._pending_previous = None
        self._round_cache = None
        self._points_cache = None
        self.restart_rounds = int(state.get("restart_rounds", 0))

