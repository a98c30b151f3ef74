"""What issue 29's checks cost: the same DP steps under the current code and under a reference commit,
interleaved.

The reference (default ``b24efd1``, the step before "every released step", issue 29) is checked out with
``git worktree add --detach`` into a temporary folder; each code version runs in its own long-lived subprocess
(this file run as a script with the version's root first on ``PYTHONPATH``, so ``hf_dpfilter`` is that
version's; each worker reports the path it imported). Both hold one trainer per case and variant (the
reference's all with its defaults), and they alternate: in each round, for each case and variant, ``--steps``
logical batches in one process, then the same batches in the other (which goes first flips every round); each
figure is the median over rounds of the per-round ratio current / reference (the mean is reported too).
``--reference .`` compares the tree with itself: the method's noise floor (an A/A run).

A timed step is what issue 29 touched: the training collator (which now attaches the raw rows to the batch,
and for packed or maskless batches collates rows alone) and ``training_step`` (the gradient-hook scan,
positions derived from the mask, the per-micro-batch proofs, the micro-batches' forward and ghost-clipping
backward). The optimizer's noise and update are the same code in both and are left out, so a ratio overstates
the share of a whole step. Every trainer gets the same logical batches in the same order (Poisson draws,
seeded); after ``--warmup`` steps (the first-step check is in them) the rounds start. Cases (random weights
from configs, random token ids, SST-2 sentence lengths: words + 2, capped at 64, from ``train.tsv`` under
``--data_dir``, ``$HF_DPFILTER_DATA`` or ``../shared/data``, else a seeded synthetic draw):

* ``bert``: BERT 2x128 (vocabulary 30522) sequence classification, right padding with an attention mask;
* ``gpt2``: GPT-2 2x128 (vocabulary 8192) causal LM, right padding with a mask, pads' labels -100;
* ``gpt2-packed``: the same GPT-2 on ``transformers.DataCollatorWithFlattening`` rows (no padding).

Variants of the current code: ``default`` (the re-checks at the default ``dp_recheck_rate``: new shapes and
the random schedule), ``rate 0`` (new shapes only) and ``no per-example checks``
(``dp_verify_first_step=False``:
only the always-on costs); the reference runs with its defaults. The models keep their configs' dropout (0.1);
``gpt2-packed`` runs without dropout (packed rows cannot key it to each example); ``--dropout 0`` measures a
dropout-free model, whose re-checks reuse the micro-batch's own training forward (one forward more instead of
two, :mod:`hf_dpfilter.proofs.separation`).

    python -m benchmarks checks-cost                    # docs/performance.md, "The per-example checks over
    the run" python -m benchmarks checks-cost --dropout 0        # dropout-free models
    python -m benchmarks checks-cost --reference HEAD   # any commit
    python -m benchmarks checks-cost --reference . --tiny --rounds 2 --warmup 1   # the smoke test: no git
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("bert", "gpt2", "gpt2-packed")
CURRENT_VARIANTS = {"default": {}, "rate 0": {"dp_recheck_rate": 0.0},
                    "no per-example checks": {"dp_verify_first_step": False}}


# ----------------------------------------------------------------------------------------------- the worker
# side
def _lengths(count: int, train_tsv: str | None) -> list[int]:
    """``count`` lengths in tokens: SST-2 sentences (words + 2) from ``train_tsv``, else a seeded synthetic
    draw."""
    rng = random.Random(0)
    if train_tsv:
        with open(train_tsv, encoding="utf-8") as handle:
            rows = [line.rstrip("\n").split("\t") for line in handle][1:]
        lengths = [min(len(row[0].split()) + 2, 64) for row in rows if row and row[0]]
        return [rng.choice(lengths) for _ in range(count)]
    return [min(int(rng.lognormvariate(2.2, 0.6)) + 2, 64) for _ in range(count)]


def _sst2_train(data_dir: str | None) -> str | None:
    from benchmarks.common import sst2_dir

    try:
        return os.path.join(sst2_dir(data_dir), "train.tsv")
    except SystemExit:
        return None


class _PadCollator:
    """Right-pads to the batch's longest example with an attention mask; causal LM labels: the ids, pads
    -100."""

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.zeros((len(examples), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(examples):
            ids[i, : len(e["input_ids"])], mask[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"]), 1
        labels = ids.masked_fill(mask == 0,
                                 -100) if self.causal else torch.tensor([e["label"] for e in examples])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _model(case: str, tiny: bool, dropout: float | None):
    """Random weights from a config; ``dropout``: every dropout probability (None: the config's default,
    0.1)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    width = 32 if tiny else 128
    torch.manual_seed(0)
    if case == "bert":
        rates = {} if dropout is None else {"hidden_dropout_prob": dropout,
                                            "attention_probs_dropout_prob": dropout}
        return BertForSequenceClassification(BertConfig(
            vocab_size=1000 if tiny else 30522, hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=4 * width, max_position_embeddings=66, **rates))
    rates = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return GPT2LMHeadModel(GPT2Config(vocab_size=1000 if tiny else 8192, n_embd=width, n_layer=2, n_head=2,
                                      n_positions=66, bos_token_id=1, eos_token_id=2, **rates))


