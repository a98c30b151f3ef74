"""Differentially private fine-tuning on GLUE (SST-2, QNLI, QQP, MNLI) with any sequence-classification model.

Examples::

    # offline on CPU: the packaged MiniLM on 1000 SST-2 examples, DiSK at epsilon 8 (about 30 s)
    .venv/bin/accelerate launch --config_file accelerate_configs/cpu.yaml recipes/glue.py --task sst2 --method disk \\
        --model packaged-minilm --data_dir ../shared/data/glue --max_train_samples 1000 --max_eval_samples 200 \\
        --max_seq_length 32 --num_train_epochs 1 --target_epsilon 8 --secure_rng --output_dir outputs/glue-disk

With every weight of the packaged MiniLM trained (no ``--lora_r``) the model classifies mean-pooled token
states, the way it was trained to embed sentences, and the settings the command line leaves out are the ones
whose seeds ``python -m benchmarks utility`` measured on SST-2's dev set (``FULL_SETTINGS`` in
recipes/common/models.py: logical batch 1024, lr 2e-3, C 0.1, 3 epochs, linear decay, dropout off;
docs/results.md has what they measure).

The papers' setting (RoBERTa-base, B = 1000 x factor, 3 x factor epochs, lr 5e-4, AdamW, linear decay) needs a
GPU and the Hub: ``--config_file accelerate_configs/multi_gpu.yaml --task mnli --method doppler --preset paper
--model roberta-base --target_epsilon 3``.

Every Trainer and DP flag works by its own name (HfArgumentParser over DPTrainingArguments): e.g.
``--report_to wandb``, ``--push_to_hub``, ``--bf16``, checkpoints with ``--save_strategy steps
--save_steps 500`` and a resume with ``--resume_from_checkpoint <output_dir>/checkpoint-500`` (the privacy
ledger goes on from it). ``--method``, ``--model`` and ``--task`` are short for ``--dp_method``,
``--model_name_or_path`` and ``--task_name``.

Data: ``--data_dir`` in the GLUE TSV layout (``<data_dir>/<TASK>/{train,dev}.tsv``, MNLI
``dev_matched.tsv`` / ``dev_mismatched.tsv``; columns are found by their header names), otherwise
``datasets.load_dataset("glue", task)`` from the Hub. Evaluation is on the dev set(s) (GLUE's test labels
are hidden). At the end the privacy report is printed and ``results.json``, ``epsilon.png`` and
``training.png`` are written to ``--output_dir`` by the main process.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    PACKAGED_MINILM,
    RecipeArgs,
    announce_and_train,
    apply_lora,
    base_model_dtype,
    count_parameters,
    final_evaluation,
    finish_run,
    parse_recipe_args,
    recipe_parser,
    refuse_offline_downloads,
    refuse_sharded_training,
    training_arguments,
)
from _common import resolve_settings as resolve  # noqa: E402

# task -> (GLUE folder, hub config, text column candidates (a, b), label column candidates, label names)
TASKS: dict[str, dict[str, Any]] = {
    "sst2": {
        "folder": "SST-2",
        "text_a": ("sentence", "content", "text"),
        "text_b": None,
        "label": ("label",),
        "labels": ("0", "1"),
        "hub_columns": ("sentence", None),
        "dev": {"validation": "dev.tsv"},
        "hub_dev": {"validation": "validation"},
        "factor": 1,
    },
    "qnli": {
        "folder": "QNLI",
        "text_a": ("question",),
        "text_b": ("sentence",),
        "label": ("label",),
        "labels": ("entailment", "not_entailment"),
        "hub_columns": ("question", "sentence"),
        "dev": {"validation": "dev.tsv"},
        "hub_dev": {"validation": "validation"},
        "factor": 2,
    },
    "qqp": {
        "folder": "QQP",
        "text_a": ("question1",),
        "text_b": ("question2",),
        "label": ("is_duplicate", "label"),
        "labels": ("0", "1"),
        "hub_columns": ("question1", "question2"),
        "dev": {"validation": "dev.tsv"},
        "hub_dev": {"validation": "validation"},
        "factor": 6,
    },
    "mnli": {
        "folder": "MNLI",
        "text_a": ("sentence1", "premise"),
        "text_b": ("sentence2", "hypothesis"),
        "label": ("gold_label", "label"),
        "labels": ("entailment", "neutral", "contradiction"),
        "hub_columns": ("premise", "hypothesis"),
        "dev": {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"},
        "hub_dev": {"matched": "validation_matched", "mismatched": "validation_mismatched"},
        "factor": 6,
    },
}
TASK_ALIASES = {"sst-2": "sst2", "sst_2": "sst2", "mnli-m": "mnli", "mnli_matched": "mnli"}

# The papers' settings (Li et al. 2022 run_wrapper, which DiSK and DOPPLER (App. C.3) say they follow):
# B = 1000 x factor, epochs = 3 x factor, lr 5e-4, AdamW (0.9, 0.999, 1e-8), weight decay 0, linear decay,
# no warm-up, max_seq_len 256. Clipping: automatic with C = 1 where the method's paper used it (DiSK,
# DOPPLER), otherwise Li et al.'s Abadi clipping with C = 0.1 (DP-PMLF and DiceSGD papers: C = 1).
PAPER_CLIPPING = {
    "disk": ("automatic", 1.0),
    "doppler": ("automatic", 1.0),
    "pmlf": ("abadi", 1.0),
    "dicesgd": ("abadi", 1.0),
    "dpsgd": ("abadi", 0.1),
    "diff2": ("abadi", 0.1),
    "none": ("abadi", 1.0),
}
PAPER_METHOD_ARGS = {"disk": {"kappa": 0.7, "gamma": 0.5}}  # decision 2: the paper's two points
PAPER_LORA = {"lora_alpha_factor": 2, "lora_dropout": 0.01}  # r = 16, alpha = 32 in the DiSK author code


def read_glue_tsv(path: str, spec: dict[str, Any]) -> dict[str, list]:
    """Read a GLUE TSV by header names -> {"text_a", "text_b", "label"} with integer labels."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)

        def column(candidates):
            for name in candidates:
                if name in header:
                    return header.index(name)
            raise ValueError(f"{path}: none of the columns {candidates} in the header {header}.")

        ia = column(spec["text_a"])
        ib = column(spec["text_b"]) if spec["text_b"] else None
        il = column(spec["label"])
        label_ids = {name: i for i, name in enumerate(spec["labels"])}
        out: dict[str, list] = {"text_a": [], "text_b": [], "label": []}
        for row in reader:
            if len(row) <= max(ia, il, ib or 0):
                continue  # a malformed line (a few exist in the official QQP/MNLI files)
            label = row[il].strip()
            if label not in label_ids:
                raise ValueError(f"{path}: unknown label {label!r}; expected one of {sorted(label_ids)}.")
            out["text_a"].append(row[ia])
            out["text_b"].append(row[ib] if ib is not None else None)
            out["label"].append(label_ids[label])
    return out


