"""The engine's multi-point service (hf_dpfilter.engine.points): a method declares its points, the engine
returns each example's *combination* of gradients (clipped once by the optimizer), with the RNG replayed
exactly."""

from __future__ import annotations

import torch
from torch import nn

from hf_dpfilter.engine import CurrentPoint, GhostClippingEngine, per_example_combination


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1)).double()


def _loss_fn(engine: GhostClippingEngine, x: torch.Tensor):
    return lambda values: engine.call_model(values, x).squeeze(-1).pow(2)


def _reference(model: nn.Module, x: torch.Tensor, points, mask_seed: int) -> torch.Tensor:
    """Per-example norms of sum_k w_k grad loss_i(x_k), one example and one point at a time, float64."""
    norms = []
    for i in range(len(x)):
        total = None
        for weight, values in points:
            leaves = {n: (values or {}).get(p, p).detach().clone().requires_grad_() for n,
                      p in model.named_parameters()}
            torch.manual_seed(mask_seed)  # the batch forward's dropout masks; example i's row of them
            out = torch.func.functional_call(model, leaves, (x,))
            grads = torch.autograd.grad(out[i].squeeze().pow(2), list(leaves.values()))
            total = [weight * g if total is None else t + weight * g for t, g in zip(total or grads, grads)]
        norms.append(torch.sqrt(sum(t.pow(2).sum() for t in total)))
    return torch.stack(norms)


def test_the_combination_is_one_vector_per_example_with_the_same_dropout_masks():
    model = _model()
    model.train()
    engine = GhostClippingEngine(model)
    x = torch.randn(6, 5, dtype=torch.float64)
    params = list(model.parameters())
    # a point's values are differentiable in x with Jacobian I, as the methods give them (value + p -
    # p.detach())
    other = {p: p.detach() * 0.5 + 0.1 + (p - p.detach()) for p in params}
    points = [(1.0, None), (-0.5, other)]
    torch.manual_seed(3)
    grads, combined, here = per_example_combination(engine, _loss_fn(engine, x), points, len(x), params)
    assert grads.precise  # a negative weight: cancellation, computed in float64
    torch.testing.assert_close(grads.norms(), _reference(model, x, points, 3), rtol=1e-9, atol=1e-12)
    assert here is not None and combined.shape == (6,)


def test_a_point_minus_itself_is_exactly_zero():
    """Same values at both points: the masks are replayed exactly, so each example's combination is 0 (not the
    difference of two dropout draws), and its clipped contribution is 0 whatever the clip."""
    model = _model()
    model.train()
    engine = GhostClippingEngine(model)
    x = torch.randn(6, 5, dtype=torch.float64)
    params = list(model.parameters())
    same = CurrentPoint({p: p.clone() for p in params})
    grads, _, here = per_example_combination(engine, _loss_fn(engine, x), [(1.0, same), (-1.0, None)], len(x),
                                             params)
    assert torch.equal(grads.norms(), torch.zeros(6, dtype=torch.float64))
    assert here is not None  # the CurrentPoint's (or None's) losses are the step's
