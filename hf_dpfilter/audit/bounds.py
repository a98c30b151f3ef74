"""Statistics of the one-run privacy audit (no training code here).

The auditing game (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run", Algorithm 1):
m canaries are each included in training independently with probability 1/2 (S_i in {-1, +1}); after training
the auditor computes one score per canary, guesses "+1" (IN) on the k+ largest scores, "-1" (OUT) on the k-
smallest scores and abstains on the rest.  With r = k+ + k- guesses of which v are correct, the functions
below turn (m, r, v) into an *empirical lower bound* on epsilon: with probability >= ``confidence`` over the
canary coins and the training randomness, a mechanism that really satisfies the hypothesis yields a bound <=
its epsilon.  A bound above the claimed epsilon is therefore statistical evidence of a bug (or of a wrong
privacy analysis); a bound below it proves nothing.

Two bounds are provided:

* :func:`one_run_epsilon_lower_bound` -- the (epsilon, delta) bound of Steinke et al. (binomial tail plus the
  2*m*delta term).  Valid for any (epsilon, delta)-DP claim, in particular Poisson-subsampled DP-SGD.  This is
  the default gate.
* :func:`fdp_epsilon_lower_bound` -- the f-DP bound of Mahloujifar, Melis & Chaudhuri ("Auditing
  f-Differential Privacy in One Run", ICML 2025, Theorem 3.1 / Algorithm 3 / Theorem 3.2) with the Gaussian-DP
  family of trade-off curves.  Stronger, but only a valid test when the *claimed* curve is mu-GDP, i.e.
  full-batch (q = 1) DP-SGD observed through all iterates (mu = sqrt(T)/sigma).  It must NOT be used for
  Poisson-subsampled runs (q < 1): their trade-off curve is not Gaussian and a GDP curve matched at the target
  delta is not a valid substitute.  The generic :func:`fdp_hypothesis_rejected` accepts any inverse blow-up
  function, e.g. one built from an accountant's exact privacy profile.

:func:`best_guess_bound` runs the game on a vector of scores, :func:`gaussian_epsilon_estimate` is the
parametric Gaussian-fit *estimate* (diagnostic only, not a rigorous bound), and
:func:`simulate_gaussian_canary_scores` / :func:`simulate_dpsgd_canary_scores` produce idealized white-box
scores for tests and for pre-registering k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import optimize
from scipy.special import gammaln, log_expit, log_ndtr, ndtr, ndtri

__all__ = [
    "steinke_p_value",
    "one_run_epsilon_lower_bound",
    "fdp_hypothesis_rejected",
    "gdp_hypothesis_rejected",
    "gdp_mu_lower_bound",
    "fdp_epsilon_lower_bound",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu_for_epsilon",
    "default_guess_counts",
    "count_correct_guesses",
    "best_guess_bound",
    "gaussian_epsilon_estimate",
    "simulate_gaussian_canary_scores",
    "simulate_dpsgd_canary_scores",
]

_EPS_MAX = 50.0  # search range for epsilon; far above any achievable one-run bound
_MU_MAX = 30.0  # search range for the GDP parameter mu


# ----------------------------------------------------------------------------------------------------------
# argument checks


def _check_counts(num_guesses: int, num_correct: int, num_canaries: int) -> tuple[int, int, int]:
    r, v, m = int(num_guesses), int(num_correct), int(num_canaries)
    if (r, v, m) != (num_guesses, num_correct, num_canaries):
        raise TypeError("num_guesses, num_correct and num_canaries must be integers")
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= num_correct <= num_guesses <= num_canaries, got v={v}, r={r}, m={m}")
    if m < 1:
        raise ValueError("num_canaries must be >= 1")
    return r, v, m


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return 1.0 - float(confidence)


def _check_delta(delta: float) -> float:
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    return float(delta)


# ----------------------------------------------------------------------------------------------------------
# Steinke, Nasr & Jagielski (2023): the (epsilon, delta) bound


def _binom_pmf(r: int, eps: float) -> np.ndarray:
    """pmf of Binomial(r, e^eps / (1 + e^eps)) on 0..r, computed in log space (no overflow for large eps)."""
    j = np.arange(r + 1, dtype=np.float64)
    log_q, log_1mq = log_expit(eps), log_expit(-eps)
    logpmf = gammaln(r + 1.0) - gammaln(j + 1.0) - gammaln(r - j + 1.0) + j * log_q + (r - j) * log_1mq
    return np.exp(logpmf)


def _binom_upper_tail(r: int, v: int, eps: float) -> float:
    """f(v) = P[Binomial(r, e^eps/(1+e^eps)) >= v], summed from pmf terms (no 1 - cdf cancellation)."""
    if v <= 0:
        return 1.0
    return float(np.sum(_binom_pmf(r, eps)[v:]))


def steinke_p_value(
    num_guesses: int, num_correct: int, num_canaries: int, epsilon: float, delta: float
) -> float:
    """p-value of observing >= ``num_correct`` correct guesses under the hypothesis "(epsilon, delta)-DP".

    Implements the right-hand side of the main (epsilon, delta) theorem of Steinke, Nasr & Jagielski (2023)
    (the quantity evaluated by the paper's Appendix D reference code; docs/audit.md §4): if the algorithm is
    (epsilon, delta)-DP, m canaries are included by independent fair coins, r = k+ + k- guesses are made
    (abstaining otherwise) and W is the number of correct guesses, then for all v

        P[W >= v] <= f(v) + 2 m delta * max_{i in {1..v}} (f(v - i) - f(v)) / i,
        f(v) := P[Binomial(r, e^eps / (e^eps + 1)) >= v].

    ``f(v - i) - f(v) = P[v - i <= Binomial <= v - 1]`` is built from pmf terms so nothing is a difference of
    tails. The result is capped at 1.
    """
    r, v, m = _check_counts(num_guesses, num_correct, num_canaries)
    delta = _check_delta(delta)
    if epsilon < 0:
        raise ValueError("epsilon must be >= 0")
    if v == 0:
        return 1.0
    pmf = _binom_pmf(r, float(epsilon))
    tail = float(np.sum(pmf[v:]))
    if delta == 0.0:
        return min(tail, 1.0)
    below = np.cumsum(pmf[v - 1 :: -1])  # P[v-i <= W' <= v-1] for i = 1..v
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def one_run_epsilon_lower_bound(
    num_guesses: int,
    num_correct: int,
    num_canaries: int,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> float:
    """Empirical epsilon lower bound from one run (Steinke, Nasr & Jagielski 2023, main (epsilon, delta)
    theorem).

    Statement implemented (docs/audit.md §4): for an (epsilon, delta)-DP algorithm audited with m =
    ``num_canaries`` canaries, each included independently with probability 1/2, r = ``num_guesses`` = k+ + k-
    guesses (abstention allowed) and W correct guesses,

        P[W >= v] <= f(v) + 2 m delta * max_{i=1..v} (f(v - i) - f(v)) / i,
        f(v) = P[Binomial(r, e^eps/(e^eps+1)) >= v]

    (see :func:`steinke_p_value`).  With beta = 1 - ``confidence``, the returned value is

        eps_lb = sup{ eps >= 0 : p_value(eps) < beta }   (0.0 if the set is empty),

    i.e. the largest epsilon whose (epsilon, delta)-DP hypothesis is rejected at level beta.  Validity: an
    (eps_true, delta)-DP mechanism is also (eps', delta)-DP for every eps' >= eps_true, so each eps' >=
    eps_true is rejected with probability <= beta, hence P[eps_lb > eps_true] <= beta (this holds for the sup
    even if the p-value were not monotone in epsilon).  The returned value is always a point where the p-value
    is < beta (to 1e-9 in epsilon).

    ``delta`` must be the delta of the claim being tested; keep 2 * m * delta << 1 (the 2 m delta term
    saturates the bound otherwise).  With delta = 0 and all r = m guesses correct the bound reaches its
    ceiling -log(beta^(-1/m) - 1) ~ log(m / log(1/beta)) (5.81 at m = 1000, 95%).
    """
    r, v, m = _check_counts(num_guesses, num_correct, num_canaries)
    delta = _check_delta(delta)
    beta = _check_confidence(confidence)
    if v == 0:
        return 0.0

    def rejected(eps: float) -> bool:
        return steinke_p_value(r, v, m, eps, delta) < beta

    # The binomial tail f(v) alone is increasing in eps and is a lower bound on the p-value, so nothing above
    # the root of f(v) = beta can be rejected: that root bounds the search.
    def tail_minus_beta(eps: float) -> float:
        return _binom_upper_tail(r, v, eps) - beta

    if tail_minus_beta(0.0) >= 0.0:
        return 0.0
    if tail_minus_beta(_EPS_MAX) < 0.0:  # not reachable for beta > 0 unless v > r, kept for safety
        eps_hi = _EPS_MAX
    else:
        eps_hi = optimize.brentq(tail_minus_beta, 0.0, _EPS_MAX, xtol=1e-12)
    if rejected(eps_hi):
        return float(eps_hi)
    # Scan down from eps_hi for the largest rejected grid point, then bisect up to the next grid point.  (In
    # practice the p-value is monotone and the first step already succeeds; the scan guards against a
    # non-monotone 2 m delta term without ever returning an epsilon that is not rejected.)
    step = 0.02
    hi = eps_hi
    lo = max(hi - step, 0.0)
    while not rejected(lo):
        if lo == 0.0:
            return 0.0
        hi, lo = lo, max(lo - step, 0.0)
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return float(lo)


# ----------------------------------------------------------------------------------------------------------
# Gaussian differential privacy helpers (Dong, Roth & Su)


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-GDP: Phi(-eps/mu + mu/2) - e^eps * Phi(-eps/mu - mu/2) (Dong, Roth & Su, Cor.
    2.13)."""
    if mu < 0 or epsilon < 0:
        raise ValueError("mu and epsilon must be >= 0")
    if mu == 0.0:
        return 0.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    return max(float(ndtr(a) - math.exp(epsilon + log_ndtr(b))), 0.0)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 such that mu-GDP implies (epsilon, delta)-DP (inverts :func:`gdp_delta`)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(
            "gdp_epsilon needs 0 < delta < 1 (mu-GDP with mu > 0 is not (eps, 0)-DP for finite eps)"
        )
    if mu < 0:
        raise ValueError("mu must be >= 0")
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    # delta(eps) <= Phi(-eps/mu + mu/2), so eps_hi = mu^2/2 + mu * Phi^{-1}(1 - delta) has delta(eps_hi) <=
    # delta.
    eps_hi = mu * mu / 2.0 - mu * float(ndtri(delta)) + 1.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, eps_hi, xtol=1e-12))


