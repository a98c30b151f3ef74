"""The privacy plan: one frozen object that says what a DP run will do (declarative: it builds nothing).

A :class:`PrivacyPlan` holds N, the expected batch B and the sample rate q = B / N, the number of steps,
delta, the accountant, the method and its config (which declares the method's mechanisms), the clipping norm
and function, the calibrated noise, the sampling and the source of randomness. Everything that needs one of
these reads it from the plan -- ``DPTrainer``, the recipes, the benchmarks, the audit and custom loops -- so
no caller re-derives the step count or sigma. :mod:`hf_dpfilter.factory` builds the engine, the optimizer and
the sampler from it, so the noise can never be sized for another C than the clip. The plan imports no engine
and no optimizer.

:func:`check_dp_settings` is the one place that validates the DP settings; ``DPTrainingArguments`` calls it
too, for errors before any model is loaded.

``dp_method="none"`` is the null plan: no noise, no accounting (epsilon = inf), the same training path.

Example (custom loop)::

    plan = PrivacyPlan.create(num_examples=len(dataset), logical_batch_size=256, epochs=3, target_epsilon=8.0,
                              per_sample_max_grad_norm=1.0, method="disk", secure_rng=True)
    engine, optimizer, sampler = make_private(plan, model, torch.optim.AdamW, lr=1e-3)  # hf_dpfilter.factory
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_dpfilter.accounting.accountant import (
    ACCOUNTANTS,
    compute_epsilon,
    default_delta,
    validate_privacy_parameters,
)
from hf_dpfilter.distributed.collectives import Collectives, default_collectives
from hf_dpfilter.optimizers.clipping import CLIPPING_FNS
from hf_dpfilter.optimizers.method_config import Mechanism, MethodConfig, NoiseRound, NoiseSettings
from hf_dpfilter.optimizers.registry import method_spec
from hf_dpfilter.randomness.secure_rng import fresh_seed

__all__ = ["PrivacyPlan", "check_dp_settings"]

SEEDED_RANDOMNESS_NOTE = (
    "seeded generators: the noise and the Poisson batches are reproducible from the DP seed, so the "
    "guarantee assumes that the seed stays secret (it is never written to results; set secure_rng=True to "
    "draw both from the OS CSPRNG instead)"
)
#: below this many steps a private run rarely leaves the noise floor (learnability_warnings)
MIN_LEARNING_STEPS = 50
#: above this best-case noise-to-signal over the run, the plan is flagged (learnability_warnings)
MAX_RUN_NOISE_TO_SIGNAL = 2.0
#: above this delta, the guarantee's failure probability is stated with the plan (learnability_warnings)
MAX_QUIET_DELTA = 1e-3
SECURE_RANDOMNESS_NOTE = ("OS CSPRNG: the noise and the Poisson batches are drawn from os.urandom (not "
                          "reproducible)")


def check_dp_settings(
    *,
    method: str,
    method_args: MethodConfig | Mapping[str, Any] | None = None,
    per_sample_max_grad_norm: float = 1.0,
    clipping_fn: str = "abadi",
    accountant: str = "prv",
    logical_batch_size: float | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    target_delta: float | None = None,
    budget: bool = True,
    names: Mapping[str, str] | None = None,
) -> MethodConfig:
    """The one check of the DP settings that need no data set; returns the method's validated config.

    ``budget``: also require exactly one of ``target_epsilon``/``noise_multiplier`` (a run with a planned
    length; not for ``for_optimizer``, whose noise is always fixed). ``names`` gives the user's names of the
    settings (``{"logical_batch_size": ...}``), for the messages; ``per_sample_max_grad_norm`` has one name
    everywhere. What needs N (delta < 1/N, q <= 1) is checked when the plan is created
    (:func:`~hf_dpfilter.accounting.accountant.validate_privacy_parameters`).
    """
    names = dict(names or {})
    config = method_spec(method).config_class.from_args(method_args)
    if clipping_fn not in CLIPPING_FNS:
        raise ValueError(f"clipping_fn must be one of {CLIPPING_FNS}, got {clipping_fn!r}.")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")
    if per_sample_max_grad_norm is None or not per_sample_max_grad_norm > 0:
        raise ValueError(f"per_sample_max_grad_norm must be > 0, got {per_sample_max_grad_norm}: it is the "
                         "per-example clipping norm C.")
    if logical_batch_size is not None and not logical_batch_size >= 1:
        name = names.get("logical_batch_size", "logical_batch_size")
        raise ValueError(f"{name} must be >= 1, got {logical_batch_size}.")
    if method == "none":
        return config
    if budget and (target_epsilon is None) == (noise_multiplier is None):
        given = "both" if target_epsilon is not None else "neither"
        raise ValueError(
            f"Give exactly one of target_epsilon and noise_multiplier ({given} was given): target_epsilon "
            "calibrates the noise to a budget; noise_multiplier fixes sigma and reports the epsilon spent."
        )
    if target_epsilon is not None and not (0 < target_epsilon < math.inf):
        raise ValueError(
            f"target_epsilon must be a positive finite number, got {target_epsilon}. For training without "
            "privacy use dp_method='none'."
        )
    if noise_multiplier is not None and not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
    if target_delta is not None and not (0 < target_delta < 1):
        raise ValueError(
            f"target_delta must be in (0, 1/N), got {target_delta}. Leave it unset for the default N^-1.1."
        )
    return config


def _refuse_keywords(keywords: Mapping[str, Any], where: str) -> None:
    """A retired keyword refused with the name that replaced it; any other as Python refuses it."""
    from hf_dpfilter.retired_names import check_no_retired_names

    check_no_retired_names(keywords, where)
    if keywords:
        raise TypeError(f"{where}() got an unexpected keyword argument {next(iter(keywords))!r}")


@dataclass(frozen=True)
class PrivacyPlan:
    """What a DP run does (see the module docstring). Build with :meth:`create`, :meth:`from_training_args` or
    :meth:`for_optimizer`; never edit (it is frozen)."""

    method: str
    config: MethodConfig
    noise: NoiseSettings
    max_grad_norm: float
    clipping_fn: str
    expected_batch_size: float
    sample_rate: float | None
    num_examples: int | None = None
    steps: int | None = None
    steps_per_epoch: int | None = None
    delta: float | None = None
    target_epsilon: float | None = None
    accountant: str = "prv"
    poisson_sampling: bool = True
    secure_rng: bool = False
    #: the secret DP seed of the seeded generators (never printed, compared or written to results)
    seed: int = field(default=0, repr=False, compare=False)

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        *,
        num_examples: int,
        logical_batch_size: int,
        epochs: float | None = None,
        max_steps: int | None = None,
        method: str = "dpsgd",
        method_args: MethodConfig | Mapping[str, Any] | None = None,
        target_epsilon: float | None = None,
        noise_multiplier: float | None = None,
        target_delta: float | None = None,
        per_sample_max_grad_norm: float = 1.0,
        clipping_fn: str = "abadi",
        accountant: str = "prv",
        poisson_sampling: bool = True,
        secure_rng: bool = False,
        seed: int | None = None,
        collectives: Collectives | None = None,
        **retired: Any,
    ) -> PrivacyPlan:
        """The plan of a run over ``num_examples`` examples, calibrated for ``target_epsilon`` (or with a
        fixed ``noise_multiplier``). ``seed=None`` draws a fresh secret seed (agreed on by all processes).

        Args:
            per_sample_max_grad_norm: the per-example clipping norm C (``DPTrainingArguments``' name; the
                retired ``max_grad_norm=`` is refused with this name).
            retired: nothing is accepted here: a retired name (``max_grad_norm``) is refused naming its
                replacement, any other keyword as Python would.
        """
        _refuse_keywords(retired, "PrivacyPlan.create")
        max_grad_norm = per_sample_max_grad_norm
        if logical_batch_size is None:
            raise ValueError("logical_batch_size must be >= 1, got None.")
        config = check_dp_settings(
            method=method, method_args=method_args, per_sample_max_grad_norm=max_grad_norm,
            clipping_fn=clipping_fn,
            accountant=accountant, logical_batch_size=logical_batch_size, target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier, target_delta=target_delta,
        )
        if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
            raise ValueError(f"The training set is empty or its size is invalid (N = {num_examples}).")
        sample_rate = logical_batch_size / num_examples
        if sample_rate > 1:
            raise ValueError(
                f"logical_batch_size={logical_batch_size} is larger than the training set "
                f"(N={num_examples}), so the "
                "sample rate q would be > 1. Use logical_batch_size <= N."
            )
        steps_per_epoch, steps = cls.run_length(num_examples, logical_batch_size, epochs, max_steps)
        delta = target_delta if target_delta is not None else default_delta(int(num_examples))
        if seed is None:
            seed = (collectives or default_collectives()).agree_on_seed(fresh_seed())
        plan = cls(
            method=method, config=config, noise=NoiseSettings(0.0), max_grad_norm=float(max_grad_norm),
            clipping_fn=clipping_fn, expected_batch_size=float(logical_batch_size), sample_rate=sample_rate,
            num_examples=int(num_examples), steps=steps, steps_per_epoch=steps_per_epoch, delta=delta,
            target_epsilon=target_epsilon, accountant=accountant, poisson_sampling=poisson_sampling,
            secure_rng=bool(secure_rng), seed=int(seed),
        )
        if not plan.is_private:
            return plan
        config.check_plan(plan)
        if target_epsilon is not None:
            validate_privacy_parameters(target_epsilon, delta, sample_rate, int(num_examples))
            noise = config.calibrate(float(target_epsilon), delta, plan)
        else:
            validate_privacy_parameters(1.0, delta, sample_rate, int(num_examples))
            noise = config.fixed_noise(float(noise_multiplier), plan)
        return dataclasses.replace(plan, noise=noise)

    @staticmethod
    def run_length(
        num_examples: int, logical_batch_size: int, epochs: float | None = None, max_steps: int | None = None
    ) -> tuple[int, int]:
        """(steps per epoch, planned steps): ``max_steps`` if > 0, else ``ceil(epochs * floor(N / B))``."""
        steps_per_epoch = max(1, int(num_examples / logical_batch_size + 1e-9))
        if max_steps is not None and max_steps > 0:
            return steps_per_epoch, int(max_steps)
        if epochs is not None and epochs > 0:
            return steps_per_epoch, math.ceil(epochs * steps_per_epoch)
        raise ValueError("Give a positive number of epochs or max_steps: the noise is calibrated for the run "
                         "length.")

    @classmethod
    def from_training_args(cls, args: Any, num_examples: int) -> PrivacyPlan:
        """The plan of a ``DPTrainer`` run: :class:`~hf_dpfilter.DPTrainingArguments` and the training-set
        size."""
        world = max(1, args.world_size)
        return cls.create(
            num_examples=num_examples,
            logical_batch_size=args.logical_batch_size or args.per_device_train_batch_size * world,
            epochs=args.num_train_epochs,
            max_steps=args.max_steps,
            method=args.dp_method,
            method_args=args.dp_method_args,
            target_epsilon=args.target_epsilon,
            noise_multiplier=args.noise_multiplier,
            target_delta=args.target_delta,
            per_sample_max_grad_norm=args.per_sample_max_grad_norm,
            clipping_fn=args.clipping_fn,
            accountant=args.accountant,
            poisson_sampling=args.poisson_sampling,
            secure_rng=args.secure_rng,
            seed=args.dp_seed,
        )

    @classmethod
    def for_optimizer(
        cls,
        *,
        method: str = "dpsgd",
        method_args: MethodConfig | Mapping[str, Any] | None = None,
        noise_multiplier: float = 0.0,
        per_sample_max_grad_norm: float = 1.0,
        expected_batch_size: float = 1.0,
        sample_rate: float | None = None,
        clipping_fn: str = "abadi",
        seed: int | None = None,
        secure_rng: bool = False,
        accountant: str = "prv",
        **retired: Any,
    ) -> PrivacyPlan:
        """A plan without a data set (no N, no planned steps): a fixed noise multiplier, accounted per step.
        What :func:`hf_dpfilter.make_dp_optimizer` builds on.

        Without ``sample_rate`` nothing says how the batches were drawn, so no subsampling amplification can
        be claimed: each step is accounted as a Gaussian mechanism over the whole data set
        (``sample_rate=1.0``, a valid but loose bound, with a warning), never as a step that spends
        nothing. ``per_sample_max_grad_norm`` is the clipping norm C (the retired ``max_grad_norm=`` is
        refused with this name)."""
        _refuse_keywords(retired, "PrivacyPlan.for_optimizer")
        max_grad_norm = per_sample_max_grad_norm
        if sample_rate is None and method != "none":
            if noise_multiplier > 0:
                warnings.warn(
                    "No sample_rate was given: each step is accounted as a Gaussian mechanism without "
                    "subsampling amplification (sample_rate=1.0), a valid but much larger epsilon than "
                    "Poisson sampling gets. Pass sample_rate=B/N when the batches are Poisson samples "
                    "(hf_dpfilter.PoissonBatchSampler).",
                    UserWarning,
                    stacklevel=3,
                )
            sample_rate = 1.0
        config = check_dp_settings(
            method=method, method_args=method_args, per_sample_max_grad_norm=max_grad_norm,
            clipping_fn=clipping_fn,
            accountant=accountant, noise_multiplier=noise_multiplier, budget=False,
        )
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}.")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
        plan = cls(
            method=method, config=config, noise=NoiseSettings(0.0), max_grad_norm=float(max_grad_norm),
            clipping_fn=clipping_fn, expected_batch_size=float(expected_batch_size), sample_rate=sample_rate,
            accountant=accountant, secure_rng=bool(secure_rng),
            seed=int(seed) if seed is not None else fresh_seed(),
        )
        if plan.is_private:
            config.check_plan(plan)
            plan = dataclasses.replace(plan, noise=config.fixed_noise(float(noise_multiplier), plan))
        return plan

    # ------------------------------------------------------------------------------ what it says
    @property
    def is_private(self) -> bool:
        return self.method != "none"

    @property
    def noise_multiplier(self) -> float:
        return self.noise.noise_multiplier

    @property
    def randomness(self) -> str:
        return SECURE_RANDOMNESS_NOTE if self.secure_rng else SEEDED_RANDOMNESS_NOTE

    def mechanisms(self, step: int) -> list[Mechanism]:
        """The mechanisms step ``step`` (0-based) releases, as the method declares them."""
        if not self.is_private or self.sample_rate is None:
            return []
        return self.config.mechanisms(step, self.noise, self)

    def history(self, steps: int | None = None) -> list[tuple[float, float, int]]:
        """Accountant history of the first ``steps`` steps (default: the planned run)."""
        steps = self.steps if steps is None else steps
        if not self.is_private or self.sample_rate is None or not steps:
            return []
        return self.config.history(self.noise, self, steps)

    def epsilon(self, steps: int | None = None, delta: float | None = None) -> float:
        """The epsilon the run spends after ``steps`` steps (default: all planned); inf without privacy."""
        if not self.is_private:
            return math.inf
        delta = self.delta if delta is None else delta
        return compute_epsilon(self.history(steps), delta, self.accountant)

    def noise_std(self, sensitivity: float | None = None) -> float:
        """Noise std on the sum scale, sigma * Delta (Delta defaults to C)."""
        return self.noise_multiplier * (self.max_grad_norm if sensitivity is None else sensitivity)

    def summary(self) -> dict[str, Any]:
        """The public description of the plan (JSON-able; never the seed)."""
        return {
            "method": self.method,
            "method_args": self.config.to_dict(),
            "num_train_examples": self.num_examples,
            "logical_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "planned_steps": self.steps,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            **{k: v for k, v in self.noise.as_dict().items()},
            "accountant": self.accountant,
            "per_sample_max_grad_norm": self.max_grad_norm,
            "clipping_fn": self.clipping_fn,
            "poisson_sampling": self.poisson_sampling,
            "randomness": self.randomness,
        }

    # ------------------------------------------------------------------------------ can it learn?
    def noise_to_signal(self, trainable_parameters: int | None = None) -> dict[str, float] | None:
        """How loud the noise is against the clipped signal, for ``d`` trainable parameters.

        ``per_step`` = sigma sqrt(d) / B for DP-SGD: the norm of the noise in one averaged privatized gradient
        over the largest possible signal, the clipped mean (norm <= C); for another method, the noise its
        loudest round really adds over that round's signal (:meth:`noise_rounds`: DiceSGD's sigma (C1 + 2 B
        C2) over C1 + C2); ``per_run`` = per_step / sqrt(T): the same for the sum over the T steps of a
        gradient that points the same way at every step (the best case). Both count every trainable
        coordinate, so they overstate the harm for real gradients, which live in a few directions; they are a
        first check (Li et al. 2022 and De et al. 2022 use large B, many steps).
        """
        if not self.is_private or not trainable_parameters or not self.steps:
            return None
        # The noise each round really adds (the method's sensitivity, e.g. DiceSGD's C1 + 2 B C2, each of
        # DIFF2's rounds), over the signal that round carries; the loudest round sets the figures.
        noise_to_clip = max(r.noise_to_clip for r in self.noise_rounds())
        per_step = noise_to_clip * math.sqrt(trainable_parameters) / self.expected_batch_size
        return {"per_step": per_step, "per_run": per_step / math.sqrt(self.steps)}

    def noise_rounds(self) -> list[NoiseRound]:
        """The kinds of rounds the method releases, each with its real noise (:class:`NoiseRound`); [] if not
        private."""
        if not self.is_private:
            return []
        return self.config.noise_rounds(self.noise, self)

    def learnability_warnings(self, trainable_parameters: int | None = None) -> list[str]:
        """Plans that cannot rise above the noise, each with the fix the DP fine-tuning literature gives."""
        if not self.is_private or self.steps is None:
            return []
        out = []
        if self.steps < MIN_LEARNING_STEPS:
            out.append(
                f"Only {self.steps} optimizer steps: DP fine-tuning needs a few hundred noisy steps for the "
                f"signal to rise above the noise (this plan: {self.num_examples} examples, logical batch "
                f"{self.expected_batch_size:g}). Train more epochs (num_train_epochs) or on more data, "
                "keeping the logical batch large (it divides the noise); then re-tune the learning rate "
                "(DP-Adam: 5e-4 to 2e-3)."
            )
        if self.delta is not None and self.delta > MAX_QUIET_DELTA:
            out.append(
                f"delta = {self.delta:.3g} is large: (epsilon, delta)-DP allows the guarantee to fail with "
                f"probability delta, so about one in {1 / self.delta:,.0f} of the {self.num_examples} "
                "privacy units (examples, or users at user level) could be exposed outright. The default "
                "N^-1.1 is this large only for small data sets: train on more units, or set a smaller "
                "target_delta "
                "(e.g. 1e-5) and report it."
            )
        ratio = self.noise_to_signal(trainable_parameters)
        if ratio is not None and ratio["per_run"] > MAX_RUN_NOISE_TO_SIGNAL:
            loudest = max(self.noise_rounds(), key=lambda r: r.noise_to_clip)
            noise = (f"sigma = {self.noise_multiplier:.3g}" if loudest.noise_to_clip == self.noise_multiplier
                     else
                     f"the noise of {self.method}'s {loudest.label} (sigma = {loudest.noise_multiplier:.3g} "
                     f"x sensitivity {loudest.sensitivity}, {loudest.noise_to_clip:.3g}x the clipped signal)")
            out.append(
                f"{noise} is large for the batch: even a gradient pointing the same way "
                f"at every step would stay {ratio['per_run']:.1f}x below the noise accumulated over the run "
                f"(noise sqrt(d) / (B sqrt(T)) with d = {trainable_parameters:,} trainable parameters). Use "
                "a larger logical_batch_size (the noise per example falls as 1/B), more epochs, fewer "
                "trainable parameters (LoRA), or a larger epsilon."
            )
        return out

    def _changed_settings(self) -> dict[str, Any]:
        # the fields' declared defaults, not an instance: a required setting (DIFF2's C2) has no default
        # instance, and is always listed
        defaults = {f.name: f.default for f in dataclasses.fields(self.config)}
        return {k: v for k, v in self.config.to_dict().items() if v != defaults.get(k)}

    def describe(self, trainable_parameters: int | None = None) -> str:
        """The plan a practitioner checks before training (a printable block; never the seed)."""
        if not self.is_private:
            return (f"Privacy plan: none (non-private run), N = {self.num_examples}, logical batch "
                    f"{self.expected_batch_size:g}, {self.steps} steps")
        lines = [
            f"Privacy plan: {self.method} ({self._changed_settings() or 'default settings'})",
            f"  N = {self.num_examples}, logical batch B = {self.expected_batch_size:g}, q = "
            f"{self.sample_rate:.4g}, {self.steps} steps ({self.steps_per_epoch} per epoch)",
            f"  sigma = {self.noise_multiplier:.4g}, C = {self.max_grad_norm:g} ({self.clipping_fn}), "
            f"epsilon = {self.epsilon():.4g} at delta = {self.delta:.3g} ({self.accountant})"
            + (f", target {self.target_epsilon:g}" if self.target_epsilon is not None else ""),
        ]
        for r in self.noise_rounds():
            lines.append(
                f"  noise of {r.label}: sigma = {r.noise_multiplier:.4g} x sensitivity {r.sensitivity} on "
                f"the sum ({r.noise_to_clip:.4g}x the per-example clip of the signal)"
            )
        ratio = self.noise_to_signal(trainable_parameters)
        if ratio is not None:
            lines.append(
                f"  noise-to-signal: {ratio['per_step']:.3g} per step, {ratio['per_run']:.3g} over the run "
                f"(noise sqrt(d) / B, / sqrt(T), loudest round; d = {trainable_parameters:,})"
            )
        lines.append(f"  randomness: {self.randomness}")
        lines += [f"  WARNING: {w}" for w in self.learnability_warnings(trainable_parameters)]
        return "\n".join(lines)
