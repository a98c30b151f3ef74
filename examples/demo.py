"""`make demo`: DP fine-tuning of the packaged pretrained MiniLM encoder on SST-2, on CPU, in a few minutes.

    python examples/demo.py --data_dir ../shared/data/glue/SST-2 [--method dpsgd] [--epsilon 8]

Trains on a fixed random subset of the SST-2 training set with DP-Adam (or another ``--method``) at the
given epsilon, evaluates on the full SST-2 dev set, and prints the dev accuracy and the privacy report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

# the demo is application code beside the package: its helpers live in recipes/common (repository root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from recipes.common.data import read_glue_tsv  # noqa: E402
from recipes.common.models import HEAD_SETTINGS as DEFAULTS  # noqa: E402  (docs/results.md, "The demo")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data/glue/SST-2", help="folder with train.tsv and dev.tsv")
    parser.add_argument("--method", default="dpsgd", help="dp method (dpsgd = DP-Adam here, disk, doppler, ...)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--noise_multiplier", type=float, default=None, help="fix sigma instead of --epsilon")
    parser.add_argument("--train_samples", type=int, default=DEFAULTS["train_samples"],
                        help="random training examples to use (0: the whole training set)")
    parser.add_argument("--epochs", type=float, default=DEFAULTS["epochs"])
    parser.add_argument("--logical_batch_size", type=int, default=DEFAULTS["logical_batch_size"])
    parser.add_argument("--learning_rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--max_grad_norm", type=float, default=DEFAULTS["max_grad_norm"])
    parser.add_argument("--clipping_fn", default="abadi", choices=["abadi", "automatic"])
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument(
        "--train", default="head", choices=["head", "bias", "lora", "full"],
        help="what to train: a linear classifier on the frozen encoder's mean-pooled sentence embeddings "
        "('head', the default: the only choice that fits in a few CPU minutes), every bias plus the classifier "
        "('bias', BiTFiT), a LoRA adapter on query/value plus the classifier ('lora'), or every weight ('full'); "
        "the last three need other --learning_rate/--epochs values, see docs/results.md",
    )
    parser.add_argument("--lora_r", type=int, default=8, help="LoRA rank for --train lora")
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data order seed")
    parser.add_argument("--data_seed", type=int, default=0, help="which random training subset to use")
    parser.add_argument(
        "--secure_rng", action="store_true",
        help="noise and Poisson sampling from the OS CSPRNG (recommended whenever results are published)",
    )
    args = parser.parse_args(argv)

    train_file = os.path.join(args.data_dir, "train.tsv")
    dev_file = os.path.join(args.data_dir, "dev.tsv")
    if not (os.path.isfile(train_file) and os.path.isfile(dev_file)):
        print(
            f"SST-2 data not found in {args.data_dir!r} (expected train.tsv and dev.tsv in the GLUE TSV layout).\n"
            "Point the demo at it with `make demo DATA_DIR=/path/to/data` (the folder holding glue/SST-2) or\n"
            "`python examples/demo.py --data_dir /path/to/SST-2`.",
            file=sys.stderr,
        )
        raise SystemExit(2)

    import datasets
    from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, default_data_collator

    from hf_dpfilter import DPTrainer, DPTrainingArguments
    from recipes.common.models import MeanPooledClassifier, mean_pooled_embeddings, packaged_model_path

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = packaged_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoder = AutoModel.from_pretrained(path)

    texts, labels = read_glue_tsv(train_file)
    rng = np.random.default_rng(args.data_seed)
    n_train = len(texts) if args.train_samples <= 0 else min(args.train_samples, len(texts))
    subset = rng.permutation(len(texts))[:n_train]
    dev_texts, dev_labels = read_glue_tsv(dev_file)
    train_texts, train_labels = [texts[i] for i in subset], [labels[i] for i in subset]
    majority = max(np.mean(dev_labels), 1.0 - np.mean(dev_labels))

    start = time.time()
    if args.train == "head":
        # The encoder is frozen, so each sentence's embedding is computed once (a public function of the
        # example; nothing private is learned from it) and DP training touches only the classifier.
        encoder.to(device)
        train = datasets.Dataset.from_dict({
            "sentence_embedding": mean_pooled_embeddings(encoder, tokenizer, train_texts, args.max_seq_length,
                                                         device=device).numpy(),
            "labels": train_labels,
        })
        dev = datasets.Dataset.from_dict({
            "sentence_embedding": mean_pooled_embeddings(encoder, tokenizer, dev_texts, args.max_seq_length,
                                                         device=device).numpy(),
            "labels": dev_labels,
        })
        model = MeanPooledClassifier(encoder.config.hidden_size, num_labels=2)
        collator = default_data_collator
        print(f"Sentence embeddings of {len(train)} training and {len(dev)} dev examples: "
              f"{time.time() - start:.0f} s on {device}", flush=True)
    else:
        model = MeanPooledClassifier(encoder.config.hidden_size, num_labels=2, encoder=encoder)
        if args.train == "bias":
            for name, param in model.named_parameters():
                param.requires_grad_(name.endswith(".bias") or name.startswith("classifier"))
        elif args.train == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=["query", "value"],
                              lora_dropout=0.0, modules_to_save=["classifier"])
            model = get_peft_model(model, lora)

        def encode(batch_texts: list[str], batch_labels: list[int]) -> datasets.Dataset:
            enc = tokenizer(batch_texts, truncation=True, max_length=args.max_seq_length)
            return datasets.Dataset.from_dict({**enc, "labels": batch_labels})

        train = encode(train_texts, train_labels)
        dev = encode(dev_texts, dev_labels)
        collator = DataCollatorWithPadding(tokenizer)

    training_args = DPTrainingArguments(
        output_dir=args.output_dir,
        dp_method=args.method,
        target_epsilon=args.epsilon if args.method != "none" and args.noise_multiplier is None else None,
        noise_multiplier=args.noise_multiplier,
        per_sample_max_grad_norm=args.max_grad_norm,
        clipping_fn=args.clipping_fn,
        logical_batch_size=args.logical_batch_size,
        per_device_train_batch_size=args.logical_batch_size if args.train == "head" else 64,
        per_device_eval_batch_size=256,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=device == "cpu",
        seed=args.seed,
        secure_rng=args.secure_rng,
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
        data_collator=collator,
        compute_metrics=accuracy,
    )
    print(trainer.privacy_plan.describe(trainer.trainable_parameter_count()), flush=True)
    train_start = time.time()
    trainer.train()
    train_seconds = time.time() - train_start
    metrics = trainer.evaluate()
    report = trainer.privacy_report()
    result = {
        "dev_accuracy": metrics["eval_accuracy"],
        "majority_class_accuracy": majority,
        "train": args.train,
        "train_examples": len(train),
        "dev_examples": len(dev),
        "device": device,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - start, 1),
        "privacy": report,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    print()
    print(f"SST-2 dev accuracy: {metrics['eval_accuracy']:.2%}  (majority-class baseline {majority:.2%}; "
          f"{len(dev)} dev examples, {len(train)} training examples)")
    print(
        f"Privacy spent: epsilon = {report['epsilon']:.3f} at delta = {report['delta']:.2e} "
        f"(target {report['target_epsilon']}, {report['accountant']} accountant, sigma = "
        f"{report['noise_multiplier']:.3f}, q = {report['sample_rate']:.4f}, {report['steps']} steps, "
        f"method {report['method']})"
    )
    print(f"Time: {result['total_seconds']:.0f} s in all, {train_seconds:.0f} s of DP training, on {device}")
    return result


if __name__ == "__main__":
    main()
