"""Tests for hf_dpfilter.accounting.accountant (PRV / RDP / PLD privacy accounting)."""

import json
import math
import time
from types import SimpleNamespace

import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from hf_dpfilter.accounting import accountant as accounting
from hf_dpfilter.accounting.accountant import (
    ACCOUNTANTS,
    PrivacyAccountant,
    compute_epsilon,
    default_delta,
    validate_privacy_parameters,
)
from hf_dpfilter.accounting.calibration import calibrate_noise_multiplier

N_SST2 = 8000
DELTA_8K = N_SST2**-1.1


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of the (non-subsampled) Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm. 8)."""
    mu = 1.0 / sigma

    def delta_of(eps: float) -> float:
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)

    return brentq(lambda e: delta_of(e) - delta, 0.0, 100.0, xtol=1e-12)


# 1. calibration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target_eps, delta, q, steps",
    [(3.0, 1e-5, 0.01, 1000), (8.0, DELTA_8K, 256 / N_SST2, 94)],
)
def test_calibrate_prv_within_one_percent_below_target(target_eps, delta, q, steps):
    sigma = calibrate_noise_multiplier(target_eps, delta, q, steps, accountant="prv")
    eps = compute_epsilon([(sigma, q, steps)], delta, "prv")
    assert target_eps * 0.99 <= eps <= target_eps
    # smallest such sigma: 1 % less noise must overshoot the target
    assert compute_epsilon([(sigma * 0.99, q, steps)], delta, "prv") > target_eps * 0.99


def test_calibrate_rdp_and_pld_and_full_batch():
    for accountant in ("rdp", "pld"):
        sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, accountant=accountant)
        assert 2.97 <= compute_epsilon([(sigma, 0.01, 1000)], 1e-5, accountant) <= 3.0
    # RDP is looser, so it needs more noise for the same target
    assert calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000, "rdp") > calibrate_noise_multiplier(
        3.0, 1e-5, 0.01, 1000, "pld"
    )
    # q = 1 single release agrees with the analytic Gaussian mechanism
    sigma = calibrate_noise_multiplier(0.5, 1e-5, 1.0, 1, "pld")
    assert 0.495 <= analytic_gaussian_epsilon(sigma, 1e-5) <= 0.5 * 1.001


def test_calibrate_with_extra_history():
    spent = [(1.0, 0.01, 500)]
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 500, "prv", extra_history=spent)
    eps = compute_epsilon([*spent, (sigma, 0.01, 500)], 1e-5, "prv")
    assert 2.97 <= eps <= 3.0
    # the already-spent part forces more noise than a fresh 500-step budget
    fresh = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 500, "pld")
    assert sigma > fresh * 1.01
    with pytest.raises(ValueError, match="extra_history alone"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 10, "pld", extra_history=[(0.5, 0.01, 1000)])


# 2./3. cross-checks between accountants ---------------------------------------------------------------------


# Measured (delta, history) -> eps: prv (upper bound) / pld / rdp
#   sigma=1.0, q=0.01, T=1000, delta=1e-5:       1.8339 / 1.8289 / 2.1014  (rdp/prv 1.146)
#   sigma=0.8, q=0.032, T=94, delta=8000^-1.1:   3.2531 / 3.2431 / 3.9672  (rdp/prv 1.220)
#   sigma=1.5, q=0.05, T=300, delta=1e-5:        2.8990 / 2.8903 / 3.1838  (rdp/prv 1.098)
# RDP is a valid but loose upper bound: in this regime it is 10-22 % above the PRV/PLD values, so we require
# eps_prv * 0.99 <= eps_rdp <= eps_prv * 1.35. PRV reports its upper bound (~0.3 % above its estimate).
@pytest.mark.parametrize(
    "sigma, q, steps, delta",
    [(1.0, 0.01, 1000, 1e-5), (0.8, 256 / N_SST2, 94, DELTA_8K), (1.5, 0.05, 300, 1e-5)],
)
def test_rdp_prv_pld_agree(sigma, q, steps, delta):
    history = [(sigma, q, steps)]
    eps_prv = compute_epsilon(history, delta, "prv")
    eps_rdp = compute_epsilon(history, delta, "rdp")
    eps_pld = compute_epsilon(history, delta, "pld")
    assert eps_prv * 0.99 <= eps_rdp <= eps_prv * 1.35
    assert abs(eps_pld - eps_prv) <= 0.03 * eps_prv
    # PRV's reported value is its upper bound: not below the (pessimistic) PLD by more than discretisation
    # error
    assert eps_prv >= eps_pld * 0.999


def test_reference_value_sigma1_q001_1000_steps():
    # eps(sigma=1, q=0.01, 1000 steps, delta=1e-5), add/remove relation. Independent values:
    #   prv_accountant estimate (eps_error=0.01): 1.82824; dp_accounting PLD (interval 1e-4): 1.82824;
    #   Opacus PRVAccountant upper bound (eps_error=0.01): 1.8384; RDP (Opacus orders, improved conversion):
    # 2.1014.
    reference = 1.8282
    eps_prv = compute_epsilon([(1.0, 0.01, 1000)], 1e-5, "prv")
    eps_pld = compute_epsilon([(1.0, 0.01, 1000)], 1e-5, "pld")
    eps_rdp = compute_epsilon([(1.0, 0.01, 1000)], 1e-5, "rdp")
    assert reference <= eps_prv <= reference * 1.006  # upper bound, within 0.6 %
    assert reference <= eps_pld <= reference * 1.002  # pessimistic PLD, within 0.2 %
    assert eps_rdp == pytest.approx(2.1014, abs=2e-3)


# 4. heterogeneous composition -------------------------------------------------------------------------------


def test_heterogeneous_composition():
    a, b = (1.0, 0.01, 1000), (2.0, 0.05, 200)
    delta = 1e-5
    for accountant in ACCOUNTANTS:
        both = compute_epsilon([a, b], delta, accountant)
        assert both >= compute_epsilon([a], delta, accountant)
        assert both >= compute_epsilon([b], delta, accountant)
        assert both < compute_epsilon([a], delta, accountant) + compute_epsilon([b], delta, accountant)
        # composition is commutative; interleaving does not matter
        assert compute_epsilon([b, a], delta, accountant) == both
        split = [(1.0, 0.01, 400), b, (1.0, 0.01, 600)]
        assert compute_epsilon(split, delta, accountant) == both
    eps_prv = compute_epsilon([a, b], delta, "prv")
    eps_pld = compute_epsilon([a, b], delta, "pld")
    assert abs(eps_prv - eps_pld) <= 0.01 * eps_prv  # measured: 2.4325 vs 2.4258


@pytest.mark.parametrize("accountant", ["prv", "pld"])
def test_full_batch_gaussian_matches_analytic(accountant):
    exact = analytic_gaussian_epsilon(10.0, 1e-5)  # 0.34067
    eps = compute_epsilon([(10.0, 1.0, 1)], 1e-5, accountant)
    assert exact <= eps <= exact * 1.02
    # k full-batch steps at sigma compose to one step at sigma / sqrt(k) (Gaussian DP)
    eps4 = compute_epsilon([(10.0, 1.0, 4)], 1e-5, accountant)
    exact4 = analytic_gaussian_epsilon(5.0, 1e-5)
    assert exact4 <= eps4 <= exact4 * 1.02


def test_full_batch_mixed_with_subsampled():
    # a DIFF2-like history: full-batch restarts interleaved with subsampled steps
    acc = PrivacyAccountant("prv")
    for _ in range(5):
        acc.step(20.0, 1.0)
        acc.step(1.2, 0.02, num_steps=19)
    assert acc.steps == 100 and len(acc.history) == 10
    eps_prv = acc.get_epsilon(1e-5)
    eps_pld = compute_epsilon(acc.history, 1e-5, "pld")
    assert math.isfinite(eps_prv) and abs(eps_prv - eps_pld) <= 0.01 * eps_prv


def test_tiny_epsilon_falls_back_to_pld():
    # PRV cannot resolve eps ~ 1e-3 cheaply; "prv" reports the PLD bound (documented fallback)
    history = [(5.0, 0.001, 10)]
    eps_prv = compute_epsilon(history, 1e-5, "prv")
    assert eps_prv == compute_epsilon(history, 1e-5, "pld")
    assert 0.0 < eps_prv < 2e-3


# 5. edge cases -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_zero_noise_is_infinite_and_no_steps_is_zero(accountant):
    acc = PrivacyAccountant(accountant)
    assert acc.steps == 0
    assert acc.get_epsilon(1e-5) == 0.0
    acc.step(1.0, 0.01, num_steps=0)
    assert acc.get_epsilon(1e-5) == 0.0 and acc.history == []
    acc.step(1.0, 0.01, 10)
    acc.step(0.0, 0.01)
    assert acc.get_epsilon(1e-5) == float("inf")
    assert compute_epsilon([], 1e-5, accountant) == 0.0
    assert compute_epsilon([(0.0, 1.0, 1)], 1e-5, accountant) == float("inf")


# 6. state, merging, caching ----------------------------------------------------------------------------


def test_step_merging_and_state_dict_round_trip():
    acc = PrivacyAccountant("pld")
    acc.step(1.0, 0.01)
    acc.step(1.0, 0.01)
    acc.step(1.0, 0.01, num_steps=8)
    acc.step(2.0, 0.01, num_steps=5)
    acc.step(1.0, 0.01)
    assert acc.history == [[1.0, 0.01, 10], [2.0, 0.01, 5], [1.0, 0.01, 1]]
    assert acc.steps == 16

    state = json.loads(json.dumps(acc.state_dict()))
    assert state == {
        "accountant": "pld", "history": [[1.0, 0.01, 10], [2.0, 0.01, 5], [1.0, 0.01, 1]], "steps": 16,
    }
    restored = PrivacyAccountant()
    restored.load_state_dict(state)
    assert restored.accountant == "pld" and restored.history == acc.history and restored.steps == 16
    assert restored.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    # a state written before "steps" existed counted one mechanism per step
    older = PrivacyAccountant()
    older.load_state_dict({"accountant": "pld", "history": state["history"]})
    assert older.steps == 16 and older.history == acc.history

    clone = acc.copy()
    clone.step(1.0, 0.01)
    assert clone.steps == 17 and acc.steps == 16 and acc.history[-1] == [1.0, 0.01, 1]

    with pytest.raises(ValueError, match="allowed values"):
        restored.load_state_dict({"accountant": "gdp", "history": []})
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        restored.load_state_dict({"accountant": "pld", "history": [], "steps": -1})


def test_record_step_counts_logical_steps_and_merges_equal_mechanisms():
    """One logical step may release several mechanisms (DiceSGD: two); ``steps`` counts logical steps."""
    from types import SimpleNamespace as Mechanism

    acc = PrivacyAccountant("pld")
    two = [Mechanism(noise_multiplier=2.0, sample_rate=0.01),
           Mechanism(noise_multiplier=3.0, sample_rate=1.0)]
    for _ in range(3):
        acc.record_step(two)
    assert acc.steps == 3
    # equal mechanisms share one entry wherever it is in the history (composition commutes)
    assert acc.history == [[2.0, 0.01, 3], [3.0, 1.0, 3]]
    acc.record_step([])  # a step that releases no mechanism still counts as a step
    assert acc.steps == 4 and acc.history == [[2.0, 0.01, 3], [3.0, 1.0, 3]]
    assert acc.get_epsilon(1e-5) == compute_epsilon([(2.0, 0.01, 3), (3.0, 1.0, 3)], 1e-5, "pld")
    clone = acc.copy()
    clone.record_step(two[:1])
    assert clone.steps == 5 and acc.steps == 4 and clone.history[0] == [2.0, 0.01, 4]
    restored = PrivacyAccountant()
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.steps == 4 and restored.history == acc.history


def test_get_epsilon_is_cached():
    acc = PrivacyAccountant("prv")
    acc.step(1.1, 0.02, num_steps=300)
    acc.get_epsilon(1e-5)
    start = time.perf_counter()
    for _ in range(100):
        acc.get_epsilon(1e-5)
    assert time.perf_counter() - start < 0.1


# 6b. log lines: epsilon before the horizon from one PRV discretisation -------------------------------------


@pytest.fixture
def prv_builds(monkeypatch):
    """Counts the ``prv_accountant.PRVAccountant`` objects built (each one discretises its PRVs)."""
    import prv_accountant

    built = []

    class Counting(prv_accountant.PRVAccountant):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("max_self_compositions"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prv_accountant, "PRVAccountant", Counting)
    return built


def _accountant_after(steps: int, mechanisms: list[tuple[float, float]]) -> PrivacyAccountant:
    acc = PrivacyAccountant("prv")
    for _ in range(steps):
        acc.record_step([SimpleNamespace(noise_multiplier=s, sample_rate=q) for s, q in mechanisms])
    return acc


@pytest.mark.parametrize(
    "mechanisms, horizon, steps",
    [([(0.9, 0.02)], 400, [1, 40, 200, 399]), ([(1.1, 0.03), (4.0, 1.0)], 150, [30])],  # 2nd: DiceSGD-like
)
def test_horizon_shortcut_is_an_upper_bound_close_to_the_exact_value(mechanisms, horizon, steps, monkeypatch):
    delta = 1e-5
    shortcut_values = []
    real = accounting._eps_prv_before_horizon

    def spy(*args):
        shortcut_values.append(real(*args))
        return shortcut_values[-1]

    monkeypatch.setattr(accounting, "_eps_prv_before_horizon", spy)
    at_horizon = compute_epsilon([(s, q, horizon) for s, q in mechanisms], delta)
    for t in steps:
        history = [(s, q, t) for s, q in mechanisms]
        shortcut = _accountant_after(t, mechanisms).get_epsilon(delta, horizon=horizon)
        # both are PRV upper bounds, with eps_error 0.3 % of eps(H) here and 0.3 % of eps(t) for the exact one
        assert abs(shortcut - compute_epsilon(history, delta)) <= 0.01 * at_horizon
        assert shortcut >= compute_epsilon(history, delta, "pld") * 0.999
    assert len(shortcut_values) == len(steps) and None not in shortcut_values  # the shortcut was taken
    # at the horizon: the exact path itself, and the horizon accountant follows exactly its eps_error rule
    full = _accountant_after(horizon, mechanisms)
    assert full.get_epsilon(delta, horizon=horizon) == full.get_epsilon(delta) == at_horizon
    horizon_key = tuple(sorted((s, q, horizon) for s, q in mechanisms))
    assert real(horizon_key, delta, horizon) == at_horizon


def test_horizon_shortcut_builds_one_accountant_for_all_log_lines(prv_builds):
    acc, delta, horizon = PrivacyAccountant("prv"), 1e-5, 300
    values = []
    for _ in range(10):
        acc.step(1.05, 0.03, num_steps=25)
        values.append(acc.get_epsilon(delta, horizon=horizon))
        if len(values) == 1:
            first = list(prv_builds)
    # built for H steps (once, or twice by the eps_error rule)
    assert first and all(m == [horizon] for m in first)
    assert prv_builds == first  # no further discretisation for the nine later step counts
    assert values == sorted(values) and len(set(values)) == 10
    assert acc.get_epsilon(delta, horizon=horizon) == values[-1]  # cached


def test_horizon_shortcut_reuses_the_accountant_of_the_exact_value_at_the_horizon(prv_builds):
    # DPTrainer prints the plan's epsilon for all planned steps before training: then log lines build nothing
    delta, horizon = 1e-5, 250
    at_horizon = compute_epsilon([(0.95, 0.025, horizon)], delta)
    built = len(prv_builds)
    acc = PrivacyAccountant("prv")
    for _ in range(5):
        acc.step(0.95, 0.025, num_steps=50)
        acc.get_epsilon(delta, horizon=horizon)
    assert len(prv_builds) == built and acc.get_epsilon(delta) == at_horizon


@pytest.mark.parametrize(
    "case",
    ["resumed with other noise", "steps without a release", "past the horizon", "no horizon", "rdp", "pld"],
)
def test_horizon_shortcut_falls_back_to_the_exact_value(case, prv_builds):
    delta, horizon = 1e-5, 200
    acc = PrivacyAccountant("rdp" if case == "rdp" else "pld" if case == "pld" else "prv")
    acc.step(1.3, 0.02, num_steps=50)
    if case == "resumed with other noise":
        acc.step(1.4, 0.02, num_steps=30)
    elif case == "steps without a release":
        acc.record_step([])
    elif case == "past the horizon":
        horizon = 40
    shortcut = accounting._eps_prv_before_horizon.cache_info()
    value = acc.get_epsilon(delta, horizon=None if case == "no horizon" else horizon)
    assert value == compute_epsilon(acc.history, delta, acc.accountant)
    assert accounting._eps_prv_before_horizon.cache_info() == shortcut  # the shortcut was not asked
    assert all(m != [horizon] for m in prv_builds)


def test_horizon_shortcut_on_a_diff2_like_history_and_bad_horizons():
    acc = PrivacyAccountant("prv")
    for _ in range(3):
        acc.record_step([SimpleNamespace(noise_multiplier=20.0, sample_rate=1.0)])
        for _ in range(4):
            acc.record_step([SimpleNamespace(noise_multiplier=1.2, sample_rate=0.05)])
    # restarts and difference steps have different counts: the exact heterogeneous composition
    assert acc.get_epsilon(1e-5, horizon=50) == compute_epsilon(acc.history, 1e-5)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="horizon"):
            acc.get_epsilon(1e-5, horizon=bad)


# 7. validation ----------------------------------------------------------------------------------------------


def test_default_delta():
    assert default_delta(8000) == pytest.approx(8000**-1.1)
    assert default_delta(8000) < 1 / 8000
    validate_privacy_parameters(8.0, default_delta(8000), 256 / 8000, 8000)  # valid: no error
    validate_privacy_parameters(8.0, None, 1.0, 8000)  # None = default delta, not checked


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf")])
def test_validate_rejects_bad_epsilon(eps):
    with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
        validate_privacy_parameters(eps, 1e-5, 0.01, 8000)


def test_validate_rejects_nonpositive_delta():
    with pytest.raises(ValueError, match="target_delta must be > 0.*smaller delta, e.g. N\\^-1.1"):
        validate_privacy_parameters(3.0, 0.0, 0.01, 8000)


def test_validate_rejects_delta_at_least_one_over_n():
    with pytest.raises(
        ValueError, match=r"delta must be < 1/N = 0.000125.*use a smaller delta, e.g. N\^-1.1 = 5.09e-05"
    ):
        validate_privacy_parameters(3.0, 1 / 8000, 0.01, 8000)


def test_validate_rejects_sample_rate_above_one():
    with pytest.raises(
        ValueError, match=r"sample_rate must be in \(0, 1\], got 1.5; use expected batch size / N"
    ):
        validate_privacy_parameters(3.0, 1e-5, 1.5, 8000)


def test_validate_rejects_nonpositive_sample_rate():
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\], got 0"):
        validate_privacy_parameters(3.0, 1e-5, 0.0, 8000)
    with pytest.raises(ValueError, match="sample_rate"):
        validate_privacy_parameters(3.0, 1e-5, -0.1, 8000)


def test_unknown_accountant_name():
    with pytest.raises(ValueError, match="unknown accountant 'gdp'; allowed values are prv, rdp, pld"):
        PrivacyAccountant("gdp")
    with pytest.raises(ValueError, match="allowed values are prv, rdp, pld"):
        compute_epsilon([(1.0, 0.01, 10)], 1e-5, "RDP")
    with pytest.raises(ValueError, match="allowed values"):
        calibrate_noise_multiplier(3.0, 1e-5, 0.01, 100, accountant="opacus")


def test_step_and_calibrate_reject_bad_arguments():
    acc = PrivacyAccountant()
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(1.0, 1.5)
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(1.0, 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.step(-1.0, 0.1)
    with pytest.raises(ValueError, match="num_steps"):
        acc.step(1.0, 0.1, num_steps=-1)
    with pytest.raises(ValueError, match="delta must be in"):
        acc.get_epsilon(0.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(0.0, 1e-5, 0.01, 100)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        calibrate_noise_multiplier(3.0, 1e-5, 0.01, 0)
    with pytest.raises(ValueError, match="sample_rate"):
        calibrate_noise_multiplier(3.0, 1e-5, 2.0, 100)