def load_glue(task: str, data_dir: str | None) -> tuple[dict[str, list], dict[str, dict[str, list]]]:
    """(train, {dev name: dev}) as column dicts, from ``data_dir`` or the Hub."""
    spec = TASKS[task]
    if data_dir is not None:
        folder = os.path.join(data_dir, spec["folder"])
        if not os.path.isdir(folder):
            folder = data_dir  # --data_dir may point at the task folder itself
        train_path = os.path.join(folder, "train.tsv")
        if not os.path.exists(train_path):
            raise FileNotFoundError(
                f"No {train_path}. --data_dir must be a GLUE copy (<data_dir>/{spec['folder']}/train.tsv) or "
                "the task folder itself; leave it out to download from the Hub."
            )
        dev = {name: read_glue_tsv(os.path.join(folder, file), spec) for name, file in spec["dev"].items()}
        return read_glue_tsv(train_path, spec), dev
    import datasets  # the Hub path (needs network access)

    raw = datasets.load_dataset("glue", task)
    col_a, col_b = spec["hub_columns"]

    def convert(split):
        return {
            "text_a": list(split[col_a]),
            "text_b": list(split[col_b]) if col_b else [None] * len(split),
            "label": list(split["label"]),
        }

    return convert(raw["train"]), {name: convert(raw[split]) for name, split in spec["hub_dev"].items()}


def take(columns: dict[str, list], n: int | None) -> dict[str, list]:
    return columns if n is None else {k: v[:n] for k, v in columns.items()}


