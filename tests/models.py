"""Tiny Hugging Face models built from configs (no download) for the tests."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForSequenceClassification,
)

VOCAB = 97


def tiny_roberta(num_labels: int = 2, dtype=torch.float64) -> RobertaForSequenceClassification:
    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=40, pad_token_id=1, num_labels=num_labels,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
    )
    torch.manual_seed(0)
    return RobertaForSequenceClassification(config).to(dtype)


def tiny_bert(num_labels: int = 2, dtype=torch.float64) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=40, pad_token_id=0, num_labels=num_labels,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).to(dtype)


def tiny_gpt2(dtype=torch.float64) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=40,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(dtype)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def padded_batch(batch_size: int, max_len: int = 9, pad_id: int = 1, seed: int = 0, causal: bool = False):
    """Variable-length examples right-padded to the longest; labels per example."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, max_len + 1, (batch_size,), generator=g)
    lengths[0] = max_len
    input_ids = torch.full((batch_size, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        input_ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        attention_mask[i, :n] = 1
    if causal:
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
    else:
        labels = torch.randint(0, 2, (batch_size,), generator=g)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# Current decoder families (rotary positions, grouped-query attention with fewer key/value heads than query
# heads, SwiGLU/GeGLU MLPs, RMSNorm); tiny configs, built without a download.
DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


def tiny_decoder(family: str, dtype=torch.float64, seed: int = 0, tie_word_embeddings: bool | None = None):
    """A 2-layer causal LM of ``family`` with hidden size 16, 4 query heads and 2 key/value heads."""
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    }
    config_name, model_name = classes[family]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attention_dropout=0.0,
    )
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    # RMSNorm weights start at 1 (or 0 for Gemma's 1 + w): perturb them so their gradients are generic.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


#: the words of :func:`tiny_tokenizer` (and of the synthetic text of the script tests)
WORDS = ("the a cat dog bird sat ran flew on under over mat log tree red blue green big small fast slow good "
         "bad food place name area price near city centre river rating high low cheap family friendly yes no "
         "what where who is was it eat type coffee shop pub restaurant").split()


def tiny_tokenizer(model_max_length: int = 64):
    """A word-level fast tokenizer over :data:`WORDS` (no download): [PAD]=0, [UNK], [CLS], [SEP], [MASK];
    pairs as ``[CLS] a [SEP] b [SEP]`` with token types and offsets, as BERT's (run_qa needs the offsets and
    sequence ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate(specials + list(WORDS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", eos_token="[SEP]", bos_token="[CLS]", model_max_length=model_max_length)


def tiny_t5(lora: bool = True, vocab_size: int = VOCAB):
    """A 2-layer T5 (d_model 16) whose pad and decoder start are 0 and eos 3 (:func:`tiny_tokenizer`'s [SEP]);
    with ``lora``, LoRA on q and v (full fine-tuning, T5's relative position bias included, is exact too)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                      dropout_rate=0.0,
                      pad_token_id=0, eos_token_id=3, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model,
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0))
    return model



#: The encoder-decoders of transformers without ``prepare_decoder_input_ids_from_labels`` (their forward
#: shifts the labels with their module's ``shift_tokens_right``), built tiny by :func:`tiny_shifting_seq2seq`.
SHIFTING_SEQ2SEQ = ("m2m_100", "blenderbot", "blenderbot-small", "nllb-moe", "seamless_m4t")


def tiny_shifting_seq2seq(model_type: str, vocab_size: int = VOCAB):
    """A 1+1-layer encoder-decoder (d_model 16) of ``model_type`` (:data:`SHIFTING_SEQ2SEQ`), float64, with
    pad 0, eos 3 and a decoder start of 2 (:func:`tiny_tokenizer`'s [CLS]: unlike the pad, so a wrong start
    shows); no dropout or LayerDrop (M2M100's default LayerDrop skips layers at random in training)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    sizes = dict(vocab_size=vocab_size, d_model=16, hidden_size=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                 decoder_ffn_dim=24, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                 activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0,
                 eos_token_id=3, bos_token_id=2, decoder_start_token_id=2)
    if model_type == "nllb-moe":  # two experts with room for every token: no token dropped by the capacity
        sizes.update(num_experts=2, expert_capacity=16, router_jitter_noise=0.0)
    config = AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(0)
    return getattr(transformers, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES[model_type])(config).double()
