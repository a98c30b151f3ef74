"""One owner of clipping and noise: the custom loop of docs/privacy.md, per-method sensitivity through it, and the
refusals.

* The custom-loop block of docs/privacy.md is executed as written.
* For every method, the custom loop (make_private + optimizer.accumulate) with noise 0 and neighbouring
  batches D and D u {x} (x an extreme example) moves the pre-noise aggregate by at most the sensitivity the
  noise is calibrated to (``optimizer.sensitivity()``, the Delta of std = sigma * Delta).
* The old two-owner pattern (an engine with its own C, p.grad filled outside the optimizer, step() without
  accumulate) is refused with a message that says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from models import tiny_bert

from hf_dpfilter import (
    GhostClippingEngine,
    PrivacyPlan,
    UnprivatizedGradientError,
    make_dp_optimizer,
    make_private,
    per_example_loss,
)

CUSTOM_LOOP_DOC = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


def test_documented_custom_loop_runs_as_written():
    text = CUSTOM_LOOP_DOC.read_text()
    match = re.search(r"<!-- custom-loop -->\n```python\n(.*?)```", text, flags=re.S)
    assert match, "docs/privacy.md lost its custom-loop block"
    namespace: dict = {}
    exec(compile(match.group(1), "docs/privacy.md (custom loop)", "exec"), namespace)
    optimizer, plan = namespace["optimizer"], namespace["plan"]
    assert optimizer.accountant.steps == plan.steps == optimizer.dp_steps
    assert optimizer.plan is plan and optimizer.secure_rng


# --------------------------------------------------------------------------- sensitivity per method
METHOD_CASES = {
    "dpsgd": ("dpsgd", {}),
    "disk one-pass": ("disk", {}),
    # weights (1 - c, c) with c > 1: a combination with cancellation
    "disk two-point": ("disk", {"gamma": 0.1}),
    "doppler": ("doppler", {}),
    "pmlf k=2": ("pmlf", {"k": 2}),
    "dicesgd": ("dicesgd", {"error_max_grad_norm": 0.05}),
    "diff2 difference round": ("diff2", {"restart_every": 10, "difference_max_grad_norm": 2.0}),
}


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (n, 8), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return ids, y


def _run(method: str, method_args: dict, last_batch, warmup_batches, clip: float = 0.5):
    """The documented loop with noise 0: warm-up steps on shared batches, then the pre-noise aggregate of the
    last."""
    model = tiny_bert(num_labels=2)  # float64, deterministic init
    plan = PrivacyPlan.for_optimizer(method=method, method_args=method_args, noise_multiplier=0.0,
                                     per_sample_max_grad_norm=clip, expected_batch_size=4.0, sample_rate=0.5, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=0.5,
                                        verify_first_backward=False)

    def accumulate(ids, y):
        def loss_fn(param_values):
            logits = engine.call_model(param_values, input_ids=ids).logits
            return per_example_loss(logits, y, causal_lm=False) * 50.0  # large gradients: clipping is active

        optimizer.accumulate(engine, loss_fn, batch_size=len(y))

    for ids, y in warmup_batches:
        accumulate(ids, y)
        optimizer.step()
    accumulate(*last_batch)
    local = optimizer._local_sums()
    # keyed by position: the two neighbouring runs build two models with identical parameters
    sums = [local[p].detach().clone() if p in local else torch.zeros_like(p) for p in optimizer.params]
    sensitivity = optimizer.sensitivity()
    engine.detach()
    return sums, sensitivity, optimizer


@pytest.mark.parametrize("case", list(METHOD_CASES))
def test_custom_loop_moves_the_pre_noise_aggregate_by_at_most_the_calibrated_sensitivity(case):
    method, method_args = METHOD_CASES[case]
    warmup = [_batch(4, seed) for seed in range(3)]  # PMLF/DiSK/DIFF2 need earlier points
    base_ids, base_y = _batch(5, 10)
    extreme_ids, _ = _batch(1, 99)
    with_x = (torch.cat([base_ids, extreme_ids]), torch.cat([base_y, torch.tensor([1])]))
    s_without, delta, opt = _run(method, method_args, (base_ids, base_y), warmup)
    s_with, delta_with, _ = _run(method, method_args, with_x, warmup)
    assert delta == pytest.approx(delta_with)  # Delta is public: it does not depend on the batch
    moved = sum(float((a - b).double().pow(2).sum()) for a, b in zip(s_with, s_without)) ** 0.5
    assert delta > 0
    assert moved <= delta * (1 + 1e-9), f"{case}: aggregate moved by {moved:.6g} > sensitivity {delta:.6g}"
    assert moved > 0.5 * delta, f"{case}: x should be clipped at (close to) the bound"
    if case.startswith("diff2"):
        assert not opt.current_round().restart


# ------------------------------------------------------------------------------------ refusals
def _setup():
    model = torch.nn.Linear(3, 2).double()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    optimizer = make_dp_optimizer(model.parameters(), torch.optim.SGD, lr=0.1, noise_multiplier=1.0,
                                  per_sample_max_grad_norm=1.0,
                                  expected_batch_size=4, sample_rate=0.1, seed=0)
    return model, engine, optimizer


def test_engine_with_its_own_clipping_norm_is_refused():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"optimizer\.accumulate\(engine, loss_fn, batch_size\)"):
        GhostClippingEngine(model, max_grad_norm=100.0)
    with pytest.raises(TypeError, match="no longer clips"):
        GhostClippingEngine(model, 100.0)
    engine = GhostClippingEngine(model)
    with pytest.raises(RuntimeError, match=r"optimizer\.accumulate"):
        engine.clip_and_accumulate(torch.zeros(2))


def test_step_refuses_a_gradient_the_optimizer_did_not_build():
    model, engine, optimizer = _setup()
    x = torch.randn(4, 3, dtype=torch.float64)
    model(x).pow(2).sum().backward()  # the two-owner pattern: p.grad filled outside the optimizer
    with pytest.raises(UnprivatizedGradientError, match=r"optimizer\.accumulate\(engine, loss_fn, "
                                                        r"batch_size\)"):
        optimizer.step()
    with pytest.raises(UnprivatizedGradientError, match="did not build"):
        optimizer.accumulate(engine, lambda v: engine.call_model(v, x).pow(2).sum(1), batch_size=4)
        optimizer.step()  # p.grad still holds the foreign gradient
    assert optimizer.dp_steps == 0 and optimizer.accountant.steps == 0  # nothing released, nothing spent


def test_step_without_accumulate_is_refused_and_an_empty_batch_is_declared():
    model, engine, optimizer = _setup()
    before = model.weight.detach().clone()
    with pytest.raises(UnprivatizedGradientError, match="batch_size=0"):
        optimizer.step()
    optimizer.accumulate(engine, None, batch_size=0)  # an empty Poisson batch: noise only, accounted
    optimizer.step()
    assert optimizer.dp_steps == 1 and optimizer.accountant.steps == 1
    assert not torch.equal(model.weight.detach(), before)  # the noise was released
    with pytest.raises(UnprivatizedGradientError):
        optimizer.step()  # the token is consumed by the step


def test_engine_and_optimizer_must_cover_the_same_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    optimizer = make_dp_optimizer(model[0].parameters(), torch.optim.SGD, lr=0.1, noise_multiplier=1.0,
                                  per_sample_max_grad_norm=1.0, expected_batch_size=4)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="make_private"):
        optimizer.accumulate(engine, lambda v: model(x).squeeze(-1), batch_size=4)
