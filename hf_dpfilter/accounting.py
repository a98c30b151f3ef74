"""Privacy accounting for hf_dpfilter (the single place where epsilon is computed).

Every mechanism tracked here is the Poisson-subsampled Gaussian mechanism: each example is included in a step
independently with probability ``sample_rate`` (q), the clipped per-example contributions (L2 sensitivity 1 in
units of the clipping norm) are summed and Gaussian noise of standard deviation ``noise_multiplier`` (sigma)
times the clipping norm is added. ``sample_rate == 1.0`` is the plain (not subsampled) Gaussian mechanism.
Heterogeneous histories (several (sigma, q) pairs, e.g. DIFF2's restarts and difference steps, or steps already
spent before a re-calibration) are composed exactly by every backend.

**Neighbouring relation: add/remove one example** everywhere (the Opacus / dp-transformers convention). To
certify a replace-one guarantee for a mechanism whose sensitivity doubles under replacement, record
``noise_multiplier / 2``.

Backends (``ACCOUNTANTS``):

* ``"prv"`` (default): numerical composition of privacy loss random variables (Gopi, Lee & Wutschitz 2021) with
  the ``prv_accountant`` package. The reported epsilon is the package's *upper* bound (estimate + eps_error),
  never the point estimate, so epsilon is not under-reported. ``eps_error`` is set relative to epsilon
  (``_PRV_REL_EPS_ERROR`` = 0.3 %, estimated from a PLD pass) and ``delta_error = delta / 1000``.
  PRV can fail numerically (the discretised mean check fails for some large-step / large-q settings, the
  floating-point guard for tiny delta, or the discretisation domain gets too large for very large epsilon or
  very many steps; relative eps_error below 1e-4 for epsilon below ~0.03). In all those cases the result
  falls back to the ``"pld"`` backend, which is also a pessimistic (upper) bound; the fallback is logged at
  INFO level on the ``hf_dpfilter.accounting`` logger.
* ``"pld"``: privacy loss distributions with Google's ``dp_accounting`` (``PLDAccountant``, pessimistic
  connect-the-dots discretisation, add/remove relation). ``value_discretization_interval`` is 1e-3
  (error ~1e-3 relative at epsilon ~ 2) and is refined for small epsilon (~1e-2 x epsilon, floor 1e-6).
* ``"rdp"``: Renyi DP (Mironov 2017; Mironov, Talwar & Zhang 2019) with Opacus' subsampled-Gaussian RDP,
  summed over the history on a grid of orders 1.1 ... 1024 and converted with the improved conversion of
  Balle et al. 2020 (Thm. 21). A looser but classical cross-check: typically 5-25 % above PRV/PLD.

Epsilon values are cached per (aggregated history, delta, accountant), so a training loop that calls
:meth:`PrivacyAccountant.get_epsilon` at every logging step pays for each distinct history only once.
Composition is commutative, so histories are aggregated per distinct (sigma, q) before computing.
"""

from __future__ import annotations

import copy as _copy
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("prv", "rdp", "pld")

__all__ = [
    "ACCOUNTANTS",
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "default_delta",
    "validate_privacy_parameters",
]

# RDP orders: Opacus' default grid extended to large orders (needed for large noise multipliers).
_RDP_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 10.0 for x in range(1, 100)]
    + list(range(12, 64))
    + [64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024]
)
# PRV: eps_error relative to epsilon, absolute floor, and largest discretisation domain (points) we accept.
_PRV_REL_EPS_ERROR = 3e-3
_PRV_MIN_EPS_ERROR = 1e-4
_PRV_MAX_DOMAIN_POINTS = 4_000_000
# PLD: default discretisation interval, and the relative one used for small epsilon.
_PLD_INTERVAL = 1e-3
_PLD_REL_INTERVAL = 1e-2
_PLD_MIN_INTERVAL = 1e-6

_HistoryKey = tuple[tuple[float, float, int], ...]


# ----------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; allowed values are {', '.join(ACCOUNTANTS)}")
    return accountant


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}; pass e.g. default_delta(N) = N^-1.1")
    return delta


def _check_mechanism(noise_multiplier: float, sample_rate: float, num_steps: int) -> tuple[float, float, int]:
    sigma, q = float(noise_multiplier), float(sample_rate)
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate}; use expected batch size / N (1.0 = full batch)"
        )
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 0:
        raise ValueError(f"num_steps must be an integer >= 0, got {num_steps}")
    return sigma, q, int(num_steps)


