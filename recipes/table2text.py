"""Differentially private table-to-text generation (E2E, DART) with GPT-2, evaluated with BLEU, NIST, METEOR,
ROUGE-L and CIDEr against all references of each input.

Examples::

    # offline on CPU: a small GPT-2 built from a config (examples/make_tiny_gpt2.py), the local E2E files
    .venv/bin/python examples/make_tiny_gpt2.py --data_dir ../shared/data/e2e --output_dir outputs/tiny-gpt2
    .venv/bin/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/table2text.py --dataset e2e \\
        --data_dir ../shared/data/e2e --model outputs/tiny-gpt2 --method dpsgd --target_epsilon 8 \\
        --max_train_samples 1000 --max_eval_samples 10 --num_train_epochs 1 --secure_rng --output_dir outputs/e2e-dpsgd

A pretrained generator offline: ``recipes/table2text_seq2seq.py --model packaged-minilm2minilm`` (the
packaged MiniLM on both sides of an encoder-decoder).

GPT-2 on E2E at epsilon 8 in the Li et al. 2022 / DiSK setting needs a GPU and the Hub:
``--config_file accelerate_configs/single_gpu.yaml --model gpt2 --method disk --preset paper --target_epsilon 8``.
Every Trainer and DP flag works by its own name (HfArgumentParser over DPTrainingArguments), as in glue.py.

Format (Li et al.'s "cat" mode): ``table <bos> text <eos>``; the loss is on the text tokens only (the table
and the separator are labelled -100) and each example's loss is the mean over its own text tokens.
Decoding as in private-transformers' table2text: beam search with 5 beams, at most 100 new tokens, at least
5, no sampling, newline tokens banned. The metrics are
:func:`recipes.common.generation_metrics.compute_generation_metrics` (the official E2E-challenge conventions;
METEOR is an offline approximation, see that module).

Data: ``--data_dir`` with the official files (E2E: ``devset.csv`` is used for training and
``testset_w_refs.csv`` for evaluation, grouped by MR, since the official training split is not shipped here;
if ``trainset.csv`` is present it is used for training and ``devset.csv`` is left out. DART: the
``*dev*.json`` file split by triple set, or ``*train*.json`` / ``*test*.json`` when present); otherwise the
Hub (``datasets.load_dataset("e2e_nlg")`` / ``("dart")``).
"""

from __future__ import annotations

import glob
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    PACKAGED_ENCODER_DECODER,
    RecipeArgs,
    announce_and_train,
    apply_lora,
    base_model_dtype,
    count_parameters,
    final_evaluation,
    finish_run,
    parse_recipe_args,
    recipe_parser,
    refuse_sharded_training,
    score_generations,
    training_arguments,
)
from _common import resolve_settings as resolve  # noqa: E402

Pairs = list[tuple[str, str]]
Groups = list[tuple[str, list[str]]]

# Li et al. 2022 (private-transformers examples/table2text/run.sh), reused by DiSK (Zhang et al. 2024):
# E2E lr 2e-3, 10 epochs, max_seq_len 100, delta 8e-6; DART lr 5e-4, 15 epochs, max_seq_len 120, delta 1e-5;
# B = 1024, AdamW, constant lr. Clipping: automatic C = 1 for DiSK/DOPPLER (their papers), Abadi C = 0.1 else.
PAPER = {
    "e2e": {"learning_rate": 2e-3, "epochs": 10, "max_seq_length": 100, "delta": 8e-6},
    "dart": {"learning_rate": 5e-4, "epochs": 15, "max_seq_length": 120, "delta": 1e-5},
}
PAPER_CLIPPING = {"disk": ("automatic", 1.0), "doppler": ("automatic", 1.0)}
PAPER_METHOD_ARGS = {"disk": {"kappa": 0.7, "gamma": 0.5}}


# ------------------------------------------------------------------------------------------- data
def linearize_triples(tripleset: list[list[str]]) -> str:
    """DART triples as one line: ``s : r : o | s : r : o``."""
    return " | ".join(" : ".join(part.strip() for part in triple) for triple in tripleset)


def _flatten(groups: Groups) -> Pairs:
    return [(src, ref) for src, refs in groups for ref in refs]


