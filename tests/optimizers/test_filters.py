"""DOPPLER, DiSK and DP-PMLF: reductions, per-example exactness, sensitivity, checkpoints, DPTrainer smoke.

float64 throughout, tiny models from tests/models.py, dropout off.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, padded_batch, tiny_roberta
from scipy.signal import lfilter

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine, make_dp_optimizer
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.optimizers.filters import FILTER_PRESETS, LowPassFilter, LowPassPostprocessor

# ----------------------------------------------------------------------------------------------- helpers


def _regression_batch(batch_size: int, seed: int, extreme: float | None = None) -> dict:
    """RoBERTa regression batch (num_labels=1); example 0 gets a wildly wrong label when ``extreme`` is
    set."""
    batch = padded_batch(batch_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    batch["labels"] = torch.randn(batch_size, generator=g, dtype=torch.float64)
    if extreme is not None:
        batch["labels"][0] = extreme
    return batch


def _loss_fn(model, engine, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss_fn(values):
        out = engine.call_model(values, **inputs)  # model(**inputs) at the given parameter values
        return per_example_loss(out.logits, batch["labels"], causal_lm=False)

    return loss_fn


def _setup(method, base=torch.optim.SGD, num_labels=1, noise=0.5, max_grad_norm=1.0, verify=True,
           method_args=None,
           **kw):
    """Model, engine and DP optimizer; ``method_args`` are the method's settings, ``kw`` the base
    optimizer's."""
    model = tiny_roberta(num_labels=num_labels)
    model.eval()  # no dropout (the tiny models have p = 0 anyway)
    engine = GhostClippingEngine(model, verify_first_backward=verify)  # the clipping norm is the optimizer's
    kw.setdefault("lr", 0.05)
    opt = make_dp_optimizer(
        model.parameters(), base=base, method=method, method_args=method_args, noise_multiplier=noise,
        per_sample_max_grad_norm=max_grad_norm, expected_batch_size=4, seed=7, **kw,
    )
    return model, engine, opt


def _step(model, engine, opt, batch):
    opt.zero_grad()
    opt.accumulate(engine, _loss_fn(model, engine, batch), batch_size=batch["labels"].shape[0])
    opt.step()


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _presum(model, engine, opt, batch, accumulate=None):
    """The pre-noise aggregate that accumulate leaves in the optimizer's own buffer (flattened)."""
    opt.zero_grad()
    (accumulate or opt.accumulate)(engine, _loss_fn(model, engine, batch), batch["labels"].shape[0])
    assert all(p.grad is None for p in _params(model))  # the clipped sum never goes through p.grad
    sums = opt._local_sums()
    out = flat([sums[p].clone() if p in sums else torch.zeros_like(p) for p in _params(model)])
    opt.zero_grad()
    return out


def _drop(batch, i):
    keep = [j for j in range(batch["labels"].shape[0]) if j != i]
    return {k: v[keep] for k, v in batch.items()}


# ------------------------------------------------------------------------------------- 1. reductions


@pytest.mark.parametrize("preset", sorted(FILTER_PRESETS))
def test_filter_matches_lfilter_and_bias_is_cumulative_impulse_response(preset):
    b, a = FILTER_PRESETS[preset]
    steps = 40
    g = torch.Generator().manual_seed(0)
    seq = torch.randn(steps, 3, 4, generator=g, dtype=torch.float64)
    post = LowPassPostprocessor(LowPassFilter(b, a))
    out = torch.stack([post([x.clone()])[0] for x in seq])
    raw = lfilter(b, [1.0, *a], seq.numpy(), axis=0)
    impulse = lfilter(b, [1.0, *a], np.eye(1, steps)[0])
    bias = np.cumsum(impulse)
    step_response = lfilter(b, [1.0, *a], np.ones(steps))
    np.testing.assert_allclose(bias, step_response, rtol=1e-12, atol=1e-14)
    expected = raw / bias[:, None, None]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(out[0], seq[0], rtol=1e-15, atol=0)  # m_hat_0 = g_0 (to rounding)


