"""``python -m benchmarks authors-noise``: the noise DiSK's and DP-PMLF's released codes add, measured on their
per-step arithmetic, and the committed figures the positive controls of ``python -m benchmarks utility`` read.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import authors_noise


def test_the_measured_fractions_are_the_released_arithmetic(tmp_path):
    """DiSK (kappa 0.7, gamma 0.5) keeps 1 - c = 1/7 of the step's draw, c = (1 - kappa) / (kappa gamma), at
    sensitivity C; gamma 0.75 keeps 3/7; DP-PMLF's k clipped sums noised once have sensitivity k C at the noise
    of C: sigma / k."""
    results = authors_noise.main(["--draws", "40000", "--json", str(tmp_path / "noise.json")])
    codes = results["codes"]
    expected = {"disk_kappa0.7_gamma0.5": (1 / 7, 1.0, 1 / 7), "disk_kappa0.7_gamma0.75": (3 / 7, 1.0, 3 / 7),
                "pmlf_k2": (1.0, 2.0, 1 / 2), "pmlf_k3": (1.0, 3.0, 1 / 3)}
    for name, (noise, sensitivity, effective) in expected.items():
        row = codes[name]
        assert row["noise_ratio"] == pytest.approx(noise, rel=0.02), name
        assert row["sensitivity_ratio"] == pytest.approx(sensitivity, rel=1e-9), name
        assert row["effective_noise_ratio"] == pytest.approx(effective, rel=0.02), name
        assert row["analytic_effective_noise_ratio"] == pytest.approx(effective, rel=1e-12), name
    assert json.loads((tmp_path / "noise.json").read_text()) == results


def test_the_release_is_the_weighted_clipped_sums_plus_the_scaled_draw():
    """At kappa 0.7, gamma 0.5: (1/7) S0 + (6/7) S1 + (1/7) N over B; PMLF: S0 + S1 + N over B."""
    s0, s1, noise = np.array([1.0, 2.0]), np.array([-3.0, 0.5]), np.array([7.0, -14.0])
    released = authors_noise.disk_released([s0, s1], noise, 10.0, 0.7, 0.5)
    assert released == pytest.approx((s0 / 7 + 6 * s1 / 7 + noise / 7) / 10.0)
    assert authors_noise.pmlf_released([s0, s1], noise, 10.0) == pytest.approx((s0 + s1 + noise) / 10.0)
    # the one-pass gamma = (1 - kappa) / kappa: one backward at the look-ahead point, the whole draw
    one_pass = authors_noise.disk_released([s1], noise, 10.0, 0.7, 0.3 / 0.7)
    assert one_pass == pytest.approx((s1 + noise) / 10.0)


def test_the_committed_figures_are_the_ones_the_controls_read():
    with open(authors_noise.RESULTS) as f:
        committed = json.load(f)
    assert committed == authors_noise.measure_all(committed["draws"], committed["seed"])
    assert authors_noise.effective_noise_ratio("disk_kappa0.7_gamma0.5") == pytest.approx(1 / 7, abs=0.002)
    assert authors_noise.effective_noise_ratio("pmlf_k2") == pytest.approx(1 / 2, abs=0.002)
    with pytest.raises(KeyError, match="authors-noise"):
        authors_noise.effective_noise_ratio("disk_kappa0.9")
