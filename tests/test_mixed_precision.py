"""bf16 autocast is allowed with fp32 norms and fp32 clipped-sum accumulation; fp16 is refused (test_bad_inputs)."""

from __future__ import annotations

import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.losses import per_example_loss


def _one_step(tmp_path, bf16: bool):
    model = tiny_roberta(dtype=torch.float32)
    examples = make_examples(8, VOCAB, causal=False, seed=4)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=0.05, logical_batch_size=8,
        per_device_train_batch_size=4, max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, bf16=bf16,
        dp_seed=0,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples), data_collator=PadCollator(1))
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
