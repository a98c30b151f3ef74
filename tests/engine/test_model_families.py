"""The architectures that were exact before the per-example checks, through DPTrainer with those checks on.

Every family trains one step with its config's dropout probabilities all set non-zero (training mode, right
padding with a mask): the per-example checks turn dropout off wherever the family reads its probability (an
nn.Dropout, a float attribute of a module, the config at call time as Falcon does) and refuse nothing. At
noise 0 in float64 with dropout 0, one step equals -(1/B) sum_i clip(g_i) from the one-example-at-a-time
reference; for every family declared in ``hf_dpfilter.proofs.padding.POSITION_SCHEMES``, with left padding too
(a wrong entry would let positions shift with the batch). Randomness that is not dropout (Mixtral's router
jitter) is refused with its reason; a bf16 frozen base under fp32 LoRA adapters is checked at the
half-precision tolerance, with or without autocast. Families not covered elsewhere
(tests/engine/test_exactness.py, tests/engine/test_llama_family.py, tests/proofs/test_padding.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import LeftPadCollator, ListDataset, PadCollator, flat, make_examples
from models import VOCAB
from torch import nn

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.proofs.padding import PaddingError
from hf_dpfilter.proofs.randomness import TrainingRandomnessError
from hf_dpfilter.trainers.trainer import _is_causal_lm

COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=24,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GQA = dict(num_key_value_heads=2, num_attention_heads=4, head_dim=4)
#: name -> (model_type, head: "cls" sequence classification, "tok" token classification, "lm" causal LM,
#: config)
FAMILIES = {
    "bert": ("bert", "cls", {}),
    "roberta": ("roberta", "cls", {"pad_token_id": 1}),
    "xlm-roberta": ("xlm-roberta", "cls", {"pad_token_id": 1}),
    "xlm-roberta-xl": ("xlm-roberta-xl", "cls", {"pad_token_id": 1}),
    "camembert": ("camembert", "cls", {"pad_token_id": 1}),
    "distilbert": ("distilbert", "cls", dict(dim=16, n_layers=2, n_heads=2, hidden_dim=24)),
    "albert": ("albert", "cls", dict(embedding_size=8)),
    "electra": ("electra", "cls", dict(embedding_size=8)),
    "modernbert": ("modernbert", "cls", dict(global_attn_every_n_layers=1, local_attention=8, cls_token_id=1,
                                             sep_token_id=2)),
    "gpt2": ("gpt2", "lm", {}),
    "gpt_neo": ("gpt_neo", "lm",
                dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=8)),
    "gpt_neox": ("gpt_neox", "lm", {}),
    "falcon": ("falcon", "lm", {}),
    "falcon_new": ("falcon", "lm", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_alibi": ("falcon", "lm", dict(alibi=True)),
    "phi": ("phi", "lm", {}),
    "phi3": ("phi3", "lm", GQA),
    "stablelm": ("stablelm", "lm", dict(num_key_value_heads=2)),
    "gptj": ("gptj", "lm", dict(rotary_dim=4)),
    "llama": ("llama", "lm", GQA),
    "llama_eager": ("llama", "lm", GQA),  # F.dropout(p=self.attention_dropout, training=self.training)
    "mistral": ("mistral", "lm", GQA),
    "qwen2": ("qwen2", "lm", GQA),
    "qwen3": ("qwen3", "lm", GQA),
    "gemma": ("gemma", "lm", GQA),
    "gemma2": ("gemma2", "lm", GQA),
    "starcoder2": ("starcoder2", "lm", GQA),
    "olmo2": ("olmo2", "lm", GQA),
    "granite": ("granite", "lm", GQA),
    "gemma3_text": ("gemma3_text", "lm", GQA),
}
#: LoRA (peft) on a base of each family: name -> (model_type, head, config, target modules)
LORA = {
    "bert": ("bert", "cls", {}, ["query", "value"]),
    "gpt2": ("gpt2", "lm", {}, ["c_attn"]),
    "llama": ("llama", "lm", GQA, ["q_proj", "v_proj"]),
    "opt": ("opt", "lm", dict(ffn_dim=24, word_embed_proj_dim=16), ["q_proj", "v_proj"]),
    "bloom": ("bloom", "lm", dict(n_layer=2, n_head=2), ["query_key_value"]),
    "t5": ("t5", "s2s",
           dict(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, decoder_start_token_id=0),
           ["q", "v"]),
    "mixtral": ("mixtral", "lm", dict(GQA, num_local_experts=4, num_experts_per_tok=2), ["q_proj", "v_proj"]),
}


def _config(model_type: str, extra: dict, dropout: float, **overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    for key, value in config.to_dict().items():  # every dropout probability of the config (not LayerDrop)
        if "drop" in key and isinstance(value, float) and "layerdrop" not in key:
            setattr(config, key, dropout)
    return config


def _head(head: str):
    import transformers

    return {"cls": transformers.AutoModelForSequenceClassification,
            "tok": transformers.AutoModelForTokenClassification,
            "lm": transformers.AutoModelForCausalLM, "s2s": transformers.AutoModelForSeq2SeqLM}[head]


def family(name: str, dropout: float, head: str | None = None, dtype=torch.float32):
    model_type, default_head, extra = FAMILIES[name]
    config = _config(model_type, extra, dropout, **({"num_labels": 3} if head == "tok" else {}))
    if name == "llama_eager":
        config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _head(head or default_head).from_config(config).to(dtype)


def lora(name: str, dropout: float, dtype=torch.float32, **overrides):
    from peft import LoraConfig, get_peft_model

    model_type, head, extra, targets = LORA[name]
    torch.manual_seed(0)
    model = _head(head).from_config(_config(model_type, extra, dropout, **overrides))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout))
    torch.manual_seed(1)
    for param_name, param in model.named_parameters():
        if "lora_B" in param_name:  # LoRA's B starts at zero, which would make A's gradient vanish
            param.data.normal_(0, 0.1)
    return model.to(dtype)


class Seq2SeqCollator(PadCollator):
    """PadCollator plus decoder_input_ids (the labels shifted right, as DataCollatorForSeq2Seq gets from
    T5)."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        labels = batch["labels"]
        decoder = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        batch["decoder_input_ids"] = decoder.masked_fill(decoder == -100, self.pad_id)
        return batch