class _Steps:
    """One trainer and its logical batches: ``run(k)`` collates and steps the next ``k``, returns the
    seconds."""

    def __init__(self, case: str, fields: dict, setup: dict, out: str) -> None:
        from transformers import DataCollatorWithFlattening

        from hf_dpfilter import DPTrainer, DPTrainingArguments

        rng = random.Random(1)
        vocab = 1000 if setup["tiny"] else (30522 if case == "bert" else 8192)
        self.rows = [{"input_ids": [rng.randrange(3, vocab) for _ in range(n)], "label": i % 2}
                     for i, n in enumerate(_lengths(setup["examples"], setup["train_tsv"]))]
        if case != "bert":
            self.rows = [{"input_ids": r["input_ids"]} for r in self.rows]
        collator = (DataCollatorWithFlattening() if case == "gpt2-packed"
                    else _PadCollator(causal=case != "bert"))
        args = DPTrainingArguments(
            output_dir=out, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
            dp_method="dpsgd", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, max_steps=10_000,
            optim="sgd",
            logical_batch_size=setup["batch"], per_device_train_batch_size=setup["micro_batch"],
            learning_rate=0.0,
            dp_seed=0, **fields)
        # packed rows cannot key dropout to each example (a row holds several): the packed case runs without
        dropout = 0.0 if case == "gpt2-packed" else setup["dropout"]
        model = _model(case, setup["tiny"], dropout)
        self.trainer = DPTrainer(model=model, args=args, train_dataset=self.rows, data_collator=collator)
        self.trainer.create_optimizer()
        self.collate = self.trainer.get_train_dataloader().collate_fn
        draw, q = random.Random(2), setup["batch"] / len(self.rows)
        self.batches = [[i for i in range(len(self.rows)) if draw.random() < q] or [0]
                        for _ in range(setup["steps"])]
        self.next = 0

    def run(self, count: int) -> float:
        seconds = 0.0
        for _ in range(count):
            rows = [self.rows[i] for i in self.batches[self.next % len(self.batches)]]
            self.next += 1
            start = time.perf_counter()
            self.trainer.training_step(self.trainer.model, self.collate(rows))
            seconds += time.perf_counter() - start
            self.trainer.dp_optimizer.zero_grad()
        return seconds


