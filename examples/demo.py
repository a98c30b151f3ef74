"""`make demo`: DP fine-tuning of the packaged pretrained MiniLM encoder on SST-2, on CPU, in a few minutes.

    python examples/demo.py --data_dir ../shared/data/glue/SST-2 [--dp_method dpsgd] [--target_epsilon 8]

Trains on a fixed random subset of the SST-2 training set with DP-Adam (or another ``--dp_method``) at the
given epsilon, evaluates on the full SST-2 dev set, and prints the dev accuracy and the privacy report. The
flags carry the names of the ``DPTrainingArguments`` fields they set.

With ``--train head`` (the default) the frozen encoder's sentence embeddings are a public function of public
weights and of each example, so they are cached on disk (``--embedding_cache``), keyed by the model folder
and its files, the texts' digest and the maximum length: a second run skips the embedding pass, and any
changed input computes afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

# the demo is application code beside the package: its helpers live in recipes/common (repository root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from recipes.common.data import read_glue_tsv  # noqa: E402
from recipes.common.models import FULL_SETTINGS, HEAD_SETTINGS  # noqa: E402  (docs/results.md, "The demo")

#: the settings each --train choice starts from (docs/results.md): the frozen-encoder head's, and
#: minilm_full's for every weight; a flag given on the command line wins
SETTINGS = {"head": HEAD_SETTINGS, "full": FULL_SETTINGS}

#: the flags this demo renamed to the ``DPTrainingArguments`` field they set
RENAMED_FLAGS = {"--epsilon": "--target_epsilon", "--epochs": "--num_train_epochs",
                 "--max_grad_norm": "--per_sample_max_grad_norm"}


class _RenamedFlag(argparse.Action):
    """An old flag name: stop with the new one."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {RENAMED_FLAGS[option_string]} (the DPTrainingArguments "
                     f"field it sets): use {RENAMED_FLAGS[option_string]} instead")