def tokenize(columns: dict[str, list], tokenizer: Any, max_length: int):
    import datasets

    has_b = any(b is not None for b in columns["text_b"])
    encoded = tokenizer(
        columns["text_a"], columns["text_b"] if has_b else None, truncation=True, max_length=max_length
    )
    data = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
            "labels": columns["label"]}
    if "token_type_ids" in encoded:
        data["token_type_ids"] = encoded["token_type_ids"]
    return datasets.Dataset.from_dict(data)


_ACCURACY_METRIC: Any = None  # the packaged evaluate module, loaded on first use


def accuracy_metric() -> Any:
    """The packaged, offline ``evaluate`` accuracy module (:func:`recipes.common.metrics.load`), loaded
    once."""
    global _ACCURACY_METRIC
    if _ACCURACY_METRIC is None:
        from recipes.common.metrics import load as load_metric

        _ACCURACY_METRIC = load_metric("accuracy")
    return _ACCURACY_METRIC


def compute_accuracy(eval_pred) -> dict[str, float]:
    """``compute_metrics``: accuracy of the argmax of the logits, via the packaged ``evaluate`` module."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    scores = accuracy_metric().compute(predictions=np.argmax(logits, axis=-1), references=labels)
    return {"accuracy": float(scores["accuracy"])}


def majority_baseline(dev_cols: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Accuracy of always predicting the most frequent label of the (first) evaluation set."""
    name = "validation" if "validation" in dev_cols else sorted(dev_cols)[0]
    labels = dev_cols[name]["label"]
    value = max(labels.count(c) for c in set(labels)) / max(1, len(labels))
    metric = "eval_accuracy" if list(dev_cols) == ["validation"] else f"eval_{name}_accuracy"
    return {"metric": metric, "value": value, "n_eval": len(labels)}


@dataclass
class GlueArguments:
    """The GLUE task and the settings preset."""

    task_name: str = field(default="sst2", metadata={
        "aliases": ["--task"], "help": "sst2, qnli, qqp or mnli (matched and mismatched dev sets)."})
    preset: str | None = field(default=None, metadata={
        "choices": ["paper"],
        "help": "Default: none (the recipe's settings). 'paper': the DiSK/DOPPLER GLUE settings (B = 1000 x "
                "factor, 3 x factor epochs, lr 5e-4, automatic clipping C = 1 for DiSK/DOPPLER); explicit "
                "flags still override it."})

    #: HF_DPFILTER_DATA=<folder>: the data is <folder>/glue (no --data_dir needed)
    data_subdir = "glue"


def packaged_full_fine_tuning(cli: RecipeArgs) -> bool:
    """Whether the run fine-tunes every weight of the packaged MiniLM: it then gets a mean-pooled head (the
    way that model was trained to embed sentences; its [CLS] pooler was never trained) and, unless the command
    line gives them, the full fine-tuning settings the benchmarks measured
    (``recipes.common.models.FULL_SETTINGS``)."""
    from recipes.common.models import packaged_model_path

    path = cli.model.model_name_or_path
    return not cli.model.lora_r and os.path.isdir(path) and os.path.samefile(path, packaged_model_path())


def resolve_settings(cli: RecipeArgs) -> dict[str, Any]:
    """Fill every optimisation/privacy setting the command line did not give from the preset (paper) or the
    recipe's defaults (a higher learning rate with LoRA)."""
    factor = TASKS[cli.task.task_name]["factor"]
    method = cli.training["dp_method"]
    if cli.task.preset != "paper" and packaged_full_fine_tuning(cli):
        from recipes.common.models import FULL_SETTINGS

        return resolve(cli, {"logical_batch_size": FULL_SETTINGS["logical_batch_size"],
                             "num_train_epochs": FULL_SETTINGS["epochs"],
                             "learning_rate": FULL_SETTINGS["learning_rate"],
                             "per_sample_max_grad_norm": FULL_SETTINGS["max_grad_norm"],
                             "lr_scheduler_type": FULL_SETTINGS["lr_scheduler_type"]})
    if cli.task.preset != "paper":
        return resolve(cli, {"learning_rate": 2e-3} if cli.model.lora_r else {})
    clip_fn, clip_norm = PAPER_CLIPPING[method]
    if cli.model.lora_r and cli.model.lora_alpha is None:
        cli.model.lora_alpha = PAPER_LORA["lora_alpha_factor"] * cli.model.lora_r
    return resolve(cli, {
        "logical_batch_size": 1000 * factor, "num_train_epochs": 3 * factor, "learning_rate": 5e-4,
        "lr_scheduler_type": "linear", "clipping_fn": clip_fn, "per_sample_max_grad_norm": clip_norm,
        "max_seq_length": 256,
    }, PAPER_METHOD_ARGS.get(method))