def load_table2text(dataset: str, data_dir: str | None, eval_fraction: float = 0.2,
                    seed: int = 0) -> tuple[Pairs, Groups]:
    """(training pairs (table, text), evaluation groups (table, [references]))."""
    from recipes.common.generation_metrics import load_dart_json, load_e2e_csv

    if data_dir is not None:
        if dataset == "e2e":
            train_file = os.path.join(data_dir, "trainset.csv")
            if not os.path.exists(train_file):
                train_file = os.path.join(data_dir, "devset.csv")
            test_file = os.path.join(data_dir, "testset_w_refs.csv")
            for f in (train_file, test_file):
                if not os.path.exists(f):
                    raise FileNotFoundError(f"No {f}: --data_dir must hold the official E2E CSV files "
                                            "(mr,ref).")
            return _flatten(load_e2e_csv(train_file)), load_e2e_csv(test_file)
        files = sorted(glob.glob(os.path.join(data_dir, "*.json")))
        train = [f for f in files if "train" in os.path.basename(f)]
        test = [f for f in files if "test" in os.path.basename(f)]

        def groups(path):
            return [(linearize_triples(t), refs) for t, refs in load_dart_json(path) if refs]

        if train and test:
            return _flatten(groups(train[0])), groups(test[0])
        dev = [f for f in files if "dev" in os.path.basename(f)]
        if not dev:
            raise FileNotFoundError(f"No DART JSON (*train*/*test* or *dev*) in {data_dir}.")
        entries = groups(dev[0])
        order = list(range(len(entries)))
        random.Random(seed).shuffle(order)  # split by triple set: no table is in both parts
        n_eval = max(1, int(round(eval_fraction * len(entries))))
        eval_ids = set(order[:n_eval])
        return (
            _flatten([e for i, e in enumerate(entries) if i not in eval_ids]),
            [e for i, e in enumerate(entries) if i in eval_ids],
        )
    import datasets  # the Hub path (needs network access)

    if dataset == "e2e":
        raw = datasets.load_dataset("e2e_nlg")
        train = list(zip(raw["train"]["meaning_representation"], raw["train"]["human_reference"]))
        grouped: dict[str, list[str]] = {}
        for mr, ref in zip(raw["test"]["meaning_representation"], raw["test"]["human_reference"]):
            grouped.setdefault(mr, []).append(ref)
        return train, list(grouped.items())
    raw = datasets.load_dataset("dart")

    def hub_groups(split):
        return [
            (linearize_triples(t), list(a["text"])) for t,
            a in zip(split["tripleset"], split["annotations"]) if a["text"]
        ]

    return _flatten(hub_groups(raw["train"])), hub_groups(raw["test"])