def embedding_cache_key(model_path: str, texts: list[str], max_length: int) -> str:
    """The cache key of the embeddings of ``texts``: the model folder (its path and every file's name, size
    and modification time), the texts' digest (each text length-prefixed, order kept) and ``max_length``."""
    model_path = os.path.realpath(model_path)
    files = sorted(
        (os.path.relpath(os.path.join(folder, name), model_path), stat.st_size, stat.st_mtime_ns)
        for folder, _, names in os.walk(model_path) for name in names
        for stat in [os.stat(os.path.join(folder, name))]
    )
    texts_digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        texts_digest.update(len(data).to_bytes(8, "little") + data)
    key = json.dumps({"pooling": "mean", "model": model_path, "files": files, "max_length": int(max_length),
                      "n": len(texts), "texts": texts_digest.hexdigest()}, sort_keys=True)
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def cached_embeddings(compute: Callable[[], np.ndarray], cache_dir: str | None, model_path: str,
                      texts: list[str], max_length: int) -> tuple[np.ndarray, bool]:
    """``compute()`` (the embeddings of ``texts``, one row each), read from ``cache_dir`` when an entry for
    the same model, texts and ``max_length`` is there, else computed and stored. Returns (embeddings, hit).
    ``cache_dir`` None or empty: no cache."""
    if not cache_dir:
        return compute(), False
    path = os.path.join(cache_dir, f"{embedding_cache_key(model_path, texts, max_length)}.npy")
    if os.path.isfile(path):
        try:
            cached = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            cached = None  # a damaged file: computed afresh and replaced below
        if cached is not None and cached.ndim == 2 and cached.shape[0] == len(texts):
            return cached, True
    embeddings = np.ascontiguousarray(compute(), dtype=np.float32)
    os.makedirs(cache_dir, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.save(f, embeddings, allow_pickle=False)
    os.replace(partial, path)  # atomic: a reader sees the whole file or none
    return embeddings, False



def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="../shared/data/glue/SST-2",
                        help="folder with train.tsv and dev.tsv")
    parser.add_argument("--dp_method", "--method", dest="dp_method", default="dpsgd",
                        help="DP method (dpsgd = DP-Adam here, disk, doppler, pmlf, dicesgd, diff2, none)")
    parser.add_argument("--target_epsilon", type=float, default=8.0)
    parser.add_argument("--noise_multiplier", type=float, default=None,
                        help="fix sigma instead of --target_epsilon")
    # None: the --train choice's measured settings (SETTINGS; the head's for bias and lora)
    parser.add_argument("--train_samples", type=int, default=None,
                        help="random training examples to use (0: the whole training set; default 20000, "
                        "--train full: 0)")
    parser.add_argument("--num_train_epochs", type=float, default=None, help="default 5, --train full: 3")
    parser.add_argument("--logical_batch_size", type=int, default=None,
                        help="default 1000, --train full: 1024")
    parser.add_argument("--learning_rate", type=float, default=None, help="default 0.01, --train full: 2e-3")
    parser.add_argument("--per_sample_max_grad_norm", type=float, default=None,
                        help="per-example clipping norm C (default 1, --train full: 0.1)")
    parser.add_argument("--lr_scheduler_type", default=None, choices=["constant", "linear"],
                        help="default constant, --train full: linear")
    parser.add_argument("--clipping_fn", default="abadi", choices=["abadi", "automatic"])
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument(
        "--train", default="head", choices=["head", "bias", "lora", "full"],
        help="what to train: a linear classifier on the frozen encoder's mean-pooled sentence embeddings "
        "('head', the default: the only choice that fits in a few CPU minutes), every bias plus the "
        "classifier ('bias', BiTFiT), a LoRA adapter on query/value plus the classifier ('lora'), or every "
        "weight ('full'); the last three need other --learning_rate/--num_train_epochs values, see "
        "docs/results.md",
    )
    parser.add_argument("--lora_r", type=int, default=8, help="LoRA rank for --train lora")
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument(
        "--embedding_cache", default="outputs/embedding_cache",
        help="folder of the cached frozen sentence embeddings (--train head), keyed by the model's folder "
        "and files, the texts' digest and --max_seq_length; '' turns the cache off",
    )
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data order seed")
    parser.add_argument("--data_seed", type=int, default=0, help="which random training subset to use")
    parser.add_argument(
        "--secure_rng", action="store_true",
        help="noise and Poisson sampling from the OS CSPRNG (recommended whenever results are published)",
    )
    for old in RENAMED_FLAGS:
        parser.add_argument(old, action=_RenamedFlag)
    args = parser.parse_args(argv)
    settings = SETTINGS.get(args.train, HEAD_SETTINGS)
    for flag, key in (("train_samples", "train_samples"), ("num_train_epochs", "epochs"),
                      ("logical_batch_size", "logical_batch_size"), ("learning_rate", "learning_rate"),
                      ("per_sample_max_grad_norm", "max_grad_norm"),
                      ("lr_scheduler_type", "lr_scheduler_type")):
        if getattr(args, flag) is None:
            setattr(args, flag, settings.get(key, "constant"))

    train_file = os.path.join(args.data_dir, "train.tsv")
    dev_file = os.path.join(args.data_dir, "dev.tsv")
    if not (os.path.isfile(train_file) and os.path.isfile(dev_file)):
        print(
            f"SST-2 data not found in {args.data_dir!r} (expected train.tsv and dev.tsv in the GLUE TSV "
            "layout).\nPoint the demo at it with `make demo DATA_DIR=/path/to/data` (the folder holding "
            "glue/SST-2) or\n"
            "`python examples/demo.py --data_dir /path/to/SST-2`.",
            file=sys.stderr,
        )
        raise SystemExit(2)

    import datasets
    from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, default_data_collator

    from hf_dpfilter import DPTrainer, DPTrainingArguments
    from recipes.common.models import (
        MeanPooledClassifier,
        encoder_dropout,
        mean_pooled_embeddings,
        packaged_model_path,
    )

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = packaged_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # --train full: the dropout minilm_full chose (off); the other choices keep the config's
    dropout = encoder_dropout(FULL_SETTINGS["dropout"]) if args.train == "full" else {}
    encoder = AutoModel.from_pretrained(path, **dropout)

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

        def embed(texts_: list[str]) -> tuple[np.ndarray, bool]:
            return cached_embeddings(
                lambda: mean_pooled_embeddings(encoder, tokenizer, texts_, args.max_seq_length,
                                               device=device).numpy(),
                args.embedding_cache, path, texts_, args.max_seq_length)

        (train_embeddings, train_hit), (dev_embeddings, dev_hit) = embed(train_texts), embed(dev_texts)
        train = datasets.Dataset.from_dict({"sentence_embedding": train_embeddings, "labels": train_labels})
        dev = datasets.Dataset.from_dict({"sentence_embedding": dev_embeddings, "labels": dev_labels})
        model = MeanPooledClassifier(encoder.config.hidden_size, num_labels=2)
        collator = default_data_collator
        cached = {(True, True): "read from the cache", (False, False): "computed and cached"}.get(
            (train_hit, dev_hit), "partly read from the cache")
        if not args.embedding_cache:
            cached = "computed (no cache)"
        print(f"Sentence embeddings of {len(train)} training and {len(dev)} dev examples: {cached}, "
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
        dp_method=args.dp_method,
        target_epsilon=(args.target_epsilon if args.dp_method != "none" and args.noise_multiplier is None
                        else None),
        noise_multiplier=args.noise_multiplier,
        per_sample_max_grad_norm=args.per_sample_max_grad_norm,
        clipping_fn=args.clipping_fn,
        logical_batch_size=args.logical_batch_size,
        per_device_train_batch_size=args.logical_batch_size if args.train == "head" else 64,
        per_device_eval_batch_size=256,
        num_train_epochs=args.num_train_epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
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
    # the clipping norm under the one name a user sets it by (the privacy report calls it max_grad_norm)
    report = {("per_sample_max_grad_norm" if key == "max_grad_norm" else key): value
              for key, value in trainer.privacy_report().items()}
    result = {
        "dev_accuracy": metrics["eval_accuracy"],
        "majority_class_accuracy": majority,
        "train": args.train,
        "train_examples": len(train),
        "settings": {"num_train_epochs": args.num_train_epochs, "logical_batch_size": args.logical_batch_size,
                     "learning_rate": args.learning_rate, "lr_scheduler_type": args.lr_scheduler_type,
                     "per_sample_max_grad_norm": args.per_sample_max_grad_norm},
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
        f"per_sample_max_grad_norm = {report['per_sample_max_grad_norm']:g}, method {report['method']})"
    )
    print(f"Time: {result['total_seconds']:.0f} s in all, {train_seconds:.0f} s of DP training, on {device}")
    return result


if __name__ == "__main__":
    main()
