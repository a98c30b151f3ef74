"""Build a small T5 or BART from a config, with a byte-level BPE tokenizer trained offline on E2E text.

No pretrained T5 or BART can be downloaded on the CI machines; this makes a stand-in that
``recipes/table2text_seq2seq.py --model <folder>`` loads like ``t5-small`` or ``facebook/bart-base``::

    python examples/make_tiny_seq2seq.py --arch t5 --data_dir ../shared/data/e2e --output_dir outputs/tiny-t5
"""

from __future__ import annotations

import argparse
import os

from make_tiny_gpt2 import e2e_texts

#: the special tokens of each family, in the order of their ids (T5: pad 0, eos 1, unk 2; BART: bos 0, pad 1,
#: eos 2)
SPECIALS = {"t5": ["<pad>", "</s>", "<unk>"], "bart": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]}


def build_tiny_seq2seq(
    output_dir: str, texts: list[str], arch: str = "t5", vocab_size: int = 1024, d_model: int = 64,
    layers: int = 2, heads: int = 2, seed: int = 0,
) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` (every encoding ends with the eos token, as T5's and
    BART's do), build a T5 or BART of the given size, save both."""
    import torch
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        PreTrainedTokenizerFast,
        T5Config,
        T5ForConditionalGeneration,
    )

    specials = SPECIALS[arch]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=specials)
    backend = bpe._tokenizer
    eos = backend.token_to_id("</s>")
    if arch == "t5":
        backend.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                               special_tokens=[("</s>", eos)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>",
                                            unk_token="<unk>")
        config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model,
                          num_layers=layers, num_heads=heads, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=eos, decoder_start_token_id=tokenizer.pad_token_id)
        model_class = T5ForConditionalGeneration
    else:
        bos = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                               special_tokens=[("<s>", bos), ("</s>", eos)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                            pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
        config = BartConfig(vocab_size=len(tokenizer), d_model=d_model, encoder_layers=layers,
                            decoder_layers=layers, encoder_attention_heads=heads,
                            decoder_attention_heads=heads, encoder_ffn_dim=2 * d_model,
                            decoder_ffn_dim=2 * d_model, max_position_embeddings=256, bos_token_id=bos,
                            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, decoder_start_token_id=eos,
                            forced_eos_token_id=eos)
        model_class = BartForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config)
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="t5", choices=sorted(SPECIALS), help="Model family.")
    parser.add_argument("--data_dir", required=True, help="Folder with the E2E CSV files.")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    args = parser.parse_args()
    print(build_tiny_seq2seq(args.output_dir, e2e_texts(args.data_dir), args.arch, args.vocab_size,
                             args.d_model, args.layers, args.heads))


if __name__ == "__main__":
    main()