class Seq2SeqAsLM:
    """Tokenizes ``table <bos> text <eos>`` with the table and separator labelled -100."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        if self.eos_id is None:
            raise ValueError("The tokenizer has neither an eos nor a sep token; give it one "
                             "(tokenizer.eos_token).")
        self.sep_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def prompt(self, src: str) -> list[int]:
        ids = self.tokenizer(src, add_special_tokens=False)["input_ids"]
        return ids[: max(1, self.max_length // 2) - 1] + [self.sep_id]

    def example(self, src: str, tgt: str) -> dict[str, list[int]]:
        prompt = self.prompt(src)
        target = self.tokenizer(" " + tgt.strip(), add_special_tokens=False)["input_ids"] + [self.eos_id]
        ids = (prompt + target)[: self.max_length]
        labels = ([-100] * len(prompt) + target)[: self.max_length]
        return {"input_ids": ids, "labels": labels}


class CausalLMCollator:
    """Right-pads input_ids (pad id), attention_mask (0) and labels (-100)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), longest), dtype=torch.long)
        labels = torch.full((len(examples), longest), -100, dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.as_tensor(e["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.as_tensor(e["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def to_dataset(rows: list[dict[str, list[int]]]):
    import datasets

    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels")})


# ------------------------------------------------------------------------------------- decoding
def banned_newlines(tokenizer: Any) -> list[list[int]]:
    """Single-token encodings of "\\n" and "\\n\\n" (GPT-2: 198, 628), banned during decoding."""
    banned = []
    for text in ("\n", "\n\n"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids not in banned:
            banned.append(ids)
    return banned


@torch.no_grad()
def generate(model: Any, fmt: Seq2SeqAsLM, sources: list[str], args: Table2TextArguments,
             device: torch.device) -> list[str]:
    """Beam-search continuations of ``table <bos>``, left-padded batches, decoded without special tokens."""
    model.eval()
    banned = banned_newlines(fmt.tokenizer)
    outputs: list[str] = []
    for start in range(0, len(sources), args.generation_batch_size):
        prompts = [fmt.prompt(s) for s in sources[start : start + args.generation_batch_size]]
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), fmt.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.as_tensor(p)
            mask[i, longest - len(p) :] = 1
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            num_beams=args.num_beams,
            max_new_tokens=args.max_generation_length,
            min_new_tokens=min(5, args.max_generation_length),
            do_sample=False,
            early_stopping=True,
            bad_words_ids=banned or None,
            eos_token_id=fmt.eos_id,
            pad_token_id=fmt.pad_id,
        )
        for row in generated[:, longest:]:
            outputs.append(fmt.tokenizer.decode(row, skip_special_tokens=True).strip())
    return outputs


# ------------------------------------------------------------------------------------------ baseline
def copy_baseline(eval_groups: Groups) -> dict[str, Any]:
    """The non-private baseline: every evaluation table copied verbatim as its text, scored like the model.

    It needs no training (no private data): a model that does not beat it has learned nothing measurable,
    as the majority class is for GLUE. Returned in ``finish_run``'s baseline format, on BLEU."""
    from recipes.common.generation_metrics import compute_generation_metrics

    scores = compute_generation_metrics([src for src, _ in eval_groups], [refs for _, refs in eval_groups])
    return {"name": "copy baseline (each table copied as its text)", "metric": "eval_bleu",
            "value": scores["bleu"],
            "n_eval": len(eval_groups), "margin": 0.0, "scores": {f"eval_{k}": v for k, v in scores.items()}}


# ------------------------------------------------------------------------------------------ main
@dataclass
class Table2TextArguments:
    """The data set, the settings preset and the decoding (recipes/table2text_seq2seq.py shares them)."""

    dataset: str = field(default="e2e",
                         metadata={"choices": ["e2e", "dart"], "help": "Table-to-text data set."})
    preset: str | None = field(default=None, metadata={
        "choices": ["paper"],
        "help": "Default: none (the recipe's settings). 'paper': Li et al. 2022 / DiSK settings (B = 1024, "
                "lr 2e-3 E2E / 5e-4 DART, 10 / 15 epochs, constant lr, delta 8e-6 / 1e-5); explicit flags "
                "still override it."})
    num_beams: int = field(default=5, metadata={"help": "Beam size for decoding."})
    max_generation_length: int = field(default=100, metadata={"help": "Maximum new tokens per output."})
    generation_batch_size: int = field(default=16, metadata={"help": "Inputs decoded together."})
    no_baseline: bool = field(default=False, metadata={
        "help": "Do not score the copy baseline (each table copied as its text) that results.json records."})
    dart_eval_fraction: float = field(default=0.2, metadata={
        "help": "DART dev split: share of triple sets held out."})


def resolve_settings(cli: RecipeArgs) -> dict[str, Any]:
    """Fill every optimisation/privacy setting the command line did not give from the preset (paper) or the
    recipe's defaults (per data set)."""
    dataset, method = cli.task.dataset, cli.training["dp_method"]
    if cli.task.preset != "paper":
        return resolve(cli, {"learning_rate": 2e-3 if dataset == "e2e" else 5e-4,
                             "max_seq_length": 100 if dataset == "e2e" else 120})
    clip_fn, clip_norm = PAPER_CLIPPING.get(method, ("abadi", 0.1))
    paper = PAPER[dataset]
    return resolve(cli, {
        "logical_batch_size": 1024, "num_train_epochs": paper["epochs"],
        "learning_rate": paper["learning_rate"],
        "lr_scheduler_type": "constant", "clipping_fn": clip_fn, "per_sample_max_grad_norm": clip_norm,
        "max_seq_length": paper["max_seq_length"], "target_delta": paper["delta"],
    }, PAPER_METHOD_ARGS.get(method))


#: the options' notes under --help, shared with recipes/table2text_seq2seq.py
NOTES = {
    "learning_rate": "2e-3 for E2E, 5e-4 for DART (the same with --preset paper).",
    "logical_batch_size": "256 (N // 4 when N is smaller); --preset paper: 1024.",
    "num_train_epochs": "3; --preset paper: 10 for E2E, 15 for DART.",
    "clipping_fn": "abadi; --preset paper: automatic for disk/doppler.",
    "per_sample_max_grad_norm": "1.0; --preset paper: 1.0 for disk/doppler, 0.1 otherwise.",
    "max_seq_length": "100 for E2E, 120 for DART.",
    "target_delta": "N^-1.1; --preset paper: 8e-6 for E2E, 1e-5 for DART.",
}
DEFAULTS = {"learning_rate": 2e-3, "max_seq_length": 100, "num_train_epochs": 3.0,
            "lr_scheduler_type": "constant", "clipping_fn": "abadi",
            "per_sample_max_grad_norm": 1.0}


def build_parser(doc: str = __doc__, args_class: type | None = None, default_model: str = "gpt2"):
    from hf_dpfilter import DPTrainingArguments

    return recipe_parser(doc, Table2TextArguments, args_class or DPTrainingArguments,
                         default_model=default_model, defaults=DEFAULTS, notes=NOTES)


def parse_args(argv: list[str] | None = None) -> RecipeArgs:
    return parse_recipe_args(build_parser(), argv)


def load_pairs(cli: RecipeArgs, settings: dict[str, Any], recipe: str) -> tuple[list, list]:
    """The training pairs and evaluation groups the options ask for (``--max_*_samples``); a logical batch
    larger than the training set becomes N // 4 (said on the console, under the recipe's name)."""
    train_pairs, eval_groups = load_table2text(cli.task.dataset, cli.data.data_dir,
                                               cli.task.dart_eval_fraction, cli.training["seed"])
    if cli.data.max_train_samples is not None:
        train_pairs = train_pairs[: cli.data.max_train_samples]
    if cli.data.max_eval_samples is not None:
        eval_groups = eval_groups[: cli.data.max_eval_samples]
    n_train = len(train_pairs)
    if settings["logical_batch_size"] > n_train:
        print(f"[{recipe}] logical batch {settings['logical_batch_size']} > N = {n_train}: using N // 4.")
        settings["logical_batch_size"] = max(1, n_train // 4)
    return train_pairs, eval_groups


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    cli = parse_args(argv)
    start = time.time()
    refuse_sharded_training()
    settings = resolve_settings(cli)
    model_name, method = cli.model.model_name_or_path, cli.training["dp_method"]
    if model_name == PACKAGED_ENCODER_DECODER:
        raise SystemExit(f"[table2text] --model {PACKAGED_ENCODER_DECODER} is an encoder-decoder: run it "
                         "with recipes/table2text_seq2seq.py (the same options).")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dpfilter import DPTrainer

    train_pairs, eval_groups = load_pairs(cli, settings, "table2text")
    n_train = len(train_pairs)

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=base_model_dtype(cli.model))
    fmt = Seq2SeqAsLM(tokenizer, settings["max_seq_length"])
    if model.config.pad_token_id is None:
        model.config.pad_token_id = fmt.pad_id
    if cli.model.lora_r:
        model = apply_lora(model, cli.model, task_type="CAUSAL_LM", modules_to_save=None)
    trainable, total = count_parameters(model)

    train_ds = to_dataset([fmt.example(s, t) for s, t in train_pairs])
    # eval loss on the first reference
    eval_ds = to_dataset([fmt.example(s, refs[0]) for s, refs in eval_groups])
    training_args = training_arguments(cli, settings, n_train=n_train)
    trainer = DPTrainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=CausalLMCollator(fmt.pad_id),
    )
    if trainer.is_world_process_zero():  # sigma, q and the steps: in the plan, printed next
        print(f"[table2text] dataset={cli.task.dataset} N={n_train} eval inputs={len(eval_groups)} "
              f"model={model_name} trainable={trainable:,}/{total:,} method={method} settings={settings}",
              flush=True)
    announce_and_train(trainer)  # the plan, and its warnings with their fixes, once
    metrics = final_evaluation(trainer)
    # the packaged, offline evaluate module "table2text" (recipes.common.generation_metrics behind it)
    pairs = score_generations(trainer,
                              lambda sources: generate(trainer.model, fmt, sources, cli.task,
                                                       trainer.args.device),
                              eval_groups, metrics, training_args.output_dir, "table2text")
    for src, pred in pairs[:3]:
        print(f"  {src}\n    -> {pred}", flush=True)
    settings.update({"n_train": n_train, "n_eval_inputs": len(eval_groups), "trainable_parameters": trainable,
                     "total_parameters": total, "num_beams": cli.task.num_beams,
                     "max_generation_length": cli.task.max_generation_length})
    baseline = None if cli.task.no_baseline else copy_baseline(eval_groups)
    return finish_run(trainer, cli, metrics, start, settings, title=f"{cli.task.dataset.upper()}, {method}",
                      baseline=baseline)


if __name__ == "__main__":
    main()
