"""DP instruction tuning of a causal LM through TRL (DPSFTTrainer) on chat-formatted E2E, evaluated with the
table-to-text metrics (BLEU, NIST, METEOR, ROUGE-L, CIDEr) against all references of each input.

Examples::

    # offline on CPU: a small Llama built from a config and the byte-level chat tokenizer (no download)
    .venv/bin/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft.py \\
        --data_dir ../shared/data/e2e --target_epsilon 8 --max_train_samples 1000 --max_eval_samples 10 \\
        --num_train_epochs 1 --output_dir outputs/sft-e2e

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
training, no private data); --method none trains the same model without privacy. Every SFTConfig, Trainer
and DP flag works by its own name (HfArgumentParser over DPSFTConfig); --max_seq_length sets max_length.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    RecipeArgs,
    announce_and_train,
    base_model_dtype,
    count_parameters,
    final_evaluation,
    finish_run,
    parse_recipe_args,
    recipe_parser,
    refuse_sharded_training,
    resolve_settings,
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
def load_model_and_tokenizer(cli: RecipeArgs, max_seq_length: int) -> tuple[Any, Any]:
    name = cli.model.model_name_or_path
    if name == OFFLINE_MODEL:
        from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama

        tokenizer = byte_level_chat_tokenizer()
        model = small_llama(tokenizer, hidden_size=cli.task.offline_hidden_size,
                            layers=cli.task.offline_layers, heads=4, max_positions=max(512, max_seq_length),
                            seed=cli.training["seed"])
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=base_model_dtype(cli.model))
    return model, tokenizer


def generate(model: Any, tokenizer: Any, sources: list[str], args: SFTArguments,
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
@dataclass
class SFTArguments:
    """The synthetic users, the offline model and the decoding (privacy_unit, max_examples_per_user, packing,
    chat_template_path are DPSFTConfig's own fields)."""

    zipf_a: float = field(default=1.5, metadata={
        "help": "User level: exponent of the Zipf law of the synthetic users' numbers of examples."})
    max_user_examples: int = field(default=200, metadata={
        "help": "User level: the largest synthetic user's number of examples."})
    offline_hidden_size: int = field(default=128, metadata={"help": "Hidden size of the offline model."})
    offline_layers: int = field(default=4, metadata={"help": "Layers of the offline model."})
    num_beams: int = field(default=5, metadata={"help": "Beam size for decoding."})
    max_generation_length: int = field(default=100, metadata={"help": "Maximum new tokens per output."})
    generation_batch_size: int = field(default=16, metadata={"help": "Inputs decoded together."})
    no_baseline: bool = field(default=False, metadata={"help": "Do not score the copy baseline."})


#: at the user level, at most this many of a sampled user's examples enter a step unless given
MAX_EXAMPLES_PER_USER = 8


def build_parser():
    from hf_dpfilter import DPSFTConfig

    parser = recipe_parser(
        __doc__, SFTArguments, DPSFTConfig, default_model=OFFLINE_MODEL,
        defaults={"learning_rate": 2e-3, "num_train_epochs": 3.0, "lr_scheduler_type": "constant",
                  "clipping_fn": "abadi", "per_sample_max_grad_norm": 1.0, "max_seq_length": 256,
                  # the recipe's values of SFTConfig's own defaults
                  "packing": True, "assistant_only_loss": True, "gradient_checkpointing": False,
                  "bf16": False},
        notes={"logical_batch_size": "256 examples, or users with --privacy_unit user (a quarter of the "
                                     "units when they are fewer).",
               "max_seq_length": "256 (the packed row's capacity; the offline tokenizer has one token per "
                                 "byte).",
               "max_examples_per_user": f"{MAX_EXAMPLES_PER_USER} with --privacy_unit user.",
               "model_name_or_path": f"'{OFFLINE_MODEL}': a small Llama from a config and the byte-level "
                                     "chat tokenizer (no download)."},
    )
    # SFTConfig's packing defaults to False, so HfArgumentParser gives it no --no_packing: the recipe's name
    parser.add_argument("--no_packing", action="store_false", dest="packing",
                        help="One example per row (padding collator).")
    return parser


def parse_args(argv: list[str] | None = None) -> RecipeArgs:
    return parse_recipe_args(build_parser(), argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    cli = parse_args(argv)
    start = time.time()
    refuse_sharded_training()
    if "max_length" in cli.given and "max_seq_length" not in cli.given:
        cli.data.max_seq_length = cli.training["max_length"]  # SFTConfig's name for the same length
    settings = resolve_settings(cli, {})
    method, unit, packing = cli.training["dp_method"], cli.training["privacy_unit"], cli.training["packing"]

    import datasets

    from hf_dpfilter import DPSFTConfig, DPSFTTrainer

    user_level = unit == "user"
    fields = {f.name for f in dataclasses.fields(DPSFTConfig)}
    if user_level and "privacy_unit" not in fields:
        raise SystemExit("--privacy_unit user needs a version of hf_dpfilter with the user unit "
                         "(privacy_unit, user_id_column, max_examples_per_user in DPTrainingArguments).")
    train_pairs, eval_groups = load_table2text("e2e", cli.data.data_dir, seed=cli.training["seed"])
    if cli.data.max_train_samples is not None:
        train_pairs = train_pairs[: cli.data.max_train_samples]
    if cli.data.max_eval_samples is not None:
        eval_groups = eval_groups[: cli.data.max_eval_samples]
    rows = [chat_row(src, tgt) for src, tgt in train_pairs]
    n_units = len(rows)
    if user_level:
        users = synthetic_users(len(rows), cli.task.zipf_a, cli.task.max_user_examples, cli.training["seed"])
        for row, user in zip(rows, users):
            row["user_id"] = user
        n_units = len(set(users))
        cli.set_default("user_id_column", "user_id")
        cli.set_default("max_examples_per_user", MAX_EXAMPLES_PER_USER)
    else:  # k applies to users only (the example-level run ignores it, as --max_examples_per_user says)
        cli.training["max_examples_per_user"] = None
    if settings["logical_batch_size"] >= n_units:  # q = 1 would leave no amplification by sampling
        print(f"[sft] logical batch {settings['logical_batch_size']} >= {n_units} units: using "
              f"{max(1, n_units // 4)}.")
        settings["logical_batch_size"] = max(1, n_units // 4)

    model, tokenizer = load_model_and_tokenizer(cli, settings["max_seq_length"])
    peft_config = None
    if cli.model.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cli.model.lora_r, lora_alpha=cli.model.lora_alpha or 2 * cli.model.lora_r,
                                 lora_dropout=cli.model.lora_dropout,
                                 target_modules=cli.model.lora_target_modules or None,
                                 task_type="CAUSAL_LM")
    training_args = training_arguments(cli, settings, n_train=n_units,
                                       extra={"max_length": settings["max_seq_length"]})
    train_ds = datasets.Dataset.from_list(rows)
    eval_ds = datasets.Dataset.from_list([chat_row(src, refs[0]) for src, refs in eval_groups])
    trainer = DPSFTTrainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                           processing_class=tokenizer, peft_config=peft_config)
    trainable, total = count_parameters(trainer.model)
    # at user level the number of examples is private (one user more adds all of theirs): the units are
    # counted
    examples = "" if user_level else f"examples={len(rows)} "
    if trainer.is_world_process_zero():  # sigma, q and the steps: in the plan, printed next
        print(f"[sft] E2E {examples}units={n_units} ({unit} level) eval inputs={len(eval_groups)} "
              f"model={cli.model.model_name_or_path} trainable={trainable:,}/{total:,} method={method} "
              f"packing={packing}", flush=True)
    announce_and_train(trainer)
    metrics = final_evaluation(trainer)
    score_generations(trainer,
                      lambda sources: generate(trainer.model, tokenizer, sources, cli.task,
                                               trainer.args.device),
                      eval_groups, metrics, training_args.output_dir, "sft")
    report = trainer.privacy_report()
    if not user_level:  # at user level the example count is private (see the print above)
        settings["n_train_examples"] = len(rows)
    settings.update({"n_units": n_units, "privacy_unit": unit,
                     "unit_note": "synthetic users (Zipf-like sizes, seeded): E2E has no authors"
                     if user_level else "one example", "n_eval_inputs": len(eval_groups),
                     "trainable_parameters": trainable, "total_parameters": total, "packing": packing,
                     "num_beams": cli.task.num_beams})
    if trainer.is_world_process_zero():
        print(f"[sft] epsilon {report['epsilon']:.4g} (delta {report['delta']:.3g}) at the "
              f"{unit} level over {n_units} units", flush=True)
    baseline = None if cli.task.no_baseline else copy_baseline(eval_groups)
    return finish_run(trainer, cli, metrics, start, settings, title=f"E2E SFT, {method}, {unit}",
                      baseline=baseline)


if __name__ == "__main__":
    main()
