"""The empirical one-run audit through the real DPTrainer: honest runs stay below the claim, broken ones do
not.

Pre-registered design (docs/audit.md §8 and §9): claimed eps = 1, delta = 1e-5, m = 1000 Dirac canaries,
full batch (q = 1), T = 100, k+ = k- = 50, 95% confidence, fixed seeds. Expected: honest ~0.2; noise / 7 ~3.0;
four separately clipped pieces (sensitivity 4C under noise calibrated for C) ~1.8.
"""

from __future__ import annotations

import pytest
import torch

from hf_dpfilter import available_methods
from hf_dpfilter.audit import AuditConfig, run_audit
from hf_dpfilter.audit.run import NoiseTooSmallDPSGD, SeparatelyClippedPiecesDPSGD


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_honest_dpsgd_stays_below_claim():
    result = run_audit(AuditConfig(method="dpsgd", target_epsilon=1.0))
    assert result.steps == 100 and result.details["scored_releases"] == 100
    assert result.claimed_epsilon <= 1.0
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert (result.fdp_epsilon_lower_bound is not None
            and result.fdp_epsilon_lower_bound <= result.claimed_epsilon)
    # The spare probe coordinates measure the noise actually added: sigma * C per step (sum scale).
    assert result.noise_std_estimate == pytest.approx(result.noise_multiplier, rel=0.15)


def test_noise_divided_by_seven_is_detected():
    result = run_audit(AuditConfig(method="dpsgd", target_epsilon=1.0, optimizer_override=NoiseTooSmallDPSGD))
    assert result.epsilon_lower_bound > 1.0, result
    assert result.noise_std_estimate == pytest.approx(result.noise_multiplier / 7, rel=0.15)


def test_separately_clipped_pieces_are_detected():
    result = run_audit(
        AuditConfig(method="dpsgd", target_epsilon=1.0, optimizer_override=SeparatelyClippedPiecesDPSGD)
    )
    assert result.epsilon_lower_bound > 1.0, result


@pytest.mark.slow
def test_poisson_sampled_canaries():
    """q = 0.1: the IN canaries go through the trainer's Poisson sampler like real examples."""
    honest = run_audit(AuditConfig(method="dpsgd", target_epsilon=1.0, sample_rate=0.1, steps=100))
    assert honest.fdp_epsilon_lower_bound is None  # the f-DP (GDP) bound is not valid for q < 1
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon
    broken = run_audit(AuditConfig(method="dpsgd", target_epsilon=1.0, sample_rate=0.1, steps=100,
                                   optimizer_override=NoiseTooSmallDPSGD))
    assert broken.epsilon_lower_bound > 1.0


def test_clipping_of_large_canaries():
    """lambda = 4C canaries are clipped back to C: the honest bound does not move above the claim."""
    result = run_audit(AuditConfig(method="dpsgd", target_epsilon=1.0, canary_gradient_multiple=4.0))
    assert result.epsilon_lower_bound <= result.claimed_epsilon


OTHER_METHODS = [m for m in available_methods() if m != "dpsgd"]


@pytest.mark.slow
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_every_method_stays_below_claim(method):
    multiple = 4.0 if method == "dicesgd" else 1.0
    result = run_audit(
        AuditConfig(method=method, target_epsilon=1.0, steps=50, canary_gradient_multiple=multiple)
    )
    assert result.details["scored_releases"] >= 1
    assert result.epsilon_lower_bound <= result.claimed_epsilon, result
    if result.fdp_epsilon_lower_bound is not None:
        assert result.fdp_epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.slow
def test_dicesgd_paper_accounting_is_audited():
    if "dicesgd" not in available_methods():
        pytest.skip("DiceSGD not available")
    result = run_audit(
        AuditConfig(method="dicesgd", target_epsilon=1.0, steps=50, canary_gradient_multiple=4.0,
                    method_hyperparameters={"accounting": "paper"})
    )
    # The reported epsilon is the library's sound bound (not the paper's claim); the audit must stay below it.
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert "epsilon_paper_claim" in result.details["privacy_report"]


def test_write_section_keeps_other_sections(tmp_path):
    from hf_dpfilter.audit.__main__ import SECTION, write_section

    path = tmp_path / "privacy.md"
    path.write_text("# Privacy\n\n## Accounting\n\ntext A\n\n" + SECTION + "\n\nold table\n\n## "
        "Later\n\ntext B\n")
    write_section(path, SECTION + "\n\nnew table\n")
    text = path.read_text()
    assert "text A" in text and "text B" in text and "new table" in text and "old table" not in text
    write_section(tmp_path / "new.md", SECTION + "\n\nt\n")
    assert SECTION in (tmp_path / "new.md").read_text()