def gdp_mu_for_epsilon(epsilon: float, delta: float) -> float:
    """The mu whose mu-GDP curve passes through (epsilon, delta); e.g. (1, 1e-5) -> 0.26805.

    For full-batch DP-SGD with T steps, mu = sqrt(T) / sigma (docs/audit.md §3), so sigma = sqrt(T) / mu.
    """
    if not 0.0 < delta < 1.0 or epsilon < 0:
        raise ValueError("need epsilon >= 0 and 0 < delta < 1")
    hi = 1.0
    while gdp_delta(hi, epsilon) < delta:
        hi *= 2.0
    return float(optimize.brentq(lambda mu: gdp_delta(mu, epsilon) - delta, 0.0, hi, xtol=1e-14))


# ----------------------------------------------------------------------------------------------------------
# Mahloujifar, Melis & Chaudhuri (ICML 2025): the f-DP bound


def fdp_hypothesis_rejected(
    fbar_inverse: Callable[[float], float],
    num_guesses: int,
    num_correct: int,
    num_canaries: int,
    tau: float = 0.05,
    alphabet_size: int = 2,
) -> bool:
    """Algorithm 3 of Mahloujifar, Melis & Chaudhuri: True iff "M is f-DP" is rejected at level ``tau``.

    ``fbar_inverse`` is the inverse of the blow-up function f_bar(x) = 1 - f(x) of the hypothesised trade-off
    curve f. By their Theorem 3.2, if this returns True then for every f-DP mechanism and every adversary
    making at most c' = ``num_guesses`` guesses on m = ``num_canaries`` canaries (secrets uniform over an
    alphabet of size k = ``alphabet_size``; k = 2 is the membership game), P[#correct >= c = ``num_correct``]
    <= tau.

    The recursion (with the max of the paper's appendix code) follows Theorem 3.1 applied to the index sets
    {i+1, ..., c'}: r[i] tracks sum_{j >= i} (j/m) p_j and h[i] tracks sum_{j >= i} ((c'-j)/m) p_j of the
    least massive distribution p that puts probability tau on >= c correct; the hypothesis is rejected when
    that distribution needs total mass r[0] + h[0] >= c'/m, i.e. probability >= 1.
    """
    c_prime, c, m = _check_counts(num_guesses, num_correct, num_canaries)
    if not 0.0 < tau < 1.0:
        raise ValueError("tau must be in (0, 1)")
    if c == 0:
        return False
    r = tau * c / m
    h = tau * (c_prime - c) / m
    for i in range(c - 1, -1, -1):
        h_new = max(h, (alphabet_size - 1) * float(fbar_inverse(min(r, 1.0))))
        if h_new == h:  # nothing changes any more: r and h stay fixed for all smaller i
            break
        r += i / (c_prime - i) * (h_new - h)
        h = h_new
    return r + h >= c_prime / m


