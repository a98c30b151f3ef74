"""``python -m hf_dpfilter.accounting``: sigma for a target epsilon and epsilon for a sigma, as DPTrainer plans."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_dpfilter.accounting.__main__ import main, run_steps
from hf_dpfilter.plan import PrivacyPlan


def test_sigma_for_epsilon_is_the_plans_and_the_reverse_gives_epsilon_back():
    line = main(["--epsilon", "3", "--n", "60000", "--batch", "1000", "--epochs", "3"])
    sigma = float(line.split("sigma = ")[1].split()[0])
    plan = PrivacyPlan.create(num_examples=60000, logical_batch_size=1000, epochs=3, target_epsilon=3.0,
                              per_sample_max_grad_norm=1.0, seed=0)
    assert sigma == pytest.approx(plan.noise.noise_multiplier, rel=1e-3)
    back = main(["--sigma", f"{sigma:.6f}", "--n", "60000", "--batch", "1000", "--epochs", "3"])
    assert float(back.split("epsilon = ")[1].split()[0]) == pytest.approx(3.0, rel=0.02)
    assert "180 steps" in line and "prv accountant" in line


def test_steps_follow_the_trainers_plan_and_bad_input_names_the_fix():
    assert run_steps(60000, 1000, 3, None) == PrivacyPlan.run_length(60000, 1000, 3)[1]
    assert run_steps(60000, 1000, None, 7) == 7
    with pytest.raises(SystemExit, match="--epochs or --steps"):
        run_steps(100, 10, None, None)
    with pytest.raises(SystemExit):
        main(["--epsilon", "3", "--n", "100", "--batch", "1000", "--epochs", "1"])


def test_the_module_runs_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "hf_dpfilter.accounting", "--epsilon", "8", "--n", "1000",
                          "--batch", "100", "--steps", "30"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("sigma = ")
