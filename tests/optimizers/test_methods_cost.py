"""The methods' step cost: what was made cheaper still computes the same thing.

* the float64 squared norm without a float64 copy (DiceSGD's error buffer, DIFF2's movement) equals the
  float64 reference across chunk boundaries;
* DiSK's look-ahead point (formed in place once per step) and DP-PMLF's snapshots are handed to every
  micro-batch as the stored tensors, without a copy, differentiable in x with Jacobian I; the clipped sum
  does not depend on how the step's examples are split into micro-batches;
* a first-order filter's two-lerp form resumes from a checkpoint of the general form;
* with tied weights (GPT-2's embedding and LM head) the points in several micro-batches give the float64
  per-example reference of the combination, clipped once.

float64, the tiny RoBERTa (and GPT-2) of tests/models.py, no dropout.
"""

from __future__ import annotations

import pytest
import torch
from helpers import flat
from models import padded_batch, tiny_gpt2, tiny_roberta

from hf_dpfilter import GhostClippingEngine, make_dp_optimizer
from hf_dpfilter.distributed import collectives as collectives_module
from hf_dpfilter.distributed.collectives import float64_squared_norm
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.optimizers.filters import LowPassFilter, LowPassPostprocessor
from hf_dpfilter.optimizers.point_values import with_identity_gradient


def test_float64_squared_norm_without_a_copy_equals_the_float64_reference(monkeypatch):
    monkeypatch.setattr(collectives_module, "_NORM_CHUNK", 7)  # many chunks and partial last chunks
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g) * 1e3, torch.randn(16, generator=g), torch.randn(0),
               torch.randn(2, 2, dtype=torch.float64, generator=g)]
    expected = sum(float(t.double().pow(2).sum()) for t in tensors)
    assert float64_squared_norm(tensors) == pytest.approx(expected, rel=1e-14)
    assert float64_squared_norm([]) == 0.0


def _batch(n: int, seed: int) -> dict:
    batch = padded_batch(n, seed=seed)
    batch["labels"] = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return batch


def _loss_fn(engine, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss_fn(values):
        return per_example_loss(engine.call_model(values, **inputs).logits, batch["labels"], causal_lm=False)

    return loss_fn


POINT_METHODS = [("disk", {"kappa": 0.7}), ("disk", {"kappa": 0.7, "gamma": 0.2}),
                 ("pmlf", {"k": 3, "beta": 0.9})]


@pytest.mark.parametrize("method,kw", POINT_METHODS)
def test_points_are_the_stored_tensors_and_the_split_into_micro_batches_does_not_matter(method, kw):
    model = tiny_roberta(num_labels=1)
    model.eval()
    engine = GhostClippingEngine(model)
    opt = make_dp_optimizer(model.parameters(), base=torch.optim.SGD, method=method, method_args=kw,
                            noise_multiplier=0.5, per_sample_max_grad_norm=0.5, expected_batch_size=6, seed=3, lr=0.05)
    params = [p for p in model.parameters() if p.requires_grad]
    for seed in (10, 11, 12):  # build d / the snapshots (noised steps)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        batch = _batch(6, seed)
        opt.accumulate(engine, _loss_fn(engine, batch), 6)
        opt.step()
    stored = opt._anchor if method == "disk" else [t for snapshot in opt._snapshots for t in snapshot]
    storage = {t.data_ptr() for t in stored}
    seen = []
    gradient_points = opt.gradient_points

    def spy():  # every micro-batch's points: their tensors are the stored ones, not copies
        points = gradient_points()
        seen.append([v for _, values in points if values is not None for v in values.values()])
        return points

    opt.gradient_points = spy
    batch = _batch(6, 20)

    def presum(splits):
        opt.zero_grad()
        for rows in splits:
            part = {k: v[rows] for k, v in batch.items()}
            opt.accumulate(engine, _loss_fn(engine, part), len(rows))
        sums = opt._local_sums()
        return flat([sums[p].clone() for p in params])

    engine.verify_first_backward = True  # the ordinary backward through the points = the engine's combination
    whole = presum([[0, 1, 2, 3, 4, 5]])
    assert not engine.verify_first_backward  # the check ran, and passed
    split = presum([[5, 2], [0], [1, 3, 4]])
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
    assert len(seen) == 4 and all(len(values) == len(stored) for values in seen)
    assert all(v.data_ptr() in storage for values in seen for v in values)
    if method == "disk":  # formed once for the step: x_t + gamma (x_t - x_{t-1}) at every micro-batch
        gamma = opt.gamma
        for value, x, x_prev in zip(seen[-1], params, before):
            torch.testing.assert_close(value, x + gamma * (x - x_prev), rtol=1e-12, atol=1e-15)
    opt.zero_grad()


def test_snapshot_values_are_not_copied_and_carry_the_gradient_to_x():
    params = [torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64)) for _ in range(2)]
    values = [torch.randn(3, 2, dtype=torch.float64) for _ in range(2)]
    points = with_identity_gradient(params, values)
    assert all(torch.equal(p, v) and p.data_ptr() == v.data_ptr() for p, v in zip(points, values))
    weights = [torch.randn(3, 2, dtype=torch.float64) for _ in range(2)]
    sum((w * p.pow(2)).sum() for w, p in zip(weights, points)).backward()
    for param, w, v in zip(params, weights, values):
        torch.testing.assert_close(param.grad, 2 * w * v, rtol=0, atol=0)


