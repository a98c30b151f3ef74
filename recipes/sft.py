"""DP instruction tuning of a causal LM through TRL (DPSFTTrainer) on chat-formatted E2E, evaluated with the
table-to-text metrics (BLEU, NIST, METEOR, ROUGE-L, CIDEr) against all references of each input.

Examples::

    # offline on CPU: a small Llama built from a config and the byte-level chat tokenizer (no download)
    .venv/bin/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft.py \\
        --data_dir ../shared/data/e2e --epsilon 8 --max_train_samples 1000 --max_eval_samples 10 --epochs 1 \\
        --output_dir outputs/sft-e2e

    # user level: examples grouped into synthetic users (Zipf-like sizes), at most 8 examples per user per step
    ... recipes/sft.py --data_dir ../shared/data/e2e --privacy_unit user --max_examples_per_user 8

    # a Hub chat model with LoRA on a GPU
    ... --config_file accelerate_configs/single_gpu.yaml recipes/sft.py --model Qwen/Qwen3-0.6B --lora_r 16 --bf16

Each E2E pair becomes one conversation: the user turn is the meaning representation, the assistant turn the
reference. The loss is on the assistant turn only (assistant_only_loss) and each example's loss is its own
mean token NLL; packing is on: each step's Poisson sample is packed best-fit into rows of --max_seq_length
tokens (docs/sft.md). E2E has no users: with --privacy_unit user the recipe groups the examples into SYNTHETIC
users with a Zipf-like number of examples each (seeded; see --zipf_a), to show what user-level DP costs on
this data. The baseline is the copy baseline of recipes/table2text.py (each table copied as its text: no
training, no private data); --method none trains the same model without privacy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    HelpFormatter,
    add_common_arguments,
    announce_and_train,
    apply_user_overrides,
    base_model_dtype,
    count_parameters,
    final_evaluation,
    finish_run,
    refuse_sharded_training,
    score_generations,
    training_arguments,
)
from table2text import copy_baseline, load_table2text  # noqa: E402

#: --model value of the offline default: a small Llama from a config and the byte-level chat tokenizer
OFFLINE_MODEL = "offline-llama"


# ------------------------------------------------------------------------------------------- data
def chat_row(meaning_representation: str, reference: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": meaning_representation},
                         {"role": "assistant", "content": reference.strip()}]}


def synthetic_users(num_examples: int, zipf_a: float, max_size: int, seed: int) -> list[int]:
    """A SYNTHETIC user id per example: users get a Zipf(``zipf_a``)-distributed number of examples (at most
    ``max_size``), examples are assigned to them in a seeded random order. E2E has no authors; this only
    models the skew of real per-user data (a few users with many examples, many with few)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    order = rng.permutation(num_examples)
    user_of = [0] * num_examples
    user, start = 0, 0
    while start < num_examples:
        size = int(min(max_size, rng.zipf(zipf_a)))
        for index in order[start : start + size]:
            user_of[int(index)] = user
        start += size
        user += 1
    return user_of


# ------------------------------------------------------------------------------------ model, decoding
def load_model_and_tokenizer(args: argparse.Namespace, max_seq_length: int) -> tuple[Any, Any]:
    if args.model == OFFLINE_MODEL:
        from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama

        tokenizer = byte_level_chat_tokenizer()
        model = small_llama(tokenizer, hidden_size=args.offline_hidden_size, layers=args.offline_layers,
                            heads=4, max_positions=max(512, max_seq_length), seed=args.seed)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=base_model_dtype(args))
    return model, tokenizer


