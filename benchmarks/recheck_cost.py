"""What the per-example checks over the run cost: a DP step with the re-checks at the default rate vs without.

A small BERT classifier (random weights from a config, nothing downloaded) is trained with ``DPTrainer`` on
logical batches with dynamic padding (right-padded to each micro-batch's longest example, with an attention
mask). The example lengths are SST-2's (words + 2 special tokens, from ``train.tsv`` in ``$HF_DPFILTER_DATA``
or ``../shared/data``; a seeded synthetic draw of similar lengths when the data is not there); the tokens are
random ids. Every variant gets the same logical batches in the same order (Poisson draws at the plan's rate,
seeded), and the variants run interleaved after a common warm-up (the shapes met in the warm-up are met by
all), each figure the median over rounds of the per-round ratio of step times
(``benchmarks.common.time_interleaved``):

* ``off``: ``dp_verify_first_step=False`` (no per-example check, no re-check): the reference;
* ``new shapes``: ``dp_recheck_rate=0``: re-checks only of micro-batches whose shape is new in the run;
* ``default rate``: ``dp_recheck_rate`` at its default (new shapes, and each other micro-batch with that
  probability): the run as users get it.

It also reports the first step's cost with the first-step check (per-example gradients of a few examples
against autograd alone) against the same step without it (fresh trainers, median over repeats).

    python -m benchmarks recheck-cost                      # docs/performance.md, "The per-example checks"
    python -m benchmarks recheck-cost --rounds 2 --warmup 1 --tiny   # the smoke test

Each check's share of a step from a run's first step, on real lengths (MiniLM, SST-2), is measured by
``python -m benchmarks checks-breakdown`` (:mod:`benchmarks.checks_breakdown`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import PadCollator, read_glue_tsv, sst2_dir, time_interleaved, time_rechecks
from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.separation import DEFAULT_RECHECK_RATE


def example_lengths(count: int, seed: int, data_dir: str | None) -> tuple[list[int], str]:
    """``count`` lengths in tokens: SST-2 sentences (words + [CLS] and [SEP]) when the data is there."""
    rng = random.Random(seed)
    try:
        sentences, _ = read_glue_tsv(os.path.join(sst2_dir(data_dir), "train.tsv"))
        lengths = [min(len(s.split()) + 2, 64) for s in sentences]
        return [rng.choice(lengths) for _ in range(count)], "SST-2 train lengths"
    except SystemExit:
        return [min(int(rng.lognormvariate(2.2, 0.6)) + 2, 64) for _ in range(count)], "synthetic lengths"


def build_model(tiny: bool, dropout: float = 0.1) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    width = 32 if tiny else 128
    config = BertConfig(vocab_size=1000 if tiny else 30522, hidden_size=width, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=4 * width, max_position_embeddings=66,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def make_trainer(data: list[dict], out: str, args: argparse.Namespace, **fields: Any) -> DPTrainer:
    training = DPTrainingArguments(
        output_dir=out, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dp_method="dpsgd", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, logical_batch_size=args.batch,
        per_device_train_batch_size=args.micro_batch, max_steps=10_000, optim="sgd", learning_rate=0.0,
        dp_seed=0, **fields,
    )
    trainer = DPTrainer(model=build_model(args.tiny, args.dropout), args=training, train_dataset=data,
                        data_collator=PadCollator())
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    return trainer


class Clock:
    """Seconds spent in a trainer's steps and, inside them, in its re-checks (timed where they run)."""

    def __init__(self) -> None:
        self.steps = self.rechecks = 0.0
        self.count = 0

    def reset(self) -> None:
        self.steps = self.rechecks = 0.0
        self.count = 0

    def time_rechecks(self, trainer: DPTrainer) -> None:
        time_rechecks(trainer, self._add_recheck)

    def _add_recheck(self, seconds: float) -> None:
        self.rechecks += seconds
        self.count += 1


