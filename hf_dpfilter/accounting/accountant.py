"""Privacy accounting for hf_dpfilter (the single place where epsilon is computed; the noise calibration that
searches it is :mod:`hf_dpfilter.accounting.calibration`).

Every mechanism tracked here is the Poisson-subsampled Gaussian mechanism: each example is included in a step
independently with probability ``sample_rate`` (q), the clipped per-example contributions (L2 sensitivity 1 in
units of the clipping norm) are summed and Gaussian noise of standard deviation ``noise_multiplier`` (sigma)
times the clipping norm is added. ``sample_rate == 1.0`` is the plain (not subsampled) Gaussian mechanism.
Heterogeneous histories (several (sigma, q) pairs, e.g. DIFF2's restarts and difference steps, or steps
already spent before a re-calibration) are composed exactly by every backend.

**Neighbouring relation: add/remove one example** everywhere (the Opacus / dp-transformers convention). To
certify a replace-one guarantee for a mechanism whose sensitivity doubles under replacement, record
``noise_multiplier / 2``.

Backends (``ACCOUNTANTS``):

* ``"prv"`` (default): numerical composition of privacy loss random variables (Gopi, Lee & Wutschitz 2021)
  with the ``prv_accountant`` package (``PRVAccountant`` with one ``PoissonSubsampledGaussianMechanism`` per
  distinct (sigma, q), ``GaussianMechanism`` for q = 1). The reported epsilon is the package's *upper* bound
  (estimate + eps_error + delta_error effect), never the point estimate. ``eps_error`` is 0.3 % of epsilon
  (first from the RDP value, redone from the PRV estimate when RDP was far off), ``delta_error = delta/1000``;
  the discretisation domain is capped at 1.5M points (eps_error is loosened up to 0.5 % to fit) and padded
  to an FFT-friendly length.
  **Fallback to "pld"** (logged at INFO on the ``hf_dpfilter.accounting.accountant`` logger) when PRV cannot
  deliver that accuracy or fails numerically: epsilon below ~0.03 (eps_error would be < 1e-4), domain over
  budget (very many steps at small epsilon), the package's "discrete mean differs" check (large q with small
  sigma), or its floating-point guard for tiny delta.
* ``"pld"``: privacy loss distributions from Google's ``dp_accounting`` (pessimistic connect-the-dots
  discretisation, add/remove relation; q = 1 steps are merged exactly into one Gaussian). The discretisation
  error grows with the number of compositions (~ steps x interval^2: at interval 1e-3 it is 0.04 % for
  1000 steps at q = 0.01 but 15 % for 20000 steps at q = 0.001), so the interval starts at 2e-3 and is
  divided by 3 until successive values agree to 0.4 % (typically 2 passes, <= 1 s).
* ``"rdp"``: Renyi DP (Mironov 2017; Mironov, Talwar & Zhang 2019) with Opacus' subsampled-Gaussian RDP,
  summed over the history on orders 1.1 ... 1024, converted with Balle et al. 2020 (Thm. 21). A looser,
  classical cross-check: typically 10-25 % above PRV/PLD.

All three are upper bounds. PRV and PLD results are additionally capped by the RDP bound, which only matters
when their float64 arithmetic breaks down (delta below ~1e-12); that is logged too.

Epsilon values are cached per (aggregated history, delta, accountant), so a training loop that calls
:meth:`PrivacyAccountant.get_epsilon` at every logging step pays for each distinct history only once.
Composition is commutative, so histories are aggregated per distinct (sigma, q) before computing.
Cost of one uncached evaluation (one CPU core): "rdp" ~0.1 s per new (sigma, q), "pld" ~0.05-1 s, "prv"
~0.1-1 s for up to a few thousand steps, several seconds for ~1e5 steps (grows ~ sqrt(steps) / epsilon).

**Log lines** have a new step count t each time. With "prv", ~85 % of an evaluation is the discretisation of
the PRVs (sizing the domain, building ``PRVAccountant``) and only the FFT composition depends on t. So
``get_epsilon(delta, horizon=H)`` (``DPTrainer.log`` passes the planned total steps) answers t < H from the
accountant of the exact value at H (the history scaled to H; same eps_error rule, domain and delta_error),
kept in a small cache: the package's upper bound with eps_error ~0.3 % of epsilon(H), capped by the RDP
bound at t (why the error guarantee carries over to t <= H: ``_eps_prv_before_horizon``). ``DPTrainer``
computes that exact value when it prints the plan before training, so the log lines discretise nothing;
otherwise the first line builds it once. Measured for sigma 0.6-0.9, q 0.004-0.05, H = 300-3000: ~0.02-0.1 s
per log line instead of ~0.25-0.75 s (a cold build: 0.35-0.9 s once). It applies only when each mechanism of
the history was applied once per logical step (one or several mechanisms per step); a history whose noise
changed, DIFF2's restarts, t >= H, no horizon, or PRV not applicable at H take the exact path, as do the
final report and the privacy ledger.
"""

