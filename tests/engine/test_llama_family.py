"""Current decoder families: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Phi-3.

Tiny configs (hidden 16, 2 layers, 4 query heads sharing 2 key/value heads, rotary positions, SwiGLU/GeGLU
MLPs, RMSNorm; Gemma's head is tied to its scaled embedding, the others are untied). One DPTrainer step in
float64 with noise 0, a logical batch of 5 padded variable-length examples in micro-batches of 2, equals
-(1/B) sum_i clip(g_i) from a one-example-at-a-time reference, for full fine-tuning and LoRA, both clipping
functions. Also: the RMSNorm rules are found by type, unknown layers by a structural check or refused, and a
bf16 frozen base with fp32 LoRA adapters trains under bf16 autocast with per-example norms close to float64.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import flat, make_examples, reference_clipped_sum
from models import DECODER_FAMILIES, VOCAB, padded_batch, tiny_decoder
from test_exactness import run_one_step
from torch import nn

from hf_dpfilter.engine import GhostClippingEngine, UnsupportedLayerError
from hf_dpfilter.engine.rules import _GRAD_RULES, _hf_offset_rms_norm, _hf_scale_rms_norm, find_grad_rule
from hf_dpfilter.losses.tasks import per_example_loss

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3 fuses q/k/v and gate/up


def lora_decoder(family: str, dtype=torch.float64):
    from peft import LoraConfig, get_peft_model

    model = tiny_decoder(family, dtype=torch.float32)
    targets = PHI3_LORA_TARGETS if family == "phi3" else LORA_TARGETS
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero, which would make A's gradient vanish
            p.data.normal_(0, 0.1)
    return model.to(dtype)


def build(family: str, mode: str, dtype=torch.float64):
    return tiny_decoder(family, dtype=dtype) if mode == "full" else lora_decoder(family, dtype=dtype)


def assert_one_step_exact(model, tmp_path, clipping_fn, micro=2, **extra_args):
    model.eval()
    examples = make_examples(5, VOCAB, causal=True, seed=3)
    _, norms = reference_clipped_sum(model, examples, True, max_grad_norm=1.0)
    max_grad_norm = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, examples, True, max_grad_norm, clipping_fn=clipping_fn)
    delta, trainer = run_one_step(model, examples, True, 0, tmp_path, clipping_fn, max_grad_norm, micro=micro,
                                  **extra_args)
    expected = flat([-reference[p] / len(examples) for p in delta])
    got = flat(list(delta.values()))
    rel = ((got - expected).norm() / expected.norm()).item()
    # Gemma2's eager attention (its only kind: sdpa lacks soft-capping) takes the softmax in float32 whatever
    # the model's dtype, so its per-example reference is float32-accurate only; where a CPU's float64 kernels
    # round a batch of 2 and a batch of 1 differently, the cast to float32 can land on different sides (seen:
    # 7e-8).
    tolerance = 1e-6 if getattr(getattr(model, "config", None), "model_type", "") == "gemma2" else 1e-10
    assert rel <= tolerance, f"relative error {rel:.3e}"
    assert trainer.privacy_report()["steps"] == 1
    return trainer


# ------------------------------------------------------------------------------------- the rules
def test_tiny_configs_cover_the_named_llama_variants():
    for family in DECODER_FAMILIES:
        model = tiny_decoder(family)
        config = model.config
        assert config.num_key_value_heads < config.num_attention_heads, family  # grouped-query attention
        assert hasattr(model.model, "rotary_emb"), family
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == family.startswith("gemma"), family


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_rms_norms_found_by_type(family):
    model = tiny_decoder(family)
    norms = [m for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms
    for norm in norms:
        assert type(norm) in _GRAD_RULES, type(norm).__name__  # by type, not by the structural fallback
        expected = _hf_offset_rms_norm if family.startswith("gemma") else _hf_scale_rms_norm
        assert find_grad_rule(norm) is expected


def _rule_matches_autograd(module: nn.Module, x: torch.Tensor) -> float:
    y = module(x)
    g = torch.randn_like(y)
    (reference,) = torch.autograd.grad(y, [module.weight], g)
    terms = find_grad_rule(module)(module, x, g)
    return ((terms["weight"].grad.sum(0).to(reference.dtype) - reference).norm() / reference.norm()).item()


def test_torch_rms_norm_rule_is_exact():
    torch.manual_seed(0)
    norm = nn.RMSNorm(8, eps=1e-5).double()
    norm.weight.data.normal_()
    assert _rule_matches_autograd(norm, torch.randn(3, 5, 8, dtype=torch.float64)) < 1e-14
    heads = nn.RMSNorm(4).double()  # Qwen3-style norm over the head dimension of (B, T, H, d) inputs
    heads.weight.data.normal_()
    assert _rule_matches_autograd(heads, torch.randn(3, 5, 2, 4, dtype=torch.float64)) < 1e-14


class _ScaleFormNorm(nn.Module):  # an RMSNorm of a model family this library has never seen
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class _OffsetFormNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class _CenteredNorm(nn.Module):  # looks like an RMSNorm (one weight, an eps) but subtracts the mean
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = 1e-6

    def forward(self, x):
        h = x - x.mean(-1, keepdim=True)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


class _ScaledEmbedding(nn.Embedding):
    def __init__(self, n: int, d: int, scale: float) -> None:
        super().__init__(n, d, padding_idx=0)
        self.embed_scale = torch.tensor(scale)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class _OddScaledEmbedding(_ScaledEmbedding):
    def forward(self, ids):
        return super().forward(ids) + 1.0  # not the scaled form: nn.Embedding's rule would be wrong


def test_structural_check_finds_unknown_rms_norms_and_scaled_embeddings():
    torch.manual_seed(0)
    assert find_grad_rule(_ScaleFormNorm(8)) is _hf_scale_rms_norm
    assert find_grad_rule(_OffsetFormNorm(8)) is _hf_offset_rms_norm
    for module in (_ScaleFormNorm(8).double(), _OffsetFormNorm(8).double()):
        assert _rule_matches_autograd(module, torch.randn(2, 5, 8, dtype=torch.float64)) < 1e-6
    emb = _ScaledEmbedding(11, 4, 3.0).double()
    ids = torch.tensor([[0, 3, 5, 3], [7, 1, 0, 2]])
    out = emb(ids)
    g = torch.randn_like(out)
    (reference,) = torch.autograd.grad(out, [emb.weight], g)
    term = find_grad_rule(emb)(emb, ids, g)["weight"]
    ours = torch.zeros_like(emb.weight).index_add_(0, term.ids.reshape(-1), term.right.reshape(-1, 4))
    assert torch.allclose(ours, reference, rtol=0, atol=1e-14)


@pytest.mark.parametrize("layer", [_CenteredNorm(8), _OddScaledEmbedding(11, 4, 3.0)],
                         ids=["norm", "embedding"])
def test_unknown_trainable_layer_is_refused(layer):
    model = nn.Sequential(layer, nn.Linear(4 if isinstance(layer, nn.Embedding) else 8, 2))
    assert find_grad_rule(layer) is None
    with pytest.raises(UnsupportedLayerError, match=type(layer).__name__):
        GhostClippingEngine(model)


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_one_step_equals_per_example_reference(family, mode, clipping_fn, tmp_path):
    assert_one_step_exact(build(family, mode), tmp_path, clipping_fn)


# ------------------------------------------------------------------ bf16 base, fp32 adapters
def _bf16_base_with_fp32_lora():
    model = lora_decoder("llama", dtype=torch.float32)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


def test_bf16_base_fp32_adapters_norms_match_float64_under_autocast():
    model = _bf16_base_with_fp32_lora()
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    batch = padded_batch(4, causal=True, pad_id=0)
    engine = GhostClippingEngine(model)  # verifies the first backward against autograd (at bf16 precision)
    with engine.record(batch_size=4), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        losses = per_example_loss(out.logits, batch["labels"], causal_lm=True)
    norms = engine.per_example_gradients(losses).norms()
    # The same weights in float64 (bf16 values are exact there), one example at a time, no padding.
    reference_model = copy.deepcopy(model).double()
    examples = [{"input_ids": ids[mask.bool()], "labels": lab[mask.bool()]}
                for ids, mask, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"])]
    _, reference = reference_clipped_sum(reference_model, examples, True, max_grad_norm=1.0)
    rel = ((norms.double() - reference).abs() / reference).max().item()
    assert rel < 3e-2, f"bf16 per-example norms off by {rel:.3e} (relative) from float64"


def test_bf16_base_fp32_adapters_train_with_dptrainer(tmp_path):
    model = _bf16_base_with_fp32_lora()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    examples = make_examples(6, VOCAB, causal=True, seed=3)
    from helpers import ListDataset, PadCollator

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.5, per_sample_max_grad_norm=1.0, logical_batch_size=6,
        per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, bf16=True, report_to=[], use_cpu=True,
        save_strategy="no", remove_unused_columns=False, dp_seed=0, logging_steps=1,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    result = trainer.train()
    assert math.isnan(result.training_loss)  # a private run returns no noiseless training loss
    assert all(torch.isfinite(p).all() for p in model.parameters())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    assert trainer.privacy_report()["steps"] == 2


# -------------------------------------------------------------------------------------------- LongRoPE
def longrope_phi3(original: int) -> nn.Module:
    """A tiny Phi-3.5 / Phi-4-mini style model: LongRoPE (the legacy ``rope_scaling`` with ``type``, as their
    configs write it) with distinct short and long factors, its original context ``original`` tokens."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=original,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 5.0]})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).double()
    assert model.model.rotary_emb.rope_type == "longrope"
    return model


