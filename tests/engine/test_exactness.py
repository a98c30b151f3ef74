"""Acceptance 1: one DPTrainer step equals -(1/B) sum_i clip(g_i) from a one-example-at-a-time reference.

float64, dropout off, noise 0, SGD with lr 1, logical batch split into >= 2 micro-batches, padded
variable-length batches, both clipping functions.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples, reference_clipped_sum
from models import VOCAB, tiny_bert, tiny_gpt2, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments


def _lora_roberta():
    from peft import LoraConfig, get_peft_model

    model = tiny_roberta(dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0,
                        modules_to_save=["classifier"])
    model = get_peft_model(model, config).double()
    # LoRA's B starts at zero, which would make A's gradient vanish; give it values so both are tested.
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    return model


MODELS = {
    "roberta": (lambda: tiny_roberta(), False, 1),
    "bert": (lambda: tiny_bert(), False, 0),
    "gpt2_tied": (lambda: tiny_gpt2(), True, 0),
    "roberta_lora": (_lora_roberta, False, 1),
}


def run_one_step(model, examples, causal, pad_id, tmp_path, clipping_fn, max_grad_norm, micro=3,
                 **extra_args):
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        dp_method="dpsgd",
        noise_multiplier=0.0,
        per_sample_max_grad_norm=max_grad_norm,
        clipping_fn=clipping_fn,
        logical_batch_size=len(examples),  # q = 1: every example is in the one step
        per_device_train_batch_size=micro,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
        dp_seed=0,
        **extra_args,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(pad_id))
    before = {p: p.detach().clone() for p in model.parameters() if p.requires_grad}
    trainer.train()
    return {p: p.detach() - before[p] for p in before}, trainer


@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_step_equals_per_example_reference(name, clipping_fn, tmp_path):
    build, causal, pad_id = MODELS[name]
    model = build()
    model.eval()
    examples = make_examples(7, VOCAB, causal=causal, seed=3)
    _, norms = reference_clipped_sum(model, examples, causal, max_grad_norm=1.0)
    max_grad_norm = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, examples, causal, max_grad_norm, clipping_fn=clipping_fn)
    delta, trainer = run_one_step(model, examples, causal, pad_id, tmp_path, clipping_fn, max_grad_norm)
    expected = flat([-reference[p] / len(examples) for p in delta])
    got = flat(list(delta.values()))
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= 1e-6, f"{name}/{clipping_fn}: relative error {rel:.3e}"
    assert trainer.privacy_report()["steps"] == 1