def test_custom_filter_matches_lfilter_and_checks_its_coefficients():
    b, a = [0.3, -0.1, 0.05, 0.02], [-0.5, 0.2, -0.03]  # n_b = 3, n_a = 3, rescaled to unit DC gain
    scale = (1 + sum(a)) / sum(b)
    b = [x * scale for x in b]
    seq = torch.randn(30, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    post = LowPassPostprocessor(LowPassFilter(b, a))
    out = torch.stack([post([x.clone()])[0] for x in seq]).numpy()
    expected = lfilter(b, [1.0, *a], seq.numpy(),
                       axis=0) / np.cumsum(lfilter(b, [1.0, *a], np.eye(1, 30)[0]))[:, None]
    np.testing.assert_allclose(out, expected, rtol=1e-11, atol=1e-13)
    assert len(post.buffers) == 3  # max(n_a, n_b) state buffers
    with pytest.raises(ValueError, match="unit DC gain"):
        LowPassFilter([0.1], [0.9])  # wrong sign convention
    with pytest.raises(ValueError, match="unstable"):
        LowPassFilter([-0.2], [-1.2])  # pole at 1.2, unit DC gain
    with pytest.raises(ValueError, match="b_0 = 0"):
        LowPassFilter([0.0, 0.1], [-0.9])


def _record_privatized(opt):
    """Instrument ``opt.privatize`` to keep each step's privatized gradient (flattened)."""
    privatized = []
    original = opt.privatize

    def recording_privatize(sums):
        out = original(sums)
        privatized.append(flat([t.clone() for t in out.values()]))
        return out

    opt.privatize = recording_privatize
    return privatized


def test_doppler_momentum_preset_is_bias_corrected_ema():
    model, engine, opt = _setup("doppler", method_args={"preset": "momentum"}, lr=0.1)
    privatized = _record_privatized(opt)
    ema = None
    for t in range(5):
        before = flat([p.detach().clone() for p in _params(model)])
        _step(model, engine, opt, _regression_batch(4, seed=t))
        g = privatized[-1]
        ema = 0.1 * g if ema is None else 0.9 * ema + 0.1 * g
        m_hat = ema / (1 - 0.9 ** (t + 1))
        after = flat([p.detach() for p in _params(model)])
        torch.testing.assert_close(after - before, -0.1 * m_hat, rtol=1e-10, atol=1e-14)


def test_disk_filter_starts_at_g0_and_weights_kappa_on_the_new_gradient():
    model, engine, opt = _setup("disk", method_args={"kappa": 0.7}, lr=0.1)
    privatized = _record_privatized(opt)
    filtered = None
    for t in range(4):
        before = flat([p.detach().clone() for p in _params(model)])
        _step(model, engine, opt, _regression_batch(4, seed=t))
        g = privatized[-1]
        filtered = g if filtered is None else 0.3 * filtered + 0.7 * g
        after = flat([p.detach() for p in _params(model)])
        torch.testing.assert_close(after - before, -0.1 * filtered, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("base", ["adam_bc", "adam"])
def test_lp_dpadam_directions(base):
    beta2, eps, phi = 0.99, 1e-8, 0.05
    bias_correct_noise = base == "adam_bc"
    seq = torch.randn(12, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b, a = FILTER_PRESETS["first_order_v2"]
    post = LowPassPostprocessor(LowPassFilter(b, a), base=base, beta2=beta2, eps=eps)
    out = np.stack([post([x.clone()], noise_variance=phi)[0].numpy() for x in seq])
    g = seq.numpy()
    m_hat = lfilter(b, [1.0, *a], g, axis=0) / np.cumsum(lfilter(b, [1.0, *a], np.eye(1, 12)[0]))[:, None]
    v = lfilter([1 - beta2], [1.0, -beta2], g**2, axis=0)  # v from the UNFILTERED gradient
    v_hat = v / (1 - beta2 ** np.arange(1, 13))[:, None]
    denom = np.sqrt(np.maximum(v_hat - phi, eps)) if bias_correct_noise else np.maximum(np.sqrt(v_hat), eps)
    np.testing.assert_allclose(out, m_hat / denom, rtol=1e-10)


def _trajectory(method, steps=4, base=torch.optim.AdamW, **kw):
    model, engine, opt = _setup(method, base=base, **kw)
    for t in range(steps):
        _step(model, engine, opt, _regression_batch(3 + t % 3, seed=t))
    return _params(model)


def test_disk_kappa_one_equals_base_dp_optimizer_exactly():
    reference = _trajectory("dpsgd")
    for gamma in (None, 0.5):
        got = _trajectory("disk", method_args={"kappa": 1.0, "gamma": gamma})
        for p, q in zip(got, reference):
            assert torch.equal(p, q)


def test_disk_adam_step_match_is_the_scaled_learning_rate():
    # The lr rule sqrt(kappa / (2 - kappa)) applied by the optimizer equals the user scaling the lr by hand,
    # and leaves the user's lr in param_groups (LR schedulers and checkpoints see their own values).
    factor = math.sqrt(0.7 / 1.3)
    matched = _trajectory("disk", method_args={"kappa": 0.7, "adam_step_match": True}, lr=0.05, noise=0.0)
    by_hand = _trajectory("disk", method_args={"kappa": 0.7}, lr=0.05 * factor, noise=0.0)
    unmatched = _trajectory("disk", method_args={"kappa": 0.7}, lr=0.05, noise=0.0)
    for p, q in zip(matched, by_hand):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert not all(torch.allclose(p, r) for p, r in zip(matched, unmatched))
    model, engine, opt = _setup("disk", base=torch.optim.AdamW, method_args={"adam_step_match": True},
                                lr=0.05)
    _step(model, engine, opt, _regression_batch(3, seed=0))
    assert [g["lr"] for g in opt.param_groups] == [0.05]
    with pytest.raises(ValueError, match="disk: adam_step_match.*SGD"):
        _setup("disk", base=torch.optim.SGD, method_args={"adam_step_match": True})
    args = DPTrainingArguments(output_dir="unused", dp_method="disk", noise_multiplier=1.0,
                               dp_method_args={"adam_step_match": True}, report_to=[], use_cpu=True)
    assert args.dp_method_args["adam_step_match"] is True


def test_doppler_adam_with_the_momentum_filter_is_dp_adam():
    # LP-DPAdam: the filter replaces Adam's first moment, so the EMA filter b = [0.1], a = [-0.9] is DP-Adam
    # (up to where eps enters: max(sqrt(v_hat), eps) here, sqrt(v_hat) + eps in torch; both negligible).
    reference = _trajectory("dpsgd", base=torch.optim.Adam, eps=0.0)
    got = _trajectory("doppler", base=torch.optim.SGD,
                      method_args={"preset": "momentum", "base": "adam", "eps": 1e-300})
    for p, q in zip(got, reference):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("base", ["optimizer", "adam", "adam_bc"])
def test_pmlf_k_one_equals_doppler_exactly(base):
    reference = _trajectory("doppler", base=torch.optim.SGD, method_args={"preset": "f1", "base": base})
    got = _trajectory("pmlf", base=torch.optim.SGD, method_args={"k": 1, "preset": "f1", "base": base})
    for p, q in zip(got, reference):
        assert torch.equal(p, q)


def test_pmlf_beta_changes_the_update():
    a = _trajectory("pmlf", method_args={"k": 2, "beta": 0.1})
    b = _trajectory("pmlf", method_args={"k": 2, "beta": 0.9})
    assert not all(torch.equal(p, q) for p, q in zip(a, b))


# ------------------------------------------------------------------------------ per-example exactness


def _reference_sum(model, batch, points, max_grad_norm):
    """sum_i clip(sum_j w_j grad f(x_j; xi_i)), one example at a time, plain autograd, no padding."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in _params(model)]
    for i in range(batch["labels"].shape[0]):
        length = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i : i + 1, :length]
        v = [torch.zeros_like(p) for p in _params(model)]
        for weight, values in points:
            leaves = [x.detach().clone().requires_grad_(True) for x in values]
            out = torch.func.functional_call(model, dict(zip(names, leaves)), args=(),
                                             kwargs={"input_ids": ids})
            loss = per_example_loss(out.logits, batch["labels"][i : i + 1], causal_lm=False).sum()
            for acc, grad in zip(v, torch.autograd.grad(loss, leaves)):
                acc += weight * grad
        norm = flat(v).norm()
        factor = clip_factors(norm.reshape(1), max_grad_norm)[0]
        for acc, grad in zip(total, v):
            acc += factor * grad
    return flat(total)


@pytest.mark.parametrize(
    "method,kw",
    [
        ("disk", {"kappa": 0.7, "gamma": 0.5}),  # c = 6/7
        ("disk", {"kappa": 0.7, "gamma": 0.2}),  # c = 15/7 > 1 (extrapolation)
        ("disk", {"kappa": 0.7}),  # one pass at x + (3/7) d
        ("pmlf", {"k": 3, "beta": 0.5}),
    ],
)
def test_one_step_clipped_sum_equals_per_example_reference(method, kw):
    model, engine, opt = _setup(method, base=torch.optim.AdamW, noise=0.3, max_grad_norm=0.5, lr=0.05,
                                method_args=kw)
    history = [[p.detach().clone() for p in _params(model)]]
    for t in range(3):
        _step(model, engine, opt, _regression_batch(4, seed=10 + t))
        history.append([p.detach().clone() for p in _params(model)])
    x = history[-1]
    if method == "disk":
        kappa, gamma = kw["kappa"], kw.get("gamma", (1 - kw["kappa"]) / kw["kappa"])
        c = (1 - kappa) / (kappa * gamma)
        shifted = [torch.add(xt, xt - xp, alpha=gamma) for xt, xp in zip(x, history[-2])]  # d = real change
        points = [(1 - c, x), (c, shifted)]
    else:
        weights = [0.5**j for j in range(kw["k"])]
        points = [(w / sum(weights), history[-1 - j]) for j, w in enumerate(weights)]
    batch = _regression_batch(5, seed=99)
    got = _presum(model, engine, opt, batch)
    expected = _reference_sum(model, batch, [(w, v) for w, v in points if w != 0], max_grad_norm=0.5)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 1e-10, f"{method} {kw}: relative error {rel:.2e}"


# -------------------------------------------------------------------------------------- 2. sensitivity

MODES = [
    ("disk", {"kappa": 0.7}),  # one pass
    ("disk", {"kappa": 0.7, "gamma": 0.2}),  # two points, c > 1
    ("disk", {"kappa": 0.7, "gamma": 0.5}),  # two points, c < 1
    ("pmlf", {"k": 2, "beta": 0.5}),
    ("pmlf", {"k": 3, "beta": 0.9}),
    ("doppler", {}),
]


def _broken_accumulate(opt):
    """The public codes' mistake: clip each gradient point's per-example gradient separately, then sum."""

    def accumulate(engine, loss_fn, batch_size):
        for _, values in opt.gradient_points():
            with engine.record(batch_size=batch_size):
                losses = loss_fn(values)
            grads = engine.per_example_gradients(losses)
            factors = clip_factors(grads.clipping_norms(), opt.max_grad_norm, opt.clipping_fn)
            opt.add_to_sums(grads.weighted_sum(factors))  # into the optimizer's own buffer, like accumulate()

    return accumulate


@pytest.mark.parametrize("method,kw", MODES)
def test_remove_one_example_moves_presum_by_at_most_C(method, kw):
    C = 1.0
    model, engine, opt = _setup(method, base=torch.optim.SGD, noise=1.0, max_grad_norm=C, lr=0.2,
                                method_args=kw)
    for t in range(2):  # build up d / snapshots / filter state
        _step(model, engine, opt, _regression_batch(4, seed=20 + t, extreme=30.0))
    assert opt.sensitivity() == C  # no rescaling of the noise
    points = opt.gradient_points()
    assert len(points) == {"disk": 2 if "gamma" in kw else 1, "pmlf": min(kw.get("k", 1), 3),
                           "doppler": 1}[method]
    batch = _regression_batch(5, seed=5, extreme=1e4)  # example 0: a wildly wrong label, a huge gradient
    full = _presum(model, engine, opt, batch)
    moves = [(full - _presum(model, engine, opt, _drop(batch, i))).norm().item() for i in (0, 3)]
    assert max(moves) <= C + 1e-9, moves
    assert moves[0] > 0.99 * C  # the extreme example is really clipped (its contribution has norm ~C)
    if len(points) > 1:  # the test has teeth: clipping the points separately exceeds C
        broken = _broken_accumulate(opt)
        full_b = _presum(model, engine, opt, batch, accumulate=broken)
        move_b = (full_b - _presum(model, engine, opt, _drop(batch, 0), accumulate=broken)).norm().item()
        assert move_b > 1.5 * C, f"the broken variant should exceed C, got {move_b}"


# ----------------------------------------------------------------------------------- 3. checkpoints

CHECKPOINT_CASES = [  # (method, base, method_args, base optimizer settings)
    ("disk", torch.optim.AdamW, {"kappa": 0.7}, {}),
    ("disk", torch.optim.SGD, {"kappa": 0.6, "gamma": 0.5}, {"momentum": 0.9}),
    ("doppler", torch.optim.SGD, {"preset": "second_order", "base": "adam_bc"}, {}),
    ("doppler", torch.optim.SGD, {"preset": "f6", "base": "adam"}, {}),
    ("doppler", torch.optim.Adam, {"preset": "f6"}, {}),
    ("pmlf", torch.optim.SGD, {"k": 3, "beta": 0.5, "preset": "pmlf_cifar"}, {}),
    ("pmlf", torch.optim.SGD, {"k": 2, "base": "adam_bc"}, {}),
]


@pytest.mark.parametrize("method,base,method_args,kw", CHECKPOINT_CASES)
def test_checkpoint_round_trip_resumes_exactly(method, base, method_args, kw):
    # noise 0: a loaded DP optimizer draws fresh noise (no generator state is saved, docs/threat_model.md),
    # so the exact round trip of the filter state is checked without noise
    kw = {**kw, "method_args": method_args, "noise": 0.0}
    batches = [_regression_batch(3 + t % 2, seed=40 + t) for t in range(6)]
    model, engine, opt = _setup(method, base=base, **kw)
    for batch in batches:
        _step(model, engine, opt, batch)
    uninterrupted = _params(model)

    model, engine, opt = _setup(method, base=base, **kw)
    for batch in batches[:3]:
        _step(model, engine, opt, batch)
    buffer = io.BytesIO()
    torch.save({"model": copy.deepcopy(model.state_dict()), "optimizer": opt.state_dict()}, buffer)
    del model, engine, opt
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, engine, opt = _setup(method, base=base, **kw)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    for batch in batches[3:]:
        _step(model, engine, opt, batch)
    for p, q in zip(_params(model), uninterrupted):
        assert torch.equal(p, q)
    assert opt.dp_steps == 6


def _train(out_dir, method, kw, resume=None, cls=DPTrainer):
    model = tiny_roberta()
    args = DPTrainingArguments(
        output_dir=out_dir, dp_method=method, noise_multiplier=1.0, logical_batch_size=4,
        per_device_train_batch_size=2, max_steps=6, learning_rate=1e-2, lr_scheduler_type="constant",
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=3, remove_unused_columns=False,
        dp_seed=0, seed=3, **kw,
    )
    examples = make_examples(16, VOCAB, causal=False, seed=1)
    trainer = cls(model=model, args=args, train_dataset=ListDataset(examples), data_collator=PadCollator(1))
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in model.parameters()], trainer


@pytest.mark.parametrize(
    "method,kw",
    [
        ("disk", {"dp_method_args": {"gamma": 0.5}}),
        ("doppler", {"dp_method_args": {"preset": "second_order"}}),
        ("pmlf", {"dp_method_args": {"k": 3}}),
    ],
)
def test_dptrainer_checkpoint_resume_restores_the_filter_state(method, kw, tmp_path):
    """The resumed DPTrainer's optimizer holds exactly the checkpoint's state (filter, base optimizer,
    accountant) before its first step; its noise and batches are then fresh, so the run is not
    bit-identical."""
    _train(str(tmp_path / "a"), method, kw)
    saved = torch.load(tmp_path / "a" / "checkpoint-3" / "optimizer.pt", weights_only=False)
    loaded = {}

    class Capture(DPTrainer):
        def _begin_privacy_session(self):
            loaded.update(copy.deepcopy(self.dp_optimizer.state_dict()))
            return super()._begin_privacy_session()

    _, trainer = _train(str(tmp_path / "b"), method, kw, resume=str(tmp_path / "a" / "checkpoint-3"),
                        cls=Capture)

    def same(a, b):
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    assert loaded["dp"]["method_state"] and same(loaded, saved)
    # run "a" released 6 steps from this lineage before the branch resumed its checkpoint-3 into "b": the
    # branch's ledger continues a's (PrivacyLedger: continued_from), so its 3 new steps come on top of those 6
    assert trainer.privacy_report()["steps"] == 6 + 3


# ------------------------------------------------------------------------------------- 4. DPTrainer


@pytest.mark.parametrize(
    "method,kw",
    [
        ("disk", {}),
        ("disk", {"dp_method_args": {"gamma": 0.5}}),
        ("doppler", {}),
        ("doppler", {"dp_method_args": {"base": "adam_bc"}, "optim": "sgd", "learning_rate": 0.1}),
        ("pmlf", {}),
    ],
)
def test_dptrainer_smoke(method, kw, tmp_path):
    model = tiny_roberta()
    examples = make_examples(16, VOCAB, causal=False, seed=1)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), dp_method=method, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=4, per_device_train_batch_size=2, max_steps=3,
        learning_rate=kw.pop("learning_rate", 1e-3),
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0,
        logging_steps=1, **kw,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    before = flat([p.detach().clone() for p in model.parameters()])
    result = trainer.train()
    assert math.isnan(result.training_loss)  # a private run returns no noiseless training loss
    assert torch.isfinite(flat([p.detach() for p in model.parameters()])).all()
    report = trainer.privacy_report()
    assert report["method"] == method and report["steps"] == 3
    assert math.isfinite(report["epsilon"]) and report["epsilon"] > 0
    assert trainer.dp_optimizer.method_name == method
    assert not torch.equal(before, flat([p.detach() for p in model.parameters()]))


def test_bad_hyperparameters_give_clear_errors():
    params = [torch.nn.Parameter(torch.zeros(2))]
    common = {"lr": 0.1, "noise_multiplier": 1.0, "per_sample_max_grad_norm": 1.0, "expected_batch_size": 4}
    with pytest.raises(ValueError, match="disk: kappa"):
        make_dp_optimizer(params, method="disk", method_args={"kappa": 0.0}, **common)
    with pytest.raises(ValueError, match="disk: gamma"):
        make_dp_optimizer(params, method="disk", method_args={"gamma": 0.0}, **common)
    with pytest.raises(ValueError, match="pmlf: k"):
        make_dp_optimizer(params, method="pmlf", method_args={"k": 0}, **common)
    with pytest.raises(ValueError, match="optim='sgd'"):
        make_dp_optimizer(params, base=torch.optim.AdamW, method="doppler", method_args={"base": "adam_bc"},
                          **common)
    with pytest.raises(ValueError, match="LP-DPAdam direction.*optim='sgd'"):
        make_dp_optimizer(params, base=torch.optim.AdamW, method="doppler", method_args={"base": "adam"},
                          **common)
    with pytest.raises(ValueError, match="pmlf: base='adam'.*optim='sgd'"):
        make_dp_optimizer(params, base=torch.optim.Adam, method="pmlf", method_args={"base": "adam"},
                          **common)
    with pytest.raises(ValueError, match="doppler: unknown preset"):
        make_dp_optimizer(params, method="doppler", method_args={"preset": "nope"}, **common)
    with pytest.raises(ValueError, match="pmlf: a was given without b"):
        make_dp_optimizer(params, method="pmlf", method_args={"a": [-0.9]}, **common)
    # The retired flat names are refused with the field that replaced them (never mapped, never ignored).
    with pytest.raises(ValueError, match=r"'disk_kappa' is no longer accepted.*method_args=\{'kappa'"):
        make_dp_optimizer(params, method="disk", disk_kappa=0.5, **common)
    with pytest.raises(ValueError, match=r"'pmlf_k' is no longer "
                                         r"accepted.*dp_method='pmlf'.*method_args=\{'k'"):
        make_dp_optimizer(params, method="dpsgd", pmlf_k=3, **common)
    with pytest.raises(ValueError, match=r"'secure_noise' was renamed 'secure_rng'"):
        make_dp_optimizer(params, method="dpsgd", secure_noise=True, **common)


def test_filtered_gradient_into_adam_warns_and_names_the_paper_variant():
    params = [torch.nn.Parameter(torch.zeros(2))]
    common = {"lr": 0.1, "noise_multiplier": 1.0, "per_sample_max_grad_norm": 1.0, "expected_batch_size": 4}
    with pytest.warns(UserWarning, match="doppler: base='adam'"):
        make_dp_optimizer(params, base=torch.optim.AdamW, method="doppler", **common)
    with pytest.warns(UserWarning, match="pmlf: base='adam'"):
        make_dp_optimizer(params, base=torch.optim.Adam, method="pmlf", **common)
