"""Empirical privacy auditing in one training run: the statistics (bounds) part.

See :mod:`hf_dpfilter.audit.bounds` for the theorems implemented (Steinke, Nasr & Jagielski 2023; Mahloujifar,
Melis & Chaudhuri 2025) and the conditions under which each bound is valid.
"""

from hf_dpfilter.audit.bounds import (
    best_guess_bound,
    count_correct_guesses,
    default_guess_counts,
    fdp_epsilon_lower_bound,
    fdp_hypothesis_rejected,
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
from hf_dpfilter.audit.run import AuditConfig, AuditModel, AuditResult, run_audit

__all__ = [
    "AuditConfig",
    "AuditModel",
    "AuditResult",
    "run_audit",
    "best_guess_bound",
    "count_correct_guesses",
    "default_guess_counts",
    "fdp_epsilon_lower_bound",
    "fdp_hypothesis_rejected",
    "gaussian_epsilon_estimate",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_hypothesis_rejected",
    "gdp_mu_for_epsilon",
    "gdp_mu_lower_bound",
    "one_run_epsilon_lower_bound",
    "simulate_dpsgd_canary_scores",
    "simulate_gaussian_canary_scores",
    "steinke_p_value",
]