def test_longrope_within_the_original_length_trains_one_exact_step(tmp_path):
    """Every example (at most 10 tokens) within the original 16: the whole micro-batch uses the short factor,
    as each example alone, so one step equals the float64 per-example reference (it was refused at attach);
    the update's rewrite of inv_freq with the values it holds is not taken for a state write."""
    model = longrope_phi3(original=16)
    trainer = assert_one_step_exact(model, tmp_path, "abadi")
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)  # the short factor, as at init
    assert trainer.privacy_report()["steps"] == 1


def test_a_micro_batch_beyond_the_original_length_of_longrope_is_refused_with_the_fix(tmp_path):
    """Original length 8, and only the second micro-batch reaches 10 tokens: transformers would switch that
    whole micro-batch to the long factor. Refused before its backward, naming truncation to 8; nothing
    released."""
    from hf_dpfilter.proofs.longrope import LongRopeLengthError

    model = longrope_phi3(original=8)
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": (ids := torch.randint(3, VOCAB, (n,), generator=g)), "labels": ids.clone()}
                for n in (5, 6, 4, 10, 3)]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LongRopeLengthError, match=r"position 10 .*original_max_position_embeddings \(8\).*"
                                                  r"truncate every training sequence to 8 tokens"):
        run_one_step(model, examples, True, 0, tmp_path, "abadi", 1.0, micro=2)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