def test_first_order_two_lerp_form_resumes_from_the_general_form():
    lowpass = LowPassFilter((1 / 11, 1 / 11), (-9 / 11,))
    assert lowpass.state_scale == pytest.approx(10 / 11)
    g = torch.Generator().manual_seed(0)
    seq = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(6)]
    reference = LowPassPostprocessor(lowpass)
    out = [reference([x.clone()])[0] for x in seq]
    resumed = LowPassPostprocessor(lowpass)
    for x in seq[:3]:
        resumed([x.clone()])
    state = resumed.state_dict(["p"])
    assert state["state_scale"] == lowpass.state_scale
    state = {**state, "state_scale": None,
             "buffers": [{"p": z["p"] * lowpass.state_scale} for z in state["buffers"]]}
    fresh = LowPassPostprocessor(lowpass)
    fresh.load_state_dict(state, ["p"])
    for x, expected in zip(seq[3:], out[3:]):
        torch.testing.assert_close(fresh([x.clone()])[0], expected, rtol=1e-12, atol=1e-15)


def _causal_batch(n: int, seed: int) -> dict:
    batch = padded_batch(n, seed=seed, causal=True, pad_id=0)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.parametrize("method,kw",
                         [("disk", {"kappa": 0.7, "gamma": 0.2}), ("pmlf", {"k": 3, "beta": 0.5})])
def test_points_of_tied_weights_in_micro_batches_equal_the_per_example_reference(method, kw):
    """GPT-2's tied embedding/LM head: the stored point is one tensor for both uses, in every micro-batch."""
    model = tiny_gpt2()
    model.eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    engine = GhostClippingEngine(model, verify_first_backward=True)
    opt = make_dp_optimizer(model.parameters(), base=torch.optim.SGD, method=method, method_args=kw,
                            noise_multiplier=0.0, per_sample_max_grad_norm=0.5, expected_batch_size=4, seed=1, lr=0.5)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    history = [[p.detach().clone() for p in params]]

    def loss_fn(part):
        return lambda values: per_example_loss(
            engine.call_model(values, input_ids=part["input_ids"],
                              attention_mask=part["attention_mask"]).logits,
            part["labels"], causal_lm=True)

    for seed in range(3):
        batch = _causal_batch(4, seed)
        opt.zero_grad()
        opt.accumulate(engine, loss_fn(batch), 4)
        opt.step()
        history.append([p.detach().clone() for p in params])
    x = history[-1]
    if method == "disk":
        c = (1 - kw["kappa"]) / (kw["kappa"] * kw["gamma"])
        points = [(1 - c, x), (c, [xt + kw["gamma"] * (xt - xp) for xt, xp in zip(x, history[-2])])]
    else:
        weights = [kw["beta"] ** j for j in range(kw["k"])]
        points = [(w / sum(weights), history[-1 - j]) for j, w in enumerate(weights)]
    batch = _causal_batch(5, 50)
    opt.zero_grad()
    for rows in ([0, 3], [1, 2, 4]):
        opt.accumulate(engine, loss_fn({k: v[rows] for k, v in batch.items()}), len(rows))
    sums = opt._local_sums()
    expected = [torch.zeros_like(p) for p in params]
    for i in range(5):  # float64, one example at a time, no padding, plain autograd
        ids = batch["input_ids"][i : i + 1, : int(batch["attention_mask"][i].sum())]
        v = [torch.zeros_like(p) for p in params]
        for weight, values in points:
            leaves = [t.clone().requires_grad_(True) for t in values]
            logits = torch.func.functional_call(model, dict(zip(names, leaves)), args=(),
                                                kwargs={"input_ids": ids}).logits
            for acc, grad in zip(v,
                    torch.autograd.grad(per_example_loss(logits, ids, causal_lm=True).sum(), leaves)):
                acc += weight * grad
        factor = clip_factors(flat(v).norm().reshape(1), 0.5)[0]
        for acc, grad in zip(expected, v):
            acc += factor * grad
    torch.testing.assert_close(flat([sums[p] for p in params]), flat(expected), rtol=1e-10, atol=1e-13)


def test_disk_two_points_with_a_negative_weight_in_float32_train_and_keep_sensitivity_c():
    """c > 1 (gamma below the one-pass value): the combination's negative weight makes the step's sums float64
    (precise mode) after a first step of one point in float32; the one-`lerp` filter takes both. float32, the
    clipped sum moves by at most C when one example is removed, over two micro-batches."""
    model = tiny_roberta(num_labels=1, dtype=torch.float32)
    model.eval()
    engine = GhostClippingEngine(model)
    opt = make_dp_optimizer(model.parameters(), base=torch.optim.SGD, method="disk",
                            method_args={"kappa": 0.7, "gamma": 0.2}, noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
                            expected_batch_size=4, seed=3, lr=0.2)
    params = [p for p in model.parameters() if p.requires_grad]

    def presum(batch, splits):
        opt.zero_grad()
        for rows in splits:
            part = {k: v[rows] for k, v in batch.items()}
            opt.accumulate(engine, lambda values, part=part: per_example_loss(
                engine.call_model(values, input_ids=part["input_ids"],
                                  attention_mask=part["attention_mask"]).logits,
                part["labels"], causal_lm=False), len(rows))
        sums = opt._local_sums()
        return flat([sums[p].float() for p in params])

    for seed in (1, 2, 3):
        batch = {k: v.float() if v.is_floating_point() else v for k, v in _batch(4, seed).items()}
        batch["labels"][0] = 30.0  # clipped
        presum(batch, [[0, 1], [2, 3]])
        opt.step()
    assert opt.gradient_points()[0][0] < 0 and all(f.dtype == torch.float32 for f in opt._filtered)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in _batch(5, 9).items()}
    batch["labels"][0] = 50.0
    whole = presum(batch, [[0, 1], [2, 3, 4]])
    for i in range(5):
        without = presum(batch, [[j for j in rows if j != i] for rows in ([0, 1], [2, 3, 4])])
        assert (whole - without).norm() <= 1.0 + 1e-4
    opt.zero_grad()
