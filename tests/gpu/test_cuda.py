"""CUDA checks: CPU/CUDA parity of every method in float64, the noise on CUDA, bf16 autocast on CUDA, and fp16
with the DP loss scaler (Accelerate's fp16 autocast and GradScaler path,
hf_dpfilter/trainers/loss_scaling.py).

Runs only where a CUDA device is visible; elsewhere every test is skipped with the reason shown by
``pytest -rs``. The CUDA-specific code paths it covers: products of bf16 terms with fp32 accumulation on
tensor cores (``torch.bmm(..., out_dtype=torch.float32)``), the clipped sum's three-piece bf16 split, the
one-draw noise on a CUDA generator, and DPTrainer's device placement.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_gpt2, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers import available_methods, make_dp_optimizer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device visible (torch.cuda.is_available() is False): the CUDA parity, noise and bf16 "
    "checks need a GPU; run `python -m pytest -rs tests/gpu/test_cuda.py` on one",
)

METHOD_ARGS = {"pmlf": {"k": 2}}


def _train(method: str, cuda: bool, tmp_path, dtype=torch.float64, bf16: bool = False, steps: int = 3,
           fp16: bool = False, check=None):
    """Parameters after a short DPTrainer run (noise 0, fixed data order) on CPU or on the GPU."""
    model = tiny_roberta(dtype=dtype)
    examples = make_examples(16, VOCAB, causal=False, seed=1)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), dp_method=method, dp_method_args=METHOD_ARGS.get(method),
        noise_multiplier=0.0, per_sample_max_grad_norm=0.05, logical_batch_size=4,
        per_device_train_batch_size=2,
        max_steps=steps, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to=[], use_cpu=not cuda, save_strategy="no", remove_unused_columns=False, dp_seed=0, seed=3,
        bf16=bf16, fp16=fp16,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    before = flat([p.detach().cpu().clone() for p in model.parameters()])
    trainer.train()
    if check is not None:
        check(trainer)
    device = next(model.parameters()).device
    assert device.type == ("cuda" if cuda else "cpu"), device
    return before, flat([p.detach().cpu() for p in model.parameters()])


@pytest.mark.parametrize("method", available_methods())
def test_cpu_cuda_parity_float64(method, tmp_path):
    start, on_cpu = _train(method, cuda=False, tmp_path=tmp_path / "cpu")
    _, on_cuda = _train(method, cuda=True, tmp_path=tmp_path / "cuda")
    moved = (on_cpu - start).norm()
    assert moved > 0
    assert (on_cuda - on_cpu).norm() <= 1e-8 * moved, ((on_cuda - on_cpu).norm(), moved)


def test_noise_std_on_cuda():
    param = torch.nn.Parameter(torch.zeros(200_000, device="cuda"))
    optimizer = make_dp_optimizer(
        [param], base=torch.optim.SGD, lr=1.0, noise_multiplier=2.0, per_sample_max_grad_norm=0.5, expected_batch_size=4,
        sample_rate=0.01, seed=0,
    )
    optimizer.accumulate(None, lambda values: torch.zeros(0), batch_size=0)
    optimizer.step()
    # SGD with lr 1 from 0: the parameter is minus the privatized gradient, N(0, (sigma C / B)^2) per
    # coordinate
    std = float(param.detach().double().std())
    expected = 2.0 * 0.5 / 4
    assert abs(std - expected) < 0.01 * expected, (std, expected)
    assert abs(float(param.detach().double().mean())) < 5 * expected / 200_000**0.5


def test_bf16_autocast_close_to_fp32_on_cuda(tmp_path):
    start, full = _train("dpsgd", cuda=True, tmp_path=tmp_path / "fp32", dtype=torch.float32, steps=1)
    _, mixed = _train("dpsgd", cuda=True, tmp_path=tmp_path / "bf16", dtype=torch.float32, bf16=True, steps=1)
    rel = ((mixed - full).norm() / (full - start).norm()).item()
    assert rel < 0.05, rel


def test_fp16_loss_scaled_step_close_to_fp32_on_cuda(tmp_path):
    """fp16=True on CUDA, the whole path: Accelerate's fp16 autocast on the forward, its GradScaler removed
    (it would skip steps on the private sum), the DP loss scaler's S = 2^10 on the engine's backward and
    divided out before clipping; one step within fp16 rounding of the fp32 step
    (hf_dpfilter/trainers/loss_scaling.py)."""
    dtypes = set()

    def check(trainer):
        assert trainer.accelerator.scaler is None and getattr(trainer.optimizer, "scaler", None) is None
        assert trainer.dp_optimizer.loss_scaler is not None and trainer.engine.loss_scale == 2.0**10
        assert trainer.dp_optimizer.loss_scaler.skipped_steps == 0

    def record_dtype(module, inputs, output):
        dtypes.add(output.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: record_dtype(m, i, o) if isinstance(m, torch.nn.Linear) else None)
    try:
        start, full = _train("dpsgd", cuda=True, tmp_path=tmp_path / "fp32", dtype=torch.float32, steps=1)
        dtypes.clear()
        _, mixed = _train("dpsgd", cuda=True, tmp_path=tmp_path / "fp16", dtype=torch.float32, fp16=True,
                          steps=1,
                          check=check)
    finally:
        hook.remove()
    assert torch.float16 in dtypes, dtypes  # the forward ran under fp16 autocast
    rel = ((mixed - full).norm() / (full - start).norm()).item()
    assert rel < 0.05, rel


def _fp16_scaled_clip_contract(device: str) -> None:
    """Under fp16 autocast with S = 2^10 the clipping norm bounds the exact norm of the stored terms divided
    by S (those of S g_i), and each clipped contribution is finite and within C."""
    from test_precision import _exact_norms

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, 48, generator=g)
    x[3] *= 1e-4  # tiny activations: output gradients that fp16 would lose unscaled
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    engine.loss_scale = 2.0**10
    with torch.autocast(device, dtype=torch.float16), engine.record(batch_size=6):
        losses = model(x.to(device)).float().pow(2).sum(dim=(1, 2))
    grads = engine.per_example_gradients(losses)
    exact = _exact_norms(grads) / 2.0**10
    bounds = grads.clipping_norms().double().cpu()
    assert bool((bounds >= exact).all()), (bounds, exact)
    factors = (1e-2 / (grads.clipping_norms() + 1e-6)).clamp(max=1.0)
    for i in range(6):
        coefficient = torch.zeros(6, device=device)
        coefficient[i] = factors[i]
        released = grads.weighted_sum(coefficient)
        norm = sum(float(v.double().pow(2).sum()) for v in released.values()) ** 0.5
        assert norm <= 1e-2 * (1 + 1e-3), (i, norm)


def test_fp16_scaled_clip_contract_on_cuda():
    _fp16_scaled_clip_contract("cuda")


@pytest.mark.parametrize("tf32", [False, True])
def test_bf16_clip_contract_on_cuda(tf32):
    """The precision contract (docs/privacy.md) on the tensor-core path: bound >= float64 norm, c_i ||g_i|| <=
    C."""
    from test_precision import _exact_norms

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for model in (tiny_roberta(dtype=torch.float32).cuda(), tiny_gpt2(dtype=torch.float32).cuda()):
            engine = GhostClippingEngine(model, verify_first_backward=False)
            ids = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1)).cuda()
            ids[1, 5:] = ids[1, :4]
            with torch.autocast("cuda", dtype=torch.bfloat16), engine.record(batch_size=4):
                logits = model(input_ids=ids).logits.float()
                if hasattr(model, "lm_head"):
                    losses = per_example_loss(logits, ids, causal_lm=True)
                else:
                    losses = per_example_loss(logits, torch.tensor([0, 1, 0, 1], device="cuda"),
                                              causal_lm=False)
            grads = engine.per_example_gradients(losses)
            exact = _exact_norms(grads)
            bounds = grads.clipping_norms().double()
            assert bool((bounds >= exact).all()), (bounds, exact)
            factors = (1e-2 / (grads.clipping_norms() + 1e-6)).clamp(max=1.0)
            assert bool((factors.double() * exact <= 1e-2).all())
            for i in range(4):
                coefficient = torch.zeros(4, device="cuda")
                coefficient[i] = factors[i]
                released = grads.weighted_sum(coefficient)
                norm = sum(float(v.double().pow(2).sum()) for v in released.values()) ** 0.5
                assert norm <= 1e-2 * (1 + 1e-3), (i, norm)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_same_shape_layers_are_stacked_on_cuda_and_clip_holds_in_bf16():
    """The CUDA default stacks same-shape layers (one batched product for all of them); the bf16 clip contract
    holds for the stacked rows on tensor cores (the float64 parity above already runs stacked on CUDA)."""
    from test_blocks import _TwoSquareLayers
    from test_precision import _adversarial_batch, _exact_norms

    x, signs = _adversarial_batch()
    model = _TwoSquareLayers(x.shape[2]).cuda()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    assert engine.stack_layers is None  # automatic: on for CUDA tensors
    with torch.autocast("cuda", dtype=torch.bfloat16), engine.record(batch_size=x.shape[0]):
        losses = (model(x.cuda()) * signs.cuda()).sum(dim=1)
    grads = engine.per_example_gradients(losses.float())
    assert any(b.left is not None and b.left.shape[0] == 2
               for b in grads._blocks), "same-shape layers not stacked"
    exact = _exact_norms(grads)
    assert bool((grads.clipping_norms().double() >= exact.to(grads.clipping_norms().device)).all())