def gdp_hypothesis_rejected(
    mu: float, num_guesses: int, num_correct: int, num_canaries: int, tau: float = 0.05
) -> bool:
    """Algorithm 3 (k = 2) for the mu-GDP curve, whose inverse blow-up is f_bar^{-1}(y) = Phi(Phi^{-1}(y) -
    mu)."""
    return fdp_hypothesis_rejected(
        lambda y: float(ndtr(ndtri(y) - mu)), num_guesses, num_correct, num_canaries, tau=tau
    )


def gdp_mu_lower_bound(
    num_guesses: int, num_correct: int, num_canaries: int, confidence: float = 0.95
) -> float:
    """Largest mu such that mu-GDP is rejected by Algorithm 3 (Mahloujifar et al.) at level 1 - confidence.

    Rejection is monotone in mu (f_bar^{-1} decreases in mu, so a larger mu makes the recursion smaller), and
    a mu-GDP mechanism is mu'-GDP for every mu' >= mu, so P[mu_lb > mu_true] <= 1 - confidence.  Bisection to
    1e-10.
    """
    _check_counts(num_guesses, num_correct, num_canaries)
    tau = _check_confidence(confidence)
    if not gdp_hypothesis_rejected(1e-12, num_guesses, num_correct, num_canaries, tau):
        return 0.0
    lo, hi = 0.0, _MU_MAX
    if gdp_hypothesis_rejected(hi, num_guesses, num_correct, num_canaries, tau):
        return hi
    while hi - lo > 1e-10:
        mid = 0.5 * (lo + hi)
        if gdp_hypothesis_rejected(mid, num_guesses, num_correct, num_canaries, tau):
            lo = mid
        else:
            hi = mid
    return float(lo)