def stepper(trainer: DPTrainer, batches: list[list[int]], data: list[dict], clock: Clock | None = None):
    """One logical batch per call, in the order of ``batches``: ``training_step`` (micro-batches, checks,
    clipped sums); returns its seconds. The accumulated sums are dropped (the noise and release are the same
    for all)."""
    collate = trainer.get_train_dataloader().collate_fn
    order = iter(batches)
    clock = clock or Clock()

    def step() -> float:
        batch = collate([data[i] for i in next(order)])
        start = time.perf_counter()
        trainer.training_step(trainer.model, batch)
        seconds = time.perf_counter() - start
        clock.steps += seconds
        clock.time_rechecks(trainer)  # from the first step on (the entry is built there)
        trainer.dp_optimizer.zero_grad()
        return seconds

    return step


def first_step_cost(data: list[dict], batch: list[int], args: argparse.Namespace, repeats: int) -> float:
    """Median ratio of the first step with the first-step check to the same step without any check."""
    ratios = []
    for _ in range(repeats):
        times = {}
        for name, check in (("off", False), ("check", True)):
            with tempfile.TemporaryDirectory() as out:
                trainer = make_trainer(data, out, args, dp_verify_first_step=check, dp_recheck_rate=0.0)
                times[name] = stepper(trainer, [batch], data)()
        ratios.append(times["check"] / times["off"])
    return statistics.median(ratios)


