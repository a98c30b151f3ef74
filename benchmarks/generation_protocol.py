"""E2E table-to-text with a generator that starts from pretrained weights: DP against non-private, on a CPU.

    python -m benchmarks generation                  # every row (resumes; finished runs are kept)
    python -m benchmarks generation --threads 1      # one core: two sweeps share a 2-core machine
    python -m benchmarks generation --report         # only rewrite docs/results.md

The model is ``recipes.common.models.packaged_encoder_decoder``: transformers' ``EncoderDecoderModel`` with
the packaged pretrained MiniLM (PyPI, offline) as the encoder and as the decoder, its cross-attention layers
and output transform new, then **warmed up on public data** (``PROTOCOL["public_warmup"]``): fine-tuned
without DP on the shipped DART file's references whose source is not E2E (WebNLG and WikiTable sentences;
DART's E2E-sourced references are E2E's own texts, the private side here), its triples written as E2E meaning
representations (:func:`e2e_style_table`). The warm-up is made once (its new layers drawn under its own seed),
kept under ``--work_dir`` and shared by every row: training on public data spends no privacy. Every weight is
then trained (``PROTOCOL["train"]``) on E2E, through ``DPSeq2SeqTrainer``.

Data (the E2E files the recipes read; see recipes/table2text.py): the training file (``trainset.csv``, else
``devset.csv``) split by meaning representation (MR): ``VALIDATION_MRS`` MRs held out as the validation split
(each MR with all its references), the training split the pairs of the other MRs. The learning rate of each
trained row is chosen on the validation split (BLEU, one run per grid point, ``--tuning_seed``); the chosen
point then trains with seeds 0, 1, 2 (data order, dropout; the DP noise stays a fresh secret per run) on the same training split, scored on a fixed random subset of
``TEST_MRS`` MRs of ``testset_w_refs.csv`` against all their references: BLEU, NIST, METEOR, ROUGE-L and CIDEr
(``recipes.common.generation_metrics``; METEOR its offline approximation). The test set is never read while
tuning.

Rows: the copy baseline (each table copied as its text, recipes/table2text.py's), the publicly warmed-up model
decoded without fine-tuning on E2E, the non-private fine-tune
(AdamW, its own batch and learning-rate grid) and DP-AdamW at epsilon 8 (delta N^-1.1). Decoding: greedy
(``PROTOCOL["num_beams"]``), at most ``PROTOCOL["max_new_tokens"]`` tokens; the uncased WordPiece output is
re-joined as text (``recipes.common.models.wordpiece_detokenize``). Each run records its wall and CPU seconds
(process time, all threads) and its thread count. Results: ``benchmarks/results/generation_protocol.json``
(one entry per run, saved as it ends), the table in docs/results.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import DEFAULT_DATA
from benchmarks.paper_protocols import Store, mean_std, point_key

Pairs = list[tuple[str, str]]
Groups = list[tuple[str, list[str]]]

VALIDATION_MRS = 40
TEST_MRS = 300
DP_EPSILON = 8.0

#: the protocol: shared settings, each trained row's method and learning-rate grid
PROTOCOL: dict[str, Any] = {
    "train": "all",  # every weight of the encoder-decoder
    # the public warm-up every row starts from (None: the warm-started encoder-decoder itself); without it, 33
    # DP steps learned one sentence for every table (the rows of generation_protocol_cold_start.json). 6 epochs:
    # its table reliance rose every epoch (0.42 to 1.91 nats), and DP-AdamW from it scored 28.2 validation
    # BLEU against 26.3 from its epoch-3 model (docs/results.md); 4 epochs at lr 1e-3 collapsed the encoder
    "public_warmup": {"corpus": "dart", "epochs": 6, "batch": 32, "learning_rate": 3e-4, "seed": 0},
    "max_length": 64,  # tokens of a table and of a text (E2E: 55 and 84 at most, 41 and 28 on average)
    "num_beams": 1,
    "max_new_tokens": 64,
    "epochs": 1,
    "schedule": "linear",
    "methods": {
        "Non-private AdamW": {"dp_method": "none", "batch": 32, "micro_batch": 32,
                              "grid": {"learning_rate": [1e-4, 3e-4, 1e-3]}},
        "DP-AdamW": {"dp_method": "dpsgd", "batch": 128, "micro_batch": 32, "clipping_fn": "abadi",
                     "max_grad_norm": 0.1, "grid": {"learning_rate": [5e-4, 1e-3, 2e-3, 4e-3]}},
    },
}
COPY, NOT_FINE_TUNED, WARMUP = "copy baseline", "not fine-tuned", "public warm-up"
#: DART's references whose source is E2E: E2E's own texts (the private side of this protocol), never public here
PRIVATE_DART_SOURCE = "e2e"
METRICS = ("bleu", "nist", "meteor", "rouge_l", "cider")


# ------------------------------------------------------------------------------------------------ data
def e2e_files(data_dir: str | None) -> tuple[str, str]:
    """The training and test CSV files: ``data_dir`` (or ``$HF_DPFILTER_DATA/e2e``, ``../shared/data/e2e``);
    ``trainset.csv`` when present, else ``devset.csv`` (the recipes' rule)."""
    folder = data_dir or os.path.join(os.environ.get("HF_DPFILTER_DATA", DEFAULT_DATA), "e2e")
    train = os.path.join(folder, "trainset.csv")
    if not os.path.exists(train):
        train = os.path.join(folder, "devset.csv")
    test = os.path.join(folder, "testset_w_refs.csv")
    for path in (train, test):
        if not os.path.exists(path):
            raise SystemExit(f"No {path}: --data_dir must hold the official E2E CSV files (mr,ref).")
    return train, test


def splits(args: argparse.Namespace) -> dict[str, Any]:
    """``train`` (pairs), ``validation`` and ``test`` (groups: an MR and all its references). The validation
    MRs are drawn from the training file in a fixed random order, the test MRs from the test file; no MR is in
    both the training and the validation split."""
    from recipes.common.generation_metrics import load_e2e_csv

    train_file, test_file = e2e_files(args.data_dir)
    groups = load_e2e_csv(train_file)
    order = np.random.default_rng(0).permutation(len(groups))
    held = {int(i) for i in order[: args.validation_mrs]}
    train = [(mr, ref) for i, (mr, refs) in enumerate(groups) if i not in held for ref in refs]
    if args.train_samples:
        train = [train[int(i)] for i in sorted(np.random.default_rng(1).permutation(len(train))[
            : args.train_samples])]
    test = load_e2e_csv(test_file)
    picked = sorted(int(i) for i in np.random.default_rng(0).permutation(len(test))[: args.test_mrs])
    return {"train": train, "validation": [groups[i] for i in sorted(held)],
            "test": [test[i] for i in picked]}


def dart_file(dart_dir: str | None) -> str:
    """The DART file of the public warm-up: ``dart_dir`` (or ``$HF_DPFILTER_DATA/dart``, ``../shared/data/dart``),
    its ``*dev*.json`` (the one split shipped offline)."""
    folder = dart_dir or os.path.join(os.environ.get("HF_DPFILTER_DATA", DEFAULT_DATA), "dart")
    files = sorted(f for f in os.listdir(folder) if "dev" in f and f.endswith(".json")) if os.path.isdir(
        folder) else []
    if not files:
        raise SystemExit(f"No DART *dev*.json in {folder}: --dart_dir must hold the official DART JSON file.")
    return os.path.join(folder, files[0])


def e2e_style_table(tripleset: list[list[str]]) -> str:
    """DART triples written as an E2E meaning representation: ``name[subject], relation[object], ...``, a new
    ``name[...]`` each time the subject changes; relations lowercased with spaces (``LEADER_NAME``: ``leader
    name``), quotes around objects dropped."""
    parts, subject = [], None
    for s, r, o in ((part.strip() for part in triple) for triple in tripleset):
        if s != subject:
            parts.append(f"name[{s}]")
            subject = s
        parts.append(f"{r.lower().replace('_', ' ')}[{o.strip(chr(34))}]")
    return ", ".join(parts)


def public_pairs(dart_dir: str | None) -> Pairs:
    """The public warm-up's pairs (table, text): every DART reference not sourced from E2E."""
    with open(dart_file(dart_dir), encoding="utf-8") as f:
        entries = json.load(f)
    return [(e2e_style_table(entry["tripleset"]), note["text"]) for entry in entries
            for note in entry.get("annotations", []) if note["source"] != PRIVATE_DART_SOURCE and note["text"]]


# ------------------------------------------------------------------------------------------------ runs
@torch.no_grad()
def table_reliance(model: Any, tokenizer: Any, pairs: Pairs, n: int = 32) -> float:
    """How much the model reads the table: its mean token loss on ``n`` pairs with each text given the next
    pair's table, less its loss with the text's own table (nats; about 0 for a model that ignores the table)."""
    from transformers import DataCollatorForSeq2Seq

    rows = encode(tokenizer, model, pairs[:n])
    batch = DataCollatorForSeq2Seq(tokenizer, model=model)([rows[i] for i in range(len(rows))])
    shifted = torch.roll(torch.arange(len(rows)), 1)
    was_training = model.training
    model.eval()
    own = float(model(**batch).loss)
    other = float(model(**{**batch, "input_ids": batch["input_ids"][shifted],
                           "attention_mask": batch["attention_mask"][shifted]}).loss)
    model.train(was_training)
    return other - own


def table_reliance_callback(tokenizer: Any, pairs: Pairs, into: list[float]) -> Any:
    """A ``TrainerCallback`` appending :func:`table_reliance` to ``into`` at each epoch's end (the warm-up's
    progress at reading the tables; evaluation mode and no random draws, so the training itself is unchanged)."""
    from transformers import TrainerCallback

    class _Callback(TrainerCallback):
        def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            into.append(round(table_reliance(model, tokenizer, pairs), 4))

    return _Callback()


def public_warmup(args: argparse.Namespace, store: Store) -> str | None:
    """The folder of the publicly warmed-up model (``PROTOCOL["public_warmup"]``; None: no warm-up).

    The warm-started encoder-decoder (new layers drawn under the warm-up's seed) fine-tuned without DP on
    :func:`public_pairs`: public data, so its training is post-processing of public data and costs no privacy.
    Made once per settings (kept under ``--work_dir``) and shared by every row; its cost is stored as the
    ``public warm-up`` entry of the results file."""
    settings = PROTOCOL["public_warmup"]
    if settings is None:
        return None
    if settings["corpus"] != "dart":
        raise ValueError(f"unknown public_warmup corpus {settings['corpus']!r}")
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from recipes.common.models import packaged_encoder_decoder

    tag = hashlib.sha256(json.dumps([settings, PROTOCOL["max_length"], args.max_steps, args.public_samples],
                                    sort_keys=True).encode()).hexdigest()[:12]
    folder = os.path.join(args.work_dir, f"public_warmup_{tag}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    start, cpu_start = time.time(), time.process_time()
    model, tokenizer = packaged_encoder_decoder(seed=settings["seed"])
    pairs = public_pairs(args.dart_dir)
    if args.public_samples:
        pairs = [pairs[int(i)] for i in sorted(np.random.default_rng(1).permutation(len(pairs))[
            : args.public_samples])]
    training_args = Seq2SeqTrainingArguments(
        output_dir=os.path.join(args.work_dir, f"run{os.getpid()}"), per_device_train_batch_size=settings["batch"],
        num_train_epochs=settings["epochs"], max_steps=args.max_steps or -1,
        learning_rate=settings["learning_rate"], lr_scheduler_type=PROTOCOL["schedule"], optim="adamw_torch",
        weight_decay=0.0, warmup_steps=0, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        seed=settings["seed"], disable_tqdm=True, logging_strategy="no", eval_strategy="no",
        remove_unused_columns=False)
    by_epoch: list[float] = []
    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=encode(tokenizer, model, pairs),
                             processing_class=tokenizer, data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
                             callbacks=[table_reliance_callback(tokenizer, pairs, by_epoch)])
    trainer.train()
    trainer.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    reliance = table_reliance(trainer.model, tokenizer, pairs)
    store.save(WARMUP, {"n_train": len(pairs), "steps": trainer.state.global_step, "epsilon": 0.0,
                        "table_reliance": reliance, "table_reliance_by_epoch": by_epoch,
                        "seconds": round(time.time() - start, 1),
                        "cpu_seconds": round(time.process_time() - cpu_start, 1),
                        "threads": torch.get_num_threads(), "settings": settings})
    return folder


def build_model(seed: int, warmed: str | None = None) -> tuple[Any, Any]:
    """The model every row starts from and its tokenizer: the publicly warmed-up model in ``warmed`` (torch
    seeded with ``seed``), else the warm-started encoder-decoder (its new layers drawn under ``seed``)."""
    if PROTOCOL["train"] != "all":
        raise ValueError(f"unknown PROTOCOL['train'] {PROTOCOL['train']!r}")
    if warmed is not None:
        from transformers import AutoTokenizer, EncoderDecoderModel

        torch.manual_seed(seed)
        return EncoderDecoderModel.from_pretrained(warmed).eval(), AutoTokenizer.from_pretrained(warmed)
    from recipes.common.models import packaged_encoder_decoder

    return packaged_encoder_decoder(seed=seed)


def encode(tokenizer: Any, model: Any, pairs: Pairs) -> Any:
    """The tables as the encoder's inputs, the texts as the labels (``[CLS]``, the decoder's start, dropped):
    recipes/table2text_seq2seq.py's encoding."""
    import datasets

    from recipes.table2text_seq2seq import encode as encode_pair

    start, length = model.config.decoder_start_token_id, PROTOCOL["max_length"]
    rows = [encode_pair(tokenizer, src, tgt, length, start) for src, tgt in pairs]
    return datasets.Dataset.from_dict({k: [r[k] for r in rows]
                                       for k in ("input_ids", "attention_mask", "labels")})


@torch.inference_mode()
def generate(model: Any, tokenizer: Any, sources: list[str], batch_size: int = 32) -> list[str]:
    """Each table decoded (``PROTOCOL``'s beams and length), batched by length, re-joined as text."""
    from recipes.common.models import wordpiece_detokenize

    model.eval()
    lengths = [len(ids) for ids in tokenizer(sources, truncation=True, max_length=PROTOCOL["max_length"])[
        "input_ids"]]
    order = sorted(range(len(sources)), key=lengths.__getitem__)
    out = [""] * len(sources)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = tokenizer([sources[i] for i in rows], truncation=True, max_length=PROTOCOL["max_length"],
                          padding=True, return_tensors="pt")
        generated = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   num_beams=PROTOCOL["num_beams"], max_new_tokens=PROTOCOL["max_new_tokens"],
                                   do_sample=False)
        for i, text in zip(rows, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[i] = wordpiece_detokenize(text.strip(), sources[i])
    return out


def score(predictions: list[str], groups: Groups) -> dict[str, float]:
    from recipes.common.generation_metrics import compute_generation_metrics

    return compute_generation_metrics(predictions, [refs for _, refs in groups])


def run_point(label: str, point: dict[str, float], seed: int, evaluate_on: str, data: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    """One run: the model warm-started under ``seed``, trained by ``label``'s method at ``point`` (none for
    the not-fine-tuned row), decoded and scored on ``evaluate_on``."""
    from transformers import DataCollatorForSeq2Seq

    from hf_dpfilter import DPSeq2SeqTrainer, DPSeq2SeqTrainingArguments

    start, cpu_start = time.time(), time.process_time()
    model, tokenizer = build_model(seed, data.get("warmed"))
    row: dict[str, Any] = {"epsilon": 0.0, "noise_multiplier": 0.0, "steps": 0}
    if label != NOT_FINE_TUNED:
        method = PROTOCOL["methods"][label]
        train = encode(tokenizer, model, data["train"])
        batch = min(method["batch"], len(train))
        private = method["dp_method"] != "none"
        training_args = DPSeq2SeqTrainingArguments(
            output_dir=os.path.join(args.work_dir, f"run{os.getpid()}"), dp_method=method["dp_method"],
            target_epsilon=DP_EPSILON if private else None,
            per_sample_max_grad_norm=method.get("max_grad_norm", 1.0),
            clipping_fn=method.get("clipping_fn", "abadi"), logical_batch_size=batch,
            per_device_train_batch_size=min(batch, method["micro_batch"]),
            num_train_epochs=PROTOCOL["epochs"],
            max_steps=args.max_steps or -1, learning_rate=point["learning_rate"],
            lr_scheduler_type=PROTOCOL["schedule"], optim="adamw_torch", weight_decay=0.0, warmup_steps=0,
            save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=seed,
            disable_tqdm=True, logging_strategy="no", eval_strategy="no", remove_unused_columns=False,
        )
        trainer = DPSeq2SeqTrainer(model=model, args=training_args, train_dataset=train,
                                   processing_class=tokenizer,
                                   data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
        trainer.train()
        report = trainer.privacy_report()
        eps = report.get("epsilon", float("inf"))
        row = {"epsilon": eps if private else float("inf"),
               "noise_multiplier": report.get("noise_multiplier") or 0.0,
               # a non-private run's report counts no private steps: the trainer's own count
               "steps": report.get("steps") or trainer.state.global_step, "n_train": len(train)}
        model = trainer.model
    row["train_seconds"] = round(time.time() - start, 1)
    row["train_cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    groups = data[evaluate_on]
    predictions = generate(model, tokenizer, [src for src, _ in groups])
    row.update(score(predictions, groups))
    row.update({"seconds": round(time.time() - start, 1),
                "cpu_seconds": round(time.process_time() - cpu_start, 1),
                "threads": torch.get_num_threads(), "n_eval": len(groups), "examples": predictions[:3]})
    return row


def grid_points(label: str) -> list[dict[str, float]]:
    points: list[dict[str, float]] = [{}]
    for key, values in PROTOCOL["methods"][label]["grid"].items():
        points = [{**p, key: v} for p in points for v in values]
    return points


def finished_or_run(store: Store, key: str, label: str, point: dict[str, float], seed: int, evaluate_on: str,
                    data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The stored row of ``key``, else the run's row, saved as soon as it ends (a sweep resumes). A stored row
    made at another point (a seed run before the grid was finished, which then chose another point) is made
    again: a seed row always holds the point the grid chose."""
    row = store.load().get(key)
    if row is None or row.get("point", point) != point:
        row = {**run_point(label, point, seed, evaluate_on, data, args), "point": point}
        store.save(key, row)
        print(key, {k: v for k, v in row.items() if k != "examples"}, flush=True)
    return row


def run_protocol(args: argparse.Namespace, store: Store) -> None:
    """The copy baseline; per seed the not-fine-tuned model; per trained row its grid on the validation split,
    then the chosen point with every seed on the test subset."""
    from recipes.table2text import copy_baseline

    data = splits(args)
    data["warmed"] = public_warmup(args, store)
    if COPY not in store.load():
        test = copy_baseline(data["test"])["scores"]
        store.save(COPY, {**{k[len("eval_"):]: v for k, v in test.items()}, "n_eval": len(data["test"]),
                          "seconds": 0.0, "cpu_seconds": 0.0, "threads": 0, "epsilon": 0.0, "steps": 0})
    for seed in args.seeds:
        finished_or_run(store, f"{NOT_FINE_TUNED}|seed={seed}", NOT_FINE_TUNED, {}, seed, "test", data, args)
    for label in PROTOCOL["methods"]:
        if args.methods and label not in args.methods:
            continue
        for point in grid_points(label):
            finished_or_run(store, f"{label}|tune|{point_key(point)}", label, point, args.tuning_seed,
                            "validation", data, args)
        # one rule for the sweep and the table: the best validation BLEU, the first of equals
        chosen = best_tuned_point(store.load(), label)
        for seed in args.seeds:
            finished_or_run(store, f"{label}|seed={seed}", label, chosen, seed, "test", data, args)


# --------------------------------------------------------------------------------------------- report
BEGIN, END = ("<!-- BEGIN GENERATED by benchmarks/generation_protocol.py -->",
              "<!-- END GENERATED by benchmarks/generation_protocol.py -->")
#: how each metric is shown: (column, scale)
SHOWN = {"bleu": ("BLEU", 100), "nist": ("NIST", 1), "meteor": ("METEOR*", 100), "rouge_l": ("ROUGE-L", 100),
         "cider": ("CIDEr", 1)}


def seed_rows(results: dict[str, Any], label: str) -> list[dict[str, Any]]:
    prefix = f"{label}|seed="
    return [row for key, row in sorted(results.items()) if key.startswith(prefix)]


def cell(values: list[float], scale: float) -> str:
    mean, std = mean_std([scale * v for v in values])
    digits = 1 if scale == 100 else 2
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


def best_tuned_point(results: dict[str, Any], label: str) -> dict[str, float] | None:
    """The grid point of ``label`` with the best validation BLEU among the stored tuning rows (the first of
    equals, in grid order, as :func:`run_protocol` chooses), or None without tuning rows."""
    if label not in PROTOCOL["methods"]:
        return None
    scored = [(results[key]["bleu"], point) for point in grid_points(label)
              if (key := f"{label}|tune|{point_key(point)}") in results]
    return max(scored, key=lambda s: s[0])[1] if scored else None


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    """The table (markdown) of every row the results hold, written between the markers of ``args.output``."""
    header = " | ".join(column for column, _ in SHOWN.values())
    lines = [BEGIN, "", f"| row | ε | {header} | seeds | chosen on validation | σ | steps | wall s/run | CPU "
                        "min/run |", "|---" * (8 + len(SHOWN)) + "|"]
    rows = [(COPY, [results[COPY]] if COPY in results else [])] + [
        (label, seed_rows(results, label)) for label in (NOT_FINE_TUNED, *PROTOCOL["methods"])]
    for label, runs in rows:
        if not runs:
            lines.append(f"| {label} | | {' | '.join('not run yet' for _ in SHOWN)} | 0 | | | | | |")
            continue
        first = runs[0]
        eps = first["epsilon"]
        eps_text = "–" if label in (COPY, NOT_FINE_TUNED) else "∞" if not isinstance(eps, (int, float)) or (
            eps == float("inf")) else f"{eps:.2f}"
        metrics = " | ".join(cell([r[name] for r in runs], scale) for name, (_, scale) in SHOWN.items())
        chosen = point_key(first.get("point", {})) or "–"
        best = best_tuned_point(results, label)
        if best is not None and best != first.get("point", {}):
            # seeds made before the grid was finished, at a point it did not choose: the next sweep remakes them
            chosen += f" (the grid now chooses {point_key(best)}: seeds not re-run yet)"
        trained = label not in (COPY, NOT_FINE_TUNED)
        sigma = f"{first['noise_multiplier']:.3g}" if trained else "–"
        steps = str(first["steps"]) if trained else "–"
        secs = f"{np.median([r['seconds'] for r in runs]):.0f}" if label != COPY else "–"
        cpu = f"{np.median([r['cpu_seconds'] for r in runs]) / 60:.1f}" if label != COPY else "–"
        seeds = len(runs) if label != COPY else "–"
        lines.append(f"| {label} | {eps_text} | {metrics} | {seeds} | {chosen} | "
                     f"{sigma} | {steps} | {secs} | {cpu} |")
    tuned = [(k, r) for k, r in results.items() if "|tune|" in k]
    if tuned:
        lines += ["", "Validation BLEU (×100) of each grid point: " + "; ".join(
            f"{k.split('|')[0]} {k.split('|')[2]}: {100 * r['bleu']:.1f}" for k, r in sorted(tuned)) + "."]
    if WARMUP in results:
        warm = results[WARMUP]
        lines += ["", f"Every row starts from the public warm-up ({warm['n_train']:,} public pairs, {warm['steps']} "
                      f"non-private steps, {warm['cpu_seconds'] / 60:.1f} CPU minutes, once); \"not fine-tuned\" "
                      "is that model decoded as it is. Its loss on public pairs rises by "
                      f"{warm.get('table_reliance', float('nan')):.3f} nats a token when each text is given "
                      "another pair's table (about 0: it does not read the table)"
                      + (f"; after each epoch: {', '.join(f'{r:.2f}' for r in warm['table_reliance_by_epoch'])}"
                         if warm.get("table_reliance_by_epoch") else "") + "."]
    timed = [r for k, r in results.items() if k != COPY]
    if timed:
        lines += ["", f"{len(timed)} runs in the results file (grid points and seeds), "
                      f"{sum(r['cpu_seconds'] for r in timed) / 60:.0f} CPU minutes in all, "
                      f"{sum(r['seconds'] for r in timed) / 60:.0f} wall minutes (torch threads per run: "
                      f"{', '.join(str(t) for t in sorted({r['threads'] for r in timed}))})."]
    methods = "; ".join(
        f"{label}: {json.dumps({k: v for k, v in method.items() if k != 'grid'})}, grid "
        f"{json.dumps(method['grid'])}" for label, method in PROTOCOL["methods"].items())
    shared = {k: v for k, v in PROTOCOL.items() if k != "methods"}
    lines += ["", f"Settings: {json.dumps(shared)}; {methods}. Test: {TEST_MRS} MRs of the E2E test set (all "
                  f"their references); validation: {VALIDATION_MRS} MRs held out of the training file.",
              "", "Command: `python -m benchmarks generation` (`--threads 1` beside another sweep).", END]
    generated = "\n".join(lines)
    if args.output:
        text = open(args.output).read() if os.path.exists(args.output) else ""
        if BEGIN in text and END in text:
            text = text[: text.index(BEGIN)] + generated + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + generated + "\n"
        with open(args.output, "w") as f:
            f.write(text)
    return generated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: every core; 1 when two sweeps share two cores)")
    parser.add_argument("--data_dir", default=None,
                        help="E2E folder (default: $HF_DPFILTER_DATA/e2e, else ../shared/data/e2e)")
    parser.add_argument("--dart_dir", default=None, help="DART folder of the public warm-up (default: "
                        "$HF_DPFILTER_DATA/dart, else ../shared/data/dart)")
    parser.add_argument("--validation_mrs", type=int, default=VALIDATION_MRS)
    parser.add_argument("--test_mrs", type=int, default=TEST_MRS)
    parser.add_argument("--train_samples", type=int, default=0,
                        help="only this many training pairs, drawn at random (default 0: every pair)")
    parser.add_argument("--public_samples", type=int, default=0,
                        help="only this many public warm-up pairs, drawn at random (default 0: every pair)")
    parser.add_argument("--max_steps", type=int, default=0, help="stop each training run after this many "
                        "steps (default 0: the epochs decide; for smoke runs)")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(PROTOCOL["methods"]),
                        help="only these trained rows (the baselines run anyway)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tuning_seed", type=int, default=100)
    parser.add_argument("--report", action="store_true", help="only rewrite the table")
    parser.add_argument("--json", default="benchmarks/results/generation_protocol.json")
    parser.add_argument("--output", default="docs/results.md")
    parser.add_argument("--work_dir", default="outputs/generation_protocol")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    store = Store(args.json)
    if not args.report:
        run_protocol(args, store)
    print(report(store.load(), args))
