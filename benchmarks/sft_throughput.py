"""Throughput of DP SFT through TRL: packed against unpacked, and private against TRL's own ``SFTTrainer``.

One interleaved run on a small Llama built from a config (the offline byte-level chat tokenizer) and the same
synthetic conversations (assistant turns of skewed lengths, seeded). Each round trains, in turn:

* ``dp_packed``: DPSFTTrainer, ``packing=True`` (each step's Poisson sample packed best-fit into rows of
  ``--max_length``, ``--bins`` rows per micro-batch);
* ``dp_unpacked``: DPSFTTrainer, ``packing=False`` (one example per row, padded; ``--micro`` examples per
  micro-batch);
* ``nonprivate``: TRL's ``SFTTrainer`` with ``packing=True`` (TRL packs the data set; a micro-batch takes
  ``--bins`` packed rows, and a step as many micro-batches as hold about ``--batch`` examples, as the DP
  runs).

Examples/s: DP runs count the expected examples per step (the logical batch) times the steps, over the
Trainer's ``train_runtime``; the non-private run counts the examples its packed rows hold (the data set's
examples per packed row times the rows per step). The ratios packed/unpacked and DP/non-private are taken per
round and their median printed, so that a slow moment of the machine hits both sides of a ratio.

Usage::

    python -m benchmarks sft-throughput                 # CPU, ~1-2 minutes
    python -m benchmarks sft-throughput --rounds 5 --steps 10 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WORDS = ("the cafe serves cheap italian food near the riverside it is family friendly and rated highly by "
         "customers with a moderate price range in the city centre").split()


def conversations(n: int, seed: int) -> list[dict]:
    """Chat rows whose assistant turns have a skewed number of words (a few long, most short)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        words = min(60, int(rng.paretovariate(1.2) * 4))
        answer = " ".join(rng.choice(WORDS) for _ in range(words))
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": answer}]})
    return rows


def run_once(kind: str, rows: list[dict], args: argparse.Namespace, work: str) -> float:
    """Examples per second of one short training run of ``kind``."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from hf_dpfilter import DPSFTConfig, DPSFTTrainer
    from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama

    tokenizer = byte_level_chat_tokenizer()
    model = small_llama(tokenizer, hidden_size=args.hidden, layers=args.layers,
                        max_positions=max(512, args.max_length))
    common = dict(output_dir=os.path.join(work, kind), max_steps=args.steps, use_cpu=not args.gpu,
                  bf16=args.bf16,
                  report_to=[], save_strategy="no", assistant_only_loss=True, max_length=args.max_length,
                  gradient_checkpointing=False, disable_tqdm=True, logging_steps=10**6, learning_rate=1e-3)
    data = datasets.Dataset.from_list(rows)
    if kind == "nonprivate":
        # the same examples per step as the DP runs (about --batch): --bins packed rows per micro-batch, and
        # as many micro-batches per step as that takes (TRL packs the data set, so a row holds several
        # examples)
        config = SFTConfig(**common, packing=True, per_device_train_batch_size=args.bins)
        probe = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        per_row = len(rows) / len(probe.train_dataset)
        accumulation = max(1, round(args.batch / (per_row * args.bins)))
        config = SFTConfig(**common, packing=True, per_device_train_batch_size=args.bins,
                           gradient_accumulation_steps=accumulation)
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        per_step = per_row * args.bins * accumulation
    else:
        packing = kind == "dp_packed"
        config = DPSFTConfig(**common, packing=packing, noise_multiplier=1.0, logical_batch_size=args.batch,
                             per_device_train_batch_size=args.bins if packing else args.micro, dp_seed=0)
        trainer = DPSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        per_step = float(args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime = trainer.train().metrics["train_runtime"]
    return per_step * args.steps / runtime


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds (each runs the three kinds)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--examples", type=int, default=512, help="training conversations")
    parser.add_argument("--batch", type=int, default=32, help="DP logical batch (expected examples per step)")
    parser.add_argument("--max_length", type=int, default=256, help="packed row capacity (tokens) and "
        "truncation")
    parser.add_argument("--bins", type=int, default=6, help="packed rows per micro-batch (per step, "
                                                            "non-private); "
                        "6 x 256 tokens is about the memory of the unpacked micro-batch (8 examples padded "
                        "to ~205)")
    parser.add_argument("--micro", type=int, default=8, help="examples per micro-batch, DP unpacked")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="run on the GPU (default: CPU)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    rows = conversations(args.examples, seed=0)
    kinds = ("dp_packed", "dp_unpacked", "nonprivate")
    speeds: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="sft_throughput_") as work:
        for index in range(args.rounds):
            order = kinds if index % 2 == 0 else tuple(reversed(kinds))  # alternate who goes first
            for kind in order:
                speeds[kind].append(run_once(kind, rows, args, work))
    packed_ratio = statistics.median(p / u for p, u in zip(speeds["dp_packed"], speeds["dp_unpacked"]))
    dp_ratio = statistics.median(p / n for p, n in zip(speeds["dp_packed"], speeds["nonprivate"]))
    result = {
        "examples_per_second": {k: statistics.median(v) for k, v in speeds.items()},
        "per_round": speeds,
        "packed_over_unpacked": packed_ratio,
        "dp_over_nonprivate": dp_ratio,
        "settings": vars(args),
    }
    print(f"DP SFT throughput ({args.rounds} interleaved rounds, {args.steps} steps each, median)")
    for kind in kinds:
        print(f"  {kind:12s} {result['examples_per_second'][kind]:10.1f} examples/s")
    print(f"  DP packed / DP unpacked : {packed_ratio:.2f}x (median of per-round ratios)")
    print(f"  DP packed / non-private : {dp_ratio:.2f}x (median of per-round ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