def build_parser():
    return recipe_parser(
        __doc__, GlueArguments, default_model="roberta-base",
        defaults={"learning_rate": 5e-4, "num_train_epochs": 3.0, "lr_scheduler_type": "linear",
                  "clipping_fn": "abadi", "per_sample_max_grad_norm": 1.0, "max_seq_length": 128},
        notes={"learning_rate": "5e-4, 2e-3 with LoRA or the packaged MiniLM; --preset paper: 5e-4.",
               "logical_batch_size": "256 (N // 4 when N is smaller), 1024 for the packaged MiniLM; --preset "
                                     "paper: 1000 x the task's factor.",
               "num_train_epochs": "3; --preset paper: 3 x the task's factor.",
               "clipping_fn": "abadi; --preset paper: the method's paper.",
               "per_sample_max_grad_norm": "1.0, 0.1 for the packaged MiniLM; --preset paper: the method's "
                                           "paper.",
               "max_seq_length": "128; --preset paper: 256."},
    )


def parse_args(argv: list[str] | None = None) -> RecipeArgs:
    cli = parse_recipe_args(build_parser(), argv)
    task = cli.task.task_name.lower()
    cli.task.task_name = TASK_ALIASES.get(task, task)
    if cli.task.task_name not in TASKS:
        raise SystemExit(f"error: --task_name must be one of {sorted(TASKS)}, got {task!r}.")
    return cli


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    cli = parse_args(argv)
    start = time.time()
    refuse_sharded_training()
    settings = resolve_settings(cli)
    task, model_name, method = cli.task.task_name, cli.model.model_name_or_path, cli.training["dp_method"]

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_dpfilter import DPTrainer

    spec = TASKS[task]
    refuse_offline_downloads("glue", cli.data.data_dir, model_name, "--data_dir", PACKAGED_MINILM)
    train_cols, dev_cols = load_glue(task, cli.data.data_dir)
    train_cols = take(train_cols, cli.data.max_train_samples)
    dev_cols = {name: take(cols, cli.data.max_eval_samples) for name, cols in dev_cols.items()}
    n_train = len(train_cols["label"])
    if settings["logical_batch_size"] > n_train:
        print(f"[glue] logical batch {settings['logical_batch_size']} > N = {n_train}: using N // 4.")
        settings["logical_batch_size"] = max(1, n_train // 4)

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if packaged_full_fine_tuning(cli):
        from transformers import AutoModel

        from recipes.common.models import FULL_SETTINGS, MeanPooledClassifier, encoder_dropout

        encoder = AutoModel.from_pretrained(model_name, **encoder_dropout(FULL_SETTINGS["dropout"]))
        model = MeanPooledClassifier(encoder.config.hidden_size, len(spec["labels"]), encoder=encoder)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(model_name, num_labels=len(spec["labels"]),
                                                                   dtype=base_model_dtype(cli.model))
        if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id
    if cli.model.lora_r:
        model = apply_lora(model, cli.model, task_type="SEQ_CLS", modules_to_save=None)  # SEQ_CLS: the head
    trainable, total = count_parameters(model)

    train_ds = tokenize(train_cols, tokenizer, settings["max_seq_length"])
    eval_ds = {name: tokenize(cols, tokenizer, settings["max_seq_length"]) for name, cols in dev_cols.items()}
    eval_ds = eval_ds["validation"] if list(eval_ds) == ["validation"] else eval_ds

    training_args = training_arguments(cli, settings, n_train=n_train)
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_accuracy,
    )
    if trainer.is_world_process_zero():  # sigma, q and the steps: in the plan, printed next
        print(f"[glue] task={task} N={n_train} model={model_name} trainable={trainable:,}/{total:,} "
              f"method={method} settings={settings}", flush=True)
    announce_and_train(trainer)  # the plan, and its warnings with their fixes, once
    metrics = final_evaluation(trainer)
    settings.update({"n_train": n_train, "trainable_parameters": trainable, "total_parameters": total})
    return finish_run(trainer, cli, metrics, start, settings, title=f"GLUE {task}, {method}",
                      baseline=majority_baseline(dev_cols))


if __name__ == "__main__":
    main()
