"""End-to-end throughput of the table-to-text recipe, private against non-private, and what it spends
beyond the training steps.

Runs ``recipes/table2text.py`` in this process (E2E data, a GPT-2 built from a config with a BPE tokenizer
trained on the E2E texts, as in ``examples/make_tiny_gpt2.py``) with ``--method none`` and ``--method dpsgd``
(``--target_epsilon 8``), alternating, ``--repeats`` times each. A callback times every optimizer step (from the
Trainer's ``on_step_begin`` to ``on_step_end``: the forwards, backwards, clipping, noise and AdamW of one
logical batch; CUDA-synchronized on a GPU). Reported per run: the Trainer's ``train_runtime``, the summed step
time, and the rest (data loading, padding, logging with epsilon, the privacy ledger, the evaluation,
callbacks). The two ratios, private over non-private, are the end-to-end one (``train_runtime``) and the step
one (summed steps): the recipe's overhead is within the step ratio when the first is not above the second.

Usage::

    python -m benchmarks recipe-throughput                        # CPU, a small GPT-2 (4 layers, width 128)
    python -m benchmarks recipe-throughput --gpt2-small --bf16    # GPU: GPT-2-small shape, bf16 autocast
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

import hf_dpfilter
from benchmarks.common import ROOT, e2e_dir

# the recipe and the tokenizer builder are scripts: imported as the sibling modules they are when run by path
for path in (os.path.join(ROOT, "recipes"), os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)


class StepTimer(TrainerCallback):
    """Sums the wall time of every optimizer step (forwards, backwards, clipping, noise, base optimizer)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.steps = 0
        self._start = None

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.total += self._now() - self._start
        self.steps += 1


def run(method: str, model_dir: str, data_dir: str, out_dir: str, args: argparse.Namespace) -> dict:
    import table2text

    timer = StepTimer()
    trainer_class = hf_dpfilter.DPTrainer

    class TimedDPTrainer(trainer_class):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(timer)

    hf_dpfilter.DPTrainer = TimedDPTrainer  # the recipe imports it when it runs
    argv = [
        "--dataset", "e2e", "--model", model_dir, "--data_dir", data_dir, "--method", method,
        "--max_train_samples", str(args.train_samples), "--max_eval_samples", "4", "--num_evals", "1",
        "--logical_batch_size", str(args.batch), "--per_device_train_batch_size", str(args.batch),
        "--max_steps", str(args.steps), "--num_beams", "1", "--max_generation_length", "4",
        "--output_dir", out_dir, "--no_plots", "--seed", "0",
    ]
    if method != "none":
        argv += ["--target_epsilon", "8"]
    if args.bf16:
        argv += ["--bf16"]
    if not torch.cuda.is_available():
        argv += ["--use_cpu"]
    try:
        table2text.main(argv)
    finally:
        hf_dpfilter.DPTrainer = trainer_class
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    runtime = next(e["train_runtime"] for e in results["log_history"] if "train_runtime" in e)
    return {"method": method, "train_runtime": runtime, "steps_time": timer.total, "steps": timer.steps,
            "rest": runtime - timer.total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=None,
                        help="folder with the E2E CSV files (default: ../shared/data/e2e, else "
                             "shared/data/e2e)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="logical batch (one micro-batch per step)")
    parser.add_argument("--train_samples", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpt2-small", action="store_true",
                        help="GPT-2 small's shape (12 layers, width 768)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.data_dir = e2e_dir(args.data_dir)
    from make_tiny_gpt2 import build_tiny_gpt2, e2e_texts

    work = tempfile.mkdtemp(prefix="recipe_throughput_")
    shape = dict(n_embd=768, n_layer=12, n_head=12) if args.gpt2_small else dict(n_embd=128, n_layer=4,
                                                                                 n_head=4)
    model_dir = build_tiny_gpt2(os.path.join(work, "model"), e2e_texts(args.data_dir, limit=5000),
                                vocab_size=2048,
                                **shape)
    rows = []
    for repeat in range(args.repeats):
        for method in (("none", "dpsgd") if repeat % 2 == 0 else ("dpsgd", "none")):
            row = run(method, model_dir, args.data_dir, os.path.join(work, f"{method}-{repeat}"), args)
            rows.append(row)
            print(f"{method:6s} train_runtime {row['train_runtime']:.2f} s, steps {row['steps_time']:.2f} s "
                  f"({row['steps']} steps), rest {row['rest']:.2f} s", flush=True)

    def median(method: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["method"] == method)

    end_to_end = median("dpsgd", "train_runtime") / median("none", "train_runtime")
    steps = median("dpsgd", "steps_time") / median("none", "steps_time")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, GPT-2 {'small' if args.gpt2_small else 'width 128, 4 layers'}, B={args.batch}, "
          f"{args.steps} steps, {'bf16' if args.bf16 else 'fp32'}, medians of {args.repeats} runs each:")
    for method in ("none", "dpsgd"):
        print(f"  {method:6s} train_runtime {median(method, 'train_runtime'):.2f} s = steps "
              f"{median(method, 'steps_time'):.2f} s + rest {median(method, 'rest'):.2f} s; "
              f"{args.steps * args.batch / median(method, 'train_runtime'):.1f} examples/s")
    print(f"  private / non-private: end to end {end_to_end:.3f}x, steps {steps:.3f}x; private throughput "
          f"{1 / end_to_end:.2f}x non-private")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "end_to_end_ratio": end_to_end, "step_ratio": steps, "device": device,
                       "arguments": vars(args)}, f, indent=1)
    return 0
