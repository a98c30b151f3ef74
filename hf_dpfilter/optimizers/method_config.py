"""Method settings as data: the base class of every DP method's config.

Each method (one file in :mod:`hf_dpfilter.optimizers`) defines a frozen dataclass subclass of
:class:`MethodConfig` that holds its hyperparameters and their defaults (once), validates them, and declares
its privacy as data:

* :meth:`MethodConfig.mechanisms` -- the Gaussian mechanisms one logical step releases, a pure function of the
  step index, the noise settings and the plan (no optimizer state), so the privacy plan, the accountant, the
  budget guard and the ledger all read the same declaration;
* :meth:`MethodConfig.noise_for_scale` -- the one-parameter family of noise settings that calibration searches
  (DP-SGD: ``sigma = z``; DiceSGD: one z for both parts; DIFF2: ``z2 = ratio * z1``);
* :meth:`MethodConfig.calibrate` -- by default the smallest scale whose composed history reaches the target
  epsilon; a method overrides it only when its calibration is not an accountant search (DiceSGD's "paper").

The DP settings shared by all methods (sigma, C, q, B, ...) live in :class:`hf_dpfilter.plan.PrivacyPlan`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from hf_dpfilter.accounting.calibration import calibrate_noise_multiplier, calibrate_scale

__all__ = ["DPSGDConfig", "Mechanism", "MethodConfig", "NoiseRound", "NoiseSettings", "PlanSettings",
           "aggregate_history"]


class PlanSettings(Protocol):
    """The settings of a :class:`hf_dpfilter.plan.PrivacyPlan` that the methods and optimizers read (the
    plan is built above them, from their configs)."""

    method: str
    config: MethodConfig
    noise: NoiseSettings
    max_grad_norm: float
    clipping_fn: str
    expected_batch_size: float
    sample_rate: float | None
    steps: int | None
    accountant: str
    secure_rng: bool
    seed: int


@dataclass(frozen=True)
class Mechanism:
    """One Gaussian mechanism: noise std / L2 sensitivity, and its Poisson sample rate (1.0 = not
    subsampled)."""

    noise_multiplier: float
    sample_rate: float


@dataclass(frozen=True)
class NoiseRound:
    """One kind of round a method releases, for the plan's diagnostics (``describe``, the noise-to-signal
    check).

    ``noise_to_clip`` is the noise std on the sum scale (sigma x the round's sensitivity) over the largest
    norm one example's contribution to that round's signal can have: 1 for DP-SGD (noise sigma C, signal
    clipped to C).
    """

    label: str
    fraction: float  # of the steps
    noise_multiplier: float
    sensitivity: str  # the round's L2 sensitivity, as the method computes it
    noise_to_clip: float


@dataclass(frozen=True)
class NoiseSettings:
    """The calibrated noise of a run: ``noise_multiplier`` plus any method-specific multipliers (by name)."""

    noise_multiplier: float
    extra: tuple[tuple[str, float], ...] = ()

    def get(self, name: str, default: float | None = None) -> float | None:
        return dict(self.extra).get(name, default)

    def as_dict(self) -> dict[str, float]:
        return {"noise_multiplier": self.noise_multiplier, **dict(self.extra)}


def aggregate_history(mechanisms_per_step: list[list[Mechanism]]) -> list[tuple[float, float, int]]:
    """``[(sigma, q, count), ...]`` with equal mechanisms merged (composition commutes)."""
    counts: dict[tuple[float, float], int] = {}
    for mechanisms in mechanisms_per_step:
        for m in mechanisms:
            key = (float(m.noise_multiplier), float(m.sample_rate))
            counts[key] = counts.get(key, 0) + 1
    return [(s, q, n) for (s, q), n in counts.items()]


@dataclass(frozen=True)
class MethodConfig:
    """Base of the per-method configs; the defaults describe DP-SGD (one subsampled Gaussian per step)."""

    #: the method's name in the registry (``dp_method``)
    name: ClassVar[str] = ""
    #: the retired flat names of earlier versions were ``legacy_prefix + field name``: read only to refuse
    #: them with the field that replaced them (hf_dpfilter/retired_names.py); never mapped
    legacy_prefix: ClassVar[str] = ""
    #: ``mechanisms(step)`` only depends on ``step % mechanism_period`` (lets long histories be built fast)
    mechanism_period: ClassVar[int] = 1

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def canonical_name(cls, name: str) -> str:
        """``name`` if it is a field of this config; a ValueError listing the fields otherwise."""
        if name in cls.field_names():
            return name
        valid = ", ".join(cls.field_names()) or "(none)"
        raise ValueError(
            f"{name!r} is not a setting of dp_method={cls.name!r}. Its settings are: {valid} "
            f"(see {cls.__name__} or docs/configuration.md)."
        )

    @classmethod
    def from_args(cls, values: MethodConfig | Mapping[str, Any] | None = None) -> MethodConfig:
        """A config from an instance (returned as is), a mapping of field names, or None."""
        if isinstance(values, cls):
            return values
        if isinstance(values, MethodConfig):
            raise TypeError(f"dp_method={cls.name!r} needs a {cls.__name__}, got a {type(values).__name__}.")
        kwargs: dict[str, Any] = {}
        for key, value in dict(values or {}).items():
            name = cls.canonical_name(key)
            if name in kwargs:
                raise ValueError(f"The setting {name!r} of dp_method={cls.name!r} was given twice ({key!r}).")
            kwargs[name] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> MethodConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------- privacy
    def check_plan(self, plan: PlanSettings) -> None:
        """Raise ValueError if the method cannot run under ``plan`` (e.g. a relation it cannot certify)."""

    def mechanisms(self, step: int, noise: NoiseSettings, plan: PlanSettings) -> list[Mechanism]:
        """The Gaussian mechanisms logical step ``step`` (0-based) releases (DP-SGD: one, subsampled)."""
        return [Mechanism(noise.noise_multiplier, plan.sample_rate)]

    def history(self, noise: NoiseSettings, plan: PlanSettings, steps: int, start: int = 0) -> list[tuple]:
        """Aggregated accountant history of steps ``start .. start + steps - 1``."""
        period = max(1, int(self.mechanism_period))
        counts: dict[tuple[float, float], int] = {}
        if steps <= 0:
            return []
        for residue in range(period):
            # how many steps s in [start, start + steps) have s % period == residue
            first = start + ((residue - start) % period)
            if first >= start + steps:
                continue
            repeats = (start + steps - 1 - first) // period + 1
            for m in self.mechanisms(first, noise, plan):
                key = (float(m.noise_multiplier), float(m.sample_rate))
                counts[key] = counts.get(key, 0) + repeats
        return [(s, q, n) for (s, q), n in counts.items()]

    def noise_rounds(self, noise: NoiseSettings, plan: PlanSettings) -> list[NoiseRound]:
        """The rounds the method releases and the real noise of each (DP-SGD: sigma C over a signal clipped to
        C).

        A method whose noise is scaled to another sensitivity than C, or which alternates kinds of rounds,
        says so here, so that the plan's diagnostics state the noise that is really added."""
        return [NoiseRound("every step", 1.0, noise.noise_multiplier, f"C = {plan.max_grad_norm:g}",
                           noise.noise_multiplier)]

    def noise_for_scale(self, scale: float, plan: PlanSettings) -> NoiseSettings:
        """The noise settings calibration tries for one scale parameter (DP-SGD: sigma = scale)."""
        return NoiseSettings(float(scale))

    def fixed_noise(self, noise_multiplier: float, plan: PlanSettings) -> NoiseSettings:
        """The noise settings when the user fixes ``noise_multiplier`` instead of a target epsilon."""
        return NoiseSettings(float(noise_multiplier))

    def calibrate(self, target_epsilon: float, delta: float, plan: PlanSettings) -> NoiseSettings:
        """The smallest noise (along :meth:`noise_for_scale`) whose run spends at most ``target_epsilon``."""
        if plan.steps is None or plan.sample_rate is None:
            raise ValueError("Calibrating the noise needs the number of steps and the sample rate of the "
                             "plan.")
        unit = self.history(self.noise_for_scale(1.0, plan), plan, plan.steps)
        if unit == [(1.0, float(plan.sample_rate), plan.steps)]:
            # DP-SGD's history (one subsampled Gaussian per step, sigma = scale): its dedicated search
            scale = calibrate_noise_multiplier(target_epsilon, delta, plan.sample_rate, plan.steps,
                                               plan.accountant)
            return self.noise_for_scale(scale, plan)
        scale = calibrate_scale(
            lambda z: self.history(self.noise_for_scale(z, plan), plan, plan.steps),
            target_epsilon,
            delta,
            plan.accountant,
        )
        return self.noise_for_scale(scale, plan)

    def report(self, noise: NoiseSettings, plan: PlanSettings, steps: int, delta: float) -> dict[str, Any]:
        """Method-specific entries of ``privacy_report()`` (how the epsilon was obtained, extra claims)."""
        return {}


@dataclass(frozen=True)
class DPSGDConfig(MethodConfig):
    """DP-SGD / DP-Adam has no settings of its own (everything is in the plan). It lives here, not beside its
    optimizer, so that the default plan is built without importing the engine."""

    name = "dpsgd"


def as_tuple(values: Any) -> tuple[float, ...] | None:
    """Coefficient lists are kept as tuples so that configs stay hashable and immutable."""
    return None if values is None else tuple(float(v) for v in values)


def check_finite_positive(value: float, name: str, allow_zero: bool = False) -> None:
    ok = value is not None and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}.")