def generate(model: Any, tokenizer: Any, sources: list[str], args: argparse.Namespace,
             device: Any) -> list[str]:
    """Greedy or beam decoding of the assistant turn for each meaning representation (left-padded batches)."""
    model.eval()
    outputs = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(sources), args.generation_batch_size):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": s}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
                   for s in sources[start : start + args.generation_batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask,
                                 max_new_tokens=args.max_generation_length,
                                 num_beams=args.num_beams, do_sample=False, pad_token_id=pad,
                                 eos_token_id=tokenizer.eos_token_id)
        for row in out[:, width:]:
            outputs.append(tokenizer.decode(row, skip_special_tokens=True).strip().replace("\n", " "))
    return outputs


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1], formatter_class=HelpFormatter,
    )
    g = parser.add_argument_group("SFT")
    g.add_argument("--privacy_unit", default="example", choices=["example", "user"],
                   help="What the (epsilon, delta) guarantee protects: one example, or one (synthetic) user "
                        "and all "
                   "of their examples.")
    g.add_argument("--max_examples_per_user", type=int, default=8,
                   help="User level: at most k of a sampled user's examples enter a step.")
    g.add_argument("--zipf_a", type=float, default=1.5,
                   help="User level: exponent of the Zipf law of the synthetic users' numbers of examples.")
    g.add_argument("--max_user_examples", type=int, default=200,
                   help="User level: the largest synthetic user's number of examples.")
    g.add_argument("--no_packing", action="store_true", help="One example per row (padding collator).")
    g.add_argument("--chat_template_path", default=None,
                   help="A chat template (.jinja file or a model name) for a tokenizer that has none "
                        "(SFTConfig).")
    g.add_argument("--offline_hidden_size", type=int, default=128, help="Hidden size of the offline model.")
    g.add_argument("--offline_layers", type=int, default=4, help="Layers of the offline model.")
    g.add_argument("--num_beams", type=int, default=5, help="Beam size for decoding.")
    g.add_argument("--max_generation_length", type=int, default=100, help="Maximum new tokens per output.")
    g.add_argument("--generation_batch_size", type=int, default=16, help="Inputs decoded together.")
    g.add_argument("--no_baseline", action="store_true", help="Do not score the copy baseline.")
    add_common_arguments(parser, default_model=OFFLINE_MODEL, defaults={
        "learning_rate": "2e-3", "logical_batch_size": "256 (examples, or users with --privacy_unit user)",
        "epochs": "3", "lr_scheduler": "constant", "clipping_fn": "abadi", "clipping_norm": "1.0",
        "max_seq_length": "256 (the packed row's capacity; the offline tokenizer has one token per byte)",
    })
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    start = time.time()
    refuse_sharded_training()
    settings = apply_user_overrides({
        "logical_batch_size": 256, "epochs": 3, "learning_rate": 2e-3, "lr_scheduler": "constant",
        "clipping_fn": "abadi", "clipping_norm": 1.0, "max_seq_length": 256, "method_args": {},
    }, args)

    import datasets

    from hf_dpfilter import DPSFTConfig, DPSFTTrainer

    user_level = args.privacy_unit == "user"
    fields = {f.name for f in dataclasses.fields(DPSFTConfig)}
    if user_level and "privacy_unit" not in fields:
        raise SystemExit("--privacy_unit user needs a version of hf_dpfilter with the user unit "
                         "(privacy_unit, user_id_column, max_examples_per_user in DPTrainingArguments).")
    train_pairs, eval_groups = load_table2text("e2e", args.data_dir, seed=args.seed)
    if args.max_train_samples is not None:
        train_pairs = train_pairs[: args.max_train_samples]
    if args.max_eval_samples is not None:
        eval_groups = eval_groups[: args.max_eval_samples]
    rows = [chat_row(src, tgt) for src, tgt in train_pairs]
    unit_extra: dict[str, Any] = {}
    n_units = len(rows)
    if user_level:
        users = synthetic_users(len(rows), args.zipf_a, args.max_user_examples, args.seed)
        for row, user in zip(rows, users):
            row["user_id"] = user
        n_units = len(set(users))
        unit_extra = {"privacy_unit": "user", "user_id_column": "user_id",
                      "max_examples_per_user": args.max_examples_per_user}
    if settings["logical_batch_size"] >= n_units:  # q = 1 would leave no amplification by sampling
        print(f"[sft] logical batch {settings['logical_batch_size']} >= {n_units} units: using "
              f"{max(1, n_units // 4)}.")
        settings["logical_batch_size"] = max(1, n_units // 4)

    model, tokenizer = load_model_and_tokenizer(args, settings["max_seq_length"])
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                                 lora_dropout=args.lora_dropout,
                                 target_modules=args.lora_target_modules or None,
                                 task_type="CAUSAL_LM")
    extra = {
        "assistant_only_loss": True, "packing": not args.no_packing, "max_length": settings["max_seq_length"],
        "gradient_checkpointing": args.gradient_checkpointing, "chat_template_path": args.chat_template_path,
        "bf16": args.bf16, **unit_extra,
    }
    training_args = training_arguments(args, settings, n_train=n_units, args_class=DPSFTConfig, extra=extra)
    train_ds = datasets.Dataset.from_list(rows)
    eval_ds = datasets.Dataset.from_list([chat_row(src, refs[0]) for src, refs in eval_groups])
    trainer = DPSFTTrainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                           processing_class=tokenizer, peft_config=peft_config)
    trainable, total = count_parameters(trainer.model)
    # at user level the number of examples is private (one user more adds all of theirs): the units are
    # counted
    examples = "" if user_level else f"examples={len(rows)} "
    if trainer.is_world_process_zero():
        print(
            f"[sft] E2E {examples}units={n_units} ({args.privacy_unit} level) eval inputs="
            f"{len(eval_groups)} model={args.model} trainable={trainable:,}/{total:,} method={args.method} "
            f"sigma={trainer.noise_multiplier:.4g} q={trainer.sample_rate:.4g} steps={trainer.planned_steps} "
            f"packing={not args.no_packing}", flush=True,
        )
    announce_and_train(trainer)
    metrics = final_evaluation(trainer)
    score_generations(trainer,
                      lambda sources: generate(trainer.model, tokenizer, sources, args, trainer.args.device),
                      eval_groups, metrics, args.output_dir, "sft")
    report = trainer.privacy_report()
    if not user_level:  # at user level the example count is private (see the print above)
        settings["n_train_examples"] = len(rows)
    settings.update({"n_units": n_units, "privacy_unit": args.privacy_unit,
                     "unit_note": "synthetic users (Zipf-like sizes, seeded): E2E has no authors"
                     if user_level
                     else "one example", "n_eval_inputs": len(eval_groups), "trainable_parameters": trainable,
                     "total_parameters": total, "packing": not args.no_packing, "num_beams": args.num_beams})
    if trainer.is_world_process_zero():
        print(f"[sft] epsilon {report['epsilon']:.4g} (delta {report['delta']:.3g}) at the "
              f"{args.privacy_unit} level over {n_units} units", flush=True)
    baseline = None if args.no_baseline else copy_baseline(eval_groups)
    return finish_run(trainer, args, metrics, start, settings, title=f"E2E SFT, {args.method}, "
        f"{args.privacy_unit}",
                      baseline=baseline)


if __name__ == "__main__":
    main()