from __future__ import annotations

import copy as _copy
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hf_dpfilter.accounting.rdp_analysis import opacus_rdp as _opacus_rdp

if TYPE_CHECKING:
    from prv_accountant import PRVAccountant

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("prv", "rdp", "pld")

__all__ = [
    "ACCOUNTANTS",
    "PrivacyAccountant",
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
# PRV: eps_error relative to epsilon (default, and the loosest accepted when the domain must be capped),
# absolute floor of eps_error, and the largest discretisation domain (points) we build.
_PRV_REL_EPS_ERROR = 3e-3
_PRV_MAX_REL_EPS_ERROR = 5e-3
_PRV_MIN_EPS_ERROR = 1e-4
_PRV_MAX_DOMAIN_POINTS = 1_500_000
# PLD: first discretisation interval, refinement factor, convergence tolerance (relative + absolute), floor.
_PLD_START_INTERVAL = 2e-3
_PLD_REFINE_FACTOR = 3.0
_PLD_REL_TOL = 4e-3
_PLD_ABS_TOL = 1e-5
_PLD_MIN_INTERVAL = 1e-6

_HistoryKey = tuple[tuple[float, float, int], ...]


# ----------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; allowed values are {', '.join(ACCOUNTANTS)}")
    return accountant


def check_delta(delta: float) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}; pass e.g. default_delta(N) = N^-1.1")
    return delta


def check_mechanism(noise_multiplier: float, sample_rate: float, num_steps: int) -> tuple[float, float, int]:
    sigma, q = float(noise_multiplier), float(sample_rate)
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate}; use expected batch size / N (1.0 = full "
            "batch)"
        )
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 0:
        raise ValueError(f"num_steps must be an integer >= 0, got {num_steps}")
    return sigma, q, int(num_steps)


def history_key(history: Iterable[Sequence[float]]) -> _HistoryKey:
    """Validate a history and sum the steps per distinct (sigma, q); composition is commutative."""
    counts: dict[tuple[float, float], int] = {}
    for entry in history:
        if len(entry) != 3:
            raise ValueError(
                f"history entries must be (noise_multiplier, sample_rate, num_steps), got {entry!r}"
            )
        sigma, q, n = check_mechanism(*entry)
        if n > 0:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + n
    return tuple(sorted((s, q, n) for (s, q), n in counts.items()))


# ----------------------------------------------------------------------------------------------------------
# backends (all take an aggregated history with sigma > 0 and at least one step)
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _rdp_curve(sigma: float, q: float) -> np.ndarray:
    opacus_rdp = _opacus_rdp()
    return np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(_RDP_ORDERS)))


def _eps_rdp(key: _HistoryKey, delta: float) -> float:
    opacus_rdp = _opacus_rdp()

    total = sum(_rdp_curve(s, q) * n for s, q, n in key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha" and log(0) warnings
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(_RDP_ORDERS), rdp=total, delta=delta)
    return max(float(eps), 0.0)


