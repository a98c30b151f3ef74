"""DIFF2's difference rounds clip a per-example DIFFERENCE of gradients; the clip must hold in the run's dtype.

The ghost norm of g_i(x) - g_i(x') sums token products whose cross terms cancel, so in float32 its relative
error grows like eps32 (||g|| / ||g(x) - g(x')||)^2 and a squared norm that rounds to <= 0 used to let the
example in unclipped. Now difference rounds run in precise mode (float64 terms, a proven upper bound of each
norm): with neighbouring batches D and D u {x} (x extreme), noise 0 and step sizes down to tiny ones, the
pre-noise aggregate never moves by more than the round's sensitivity Delta = C2 ||x_{r-1} - x_{r-2}||, in
float32 and under bf16 autocast.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from models import tiny_bert

from hf_dpfilter import PrivacyPlan
from hf_dpfilter.engine import GhostClippingEngine


def _batch(n: int, seed: int, target_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (n, 8), generator=g), torch.randn(n, generator=g) * target_scale


def _difference_round_sums(batch, lr: float, bf16: bool):
    model = tiny_bert(num_labels=1, dtype=torch.float32)
    plan = PrivacyPlan.for_optimizer(
        method="diff2", method_args={"restart_every": 2, "difference_max_grad_norm": 1.0}, noise_multiplier=0.0,
        max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=1.0, seed=0,
    )
    engine, optimizer = plan.build(model, base=torch.optim.SGD, lr=lr, verify_first_backward=False)

    def accumulate(ids, y):
        def loss_fn(values):
            context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with context:
                out = engine.call_model(values, input_ids=ids).logits.squeeze(-1)
            return (out.float() - y) ** 2

        optimizer.accumulate(engine, loss_fn, batch_size=len(y))

    accumulate(*_batch(8, 0))  # restart round on shared data
    optimizer.step()
    accumulate(*batch)  # the difference round under test
    assert not optimizer.current_round().restart
    local = optimizer._local_sums()
    sums = [local[p].double().clone() if p in local else torch.zeros_like(p, dtype=torch.float64)
            for p in optimizer.params]
    return sums, optimizer.sensitivity()


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("lr", [5e-2, 5e-4, 5e-6, 5e-8, 1e-10])
def test_difference_round_never_exceeds_its_sensitivity(lr, bf16):
    base = _batch(6, 1)
    worst = 0.0
    for seed in range(4):  # several extreme examples x
        x_ids, _ = _batch(1, 100 + seed)
        x_target = torch.tensor([1e3 * (seed + 1)])
        with_x = (torch.cat([base[0], x_ids]), torch.cat([base[1], x_target]))
        s_without, delta = _difference_round_sums(base, lr, bf16)
        s_with, delta_with = _difference_round_sums(with_x, lr, bf16)
        assert delta == delta_with and delta > 0
        moved = sum(float((a - b).pow(2).sum()) for a, b in zip(s_with, s_without)) ** 0.5
        worst = max(worst, moved / delta)
    assert worst <= 1.0, f"lr={lr}: the aggregate moved by {worst:.3g} x the sensitivity"


def test_precise_norm_bound_covers_total_cancellation():
    """Two identical points with weights +1 and -1: the exact difference is 0, the float32 ghost sum of the
    cancelling terms is not. The precise bound is >= the exact norm, and the clip never uses factor 1 for a
    nonzero computed difference."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    engine = GhostClippingEngine(layer, verify_first_backward=False)
    x = torch.randn(3, 50, 64) * 100
    with engine.record(batch_size=3):
        out1 = layer(x)
        out2 = layer(x * (1 + 1e-7))
    combined = out1.pow(2).sum(dim=(1, 2)) - out2.pow(2).sum(dim=(1, 2))
    grads = engine.per_example_gradients(combined, precise=True)
    bounds = grads.clipping_norms()
    # the exact per-example difference, materialized in float64 from the same inputs
    exact = []
    for i in range(3):
        a = torch.cat([x[i], x[i] * (1 + 1e-7)]).double()
        g1 = 2 * out1[i].detach().double()
        g2 = -2 * out2[i].detach().double()
        b = torch.cat([g1, g2])
        exact.append(float((b.t() @ a).norm() ** 2 + b.sum(0).norm() ** 2) ** 0.5)
    for bound, true in zip(bounds.tolist(), exact):
        assert bound >= true * (1 - 1e-12)
    assert grads.dtype == torch.float64