def fdp_epsilon_lower_bound(
    num_guesses: int,
    num_correct: int,
    num_canaries: int,
    delta: float = 1e-5,
    confidence: float = 0.95,
) -> float:
    """Empirical epsilon lower bound from the f-DP one-run audit with the Gaussian-DP family.

    Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML 2025): Theorem 3.1
    (bound on the distribution of the number of correct guesses of an adversary with at most c' guesses
    against an f-DP mechanism), Algorithm 3 (decides whether P[>= c correct] <= tau for every f-DP mechanism)
    and Theorem 3.2 (its soundness), applied to the ordered family of mu-GDP curves (their Def. 2.7 / section
    3.1 empirical privacy). Returns eps_GDP(mu_lb, delta), where mu_lb is :func:`gdp_mu_lower_bound`, the
    boundary between rejected and non-rejected GDP hypotheses, converted to epsilon at ``delta`` with the
    mu-GDP privacy profile.

    Valid ONLY when the claimed trade-off curve is mu-GDP (docs/audit.md §6.3 and §11): full-batch (q = 1)
    DP-SGD / DIFF2-GD with Gaussian noise, all iterates observed (mu = sqrt(T)/sigma).  Then "eps_lb >
    eps_claimed" at the claim's delta is equivalent to "mu_lb > mu_claimed" and the test has level 1 -
    ``confidence``.  For Poisson-subsampled runs use :func:`one_run_epsilon_lower_bound` (or
    :func:`fdp_hypothesis_rejected` with the exact subsampled-Gaussian curve).  ``delta`` must be > 0 (mu-GDP
    is not (eps, 0)-DP for finite eps).
    """
    delta = _check_delta(delta)
    mu_lb = gdp_mu_lower_bound(num_guesses, num_correct, num_canaries, confidence=confidence)
    if mu_lb == 0.0:
        return 0.0
    return gdp_epsilon(mu_lb, delta)