def _eps_pld_at(key: _HistoryKey, delta: float, interval: float) -> float:
    """PLD epsilon (pessimistic connect-the-dots discretisation) at one discretisation interval."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.privacy_accountant import NeighboringRelation

    # dp_accounting's default tail truncation (1e-15, moved to the infinity mass) would make tiny deltas
    # infinite
    tail = min(1e-15, delta * 1e-10)
    total = None
    for sigma, q, n in key:
        if q >= 1.0:  # n Gaussian releases = one Gaussian release with sigma / sqrt(n) (exact)
            pld = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(n),
                value_discretization_interval=interval,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            )
        else:
            pld = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma,
                value_discretization_interval=interval,
                sampling_prob=q,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            ).self_compose(n, tail_mass_truncation=tail)
        total = pld if total is None else total.compose(pld, tail_mass_truncation=tail)
    assert total is not None
    return max(float(total.get_epsilon_for_delta(delta)), 0.0)


@functools.lru_cache(maxsize=1024)
def _eps_pld(key: _HistoryKey, delta: float) -> float:
    """PLD epsilon with the discretisation refined until it has converged.

    The pessimistic discretisation error grows with the number of compositions (~ steps * interval^2; at
    interval 1e-3 it is 0.04 % for 1000 steps at q=0.01 but 15 % for 20000 steps at q=0.001), so the
    interval is divided by 3 until two successive values agree to ``_PLD_REL_TOL``. Every value is an upper
    bound; the smallest is returned.
    """
    interval = _PLD_START_INTERVAL
    eps = _eps_pld_at(key, delta, interval)
    while math.isfinite(eps) and interval / _PLD_REFINE_FACTOR >= _PLD_MIN_INTERVAL:
        interval /= _PLD_REFINE_FACTOR
        finer = _eps_pld_at(key, delta, interval)
        converged = eps - finer <= _PLD_REL_TOL * finer + _PLD_ABS_TOL
        eps = min(eps, finer)
        if converged:
            break
    return _at_most_rdp(eps, _eps_rdp_cached(key, delta), "PLD")


def _fast_half_width(half_width: float, mesh: float) -> float:
    """Half-width >= ``half_width`` whose PRV domain length (2 * ceil(L / mesh) + 2 points) is FFT-friendly.

    ``prv_accountant`` sizes its domain from ``eps_max``; an arbitrary even length can have large prime
    factors, which makes its FFTs up to ~10x slower. The returned value is ``(m - 1/4) * mesh`` with 2m + 2 a
    5-smooth even number, so the domain is at least as large as the safe one.
    """
    from scipy.fft import next_fast_len

    m = math.ceil(half_width / mesh) + 1
    size = next_fast_len(2 * m + 2, real=True)
    while size % 2:
        size = next_fast_len(size + 1, real=True)
    return ((size - 2) // 2 - 0.25) * mesh


def _prv_accountant(
    key: _HistoryKey, delta: float, eps_error: float, max_eps_error: float
) -> PRVAccountant | None:
    """prv_accountant's ``PRVAccountant`` for ``key`` (domain and mesh sized for its step counts), or None.

    None when the accuracy cannot be delivered (eps_error below the floor, domain over budget) or the
    construction fails numerically (e.g. the package's "discrete mean differs" check).
    """
    from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant
    from prv_accountant.accountant import compute_safe_domain_size

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
            half_width = compute_safe_domain_size(prvs, steps, eps_error=eps_error, delta_error=delta_error)
            if not math.isfinite(half_width):
                return None
            # mesh as in PRVAccountant (Gopi et al. Thm 5.5); domain points = 2 * half_width / mesh
            mesh = eps_error / np.sqrt(sum(steps) / 2 * np.log(12 / delta_error))
            if 2.0 * half_width / mesh > _PRV_MAX_DOMAIN_POINTS:
                # loosen eps_error to fit the domain budget, within the accuracy limit
                eps_error *= 2.0 * half_width / mesh / _PRV_MAX_DOMAIN_POINTS
                if eps_error > max_eps_error:
                    logger.info(
                        "PRV domain too large (%d steps, eps_error %.3g needed)", sum(steps), eps_error
                    )
                    return None
                half_width = max(half_width, eps_error + 3.0)
                mesh = eps_error / np.sqrt(sum(steps) / 2 * np.log(12 / delta_error))
            return PRVAccountant(
                prvs=prvs,
                eps_error=eps_error,
                delta_error=delta_error,
                max_self_compositions=steps,
                eps_max=_fast_half_width(half_width, float(mesh)),  # >= the domain PRVAccountant would use
            )
    except (RuntimeError, ValueError, FloatingPointError, OverflowError, MemoryError) as err:
        logger.info("PRV accountant failed numerically (%s)", err)
        return None


def _prv_bounds(accountant: PRVAccountant, delta: float, steps: list[int]) -> tuple[float, float] | None:
    """(estimate, upper bound) of ``accountant`` after ``steps`` self-compositions, or None on failure."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            _, estimate, upper = accountant.compute_epsilon(delta=delta, num_self_compositions=steps)
    except (RuntimeError, ValueError, FloatingPointError, OverflowError, MemoryError) as err:
        logger.info("PRV accountant failed numerically (%s)", err)
        return None
    if math.isnan(estimate) or math.isnan(upper):
        return None
    return float(estimate), float(upper)


# Few entries: an accountant holds its discretised PRVs (~5 MB per mechanism for a few thousand steps, up to
# ~25 MB at the domain cap). Kept so that the log lines of a run reuse the one built for the exact epsilon of
# the whole run (which the trainer prints with the plan before training).
@functools.lru_cache(maxsize=2)
def _prv_calibrated(key: _HistoryKey, delta: float) -> tuple[PRVAccountant, float] | None:
    """(accountant, upper bound at ``key``'s counts) with eps_error ~0.3 % of epsilon, or None (use PLD).

    RDP over-estimates epsilon (10-25 % in typical regimes), so eps_error is first set from it and, if the
    PRV estimate turns out much smaller (small epsilon), the accountant is rebuilt at the right accuracy.
    """
    eps_rdp = _eps_rdp_cached(key, delta)
    if not math.isfinite(eps_rdp):
        return None
    steps = [n for _, _, n in key]
    accountant = _prv_accountant(key, delta, _PRV_REL_EPS_ERROR * eps_rdp, _PRV_MAX_REL_EPS_ERROR * eps_rdp)
    result = None if accountant is None else _prv_bounds(accountant, delta, steps)
    if result is not None and eps_rdp > 1.5 * result[0]:
        estimate = result[0]
        accountant = None  # free its arrays before building the finer one
        accountant = _prv_accountant(
            key, delta, _PRV_REL_EPS_ERROR * estimate, _PRV_MAX_REL_EPS_ERROR * estimate
        )
        result = None if accountant is None else _prv_bounds(accountant, delta, steps)
    if result is None:
        return None
    return accountant, result[1]


@functools.lru_cache(maxsize=1024)
def _eps_prv(key: _HistoryKey, delta: float) -> float:
    """PRV upper bound with eps_error ~0.3 % of epsilon; PLD fallback; never above the RDP bound."""
    built = _prv_calibrated(key, delta)
    if built is None:
        logger.info("PRV not applicable for history %s, delta=%g; reporting the PLD bound", key, delta)
        return _eps_pld(key, delta)
    return _at_most_rdp(built[1], _eps_rdp_cached(key, delta), "PRV")


@functools.lru_cache(maxsize=1024)
def _eps_prv_before_horizon(horizon_key: _HistoryKey, delta: float, steps: int) -> float | None:
    """PRV upper bound after ``steps`` <= H steps of each mechanism of ``horizon_key`` (all counts H),
    computed with the accountant discretised once for H; None where PRV is not applicable at H.

    Why the bound holds for any ``steps`` = t <= H, with the domain and mesh built for H (Gopi, Lee &
    Wutschitz 2021, Thm. 5.5 and Remark 5.6, as implemented by ``prv_accountant.PRVAccountant``):

    * mesh: the mean-preserving discretisation moves each PRV by at most h/2, so (Hoeffding) the error of
      a sum of k discretised PRVs exceeds eps_error with a probability bounded by a function of
      k h^2 / eps_error^2 that grows with k. The package sets h = eps_error / sqrt(H/2 log(12/delta_error))
      so that this is within the delta_error budget for k = H; k = t <= H only makes it smaller (the mesh
      is finer than t alone needs).
    * domain: ``compute_safe_domain_size`` takes L >= the RDP epsilon of the H-fold composition at
      delta_error/4 and of each single PRV at delta_error/(8 H). RDP epsilon is non-decreasing in the
      number of compositions (the RDP curves add, each >= 0) and non-increasing in delta, so L also bounds
      both quantities for t (delta_error/(8 t) >= delta_error/(8 H)): the tail mass truncated or wrapped
      around is no larger than for H. Our domain (``_fast_half_width``) is at least L.
    * ``compute_epsilon`` then applies the same eps_error and delta_error for any
      ``num_self_compositions <= max_self_compositions`` (it only refuses larger ones).

    So the value is an upper bound with absolute accuracy eps_error ~0.3 % (at most 0.5 %) of epsilon at H:
    a larger relative margin early in the run, where epsilon is smaller. It is capped by the RDP bound at t.
    """
    built = _prv_calibrated(horizon_key, delta)  # the accountant of the exact value at H
    if built is None:
        return None
    result = _prv_bounds(built[0], delta, [steps] * len(horizon_key))
    if result is None:
        return None
    key = tuple((s, q, steps) for s, q, _ in horizon_key)
    return _at_most_rdp(result[1], _eps_rdp_cached(key, delta), "PRV")


def _at_most_rdp(eps: float, eps_rdp: float, name: str) -> float:
    """Both values are upper bounds; a numerical result above RDP's signals breakdown (e.g. delta < 1e-12)."""
    if eps > eps_rdp:
        logger.info(
            "%s epsilon %.6g exceeds the RDP bound %.6g (numerical limits); reporting RDP", name, eps, eps_rdp
        )
        return eps_rdp
    return eps


_eps_rdp_cached = functools.lru_cache(maxsize=4096)(_eps_rdp)

_BACKENDS: dict[str, Callable[[_HistoryKey, float], float]] = {
    "prv": _eps_prv,
    "pld": _eps_pld,
    "rdp": _eps_rdp_cached,
}


def epsilon_of_key(key: _HistoryKey, delta: float, accountant: str) -> float:
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
    check_accountant(accountant)
    delta = check_delta(delta)
    return epsilon_of_key(history_key(history), delta, accountant)


class PrivacyAccountant:
    """Tracks the composition of (possibly heterogeneous) Gaussian mechanisms.

    history: list of [noise_multiplier, sample_rate, num_steps] entries (consecutive equal entries merged).

    Each recorded step is one application of the Poisson-subsampled Gaussian mechanism under the
    add/remove-one neighbouring relation. ``get_epsilon`` results are cached, so calling it at every logging
    step is cheap when nothing changed.
    """

    def __init__(self, accountant: str = "prv") -> None:
        """Create an empty accountant using backend ``accountant`` (one of ``ACCOUNTANTS``)."""
        self.accountant: str = check_accountant(accountant)
        self.history: list[list] = []
        self._steps = 0  # logical (optimizer) steps; one step may compose several mechanisms

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` applications of the Poisson-subsampled Gaussian mechanism.

        Args:
            noise_multiplier: noise standard deviation divided by the L2 sensitivity (clipping norm), >= 0.
            sample_rate: Poisson sampling probability q in (0, 1]; 1.0 means no subsampling.
            num_steps: number of steps (>= 0; 0 records nothing).
        """
        self._compose(noise_multiplier, sample_rate, num_steps)
        self._steps += int(num_steps)

    def record_step(self, mechanisms: Iterable) -> None:
        """Record ONE logical step that releases each of ``mechanisms`` (objects with ``noise_multiplier`` and
        ``sample_rate``, e.g. :class:`hf_dpfilter.optimizers.method_config.Mechanism`); ``steps`` grows by
        1."""
        for m in mechanisms:
            self._compose(m.noise_multiplier, m.sample_rate, 1, merge_anywhere=True)
        self._steps += 1

    def _compose(self, noise_multiplier: float, sample_rate: float, num_steps: int,
                 merge_anywhere: bool = False):
        sigma, q, n = check_mechanism(noise_multiplier, sample_rate, num_steps)
        if n == 0:
            return
        entries = self.history if merge_anywhere else self.history[-1:]
        for entry in entries:  # composition commutes: equal mechanisms share one entry
            if entry[0] == sigma and entry[1] == q:
                entry[2] += n
                return
        self.history.append([sigma, q, n])

    @property
    def steps(self) -> int:
        """Number of logical steps recorded (a step may release several mechanisms, e.g. DiceSGD's two)."""
        return self._steps

    def get_epsilon(self, delta: float, horizon: int | None = None) -> float:
        """Epsilon spent so far at ``delta`` (upper bound; ``inf`` if a sigma is 0, 0.0 if no steps).

        Args:
            delta: target delta, in (0, 1).
            horizon: the planned total number of logical steps, for values logged during a run. With the
                "prv" backend, before the horizon, and when every mechanism of the history was applied once
                per logical step, epsilon then comes from one PRV discretisation built for the horizon and
                shared by all step counts (see the module docstring): the same kind of upper bound
                with the same absolute eps_error as at the horizon, ~10x cheaper per new step count. In all
                other cases, and with ``None``, the result is exactly :func:`compute_epsilon`'s.
        """
        if horizon is not None and (isinstance(horizon, bool) or int(horizon) != horizon or horizon < 1):
            raise ValueError(f"horizon must be an integer >= 1 or None, got {horizon!r}")
        if horizon is not None and self.accountant == "prv":
            key, steps = history_key(self.history), self._steps
            # At the horizon the exact path gives the same value (same accountant), cached for the report.
            if key and steps < horizon and all(s > 0.0 and n == steps for s, _, n in key):
                horizon_key = tuple((s, q, int(horizon)) for s, q, _ in key)
                eps = _eps_prv_before_horizon(horizon_key, check_delta(delta), steps)
                if eps is not None:
                    return eps
        return compute_epsilon(self.history, delta, self.accountant)

    def state_dict(self) -> dict:
        """JSON-able state: ``{"accountant": str, "history": [[sigma, q, steps], ...]}``."""
        return {
            "accountant": self.accountant,
            "history": [[float(s), float(q), int(n)] for s, q, n in self.history],
            "steps": int(self._steps),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the state produced by :meth:`state_dict` (validated; consecutive equal entries merged)."""
        accountant = check_accountant(state.get("accountant", self.accountant))
        history = state.get("history", [])
        fresh = PrivacyAccountant(accountant)
        for entry in history:
            if len(entry) != 3:
                raise ValueError(
                    f"history entries must be [noise_multiplier, sample_rate, num_steps], got {entry!r}"
                )
            fresh.step(*entry)
        steps = state.get("steps", fresh.steps)  # older states counted one mechanism per step
        if isinstance(steps, bool) or int(steps) != steps or steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
        self.accountant, self.history, self._steps = fresh.accountant, fresh.history, int(steps)

    def copy(self) -> PrivacyAccountant:
        """An independent copy (same backend and history)."""
        other = PrivacyAccountant(self.accountant)
        other.history = _copy.deepcopy(self.history)
        other._steps = self._steps
        return other

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(accountant={self.accountant!r}, steps={self.steps}, history={self.history})"
        )


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