def _aggregate(history: Iterable[Sequence[float]]) -> _HistoryKey:
    """Validate a history and sum the steps per distinct (sigma, q); composition is commutative."""
    counts: dict[tuple[float, float], int] = {}
    for entry in history:
        if len(entry) != 3:
            raise ValueError(
                f"history entries must be (noise_multiplier, sample_rate, num_steps), got {entry!r}"
            )
        sigma, q, n = _check_mechanism(*entry)
        if n > 0:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + n
    return tuple(sorted((s, q, n) for (s, q), n in counts.items()))


# ----------------------------------------------------------------------------------------------------------
# backends (all take an aggregated history with sigma > 0 and at least one step)
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _rdp_curve(sigma: float, q: float) -> np.ndarray:
    from opacus.accountants.analysis import rdp as opacus_rdp

    return np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(_RDP_ORDERS)))


def _eps_rdp(key: _HistoryKey, delta: float) -> float:
    from opacus.accountants.analysis import rdp as opacus_rdp

    total = sum(_rdp_curve(s, q) * n for s, q, n in key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha" and log(0) warnings
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(_RDP_ORDERS), rdp=total, delta=delta)
    return max(float(eps), 0.0)


def _eps_pld_at(key: _HistoryKey, delta: float, interval: float) -> float:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=interval,
    )
    for sigma, q, n in key:
        event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(sigma)
        if q < 1.0:
            event = dp_accounting.PoissonSampledDpEvent(q, event)
        acc.compose(event, n)
    return max(float(acc.get_epsilon(delta)), 0.0)


@functools.lru_cache(maxsize=1024)
def _eps_pld(key: _HistoryKey, delta: float) -> float:
    eps = _eps_pld_at(key, delta, _PLD_INTERVAL)
    interval = max(_PLD_MIN_INTERVAL, _PLD_REL_INTERVAL * eps)
    if math.isfinite(eps) and interval < _PLD_INTERVAL:  # small epsilon: refine the grid
        eps = min(eps, _eps_pld_at(key, delta, interval))
    return eps


def _eps_prv_or_none(key: _HistoryKey, delta: float, eps_estimate: float) -> float | None:
    """PRV upper bound, or None when PRV is not applicable / fails numerically."""
    from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant
    from prv_accountant.accountant import compute_safe_domain_size

    eps_error = _PRV_REL_EPS_ERROR * eps_estimate
    if not math.isfinite(eps_error) or eps_error < _PRV_MIN_EPS_ERROR:
        return None
    delta_error = delta / 1000.0
    prvs = [
        GaussianMechanism(noise_multiplier=s) if q >= 1.0 else PoissonSubsampledGaussianMechanism(q, s)
        for s, q, _ in key
    ]
    steps = [n for _, _, n in key]
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            domain_half_width = compute_safe_domain_size(
                prvs, steps, eps_error=eps_error, delta_error=delta_error
            )
            mesh = eps_error / math.sqrt(sum(steps) / 2.0 * math.log(12.0 / delta_error))
            if (
                not math.isfinite(domain_half_width)
                or 2.0 * domain_half_width / mesh > _PRV_MAX_DOMAIN_POINTS
            ):
                return None
            acc = PRVAccountant(
                prvs=prvs,
                eps_error=eps_error,
                delta_error=delta_error,
                max_self_compositions=steps,
                eps_max=domain_half_width,  # the same domain PRVAccountant would compute itself
            )
            _, _, eps_upper = acc.compute_epsilon(delta=delta, num_self_compositions=steps)
    except (RuntimeError, ValueError, FloatingPointError, OverflowError, MemoryError) as err:
        logger.info("PRV accountant failed numerically (%s)", err)
        return None
    eps_upper = float(eps_upper)
    if math.isnan(eps_upper):
        return None
    return max(eps_upper, 0.0)


@functools.lru_cache(maxsize=1024)
def _eps_prv(key: _HistoryKey, delta: float) -> float:
    eps_pld = _eps_pld(key, delta)
    if not math.isfinite(eps_pld):
        return eps_pld
    eps = _eps_prv_or_none(key, delta, eps_pld)
    if eps is None:
        logger.info("PRV not applicable for history %s, delta=%g; reporting the PLD bound", key, delta)
        return eps_pld
    return eps


_BACKENDS: dict[str, Callable[[_HistoryKey, float], float]] = {
    "prv": _eps_prv,
    "pld": _eps_pld,
    "rdp": functools.lru_cache(maxsize=4096)(_eps_rdp),
}


