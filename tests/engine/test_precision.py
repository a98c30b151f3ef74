"""bf16 autocast is allowed with fp32 norms and fp32 clipped-sum accumulation; fp16 with the DP loss scaler is
tested in tests/trainers/test_loss_scaling.py."""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss


def _one_step(tmp_path, bf16: bool):
    model = tiny_roberta(dtype=torch.float32)
    examples = make_examples(8, VOCAB, causal=False, seed=4)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=0.05, logical_batch_size=8,
        per_device_train_batch_size=4, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        bf16=bf16,
        dp_seed=0,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    before = flat([p.detach().clone() for p in model.parameters()])
    trainer.train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return flat([p.detach() for p in model.parameters()]) - before


def test_bf16_autocast_step_close_to_fp32(tmp_path):
    full = _one_step(tmp_path / "fp32", bf16=False)
    mixed = _one_step(tmp_path / "bf16", bf16=True)
    rel = ((mixed - full).norm() / full.norm()).item()
    assert rel < 0.05, rel


def test_norms_and_sums_accumulate_in_fp32_under_bf16():
    model = tiny_roberta(dtype=torch.float32)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    ids = torch.randint(3, VOCAB, (4, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.record(batch_size=4):
        logits = model(input_ids=ids).logits
        losses = per_example_loss(logits, torch.tensor([0, 1, 0, 1]), causal_lm=False)
    grads = engine.per_example_gradients(losses)
    assert grads.squared_norms().dtype == torch.float32
    sums = grads.weighted_sum(torch.ones(4))
    assert all(v.dtype == torch.float32 for v in sums.values())


# ---------------------------------------------------------------------------------------------------------
# The precision contract under bf16 autocast (docs/privacy.md, "Mixed precision: the norm under bf16"): the
# engine keeps bf16 activations and output gradients as the layers computed them, accumulates every product
# in fp32, and clips against a bound-inflated norm. Checked against a float64 recomputation of the same
# per-example gradient (the bf16-rounded terms, summed exactly).


def _exact_norms(grads) -> torch.Tensor:
    """float64 norms (on the CPU) of the per-example gradients the stored terms describe (call before any norm
    is taken)."""
    batch = grads.batch_size
    total = torch.zeros(batch, dtype=torch.float64)
    for param, (outer, index, dense) in grads._merged.items():
        g = torch.zeros(batch, param.numel(), dtype=torch.float64)
        if outer is not None:
            g += torch.bmm(outer.left.cpu().double().transpose(1, 2),
                           outer.right.cpu().double()).reshape(batch, -1)
        if dense is not None:
            g += dense.grad.cpu().double().reshape(batch, -1)
        if index is not None:
            for i in range(batch):
                rows = g[i].view(index.num_rows, -1)
                rows.index_add_(0, index.ids[i].cpu(), index.right[i].cpu().double())
        total += (g * g).sum(dim=1)
    for grad in grads._dense_groups.values():  # the parameters with only a dense gradient, stored together
        total += grad.cpu().double().pow(2).sum(dim=1)
    for block in grads._blocks:  # weights with only an outer product: (L, B, T, P) stacks of fused layers
        for layer in range(block.left.shape[0]):
            g = torch.bmm(block.left[layer].cpu().double().transpose(1, 2), block.right[layer].cpu().double())
            total += g.pow(2).sum(dim=(1, 2))
    return total.sqrt()


def _stored_terms(grads) -> list[torch.Tensor]:
    """Every activation and output gradient the per-example gradients keep."""
    terms = [t for outer, _,
             _ in grads._merged.values() if outer is not None for t in (outer.left, outer.right)]
    return terms + [t for block in grads._blocks for t in (block.left, block.right) if t is not None]


class _TokenModel(torch.nn.Module):
    """Per-token linear map and a scalar head: per-example loss sum_t sign_t * head(proj(x_t))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x)).squeeze(-1)


def _adversarial_batch(width: int = 48, tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, tokens, width, generator=g)
    signs = torch.ones(6, tokens)
    # 0: near-cancellation at large scale: pairs of almost equal tokens with opposite signs
    base = 1e3 * torch.randn(tokens // 2, width, generator=g)
    x[0, 0::2] = base
    x[0, 1::2] = base + 1e-1 * torch.randn(tokens // 2, width, generator=g)
    signs[0, 1::2] = -1
    # 1: exact cancellation (the gradient is exactly zero)
    x[1, 1::2] = x[1, 0::2]
    signs[1, 1::2] = -1
    # 2: very large activations, no cancellation
    x[2] *= 1e4
    # 3: tiny activations
    x[3] *= 1e-4
    # 4: near-cancellation at moderate scale
    x[4, 1::2] = x[4, 0::2] + 1e-3 * torch.randn(tokens // 2, width, generator=g)
    signs[4, 1::2] = -1
    return x, signs


def _check_contract(engine, model_call, batch: int, max_grad_norm: float):
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.record(batch_size=batch):
        losses = model_call()
    grads = engine.per_example_gradients(losses.float())
    exact = _exact_norms(grads)
    assert any(t.dtype == torch.bfloat16
               for t in _stored_terms(grads)), "bf16 terms must stay bf16 (no fp32 copies)"
    bounds = grads.clipping_norms()
    assert bounds.dtype == torch.float32
    assert bool((bounds.double() >= exact).all()), (bounds, exact)
    factors = (max_grad_norm / (bounds + 1e-6)).clamp(max=1.0)
    assert bool((factors.double() * exact <= max_grad_norm).all()), factors.double() * exact
    # the released vectors themselves (fp32 sums of bf16 terms) stay within C up to fp32 rounding
    for i in range(batch):
        coefficient = torch.zeros(batch)
        coefficient[i] = factors[i]
        released = grads.weighted_sum(coefficient)
        norm = sum(float(v.double().pow(2).sum()) for v in released.values()) ** 0.5
        assert norm <= max_grad_norm * (1 + 1e-3), (i, norm)
    return grads, exact


def test_bf16_clip_holds_against_float64_recomputation_adversarial():
    model = _TokenModel(48)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    x, signs = _adversarial_batch()
    grads, exact = _check_contract(engine, lambda: (signs * model(x)).sum(dim=1), 6, max_grad_norm=1e-3)
    assert float(exact[1]) == 0.0  # the exactly cancelling example: its bound is >= 0, contribution 0
    # the batch is adversarial: clipping against the computed norm alone would let some example exceed C
    assert bool((grads.norms().double() < exact).any())
    # the bound is not vacuous where there is no cancellation: at most a few percent above the exact norm
    plain = torch.tensor([2, 3, 5])
    assert bool((grads.clipping_norms().double()[plain] <= exact[plain] * 1.05).all())


def test_bf16_clip_holds_on_transformers():
    from models import tiny_gpt2

    for model in (tiny_roberta(dtype=torch.float32), tiny_gpt2(dtype=torch.float32)):
        engine = GhostClippingEngine(model, verify_first_backward=False)
        ids = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
        ids[1, 5:] = ids[1, :4]  # repeated tokens

        def call(model=model, ids=ids):
            if hasattr(model, "lm_head"):
                return per_example_loss(model(input_ids=ids).logits, ids, causal_lm=True)
            return per_example_loss(model(input_ids=ids).logits, torch.tensor([0, 1, 0, 1]), causal_lm=False)

        _check_contract(engine, call, 4, max_grad_norm=1e-2)


def test_bf16_hook_keeps_the_rounded_input_not_an_fp32_copy():
    model = _TokenModel(8)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    x = torch.randn(2, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.record(batch_size=2):
        model(x)
    record = next(r for r in engine._records if r.module is model.proj)
    assert record.activations.dtype == torch.bfloat16
    assert torch.equal(record.activations, x.to(torch.bfloat16))  # exactly what autocast's linear multiplied
    engine.clear()


def test_split_bf16_reconstructs_fp32():
    from hf_dpfilter.engine.precision import split_bf16

    x = torch.randn(1000) * torch.logspace(-20, 20, 1000)
    pieces = split_bf16(x)
    assert all(p.dtype == torch.bfloat16 for p in pieces)
    back = sum(p.double() for p in pieces)
    assert bool(((back - x.double()).abs() <= x.double().abs() * 2.0**-26).all())


# ---------------------------------------------------------------------------------------------------------
# Underflow: a confidently classified example has a gradient about exp(-margin) times a usual one, and its Gram
# products fall into fp32's subnormal range, where the relative bound does not hold. The clip must still be an
# upper bound of the exact norm (scaling the loss by a power of two scales the gradient exactly).


def _tiny_gradients(model, call, scale_exponent: int, bf16: bool):
    engine = GhostClippingEngine(model, verify_first_backward=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), engine.record(batch_size=4):
        losses = call() * 2.0**-scale_exponent
    return engine.per_example_gradients(losses.float())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("family", ["roberta", "gpt2", "narrow"])
def test_clip_holds_when_the_gradients_underflow(family, bf16):
    from models import tiny_gpt2

    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    if family == "roberta":  # ghost blocks, embeddings, LayerNorm and biases
        model = tiny_roberta(dtype=torch.float32)

        def call():
            return per_example_loss(model(input_ids=ids).logits, torch.tensor([0, 1, 0, 1]), causal_lm=False)
    elif family == "gpt2":  # tied embeddings: the cross term
        model = tiny_gpt2(dtype=torch.float32)

        def call():
            return per_example_loss(model(input_ids=ids).logits, ids, causal_lm=True)
    else:  # a layer narrow enough to be materialized
        model = _TokenModel(2)
        x = torch.randn(4, 40, 2)

        def call():
            return model(x).sum(dim=1)
    max_grad_norm = 1e-2
    for exponent in (0, 40, 60, 75, 100, 120):
        grads = _tiny_gradients(model, call, exponent, bf16)
        exact = _exact_norms(grads)
        bounds = grads.clipping_norms()
        assert bool((bounds.double() >= exact).all()), (exponent, bounds, exact)
        if exponent == 0:  # the underflow term is nothing beside a usual norm
            assert bool((bounds.double() <= exact * 1.01).all()), (bounds, exact)
        factors = (max_grad_norm / bounds).clamp(max=1.0)
        for i in range(4):
            coefficient = torch.zeros(4)
            coefficient[i] = factors[i]
            released = grads.weighted_sum(coefficient)
            norm = sum(float(v.double().pow(2).sum()) for v in released.values()) ** 0.5
            assert norm <= max_grad_norm * (1 + 1e-3), (exponent, i, norm)