def _args(tmp_path, n: int, clip: float = 1.0, **extra) -> DPTrainingArguments:
    return DPTrainingArguments(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=n, per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0, **extra,
    )


def _train(model, tmp_path, head: str, collator=None, n: int = 5, **extra) -> DPTrainer:
    examples = make_examples(n, VOCAB, causal=head != "cls", seed=3)
    pad = getattr(model.config, "pad_token_id", None) or 0
    collator = collator or (Seq2SeqCollator(pad) if head == "s2s" else PadCollator(pad))
    trainer = DPTrainer(model=model, args=_args(tmp_path, n, **extra), train_dataset=ListDataset(examples),
                        data_collator=collator)
    trainer.train()
    return trainer


# ------------------------------------------------------------------------- dropout in training mode
@pytest.mark.parametrize("name", list(FAMILIES))
def test_trains_with_the_configs_dropout_on(name, tmp_path):
    model = family(name, dropout=0.1)
    assert _train(model, tmp_path, FAMILIES[name][1]).accountant.steps == 1


@pytest.mark.parametrize("name", list(LORA))
def test_lora_trains_with_dropout_on(name, tmp_path):
    assert _train(lora(name, dropout=0.1), tmp_path, LORA[name][1]).accountant.steps == 1


class _OwnBlock(nn.Module):
    """A user's module: an nn.Dropout inside, a functional dropout with its own float probability (named as
    BART names it) and one read from the model's config at call time."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.activation_dropout = 0.1

    def forward(self, h):
        h = nn.functional.dropout(torch.tanh(self.linear(self.drop(h))), p=self.activation_dropout,
                                  training=self.training)
        return nn.functional.dropout(h, p=self.config.hidden_dropout_prob, training=self.training)


class _OwnClassifier(nn.Module):
    def __init__(self):
        from transformers import PretrainedConfig

        super().__init__()
        torch.manual_seed(0)
        self.config = PretrainedConfig(hidden_dropout_prob=0.1)
        self.embed = nn.Embedding(VOCAB, 8)
        self.block = _OwnBlock(self.config)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask, **kwargs):
        h = self.block(self.embed(input_ids))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return {"logits": self.head((h * mask).sum(1) / mask.sum(1))}


def test_own_module_with_dropout_trains(tmp_path):
    assert _train(_OwnClassifier(), tmp_path, "cls").accountant.steps == 1


def test_router_jitter_is_refused_with_its_reason(tmp_path):
    model = lora("mixtral", dropout=0.0, router_jitter_noise=0.1)
    with pytest.raises(TrainingRandomnessError, match="(?s)random even with dropout "
                                                      "off.*router_jitter_noise=0.1"):
        _train(model, tmp_path, "lm")


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-weights", "bf16-autocast"])
def test_bf16_frozen_base_under_fp32_adapters_is_not_refused(autocast, tmp_path):
    """``get_peft_model`` on a base loaded in bf16 keeps fp32 adapters: the base's matmuls are bf16 with or
    without autocast, and a batch and an example alone round differently (1e-3 relative): checked at bf16's
    tolerance."""
    model = lora("llama", dropout=0.1)
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    assert _train(model, tmp_path, "lm", n=8, bf16=autocast).accountant.steps == 1


# ------------------------------------------------------------------------- one step equals the reference
def _reference(model, examples, collator, clip: float | None):
    """Per-example clipped gradients summed, each example collated alone (no padding), float64; with
    ``clip=None`` the per-example norms."""
    causal = _is_causal_lm(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for example in examples:
        batch = PadCollator.__call__(collator, [example])
        labels = batch.pop("labels")
        if isinstance(collator, Seq2SeqCollator):
            batch = Seq2SeqCollator.__call__(collator, [example])
            batch.pop("labels")
        loss = per_example_loss(model(**batch).logits, labels, causal_lm=causal)
        grads.append(flat([torch.zeros_like(p) if g is None else g
                           for g,
                           p in zip(torch.autograd.grad(loss.sum(), params, allow_unused=True), params)]))
    norms = torch.stack([g.norm() for g in grads])
    if clip is None:
        return norms
    return sum(g * factor for g, factor in zip(grads, clip_factors(norms, clip)))


def _relative_error(model, tmp_path, head: str, collator) -> float:
    """One DPTrainer step (q = 1, noise 0, SGD lr 1, micro-batches of 2) against the reference, float64."""
    model.eval()
    examples = make_examples(5, VOCAB, causal=head != "cls", seed=3)
    if head == "tok":  # one of 3 labels per token
        examples = [{**e, "input_ids": e["input_ids"], "labels": e["input_ids"] % 3} for e in examples]
    clip = float(_reference(model, examples, collator, None).median())  # some examples clipped, some not
    expected = _reference(model, examples, collator, clip)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    DPTrainer(model=model, args=_args(tmp_path, 5, clip), train_dataset=ListDataset(examples),
              data_collator=collator).train()
    got = -len(examples) * flat([p.detach() - b for p, b in zip(params, before)])
    return ((got - expected).norm() / expected.norm()).item()


#: right padding: encoders not covered elsewhere; left padding: every declared family not covered elsewhere
#: (encoders through a token-level head: their sequence heads read the first column and are refused under left
#: padding); Gemma2 left-padded is NaN in float64 (its eager mask overflows to -inf, and the re-check refuses
#: the step): in float32 (7e-6 relative, as padded on the right)
CASES = [(n, "cls", "right") for n in ["xlm-roberta", "distilbert", "albert", "electra", "modernbert"]] + [
    (n, "tok", "left")
    for n in ["bert", "distilbert", "albert", "electra", "modernbert", "xlm-roberta", "xlm-roberta-xl",
                                 "camembert"]] + [
    (n, "lm", "left") for n in ["gpt_neo", "gptj", "gpt_neox", "falcon", "falcon_new", "falcon_alibi", "phi",
                                "stablelm", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
                                "starcoder2",
                                "olmo2", "granite", "gemma3_text"]]


@pytest.mark.parametrize(("name", "head", "side"), CASES, ids=[f"{n}-{h}-{s}" for n, h, s in CASES])
def test_one_step_equals_the_per_example_reference(name, head, side, tmp_path):
    dtype = torch.float32 if name == "gemma2" else torch.float64
    model = family(name, dropout=0.0, head=head, dtype=dtype)
    pad = model.config.pad_token_id or 0
    collator = LeftPadCollator(pad) if side == "left" else PadCollator(pad)
    # Gemma's RMSNorm casts to float32 inside a float64 model (x.float()): float32-rounded terms, ~1e-9
    # relative
    tolerance = 1e-4 if dtype == torch.float32 else 1e-7 if name.startswith("gemma") else 1e-9
    assert _relative_error(model, tmp_path, head, collator) <= tolerance


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_modernbert_sequence_head_left_padded(pooling, tmp_path):
    """ModernBERT's "mean" pooling averages over the attention mask: exact left-padded; "cls" reads the first
    column (a pad for every shorter example): refused."""
    model = family("modernbert", dropout=0.0, dtype=torch.float64)
    model.config.classifier_pooling = pooling
    if pooling == "mean":
        assert _relative_error(model, tmp_path, "cls", LeftPadCollator(0)) <= 1e-9
        return
    with pytest.raises(PaddingError, match="reads the first column"):
        _train(model, tmp_path, "cls", collator=LeftPadCollator(0))


#: BLOOM left-padded is NaN in float64 (its mask overflows, as Gemma2's) and Mixtral's experts run grouped
#: matmuls, which take no float64: both in float32 (BLOOM rounds to 2e-5 relative padded on the right as well)
LORA_CASES = [("opt", "left", torch.float64), ("bloom", "left", torch.float32),
              ("mixtral", "left", torch.float32),
              ("gpt2", "left", torch.float64), ("bert", "right", torch.float64),
              ("t5", "right", torch.float64)]


@pytest.mark.parametrize(("name", "side", "dtype"), LORA_CASES, ids=[f"{n}-{s}" for n, s, _ in LORA_CASES])
def test_lora_step_equals_the_per_example_reference(name, side, dtype, tmp_path):
    model = lora(name, dropout=0.0, dtype=dtype)
    pad = model.config.pad_token_id or 0
    head = LORA[name][1]
    collator = (LeftPadCollator(pad) if side == "left" else Seq2SeqCollator(pad) if head == "s2s"
                else PadCollator(pad))
    assert _relative_error(model, tmp_path, head, collator) <= (1e-9 if dtype == torch.float64 else 1e-4)
