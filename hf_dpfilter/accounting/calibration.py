"""Noise calibration: the smallest noise whose composed history spends at most a target epsilon.

:func:`calibrate_noise_multiplier` (one Poisson-subsampled Gaussian per step, optionally after an
``extra_history``) and :func:`calibrate_scale` (several Gaussians whose noise multipliers scale with one z)
search the epsilon computed by :mod:`hf_dpfilter.accounting.accountant`, the one place where epsilon is
computed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from hf_dpfilter.accounting.accountant import (
    check_accountant,
    check_delta,
    check_mechanism,
    compute_epsilon,
    epsilon_of_key,
    history_key,
)

logger = logging.getLogger(__name__)

__all__ = ["calibrate_noise_multiplier", "calibrate_scale"]


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    extra_history: list[tuple[float, float, int]] | None = None,
) -> float:
    """Smallest noise multiplier, up to the tolerance: its epsilon lies in ``[target*(1-tol), target]``.

    Found by a bracketing root search (regula falsi with bisection safeguard on log eps vs log sigma), started
    from the cheaper accountants' answers (RDP, then PLD for "prv").

    The epsilon is that of ``steps`` steps of the Poisson-subsampled Gaussian mechanism with ``sample_rate``,
    composed with ``extra_history`` (other mechanisms, e.g. already-spent steps), as computed by
    :func:`compute_epsilon` with ``accountant``. The returned sigma's epsilon is never above the target.

    Raises:
        ValueError: on invalid arguments, or if ``extra_history`` alone already spends ``target_epsilon``.
    """
    check_accountant(accountant)
    target_epsilon = float(target_epsilon)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    delta = check_delta(target_delta)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps}")
    check_mechanism(1.0, sample_rate, steps)
    if not (0.0 < epsilon_tolerance < 1.0):
        raise ValueError(f"epsilon_tolerance must be in (0, 1), got {epsilon_tolerance}")
    q, steps = float(sample_rate), int(steps)
    extra = list(history_key(extra_history or []))
    lower = target_epsilon * (1.0 - epsilon_tolerance)

    def eps_fn(backend: str) -> Callable[[float], float]:
        return lambda sigma: epsilon_of_key(history_key([*extra, (sigma, q, steps)]), delta, backend)

    # feasibility check (PLD stands in for PRV here: same value up to PRV's ~0.3 % error margin, much cheaper)
    eps_extra = epsilon_of_key(tuple(extra), delta, "pld" if accountant == "prv" else accountant)
    if eps_extra >= target_epsilon:
        raise ValueError(
            f"extra_history alone already spends epsilon={eps_extra:.4g} >= target_epsilon={target_epsilon}; "
            "increase the target or reduce the other mechanisms"
        )
    # Cheap-to-expensive chain of starting points: RDP (ms per evaluation) -> PLD -> PRV. RDP's sigma is
    # 5-12 % above PLD's; PRV reports an upper bound ~0.3 % above PLD, so PLD aims at the upper-middle part
    # of the window, which usually leaves a single PRV evaluation.
    try:
        guess, factor = _search(eps_fn("rdp"), target_epsilon, lower, 1.0, 2.0), 2.0
    except ValueError:  # RDP's looser bound can make a feasible extra_history look infeasible
        guess, factor = 1.0, 2.0
    else:
        if accountant in ("pld", "prv"):
            guess, factor = guess / 1.08, 1.05
    if accountant == "prv":
        window = (
            target_epsilon * (1 - 0.5 * epsilon_tolerance),
            target_epsilon * (1 - 0.8 * epsilon_tolerance),
        )
        guess, factor = _search(eps_fn("pld"), *window, guess, factor), 1.01
    return _search(eps_fn(accountant), target_epsilon, lower, guess, factor)



def calibrate_scale(
    history_of: Callable[[float], list], target_epsilon: float, delta: float, accountant: str = "prv",
    tol: float = 0.01
) -> float:
    """Smallest noise scale z with ``epsilon(history_of(z))`` in ``[target (1 - tol), target]``.

    For mechanisms made of several Gaussians whose noise multipliers all scale with one z (DiceSGD's two
    parts, DIFF2's restart and difference rounds): ``history_of(z)`` returns the accountant history.
    With ``accountant="prv"`` the bracket is located with the cheaper PLD first and refined with PRV.
    """

    def eps(backend: str) -> Callable[[float], float]:
        return lambda z: compute_epsilon(history_of(z), delta, backend)

    guess, factor = 1.0, 2.0
    if accountant == "prv":
        guess = _search(eps("pld"), target_epsilon * (1 - 0.5 * tol), target_epsilon * (1 - 0.8 * tol), 1.0,
                        2.0)
        factor = 1.01
    return _search(eps(accountant), target_epsilon, target_epsilon * (1 - tol), guess, factor)

def _search(eps: Callable[[float], float], upper: float, lower: float, guess: float, factor: float) -> float:
    """A sigma with ``lower <= eps(sigma) <= upper`` for ``eps`` decreasing in sigma.

    Brackets from ``guess`` (steps growing from ``factor``), then runs the Illinois variant of regula falsi on
    log(eps) against log(sigma) (nearly linear, so a handful of evaluations), with bisection as safeguard.
    """
    sigma_max, sigma_min = 1e7, 1e-4
    target = math.sqrt(upper * lower)

    def log_ratio(e: float) -> float:
        if e <= 0.0:
            return -math.inf
        return math.log(e / target) if math.isfinite(e) else math.inf

    e = eps(guess)
    if lower <= e <= upper:
        return guess
    if e > upper:  # need more noise
        lo, e_lo = guess, e
        hi = lo * factor
        while (e_hi := eps(hi)) > upper:
            if hi > sigma_max:
                raise ValueError("could not calibrate: epsilon stays above the target even for huge noise")
            lo, e_lo, factor = hi, e_hi, factor * factor
            hi = lo * factor
    else:  # need less noise
        hi, e_hi = guess, e
        lo = hi / factor
        while (e_lo := eps(lo)) < lower:
            if lo < sigma_min:
                raise ValueError("could not calibrate: epsilon stays below the target even for tiny noise")
            hi, e_hi, factor = lo, e_lo, factor * factor
            lo = hi / factor
    for sigma, e in ((lo, e_lo), (hi, e_hi)):
        if lower <= e <= upper:
            return sigma
    # invariant: eps(lo) > upper and eps(hi) < lower
    x_lo, x_hi = math.log(lo), math.log(hi)
    f_lo, f_hi = log_ratio(e_lo), log_ratio(e_hi)
    last_side = 0
    for _ in range(100):
        x = 0.5 * (x_lo + x_hi)
        if math.isfinite(f_lo) and math.isfinite(f_hi) and f_lo != f_hi:
            x_secant = (x_lo * f_hi - x_hi * f_lo) / (f_hi - f_lo)
            margin = 1e-3 * (x_hi - x_lo)
            if x_lo + margin < x_secant < x_hi - margin:
                x = x_secant
        sigma = math.exp(x)
        e = eps(sigma)
        if lower <= e <= upper:
            return sigma
        if e > upper:
            x_lo, f_lo = x, log_ratio(e)
            if last_side == -1:
                f_hi *= 0.5  # Illinois step: the other end was kept twice
            last_side = -1
        else:
            x_hi, f_hi = x, log_ratio(e)
            if last_side == 1:
                f_lo *= 0.5
            last_side = 1
        if x_hi - x_lo < 1e-12:
            break
    sigma = math.exp(x_hi)
    logger.warning(
        "noise calibration stopped at sigma=%g with epsilon %g below the tolerance window", sigma, eps(sigma)
    )
    return sigma
