"""Tests of the one-run audit statistics (hf_dpfilter.audit.bounds).

Reference numbers are those of docs/audit.md (and the papers it cites); each test cites the section it
reproduces.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from hf_dpfilter.audit import (
    best_guess_bound,
    count_correct_guesses,
    default_guess_counts,
    fdp_epsilon_lower_bound,
    gaussian_epsilon_estimate,
    gdp_delta,
    gdp_epsilon,
    gdp_hypothesis_rejected,
    gdp_mu_for_epsilon,
    gdp_mu_lower_bound,
    one_run_epsilon_lower_bound,
    simulate_dpsgd_canary_scores,
    simulate_gaussian_canary_scores,
    steinke_p_value,
)

DELTA = 1e-5
MU_EPS1 = gdp_mu_for_epsilon(1.0, DELTA)  # 0.26805 (docs/audit.md §3)


def _close(x: float, expected: float, rel: float = 0.02, abs_: float = 0.01) -> bool:
    return abs(x - expected) <= max(rel * abs(expected), abs_)


# ---------------------------------------------------------------------------------------------------------------------
# Steinke, Nasr & Jagielski (epsilon, delta) bound


@pytest.mark.parametrize(
    ("m", "r", "v", "delta", "expected"),
    [
        # printed in Steinke et al. 2023, Appendix D (docs/audit.md §4)
        (1000, 100, 75, 1e-4, 0.673),
        # printed in Steinke et al. 2023, arXiv v1 section 7 (docs/audit.md §4)
        (10**5, 1510, 1439, 1e-5, 2.675),
        # pins of this implementation (docs/audit.md §4)
        (1000, 100, 99, 1e-5, 3.003),
        (1000, 100, 100, 1e-5, 3.465),
        (1000, 1000, 1000, 0.0, 5.809),
        # docs/audit.md §5: sensitivity to delta at m = 1000, r = 100
        (1000, 100, 81, 0.0, 1.01),
        (1000, 100, 99, 1e-4, 2.84),
        (1000, 100, 100, 2.3e-4, 2.73),
        (1000, 100, 100, 1e-3, 0.81),
        # docs/audit.md §9.1: Steinke bounds at v = 97 / 98 (k+ = k- = 50)
        (1000, 100, 97, 1e-5, 2.49),
        (1000, 100, 98, 1e-5, 2.71),
    ],
)
def test_steinke_reference_values(m, r, v, delta, expected):
    eps = one_run_epsilon_lower_bound(r, v, m, delta=delta, confidence=0.95)
    assert _close(eps, expected), (eps, expected)


def test_steinke_returned_epsilon_is_rejected_and_tight():
    r, v, m = 100, 75, 1000
    eps = one_run_epsilon_lower_bound(r, v, m, delta=1e-4)
    assert steinke_p_value(r, v, m, eps, 1e-4) < 0.05
    assert steinke_p_value(r, v, m, eps + 1e-6, 1e-4) >= 0.05


def test_steinke_p_value_matches_scipy_binomial_tail():
    for r, v, eps in [(100, 75, 0.5), (1000, 900, 2.0), (1510, 1439, 2.6), (50, 1, 0.0)]:
        q = math.exp(eps) / (1 + math.exp(eps))
        assert steinke_p_value(r, v, 10**5, eps, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, q), rel=1e-9)
    assert steinke_p_value(100, 0, 1000, 3.0, 1e-5) == 1.0
    # the 2 m delta term only adds
    assert steinke_p_value(100, 80, 1000, 1.0, 1e-4) > steinke_p_value(100, 80, 1000, 1.0, 0.0)


def test_steinke_p_value_increases_with_epsilon():
    eps_grid = np.linspace(0.0, 8.0, 81)
    for r, v, m, delta in [(100, 75, 1000, 1e-4), (100, 100, 1000, 1e-3), (1000, 700, 10**4, 1e-5)]:
        p = np.array([steinke_p_value(r, v, m, e, delta) for e in eps_grid])
        assert np.all(np.diff(p) >= -1e-12)  # pmf sums round near 1


@pytest.mark.parametrize("m", [100, 200, 500, 1000, 2000, 5000, 10000])
def test_ceiling_delta_zero_closed_form(m):
    # docs/audit.md §5: all r = m guesses correct, delta = 0: eps_max = -ln(beta^(-1/m) - 1)
    expected = -math.log(0.05 ** (-1.0 / m) - 1.0)
    assert one_run_epsilon_lower_bound(m, m, m, delta=0.0) == pytest.approx(expected, abs=1e-6)


def _steinke_ceiling(m: int, delta: float) -> float:
    rs = {m, m // 2, m // 4, m // 10, max(m // 100, 1)}  # docs/audit.md §5: best of these r
    return max(one_run_epsilon_lower_bound(r, r, m, delta=delta) for r in rs)


def test_ceiling_table_and_monotone_in_m():
    # docs/audit.md §5 table (95%): delta = 1e-5 column
    table = {100: 3.49, 500: 5.10, 1000: 5.78, 5000: 7.28, 10000: 7.83}
    ceilings = []
    for m, expected in table.items():
        c = _steinke_ceiling(m, DELTA)
        assert _close(c, expected), (m, c, expected)
        ceilings.append(c)
    assert all(b > a for a, b in zip(ceilings, ceilings[1:]))
    # delta = 1e-6 column, and the m = 10^5 saturation through the 2 m delta term (10.14 vs 8.13)
    assert _close(_steinke_ceiling(10**5, 1e-6), 10.14)
    assert _close(_steinke_ceiling(10**5, 1e-5), 8.13)
    # all-correct bound increases with m at fixed r = m, delta = 0, and a higher confidence costs
    vals = [one_run_epsilon_lower_bound(m, m, m) for m in (10, 100, 1000, 10000)]
    assert all(b > a for a, b in zip(vals, vals[1:]))
    assert one_run_epsilon_lower_bound(1000, 1000, 1000, confidence=0.99) < vals[2]


def test_random_guessing_gives_zero():
    # 50% correct is what a coin flip achieves: no epsilon > 0 can be rejected
    for r, m in [(100, 1000), (1000, 1000), (200, 10**4)]:
        assert one_run_epsilon_lower_bound(r, r // 2, m, delta=DELTA) == 0.0
        assert fdp_epsilon_lower_bound(r, r // 2, m, delta=DELTA) == 0.0
    assert one_run_epsilon_lower_bound(100, 0, 1000) == 0.0
    # slightly better than chance is still ~0
    assert one_run_epsilon_lower_bound(100, 58, 1000, delta=DELTA) < 0.05


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        one_run_epsilon_lower_bound(100, 101, 1000)
    with pytest.raises(ValueError):
        one_run_epsilon_lower_bound(1001, 10, 1000)
    with pytest.raises(ValueError):
        one_run_epsilon_lower_bound(100, 50, 1000, confidence=1.0)
    with pytest.raises(ValueError):
        one_run_epsilon_lower_bound(100, 50, 1000, delta=-1e-5)
    with pytest.raises(ValueError):
        fdp_epsilon_lower_bound(100, 90, 1000, delta=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# Gaussian DP conversions and the f-DP bound of Mahloujifar, Melis & Chaudhuri


def test_gdp_conversions():
    # docs/audit.md §3: at delta = 1e-5, eps = 1 <=> mu = 0.26805, eps = 4 <=> 0.92493, eps = 8 <=> 1.66603,
    # mu = 1 <=> eps = 4.3772; T = 100 full batch gives sigma = sqrt(T)/mu = 37.31 / 10.81 / 6.002
    assert MU_EPS1 == pytest.approx(0.26805, abs=2e-5)
    assert gdp_mu_for_epsilon(4.0, DELTA) == pytest.approx(0.92493, abs=2e-5)
    assert gdp_mu_for_epsilon(8.0, DELTA) == pytest.approx(1.66603, abs=2e-5)
    assert gdp_epsilon(1.0, DELTA) == pytest.approx(4.3772, abs=2e-4)
    assert 10.0 / MU_EPS1 == pytest.approx(37.31, abs=0.01)
    assert 10.0 / gdp_mu_for_epsilon(4.0, DELTA) == pytest.approx(10.81, abs=0.01)
    assert 10.0 / gdp_mu_for_epsilon(8.0, DELTA) == pytest.approx(6.002, abs=0.002)
    assert gdp_delta(MU_EPS1, 1.0) == pytest.approx(DELTA, rel=1e-8)
    assert gdp_epsilon(0.0, DELTA) == 0.0


@pytest.mark.parametrize(
    ("m", "c_prime", "c", "expected"),
    [
        # docs/audit.md §6.2: pins of this implementation of the f-DP bound
        (1000, 100, 99, 4.727),
        (1000, 100, 100, 5.549),
        (10**5, 1500, 1429, 3.299),
        # docs/audit.md §9.1: f-DP GDP bounds at v = 97 / 98
        (1000, 100, 97, 3.86),
        (1000, 100, 98, 4.23),
    ],
)
def test_fdp_reference_values(m, c_prime, c, expected):
    eps = fdp_epsilon_lower_bound(c_prime, c, m, delta=DELTA)
    assert _close(eps, expected), (eps, expected)


def test_fdp_ceiling_and_dominance():
    # docs/audit.md §5 table, f-DP column (delta = 1e-5): m = 100 -> 8.22, m = 1000 -> 12.33
    for m, expected in [(100, 8.22), (1000, 12.33)]:
        rs = {m, m // 2, m // 4, m // 10, max(m // 100, 1)}
        c = max(fdp_epsilon_lower_bound(r, r, m, delta=DELTA) for r in rs)
        assert _close(c, expected), (m, c, expected)
    # docs/audit.md §6.2: (10^5, 1500, 1429) gives 3.30 with f-DP but only 2.67 with the (eps, delta) bound
    assert _close(one_run_epsilon_lower_bound(1500, 1429, 10**5, delta=DELTA), 2.67)
    # rejection is monotone in mu, and mu_lb is the boundary
    mu_lb = gdp_mu_lower_bound(100, 90, 1000)
    assert gdp_hypothesis_rejected(mu_lb, 100, 90, 1000)
    assert not gdp_hypothesis_rejected(mu_lb + 1e-6, 100, 90, 1000)
    assert gdp_hypothesis_rejected(0.5 * mu_lb, 100, 90, 1000)


# ---------------------------------------------------------------------------------------------------------------------
# the guessing game on scores


def test_count_correct_guesses():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([1, 0, 1, 0, 0, 1])
    assert count_correct_guesses(scores, included, 2, 2) == 1 + 1  # top {5, 4}: 1 IN; bottom {0, 1}: 1 OUT
    assert count_correct_guesses(scores, included.astype(bool), 1, 0) == 1
    assert count_correct_guesses(scores, 2 * included - 1, 0, 1) == 0  # k_pos = 0 must not select everything
    assert count_correct_guesses(scores, included, 3, 3) == 2 + 2


def test_best_guess_bound_single_k_and_bonferroni():
    rng = np.random.default_rng(0)
    scores, included = simulate_gaussian_canary_scores(1000, 7 * MU_EPS1, rng)
    single = best_guess_bound(scores, included, delta=DELTA, guess_counts=[50])
    v = count_correct_guesses(scores, included, 50, 50)
    assert single["num_correct"] == v and single["num_guesses"] == 100 and single["bonferroni_factor"] == 1
    assert single["epsilon_lower_bound"] == one_run_epsilon_lower_bound(100, v, 1000, delta=DELTA)

    grid = best_guess_bound(scores, included, delta=DELTA)
    assert default_guess_counts(1000) == (25, 50, 100)
    assert grid["bonferroni_factor"] == 3 and grid["per_k_confidence"] == pytest.approx(1 - 0.05 / 3)
    assert grid["epsilon_lower_bound"] == max(d["epsilon_lower_bound"] for d in grid["per_k"])
    for d in grid["per_k"]:  # every grid point is tested at the Bonferroni level
        ref = one_run_epsilon_lower_bound(d["num_guesses"], d["num_correct"], 1000, DELTA, 1 - 0.05 / 3)
        assert d["epsilon_lower_bound"] == ref
    # the k = 50 entry under Bonferroni is weaker than the pre-registered k = 50
    k50 = next(d for d in grid["per_k"] if d["k_pos"] == 50)
    assert k50["epsilon_lower_bound"] < single["epsilon_lower_bound"]

    asym = best_guess_bound(scores, included, delta=DELTA, guess_counts=[(80, 20)], method="fdp_gdp")
    assert asym["k_pos"] == 80 and asym["k_neg"] == 20 and asym["num_guesses"] == 100
    perfect = best_guess_bound(included.astype(float), included, delta=0.0, guess_counts=[50])
    assert perfect["num_correct"] == 100 and _close(perfect["epsilon_lower_bound"], 3.49)


def _sim_bounds(mu_mult: float, seeds, **kw) -> np.ndarray:
    out = []
    for seed in seeds:
        scores, included = simulate_gaussian_canary_scores(
            1000, mu_mult * MU_EPS1, np.random.default_rng(seed)
        )
        out.append(best_guess_bound(scores, included, delta=DELTA, **kw)["epsilon_lower_bound"])
    return np.array(out)


@pytest.mark.parametrize("kw", [dict(guess_counts=[50]), dict()], ids=["k50", "grid"])
def test_simulated_full_batch_audit_power(kw):
    """docs/audit.md §9: claimed eps = 1 (delta = 1e-5), m = 1000, full batch: mu = 0.268 honest, 7 mu for
    noise/7.

    Expected (400 simulated runs, k = 50): honest median 0.21 (95% quantile 0.56, P[> 1] = 0.003); noise/7
    median 3.00 (5% quantile 2.49); sensitivity x4 median 1.81 (P[> 1] = 1.00).
    """
    seeds = range(20)
    honest = _sim_bounds(1.0, seeds, **kw)
    assert np.sum(honest > 1.0) <= 1  # at most the expected 20 * 5% = 1 exceedance (the true rate is ~0)
    assert np.median(honest) < 0.5
    broken = _sim_bounds(7.0, seeds, **kw)
    assert np.all(broken > 1.0)
    assert 2.5 <= np.median(broken) <= 3.5
    assert np.all(_sim_bounds(4.0, seeds, **kw) > 1.0)  # lambda = 4C with the clip missing


def test_simulated_full_batch_fdp_audit_power():
    # docs/audit.md §9: f-DP expected about 0.3 honest and 4.7 for noise/7 (k = 50)
    seeds = range(20)
    honest = _sim_bounds(1.0, seeds, guess_counts=[50], method="fdp_gdp")
    assert np.sum(honest > 1.0) <= 1
    broken = _sim_bounds(7.0, seeds, guess_counts=[50], method="fdp_gdp")
    assert np.all(broken > 1.0) and np.median(broken) > 3.8


def test_false_alarm_rate_at_the_claim():
    # the idealized honest mechanism is exactly at its claim: the 95% bound may exceed it in at most ~5% of
    # runs
    steinke = _sim_bounds(1.0, range(100, 300), guess_counts=[50])
    assert np.mean(steinke > 1.0) <= 0.05
    # a tight claim at eps = 4 with the f-DP bound (docs/audit.md §9: a few % exceedances at most)
    out = []
    mu4 = gdp_mu_for_epsilon(4.0, DELTA)
    for seed in range(100):
        s, inc = simulate_gaussian_canary_scores(1000, mu4, np.random.default_rng(seed))
        out.append(best_guess_bound(s, inc, delta=DELTA, method="fdp_gdp")["epsilon_lower_bound"])
    assert np.mean(np.array(out) > 4.0) <= 0.06


def test_simulated_poisson_audit_power():
    # docs/audit.md §9.3: q = 0.1, T = 100, sigma = 3.942: honest P[> 1] = 0, noise/7 median 2.71 with P[> 1]
    # = 1
    honest, broken = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        s, inc = simulate_dpsgd_canary_scores(1000, 3.942, 100, 0.1, rng)
        honest.append(best_guess_bound(s, inc, delta=DELTA, guess_counts=[50])["epsilon_lower_bound"])
        s, inc = simulate_dpsgd_canary_scores(1000, 3.942 / 7, 100, 0.1, rng)
        broken.append(best_guess_bound(s, inc, delta=DELTA, guess_counts=[50])["epsilon_lower_bound"])
    assert np.sum(np.array(honest) > 1.0) <= 1
    assert np.all(np.array(broken) > 1.0)


def test_dpsgd_simulation_full_batch_matches_gaussian_model():
    # with q = 1 the sum score divided by sigma sqrt(T) is N(mu [IN], 1) with mu = sqrt(T)/sigma
    rng = np.random.default_rng(1)
    s, inc = simulate_dpsgd_canary_scores(20000, 37.31, 100, 1.0, rng)
    z = s / (37.31 * 10.0)
    assert z[inc].mean() - z[~inc].mean() == pytest.approx(MU_EPS1, abs=0.04)
    assert z[~inc].std() == pytest.approx(1.0, abs=0.03)


def test_gaussian_estimate_is_a_diagnostic():
    # docs/audit.md §10: honest median ~0.6 at 95% (so below 1 at 99%), noise/7 median ~8.5
    rng = np.random.default_rng(3)
    s, inc = simulate_gaussian_canary_scores(1000, MU_EPS1, rng)
    assert gaussian_epsilon_estimate(s, inc, delta=DELTA)["epsilon_estimate"] < 1.0
    s, inc = simulate_gaussian_canary_scores(1000, 7 * MU_EPS1, rng)
    est = gaussian_epsilon_estimate(s, inc, delta=DELTA)
    assert est["epsilon_estimate"] > 5.0 and est["mu_hat"] == pytest.approx(7 * MU_EPS1, abs=0.3)
