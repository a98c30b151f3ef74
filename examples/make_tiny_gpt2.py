"""Build a small GPT-2 from a config, with a byte-level BPE tokenizer trained offline on E2E text.

No pretrained GPT-2 can be downloaded on the CI machines; this makes a stand-in that
``recipes/table2text.py --model <folder>`` loads like ``gpt2``::

    python examples/make_tiny_gpt2.py --data_dir ../shared/data/e2e --output_dir outputs/tiny-gpt2
"""

from __future__ import annotations

import argparse
import csv
import os


def e2e_texts(data_dir: str, limit: int | None = None) -> list[str]:
    """MRs and references of the E2E CSV files in ``data_dir`` (the tokenizer's training text)."""
    texts: list[str] = []
    for name in ("trainset.csv", "devset.csv"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            with open(path, newline="", encoding="utf-8-sig") as f:
                for row in csv.DictReader(f):
                    texts += [row["mr"], " " + row["ref"]]
    if not texts:
        raise FileNotFoundError(f"No E2E CSV (trainset.csv / devset.csv) in {data_dir}.")
    return texts[:limit] if limit else texts


def build_tiny_gpt2(
    output_dir: str,
    texts: list[str],
    vocab_size: int = 1024,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 2,
    n_positions: int = 256,
    seed: int = 0,
) -> str:
    """Train a byte-level BPE tokenizer on ``texts``, build a GPT-2 of the given size, save both."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", required=True, help="Folder with the E2E CSV files.")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=2)
    args = parser.parse_args()
    path = build_tiny_gpt2(
        args.output_dir, e2e_texts(args.data_dir), args.vocab_size, args.n_embd, args.n_layer, args.n_head
    )
    print(path)


if __name__ == "__main__":
    main()