def shape_census(lengths: list[int], batch: int, micro_batch: int, steps: int, seed: int) -> dict:
    """How many micro-batches of a run are a new shape (what the re-checks key on: number of examples and
    longest length; right padding, unpacked), from the lengths alone: no model, the run's Poisson draws
    simulated."""
    draw, q, seen = random.Random(seed), batch / len(lengths), set()
    total = new = late_total = late_new = 0
    for step in range(steps):
        sample = [lengths[i] for i in range(len(lengths)) if draw.random() < q]
        for start in range(0, len(sample), micro_batch):
            part = sample[start : start + micro_batch]
            shape = (len(part), max(part))
            fresh = shape not in seen
            seen.add(shape)
            total, new = total + 1, new + fresh
            if step >= steps // 2:
                late_total, late_new = late_total + 1, late_new + fresh
    return {"steps": steps, "micro_batches": total, "new_fraction": new / max(total, 1),
            "new_fraction_second_half": late_new / max(late_total, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=None, help="SST-2 (train.tsv); default $HF_DPFILTER_DATA or "
                                                         "../shared/data")
    parser.add_argument("--examples", type=int, default=4096, help="training set size N")
    parser.add_argument("--batch", type=int, default=64, help="expected logical batch (Poisson)")
    parser.add_argument("--micro_batch", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--warmup", type=int, default=30, help="steps run by every variant before timing")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved timing rounds")
    parser.add_argument("--first_step_repeats", type=int, default=3)
    parser.add_argument("--census_steps", type=int, default=3000,
                        help="steps of the simulated run whose micro-batch shapes are counted (lengths only)")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="the model's dropout (0: the re-checks reuse the micro-batch's training forward)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))

    lengths, source = example_lengths(args.examples, 0, args.data_dir)
    ids = torch.Generator().manual_seed(1)
    vocab = 1000 if args.tiny else 30522
    data = [{"input_ids": torch.randint(3, vocab, (n,), generator=ids), "labels": i % 2} for i,
            n in enumerate(lengths)]
    draw = random.Random(2)
    q = args.batch / args.examples
    steps = args.warmup + args.rounds
    batches = [[i for i in range(args.examples) if draw.random() < q] or [0] for _ in range(steps)]

    with tempfile.TemporaryDirectory() as out:
        variants = {
            "off": make_trainer(data, os.path.join(out, "off"), args, dp_verify_first_step=False),
            "new shapes": make_trainer(data, os.path.join(out, "shapes"), args, dp_recheck_rate=0.0),
            "default rate": make_trainer(data, os.path.join(out, "rate"), args),
        }
        clocks = {name: Clock() for name in variants}
        steps_of = {name: stepper(t, batches, data, clocks[name]) for name, t in variants.items()}
        for _ in range(args.warmup):
            for step in steps_of.values():
                step()
        seen = {n: t._separation.rechecks_run if t._separation else 0 for n, t in variants.items()}
        for clock in clocks.values():
            clock.reset()
        timing = time_interleaved(steps_of, args.rounds)
        rechecks = {n: (t._separation.rechecks_run if t._separation else 0) - seen[n] for n,
                    t in variants.items()}
        micro = sum(-(-len(b) // args.micro_batch) for b in batches[args.warmup:])
        warm_micro = sum(-(-len(b) // args.micro_batch) for b in batches[: args.warmup])
    first = first_step_cost(data, batches[0], args, args.first_step_repeats)
    census = shape_census(lengths, args.batch, args.micro_batch, args.census_steps, 3)
    # one re-check's cost in steps without checks, timed where it runs (the median of per-round ratios misses
    # a cost paid in some rounds only: it is reported, and so is the mean)
    timed = clocks["default rate"]
    per_recheck = (timed.rechecks / max(timed.count, 1)) / (clocks["off"].steps / max(args.rounds, 1))
    per_micro = micro / max(args.rounds, 1)
    run_rechecks = census["new_fraction"] + (1 - census["new_fraction"]) * DEFAULT_RECHECK_RATE
    run_cost = run_rechecks * per_micro * per_recheck
    result = {
        "lengths": source, "model": "tiny BERT" if args.tiny else "BERT 2x128 (vocab 30522)",
        "dropout": args.dropout,
        "batch": args.batch, "micro_batch": args.micro_batch, "rounds": args.rounds, "warmup": args.warmup,
        "default_rate": DEFAULT_RECHECK_RATE, "micro_batches_timed": micro,
        "rechecks_timed": rechecks, "rechecks_warmup": seen, "micro_batches_warmup": warm_micro,
        "ratio_new_shapes_vs_off": timing["new shapes"]["ratio"],
        "ratio_default_vs_off": timing["default rate"]["ratio"],
        "mean_ratio_new_shapes_vs_off": statistics.mean(timing["new shapes"]["ratios"]),
        "mean_ratio_default_vs_off": statistics.mean(timing["default rate"]["ratios"]),
        "recheck_share_of_step_time": timed.rechecks / max(timed.steps, 1e-12),
        "schedule_cost": timing["default rate"]["ratio"] / timing["new shapes"]["ratio"] - 1.0,
        "step_s_off": timing["off"]["time_s"],
        "first_step_ratio": first,
        "census": census, "recheck_cost_in_steps": per_recheck, "run_average_cost": run_cost,
    }
    print(f"recheck-cost: {result['model']}, dropout {args.dropout:g}, {source}, Poisson batch {args.batch}, "
          f"micro-batch {args.micro_batch}, {args.warmup} warm-up steps, {args.rounds} interleaved rounds "
          f"({micro} micro-batches), CPU")
    print(f"  step without checks: {result['step_s_off'] * 1e3:.1f} ms")
    print(f"  re-checks in the warm-up ({warm_micro} micro-batches): {seen}")
    print(f"  re-checks in the timed rounds ({micro} micro-batches): {rechecks}")
    print("  step time, new-shape re-checks only / no checks: median "
          f"{result['ratio_new_shapes_vs_off']:.3f}, mean {result['mean_ratio_new_shapes_vs_off']:.3f}")
    print(f"  step time, default rate {DEFAULT_RECHECK_RATE:g} / no checks: median "
          f"{result['ratio_default_vs_off']:.3f}, mean {result['mean_ratio_default_vs_off']:.3f}; time in "
          f"re-checks: {result['recheck_share_of_step_time']:.1%} of the default variant's step time")
    print(f"  first step with the first-step check / without: {first:.2f}")
    print(f"  one re-check: {per_recheck:.3f} of a step; a simulated run of {census['steps']} steps: "
          f"{census['new_fraction']:.1%} of its {census['micro_batches']} micro-batches are a new shape "
          f"({census['new_fraction_second_half']:.1%} in its second half); run-average cost of the re-checks "
          f"at the default rate: {run_cost:.1%} of a step")
    return result


if __name__ == "__main__":
    main()