# ----------------------------------------------------------------------------------------------------------
# running the game on a score vector


def default_guess_counts(num_canaries: int) -> tuple[int, ...]:
    """Default grid of k (k+ = k- = k): m/40, m/20, m/10 -> (25, 50, 100) for m = 1000.

    docs/audit.md §7: for m = 1000 and claimed eps <= 2 the pre-registered choice is k = 50, with idealized
    simulations putting the best k between 25 and 150; the grid brackets that and costs a Bonferroni factor of
    only 3.
    """
    m = int(num_canaries)
    if m < 2:
        raise ValueError("the symmetric default grid needs at least 2 canaries")
    return tuple(sorted({min(max(1, round(m / d)), m // 2) for d in (40, 20, 10)}))


def _as_membership(included: np.ndarray) -> np.ndarray:
    s = np.asarray(included)
    if s.dtype == bool:
        return s
    uniq = set(np.unique(s).tolist())
    if uniq <= {0, 1}:
        return s.astype(bool)
    if uniq <= {-1, 1}:
        return s > 0
    raise ValueError("included must be boolean, 0/1 or -1/+1")


def count_correct_guesses(scores: np.ndarray, included: np.ndarray, k_pos: int, k_neg: int) -> int:
    """Number of correct guesses when guessing IN on the ``k_pos`` largest and OUT on the ``k_neg`` smallest
    scores.

    Steinke et al. Algorithm 1, step 7.  Ties are broken by canary index (a stable sort), which depends on the
    scores and the fixed indexing only, never on the membership coins, so the game stays valid.
    """
    y = np.asarray(scores, dtype=np.float64).ravel()
    s = _as_membership(included).ravel()
    if y.shape != s.shape:
        raise ValueError(f"scores and included must have the same length, got {y.shape} and {s.shape}")
    m = y.size
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise ValueError(f"need k_pos, k_neg >= 0 and k_pos + k_neg <= m (= {m}), got {k_pos}, {k_neg}")
    if not np.all(np.isfinite(y)):
        raise ValueError("scores must be finite")
    order = np.argsort(y, kind="stable")
    top = order[m - k_pos :] if k_pos > 0 else order[:0]  # order[m - 0:] is empty, unlike order[-0:]
    bottom = order[:k_neg]
    return int(np.count_nonzero(s[top]) + np.count_nonzero(~s[bottom]))


def best_guess_bound(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float = 0.0,
    confidence: float = 0.95,
    guess_counts: Sequence[int | tuple[int, int]] | None = None,
    method: str = "steinke",
) -> dict[str, Any]:
    """Run the one-run guessing game on canary scores and return the empirical epsilon lower bound.

    Parameters
    ----------
    scores:
        One score per canary, higher = more likely included (e.g. the white-box score sum_t <g~_t, u_i>).
    included:
        The membership coins S (bool, 0/1 or -1/+1), drawn independently with probability 1/2 each.
    delta:
        delta of the claim under test (set it explicitly; keep 2 * m * delta << 1).
    confidence:
        Overall confidence of the returned bound (0.95 default; docs/audit.md §7 recommends 0.99 in CI).
    guess_counts:
        Grid K of guess counts.  An int k means k+ = k- = k (Steinke et al. Algorithm 1: +1 on the k+ largest
        scores, -1 on the k- smallest, abstain elsewhere); a pair (k+, k-) allows asymmetric guessing (useful
        when q*T is small and many IN canaries were never sampled).  Default :func:`default_guess_counts` (25,
        50, 100 for m = 1000).  Pass a single pre-registered k (e.g. ``[50]``) to pay no multiplicity
        correction.
    method:
        ``"steinke"`` (default, :func:`one_run_epsilon_lower_bound`, valid for any (eps, delta) claim) or
        ``"fdp_gdp"`` (:func:`fdp_epsilon_lower_bound`, valid only for full-batch Gaussian claims, needs delta
        > 0).

    Multiplicity (docs/audit.md §7): choosing k after looking at the scores of the same run
    invalidates the confidence level.  Every k in the grid is therefore tested at level (1 - confidence)/|K|
    (Bonferroni), and the maximum over the grid is returned: by the union bound, P[max_k eps_lb(k) > eps_true]
    <= sum_k (1 - confidence)/|K| = 1 - confidence.  With a single k this is the plain, pre-registered bound.

    Returns
    -------
    dict with ``epsilon_lower_bound`` (max over K), ``num_guesses`` / ``num_correct`` / ``k_pos`` / ``k_neg``
    at the maximising k, ``num_canaries``, ``num_included``, ``delta``, ``confidence``, ``per_k_confidence``,
    ``bonferroni_factor``, ``method`` and ``per_k`` (list of dicts with k_pos, k_neg, num_guesses,
    num_correct, epsilon_lower_bound for every k in the grid; ties resolved towards the first grid entry).
    """
    s = _as_membership(included).ravel()
    y = np.asarray(scores, dtype=np.float64).ravel()
    m = int(y.size)
    if m == 0:
        raise ValueError("no canaries")
    delta = _check_delta(delta)
    beta = _check_confidence(confidence)
    if method not in ("steinke", "fdp_gdp"):
        raise ValueError(f"method must be 'steinke' or 'fdp_gdp', got {method!r}")
    if method == "fdp_gdp" and delta <= 0.0:
        raise ValueError("method='fdp_gdp' needs delta > 0")
    grid = default_guess_counts(m) if guess_counts is None else tuple(guess_counts)
    if not grid:
        raise ValueError("guess_counts must not be empty")
    pairs: list[tuple[int, int]] = []
    for g in grid:
        kp, kn = (int(g), int(g)) if np.ndim(g) == 0 else (int(g[0]), int(g[1]))  # type: ignore[index]
        if kp + kn == 0:
            raise ValueError("each guess count must make at least one guess")
        pairs.append((kp, kn))
    factor = len(pairs)
    per_k_confidence = 1.0 - beta / factor
    bound_fn = one_run_epsilon_lower_bound if method == "steinke" else fdp_epsilon_lower_bound

    per_k = []
    for kp, kn in pairs:
        v = count_correct_guesses(y, s, kp, kn)
        r = kp + kn
        eps = bound_fn(r, v, m, delta=delta, confidence=per_k_confidence)
        per_k.append(dict(k_pos=kp, k_neg=kn, num_guesses=r, num_correct=v, epsilon_lower_bound=eps))
    best = max(per_k, key=lambda d: d["epsilon_lower_bound"])  # first maximiser on ties
    return dict(
        epsilon_lower_bound=best["epsilon_lower_bound"],
        num_guesses=best["num_guesses"],
        num_correct=best["num_correct"],
        k_pos=best["k_pos"],
        k_neg=best["k_neg"],
        num_canaries=m,
        num_included=int(np.count_nonzero(s)),
        delta=delta,
        confidence=float(confidence),
        per_k_confidence=per_k_confidence,
        bonferroni_factor=factor,
        method=method,
        per_k=per_k,
    )


# ----------------------------------------------------------------------------------------------------------
# Gaussian-fit estimate (diagnostic only)


def gaussian_epsilon_estimate(
    scores: np.ndarray, included: np.ndarray, delta: float = 1e-5, confidence: float = 0.99
) -> dict[str, float]:
    """Parametric Gaussian-fit *estimate* after Agrawal et al. ("Let's Ask Gauss", 2026); see docs/audit.md
    §10.

    NOT a rigorous bound: it assumes IN ~ N(mu, s^2) and OUT ~ N(0, s^2) (exact only for the full-batch audit
    probe). mu_hat = (mean_IN - mean_OUT) / pooled sd, SE = sqrt(1/n_IN + 1/n_OUT + mu_hat^2 / (2 (n_IN +
    n_OUT - 2))), mu_lb = mu_hat - z_confidence * SE, eps = eps_GDP(max(mu_lb, 0), delta).  Its false-alarm
    rate is only approximately 1 - confidence, so use it as a diagnostic or a secondary gate at 99% (the
    default here).
    """
    s = _as_membership(included).ravel()
    y = np.asarray(scores, dtype=np.float64).ravel()
    a, b = y[s], y[~s]
    n_in, n_out = a.size, b.size
    if n_in < 2 or n_out < 2:
        raise ValueError("need at least two IN and two OUT canaries")
    pooled = math.sqrt(((n_in - 1) * a.var(ddof=1) + (n_out - 1) * b.var(ddof=1)) / (n_in + n_out - 2))
    mu_hat = (a.mean() - b.mean()) / pooled
    se = math.sqrt(1.0 / n_in + 1.0 / n_out + mu_hat**2 / (2.0 * (n_in + n_out - 2)))
    z = float(ndtri(confidence))
    mu_lb = max(mu_hat - z * se, 0.0)
    return dict(
        mu_hat=float(mu_hat),
        mu_lower=float(mu_lb),
        epsilon_estimate=gdp_epsilon(mu_lb, delta) if mu_lb > 0 else 0.0,
        epsilon_point=gdp_epsilon(max(mu_hat, 0.0), delta) if mu_hat > 0 else 0.0,
    )


# ----------------------------------------------------------------------------------------------------------
# idealized simulations (tests, pre-registration of k)


def simulate_gaussian_canary_scores(
    num_canaries: int, mu: float, rng: np.random.Generator, include_prob: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Idealized full-batch white-box scores: IN ~ N(mu, 1), OUT ~ N(0, 1), membership ~
    Bernoulli(include_prob).

    This is the normalized Dirac-canary score sum_t <g~_t, u_i> / (sigma C sqrt(T)) of full-batch DP-SGD with
    clip C, noise sigma*C and T steps (docs/audit.md §9, assumption A4): mu = sqrt(T)/sigma * (signal/C).
    For a claim (eps, delta) use ``mu = gdp_mu_for_epsilon(eps, delta)``; a noise multiplier k times too small
    gives k * mu, a k-fold sensitivity bug gives k * mu as well.  Returns (scores, included) with included
    boolean.
    """
    included = rng.random(num_canaries) < include_prob
    scores = rng.standard_normal(num_canaries) + mu * included
    return scores, included


def simulate_dpsgd_canary_scores(
    num_canaries: int,
    noise_multiplier: float,
    steps: int,
    sampling_rate: float,
    rng: np.random.Generator,
    signal: float = 1.0,
    include_prob: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Idealized Poisson-subsampled DP-SGD white-box sum scores in units of the clip norm C (docs/audit.md
    §9).

    IN canary: signal * Binomial(steps, sampling_rate) + N(0, steps * noise_multiplier^2); OUT canary: the
    noise only.  ``signal`` = 1 for a correctly clipped canary, 4 for lambda = 4C with the clip missing;
    divide ``noise_multiplier`` by 7 to simulate the noise/7 bug.  sampling_rate = 1 gives the full-batch
    case.
    """
    included = rng.random(num_canaries) < include_prob
    hits = rng.binomial(steps, sampling_rate, size=num_canaries) * included
    scores = signal * hits + noise_multiplier * math.sqrt(steps) * rng.standard_normal(num_canaries)
    return scores.astype(np.float64), included
