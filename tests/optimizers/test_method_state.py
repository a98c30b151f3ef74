"""A method's state round trip, where the cheaper steps keep it in place.

* DiSK's stored x_{t-1} holds the look-ahead point from a step's first micro-batch to its optimizer step: a
  ``state_dict()`` taken in between (a callback, a save while a step is refused) resumes that step exactly, at
  noise 0, bit for bit (x_{t-1} is not recovered from the point by a division by gamma);
* the loaded method state lies on the parameters' device (the Trainer loads ``optimizer.pt`` on the CPU when
  one GPU trains): here a CPU checkpoint loaded for parameters on the ``meta`` device, and on CUDA a resumed
  step.

float32, the tiny RoBERTa of tests/models.py, no dropout, SGD.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import padded_batch, tiny_roberta

from hf_dpfilter import GhostClippingEngine, make_dp_optimizer
from hf_dpfilter.losses.tasks import per_example_loss

STATEFUL = [("disk", {"kappa": 0.7}), ("pmlf", {"k": 2}), ("doppler", {})]


def _batch(n: int, seed: int) -> dict:
    batch = padded_batch(n, seed=seed)
    batch["labels"] = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    return batch


def _step(opt, engine, seed: int, n: int = 4, split: int | None = None, between=None) -> None:
    """One logical step of ``n`` examples in two micro-batches; ``between(opt)`` runs after the first."""
    batch = {k: v.to(engine.model.device) for k, v in _batch(n, seed).items()}
    opt.zero_grad()
    for i, rows in enumerate(([*range(split or n // 2)], [*range(split or n // 2, n)])):
        part = {k: v[rows] for k, v in batch.items()}
        inputs = {k: v for k, v in part.items() if k != "labels"}

        def loss_fn(values, inputs=inputs, labels=part["labels"]):
            return per_example_loss(engine.call_model(values, **inputs).logits.float(), labels,
                                    causal_lm=False)

        opt.accumulate(engine, loss_fn, len(rows))
        if i == 0 and between is not None:
            between(opt)
    opt.step()


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors of a (nested) method state, in order."""
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def _private(model, method: str, kw: dict):
    model.eval()
    return GhostClippingEngine(model), make_dp_optimizer(
        model.parameters(), base=torch.optim.SGD, method=method, method_args=kw, noise_multiplier=0.0,
        per_sample_max_grad_norm=0.5, expected_batch_size=4, seed=3, lr=0.05)


def _spy_points(opt) -> list[list[torch.Tensor]]:
    """Record the look-ahead point's values that every micro-batch evaluates."""
    seen, gradient_points = [], opt.gradient_points

    def spy():
        points = gradient_points()
        seen.append([v.clone() for _, values in points if values is not None for v in values.values()])
        return points

    opt.gradient_points = spy
    return seen


def test_disk_state_dict_inside_a_step_resumes_that_step_exactly():
    model = tiny_roberta(num_labels=1).float()
    # gamma = 1/19: x_{t-1} from the point loses digits
    engine, opt = _private(model, "disk", {"kappa": 0.95})
    for seed in (1, 2, 3):
        _step(opt, engine, seed)
    saved = {}

    def save(optimizer):  # between the micro-batches: the stored x_{t-1} holds the look-ahead point
        saved["model"], saved["optimizer"] = copy.deepcopy(model), copy.deepcopy(optimizer.state_dict())

    points = _spy_points(opt)
    _step(opt, engine, 4, between=save)
    _step(opt, engine, 5)
    resumed_model = saved["model"]
    resumed_engine, resumed = _private(resumed_model, "disk", {"kappa": 0.95})
    resumed.load_state_dict(saved["optimizer"])
    resumed_points = _spy_points(resumed)
    _step(resumed, resumed_engine, 4)  # the interrupted step, redone from its start
    _step(resumed, resumed_engine, 5)
    assert len(points) == len(resumed_points) == 4
    for here, there in zip(points, resumed_points):  # the same look-ahead points, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(here, there))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    for name in ("filtered", "anchor"):
        for a, b in zip(_tensors(opt.method_state_dict()[name]), _tensors(resumed.method_state_dict()[name])):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("method,kw", STATEFUL)
def test_loaded_method_state_lies_on_the_parameters_device(method, kw):
    model = tiny_roberta(num_labels=1).float()
    engine, opt = _private(model, method, kw)
    for seed in (1, 2):
        _step(opt, engine, seed)
    state = opt.state_dict()
    _, on_meta = _private(copy.deepcopy(model).to("meta"), method, kw)
    on_meta.load_state_dict(state)
    tensors = _tensors(on_meta.method_state_dict())
    assert tensors and all(t.device.type == "meta" for t in tensors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU-loaded checkpoint, one GPU)")
@pytest.mark.parametrize("method,kw", STATEFUL)
def test_cpu_loaded_method_state_resumes_on_cuda(method, kw):
    model = tiny_roberta(num_labels=1).float().cuda()
    engine, opt = _private(model, method, kw)
    for seed in (1, 2):
        _step(opt, engine, seed)
    state = opt.state_dict()
    on_cpu = {"base": state["base"], "dp": copy.deepcopy(state["dp"])}

    def to_cpu(obj):
        if isinstance(obj, dict):
            return {k: to_cpu(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [to_cpu(v) for v in obj]
        return obj.cpu() if isinstance(obj, torch.Tensor) else obj

    on_cpu["dp"]["method_state"] = to_cpu(on_cpu["dp"]["method_state"])
    resumed_model = copy.deepcopy(model)
    resumed_engine, resumed = _private(resumed_model, method, kw)
    resumed.load_state_dict(on_cpu)
    _step(opt, engine, 3)
    _step(resumed, resumed_engine, 3)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved,resumed,match", [
    (("pmlf", {"k": 3}), ("pmlf", {"k": 2}), "resume with the checkpoint's k"),  # 3 points used silently
    # IndexError
    (("doppler", {}), ("doppler", {"preset": "second_order"}), "of order 1 and this run's of order 2"),
    # silent
    (("doppler", {"preset": "second_order"}), ("doppler", {}), "of order 2 and this run's of order 1"),
])
def test_a_checkpoint_of_other_method_settings_is_refused_before_any_step(saved, resumed, match):
    model = tiny_roberta(num_labels=1).float()
    engine, opt = _private(model, *saved)
    for seed in (1, 2, 3):
        _step(opt, engine, seed)
    _, other = _private(model, *resumed)
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(opt.state_dict())
