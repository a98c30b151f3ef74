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
from hf_dpfilter.factory import make_private


def _batch(n: int, seed: int, target_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (n, 8), generator=g), torch.randn(n, generator=g) * target_scale


def _round_like_a_batch_dependent_kernel(module, inputs, output):
    """(h * s) / s with s depending on the batch's size: the identity in exact arithmetic, a rounding of about
    one unit in the last place that depends on which examples share the batch -- as BLAS kernels that block
    the product by the batch's size do on some CPUs (not on every one, hence this stand-in)."""
    scale = 3.0 if output.shape[0] % 2 else 1.0
    return (output * scale) / scale


def _difference_round_sums(batch, lr: float, bf16: bool, batch_dependent_rounding: bool = False,
                           float64_differences: bool = True):
    model = tiny_bert(num_labels=1, dtype=torch.float32)
    if batch_dependent_rounding:
        model.bert.embeddings.register_forward_hook(_round_like_a_batch_dependent_kernel)
    plan = PrivacyPlan.for_optimizer(
        method="diff2",
        method_args={"restart_every": 2, "difference_max_grad_norm": 1.0, "float64_differences": float64_differences},
        noise_multiplier=0.0,
        max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=1.0, seed=0,
    )
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=lr, verify_first_backward=False)

    def accumulate(ids, y):
        def loss_fn(values):
            context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with context:
                out = engine.call_model(values, input_ids=ids).logits.squeeze(-1)
            return (out.to(torch.float64 if out.dtype == torch.float64 else torch.float32) - y.to(
                torch.float64 if out.dtype == torch.float64 else torch.float32)) ** 2

        optimizer.accumulate(engine, loss_fn, batch_size=len(y))

    accumulate(*_batch(8, 0))  # restart round on shared data
    optimizer.step()
    accumulate(*batch)  # the difference round under test
    assert not optimizer.current_round().restart
    local = optimizer._local_sums()
    sums = [local[p].double().clone() if p in local else torch.zeros_like(p, dtype=torch.float64)
            for p in optimizer.params]
    return sums, optimizer.sensitivity()


@pytest.mark.parametrize("kernels", ["own-cpu", "batch-dependent"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("lr", [5e-2, 5e-4, 5e-6, 5e-8, 1e-10])
def test_difference_round_never_exceeds_its_sensitivity(lr, bf16, kernels):
    """``batch-dependent``: the forward rounds as kernels that block by the batch's size do on some CPUs
    (issue 21 item 7: 1.0000073 x Delta there with float32 points; 1.00002 to 1.0017 x Delta here with this
    stand-in and float32 points, <= 1 with the default float64 points)."""
    rounding = kernels == "batch-dependent"
    base = _batch(6, 1)
    worst = 0.0
    for seed in range(4):  # several extreme examples x
        x_ids, _ = _batch(1, 100 + seed)
        x_target = torch.tensor([1e3 * (seed + 1)])
        with_x = (torch.cat([base[0], x_ids]), torch.cat([base[1], x_target]))
        s_without, delta = _difference_round_sums(base, lr, bf16, rounding)
        s_with, delta_with = _difference_round_sums(with_x, lr, bf16, rounding)
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


def _difference_norms(batch, lr: float, float64_differences: bool) -> torch.Tensor:
    """Per-example norms of the clipped combination g_i(x_{r-1}) - g_i(x_{r-2}) in a difference round."""
    model = tiny_bert(num_labels=1, dtype=torch.float32)
    model.bert.embeddings.register_forward_hook(_round_like_a_batch_dependent_kernel)
    plan = PrivacyPlan.for_optimizer(
        method="diff2",
        method_args={"restart_every": 2, "difference_max_grad_norm": 1.0, "float64_differences": float64_differences},
        noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=1.0, seed=0,
    )
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=lr, verify_first_backward=False)

    def loss_fn_of(ids, y):
        def loss_fn(values):  # in the dtype of the point (a cast of the logits to float32 would round again)
            out = engine.call_model(values, input_ids=ids).logits.squeeze(-1)
            return (out - y.to(out.dtype)) ** 2

        return loss_fn

    restart = _batch(8, 0)
    optimizer.accumulate(engine, loss_fn_of(*restart), batch_size=8)
    optimizer.step()
    grads, _, _ = optimizer._per_example_pass(engine, loss_fn_of(*batch), len(batch[1]))
    assert not optimizer.current_round().restart
    return grads.norms().double(), grads.dtype


@pytest.mark.parametrize("lr", [5e-4, 5e-6])
def test_difference_of_an_example_does_not_depend_on_the_other_examples_of_the_batch(lr):
    """Issue 21 item 7: a float32 forward rounds differently when the batch holds other examples (the kernels
    block by the batch's size), and the difference g(x) - g(x') amplifies that by ||g|| / ||g(x) - g(x')||: a
    neighbouring batch then moved the OTHER examples' clipped differences, and the aggregate by more than the
    round's sensitivity on some CPUs. With both points in float64 (the default), an example's difference is the
    same whichever examples share its batch, to float64 accuracy."""
    base = _batch(12, 1)
    x_ids, _ = _batch(1, 100)
    with_x = (torch.cat([base[0], x_ids]), torch.cat([base[1], torch.tensor([1e3])]))
    without, dtype = _difference_norms(base, lr, True)
    with_, _ = _difference_norms(with_x, lr, True)
    assert dtype == torch.float64
    drift = ((with_[:12] - without).abs() / without).max().item()
    limit = 1e-8 if lr >= 5e-4 else 1e-5  # float32 points: 8e-5 and 1e-2 (the norm of a difference is
    # sensitive to its terms' rounding in proportion to (||g|| / ||g(x) - g(x')||)^2)
    assert drift <= limit, f"an example's clipped difference moved by {drift:.2e} when x joined the batch"


def test_difference_round_runs_the_model_in_float64_and_reports_the_current_loss():
    model = tiny_bert(num_labels=1, dtype=torch.float32)
    plan = PrivacyPlan.for_optimizer(
        method="diff2", method_args={"restart_every": 2, "difference_max_grad_norm": 1.0}, noise_multiplier=0.0,
        max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=1.0, seed=0,
    )
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=1e-3, verify_first_backward=True)
    ids, y = _batch(8, 0)
    seen = []

    def loss_fn(values):
        out = engine.call_model(values, input_ids=ids).logits.squeeze(-1)
        seen.append(out.dtype)
        return (out - y.to(out.dtype)) ** 2

    optimizer.accumulate(engine, loss_fn, batch_size=8)  # restart round: float32
    optimizer.step()
    reported = optimizer.accumulate(engine, loss_fn, batch_size=8)  # difference round: both points in float64
    assert seen == [torch.float32, torch.float64, torch.float64]
    with torch.no_grad():
        here = (model(input_ids=ids).logits.squeeze(-1) - y) ** 2
    torch.testing.assert_close(reported.float(), here, rtol=1e-5, atol=1e-6)  # the current point's losses
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model itself is untouched
    optimizer.step()
