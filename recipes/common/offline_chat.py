"""An offline chat tokenizer and a small Llama-family model built from a config: no download, no data.

The tokenizer is byte-level with no merges (every UTF-8 byte is a token) plus the chat special tokens, so its
vocabulary is a public constant: nothing is learned from the training text (a tokenizer trained on private
text would publish its frequent strings in its vocabulary). Its chat template marks the assistant turns with
``{% generation %}`` so that TRL's ``assistant_only_loss`` can mask everything else.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "byte_level_chat_tokenizer", "small_llama"]

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")

#: each turn ends with <|end|> (the eos token); the assistant's content and its <|end|> are the generation
#: part
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_chat_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: 256 byte tokens, then :data:`SPECIAL_TOKENS`; pad, bos and eos set, and
    :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def small_llama(tokenizer: Any, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                max_positions: int = 512,
                seed: int = 0, dtype: Any = None) -> Any:
    """A ``LlamaForCausalLM`` built from a config (random weights) for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=hidden_size // heads, max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(dtype) if dtype is not None else model
