"""Sensitivity on the device the GPU report measures: removing one example moves the clipped sum by at most C.

The same check as ``tests/engine/test_blocks.py``'s, run on CUDA (skipped without a GPU) and, so that the test
itself is checked on every machine, on CPU: float32 and bf16 autocast, with same-shape layers stacked (the
CUDA default) and not. Under bf16 the released sums are fp32 sums of bf16 terms, so the bound holds up to fp32
rounding (docs/privacy.md, "Mixed precision: the norm under bf16"). ``make gpu-report`` runs the CUDA cases.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import PadCollator, make_examples
from models import VOCAB, tiny_gpt2, tiny_roberta

from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device "
        "visible")),
]
MODELS = {"roberta": (tiny_roberta, False, 1), "gpt2_tied": (tiny_gpt2, True, 0)}


def _clipped_sums(model, batch, causal, device, bf16, stack, max_grad_norm, drop):
    engine = GhostClippingEngine(model, verify_first_backward=False, stack_layers=stack)
    n = batch["input_ids"].shape[0]
    amp = torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with amp, engine.record(batch_size=n):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        losses = per_example_loss(out.logits.float(), batch["labels"], causal_lm=causal)
    grads = engine.per_example_gradients(losses)
    if drop is not None:
        grads.zero_examples(torch.arange(n, device=losses.device) == drop)
    factors = clip_factors(grads.clipping_norms(), max_grad_norm)
    return grads.weighted_sum(factors, release=True)


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("device", DEVICES)
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(device, name, bf16, stack):
    build, causal, pad_id = MODELS[name]
    torch.manual_seed(0)
    model = build(dtype=torch.float32).to(device)
    model.eval()  # dropout off: the two passes see the same function
    examples = make_examples(6, VOCAB, causal=causal, seed=3)
    batch = {k: v.to(device) for k, v in PadCollator(pad_id)(examples).items()}
    max_grad_norm = 1e-3  # below every example's norm: each one is clipped to exactly C
    with_all = _clipped_sums(model, batch, causal, device, bf16, stack, max_grad_norm, drop=None)
    without = _clipped_sums(model, batch, causal, device, bf16, stack, max_grad_norm, drop=2)
    moved = torch.sqrt(sum((with_all[p].double() - without[p].double()).pow(2).sum() for p in with_all))
    tolerance = 1e-3 if bf16 else 1e-5  # fp32 sums (of bf16 terms under autocast)
    assert moved <= max_grad_norm * (1 + tolerance), (float(moved), max_grad_norm)
    # the removed example was clipped to C, not dropped or zeroed elsewhere
    assert moved > max_grad_norm * 0.9