def _epsilon_of_key(key: _HistoryKey, delta: float, accountant: str) -> float:
    if not key:
        return 0.0
    if any(s == 0.0 for s, _, _ in key):
        return math.inf
    return _BACKENDS[accountant](key, delta)


# ----------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------


def compute_epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str = "prv") -> float:
    """Epsilon at ``delta`` of the composition of the Poisson-subsampled Gaussian mechanisms in ``history``.

    Args:
        history: entries ``(noise_multiplier, sample_rate, num_steps)``; ``sample_rate == 1.0`` means no
            subsampling. Order does not matter (composition is commutative).
        delta: target delta, in (0, 1).
        accountant: one of ``ACCOUNTANTS`` (``"prv"``, ``"rdp"``, ``"pld"``).

    Returns:
        An upper bound on epsilon (add/remove-one relation); ``0.0`` for an empty history (or only zero-step
        entries), ``float('inf')`` if any recorded step has ``noise_multiplier == 0``.
    """
    _check_accountant(accountant)
    delta = _check_delta(delta)
    return _epsilon_of_key(_aggregate(history), delta, accountant)


class PrivacyAccountant:
    """Tracks the composition of (possibly heterogeneous) Gaussian mechanisms.

    history: list of [noise_multiplier, sample_rate, num_steps] entries (consecutive equal entries merged).

    Each recorded step is one application of the Poisson-subsampled Gaussian mechanism under the add/remove-one
    neighbouring relation. ``get_epsilon`` results are cached, so calling it at every logging step is cheap
    when nothing changed.
    """

    def __init__(self, accountant: str = "prv") -> None:
        """Create an empty accountant using backend ``accountant`` (one of ``ACCOUNTANTS``)."""
        self.accountant: str = _check_accountant(accountant)
        self.history: list[list] = []

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` applications of the Poisson-subsampled Gaussian mechanism.

        Args:
            noise_multiplier: noise standard deviation divided by the L2 sensitivity (clipping norm), >= 0.
            sample_rate: Poisson sampling probability q in (0, 1]; 1.0 means no subsampling.
            num_steps: number of steps (>= 0; 0 records nothing).
        """
        sigma, q, n = _check_mechanism(noise_multiplier, sample_rate, num_steps)
        if n == 0:
            return
        if self.history and self.history[-1][0] == sigma and self.history[-1][1] == q:
            self.history[-1][2] += n
        else:
            self.history.append([sigma, q, n])

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(int(n) for _, _, n in self.history)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (upper bound; ``inf`` if any noise_multiplier is 0, 0.0 if no steps)."""
        return compute_epsilon(self.history, delta, self.accountant)

    def state_dict(self) -> dict:
        """JSON-able state: ``{"accountant": str, "history": [[sigma, q, steps], ...]}``."""
        return {
            "accountant": self.accountant,
            "history": [[float(s), float(q), int(n)] for s, q, n in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the state produced by :meth:`state_dict` (validated; consecutive equal entries merged)."""
        accountant = _check_accountant(state.get("accountant", self.accountant))
        history = state.get("history", [])
        fresh = PrivacyAccountant(accountant)
        for entry in history:
            if len(entry) != 3:
                raise ValueError(
                    f"history entries must be [noise_multiplier, sample_rate, num_steps], got {entry!r}"
                )
            fresh.step(*entry)
        self.accountant, self.history = fresh.accountant, fresh.history

    def copy(self) -> PrivacyAccountant:
        """An independent copy (same backend and history)."""
        other = PrivacyAccountant(self.accountant)
        other.history = _copy.deepcopy(self.history)
        return other

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(accountant={self.accountant!r}, steps={self.steps}, history={self.history})"
        )


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    extra_history: list[tuple[float, float, int]] | None = None,
) -> float:
    """Smallest noise multiplier (binary search) whose epsilon lies in ``[target*(1-tol), target]``.

    The epsilon is that of ``steps`` steps of the Poisson-subsampled Gaussian mechanism with ``sample_rate``,
    composed with ``extra_history`` (other mechanisms, e.g. already-spent steps), as computed by
    :func:`compute_epsilon` with ``accountant``. The returned sigma's epsilon is never above the target.

    Raises:
        ValueError: on invalid arguments, or if ``extra_history`` alone already spends ``target_epsilon``.
    """
    _check_accountant(accountant)
    target_epsilon = float(target_epsilon)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    delta = _check_delta(target_delta)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps}")
    _check_mechanism(1.0, sample_rate, steps)
    if not (0.0 < epsilon_tolerance < 1.0):
        raise ValueError(f"epsilon_tolerance must be in (0, 1), got {epsilon_tolerance}")
    q, steps = float(sample_rate), int(steps)
    extra = list(_aggregate(extra_history or []))
    lower = target_epsilon * (1.0 - epsilon_tolerance)

    def eps_fn(backend: str) -> Callable[[float], float]:
        return lambda sigma: _epsilon_of_key(_aggregate([*extra, (sigma, q, steps)]), delta, backend)

    # feasibility check (PLD stands in for PRV here: same value up to PRV's ~0.3 % error margin, much cheaper)
    eps_extra = _epsilon_of_key(tuple(extra), delta, "pld" if accountant == "prv" else accountant)
    if eps_extra >= target_epsilon:
        raise ValueError(
            f"extra_history alone already spends epsilon={eps_extra:.4g} >= target_epsilon={target_epsilon}; "
            "increase the target or reduce the other mechanisms"
        )
    guess, factor = 1.0, 2.0
    if accountant == "prv":
        # Locate cheaply with PLD, aiming at the middle-upper part of the window since PRV reports an upper bound
        # ~0.3 % above PLD; then refine with PRV itself (usually 1-2 PRV evaluations).
        guess = _search(
            eps_fn("pld"),
            target_epsilon * (1 - 0.5 * epsilon_tolerance),
            target_epsilon * (1 - 0.8 * epsilon_tolerance),
            1.0,
            2.0,
        )
        factor = 1.01
    return _search(eps_fn(accountant), target_epsilon, lower, guess, factor)


def _search(eps: Callable[[float], float], upper: float, lower: float, guess: float, factor: float) -> float:
    """Smallest sigma with lower <= eps(sigma) <= upper, eps decreasing in sigma (bracket, then bisect)."""
    sigma_max, sigma_min = 1e7, 1e-4
    e = eps(guess)
    if e <= upper:
        hi = guess
        if e >= lower:
            return hi
        lo = guess / factor
        while eps(lo) <= upper:
            hi, factor = lo, factor * factor
            if hi < sigma_min:
                raise ValueError("could not calibrate: epsilon stays below the target even for tiny noise")
            lo = hi / factor
    else:
        lo = guess
        hi = guess * factor
        while eps(hi) > upper:
            lo, factor = hi, factor * factor
            if lo > sigma_max:
                raise ValueError("could not calibrate: epsilon stays above the target even for huge noise")
            hi = lo * factor
    # invariant: eps(lo) > upper >= eps(hi)
    for _ in range(200):
        if eps(hi) >= lower:
            return hi
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:
            break
        if eps(mid) > upper:
            lo = mid
        else:
            hi = mid
    logger.warning(
        "noise calibration stopped at sigma=%g with epsilon %g below the tolerance window", hi, eps(hi)
    )
    return hi


def default_delta(num_examples: int) -> float:
    """Library default delta = N ** -1.1 (N = number of training examples)."""
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
        raise ValueError(f"num_examples must be a positive integer, got {num_examples}")
    return float(num_examples) ** -1.1


def validate_privacy_parameters(
    target_epsilon: float, target_delta: float | None, sample_rate: float, num_examples: int
) -> None:
    """Raise a ``ValueError`` naming the problem and the fix for unusable privacy parameters.

    Checks: ``target_epsilon`` finite and > 0; ``0 < target_delta < 1/N`` (``None`` means the default
    N^-1.1 will be used and is not checked); ``0 < sample_rate <= 1``; ``num_examples`` a positive integer.
    """
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
        raise ValueError(
            f"num_examples must be a positive integer (size of the training set), got {num_examples}"
        )
    n = int(num_examples)
    eps = float(target_epsilon)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(
            f"target_epsilon must be a finite number > 0, got {target_epsilon}; "
            "pass a positive privacy budget such as 3.0 or 8.0"
        )
    if target_delta is not None:
        delta = float(target_delta)
        suggestion = f"use a smaller delta, e.g. N^-1.1 = {default_delta(n):.3g}"
        if not delta > 0:  # also catches nan
            raise ValueError(f"target_delta must be > 0, got {target_delta}; {suggestion}")
        if not delta < 1.0 / n:
            raise ValueError(
                f"target_delta={target_delta} is too large: delta must be < 1/N = {1.0 / n:.3g} "
                f"(N = {n} training examples); {suggestion}"
            )
    q = float(sample_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate}; "
            f"use expected batch size / N (e.g. 256 / {n} = {min(256 / n, 1.0):.3g}), or 1.0 for full batch"
        )