def worker() -> None:
    """The subprocess: one JSON request a line on stdin, one JSON answer a line on the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr
    import torch

    import hf_dpfilter

    torch.set_num_threads(1)
    trainers: dict[tuple[str, str], _Steps] = {}
    out = tempfile.mkdtemp(prefix="checks-cost-")
    for line in sys.stdin:
        request = json.loads(line)
        if request["do"] == "setup":
            for case in request["cases"]:
                for name, fields in request["variants"].items():
                    trainers[case, name] = _Steps(case, fields, request, os.path.join(out, case, name))
            answer: Any = {"imported": os.path.dirname(os.path.dirname(os.path.abspath(hf_dpfilter.__file__)))}
        elif request["do"] == "warm-up":
            answer = {f"{c}|{v}": t.run(request["steps"]) for (c, v), t in trainers.items()}
        elif request["do"] == "run":
            case, variant = request["key"].split("|")
            answer = trainers[case, variant].run(request["steps"])
        else:
            return
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


# ------------------------------------------------------------------------------------------- the driver side
class _Worker:
    def __init__(self, root: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self.root = root
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=root,
                                        env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, request: dict) -> Any:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.root} ended (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"do": "stop"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)


def _reference_tree(reference: str, folder: str) -> str:
    """The reference code's root: ``.`` is this tree (the smoke test, no git), else a detached worktree."""
    if reference == ".":
        return ROOT
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", folder, reference], check=True,
                   stdout=subprocess.DEVNULL)
    return folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", default="b24efd1", help="the commit to compare with ('.': this tree)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, among {', '.join(CASES)}")
    parser.add_argument("--data_dir", default=None, help="SST-2 (train.tsv); default $HF_DPFILTER_DATA or "
                                                         "../shared/data")
    parser.add_argument("--examples", type=int, default=4096, help="training set size N")
    parser.add_argument("--batch", type=int, default=64, help="expected logical batch (Poisson)")
    parser.add_argument("--micro_batch", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--warmup", type=int, default=5, help="steps of every trainer before the rounds")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="logical batches per trainer per round")
    parser.add_argument("--dropout", type=float, default=None,
                        help="every dropout probability of the models (default: the configs', 0.1)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (the smoke test)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    setup = {"do": "setup", "cases": cases, "tiny": args.tiny, "examples": args.examples, "batch": args.batch,
             "micro_batch": args.micro_batch, "dropout": args.dropout,
             "train_tsv": _sst2_train(args.data_dir),
             "steps": args.warmup + args.rounds * args.steps}
    with tempfile.TemporaryDirectory() as folder:
        tree = os.path.join(folder, "reference")
        root = _reference_tree(args.reference, tree)
        sides = {"reference": _Worker(root), "current": _Worker(ROOT)}
        try:
            # both sides hold a trainer per case and variant (the reference's all with its defaults), so each
            # current variant is timed right after or before the reference on the same batches
            imported = {
                "reference": sides["reference"].ask({**setup, "variants": {v: {} for v in CURRENT_VARIANTS}}),
                "current": sides["current"].ask({**setup, "variants": CURRENT_VARIANTS}),
            }
            imported = {name: answer["imported"] for name, answer in imported.items()}
            for side in sides.values():
                side.ask({"do": "warm-up", "steps": args.warmup})
            keys = [f"{case}|{variant}" for case in cases for variant in CURRENT_VARIANTS]
            rounds = []
            for index in range(args.rounds):
                order = ("reference", "current") if index % 2 == 0 else ("current", "reference")
                times: dict[str, dict[str, float]] = {"reference": {}, "current": {}}
                for key in keys:  # the two processes alternate on each case and variant
                    for name in order:
                        times[name][key] = sides[name].ask({"do": "run", "key": key, "steps": args.steps})
                rounds.append(times)
        finally:
            for side in sides.values():
                side.close()
            if root != ROOT:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    figures: dict[str, dict] = {}
    for case in cases:
        figures[case] = {"reference_step_ms": 1e3 * statistics.median(
            r["reference"][f"{case}|default"] for r in rounds) / args.steps}
        for variant in CURRENT_VARIANTS:
            key = f"{case}|{variant}"
            ratios = [r["current"][key] / r["reference"][key] for r in rounds]
            figures[case][variant] = {"median": statistics.median(ratios), "mean": statistics.mean(ratios)}
    lengths = "SST-2 train lengths" if setup["train_tsv"] else "synthetic lengths"
    print(f"checks-cost: {lengths}, current code ({imported['current']}) vs {args.reference} "
          f"({imported['reference']}); Poisson batch {args.batch}, micro-batch {args.micro_batch}, "
          f"{args.warmup} warm-up steps, {args.rounds} rounds of {args.steps} steps, dropout "
          f"{'0.1' if args.dropout is None else args.dropout}, CPU, "
          "1 thread")
    for case, row in figures.items():
        cells = ", ".join(f"{v}: {row[v]['median']:.3f} (mean {row[v]['mean']:.3f})"
                          for v in CURRENT_VARIANTS)
        print(f"  {case:12s} reference step {row['reference_step_ms']:.1f} ms; current / reference: {cells}")
    return {"lengths": lengths, "dropout": args.dropout, "reference": args.reference, "imported": imported,
            "figures": figures, "rounds": args.rounds}


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
