"""Peak memory of a private training step with and without gradient checkpointing.

Models (random weights from configs, no download, float32, full fine-tuning, train mode):

* ``gpt2`` -- GPT-2 small (``GPT2Config()``, 124M, tied head), sequences of T = 1024 tokens;
* ``llama`` -- a Llama-shaped model (hidden 1024, 8 layers, 16 query / 4 key-value heads, SwiGLU 2816,
  vocabulary 32000, untied head; ~160M), T = 1024.

One step is what ``DPTrainer`` does per micro-batch and per logical step: ``DPOptimizer.accumulate(engine,
loss_fn, B)`` (forward, one backward to the layer outputs, ghost norms, clipped sums) and ``step()`` (noise,
SGD). Checkpointing is transformers' non-reentrant activation checkpointing of every decoder layer
(``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``).

CPU (default): every variant runs in its own subprocess with ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (freed
tensors go back to the OS); after the model is built and one warm-up step has run, the peak-RSS counter is
reset (``/proc/self/clear_refs``) and one more step runs. Reported: that step's peak RSS minus the RSS before
it (weights, optimizer state and the warm-up's allocations excluded), i.e. activations, output gradients,
norms, clipped sums and every temporary of the step. ``--device cuda``: the same step on the GPU, measured as
``torch.cuda.max_memory_allocated()`` minus the memory allocated before the step.

Usage::

    python -m benchmarks checkpointing-memory                        # both models, B = 2, T = 1024 (CPU)
    python -m benchmarks checkpointing-memory --models gpt2 --seq-len 256 --batch-size 1   # quick
    python -m benchmarks checkpointing-memory --device cuda          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_WORKER = r"""
import json, os, sys, time, warnings
import torch
warnings.simplefilter("ignore")
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(spec["threads"])
device = torch.device(spec["device"])

from benchmarks.common import current_rss_kb as rss_kb, peak_rss_kb as peak_kb, reset_peak_rss as reset_peak

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers import make_dp_optimizer

if spec["model"] == "gpt2":
    model = GPT2LMHeadModel(GPT2Config())
else:
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=spec["seq_len"], tie_word_embeddings=False))
model.to(device).train()
if spec["checkpointing"]:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
B, T = spec["batch_size"], spec["seq_len"]
ids = torch.randint(0, model.config.vocab_size, (B, T), device=device)
engine = GhostClippingEngine(model, verify_first_backward=False)
optimizer = make_dp_optimizer(model.parameters(), torch.optim.SGD, lr=1e-4, noise_multiplier=1.0,
                              per_sample_max_grad_norm=1.0, expected_batch_size=B, sample_rate=0.01, seed=0)

def loss_fn(values):
    logits = engine.call_model(values, input_ids=ids).logits
    return per_example_loss(logits, ids, causal_lm=True)

def step():
    optimizer.accumulate(engine, loss_fn, B, example_keys=list(ids))  # rows of one length: the examples
    optimizer.step()
    optimizer.zero_grad()

step()  # warm-up: optimizer state, allocator pools, lazy initialisation
if device.type == "cuda":
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter(); step(); torch.cuda.synchronize(); seconds = time.perf_counter() - start
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    reset = True
else:
    before = rss_kb()
    reset = reset_peak()
    start = time.perf_counter(); step(); seconds = time.perf_counter() - start
    peak_mb = (peak_kb() - before) / 1024
print(json.dumps({"peak_mb": peak_mb, "seconds": seconds, "peak_reset": reset,
                  "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6}))
"""


def measure(model: str, checkpointing: bool, args: argparse.Namespace) -> dict:
    spec = {"model": model, "checkpointing": checkpointing, "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "device": args.device, "threads": args.threads}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), TOKENIZERS_PARALLELISM="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(spec)], capture_output=True, text=True,
                          env=env,
                          cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"{model} (checkpointing={checkpointing}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    rows = []
    print(f"device={args.device} B={args.batch_size} T={args.seq_len} (peak of one DP step, MiB)")
    print(f"{'model':<8} {'params':>8} {'no ckpt':>10} {'ckpt':>10} {'saving':>8} {'time x':>7}")
    for model in args.models:
        started = time.time()
        plain = measure(model, False, args)
        ckpt = measure(model, True, args)
        saving = 1.0 - ckpt["peak_mb"] / plain["peak_mb"]
        slowdown = ckpt["seconds"] / plain["seconds"]
        rows.append({"model": model, "plain": plain, "checkpointing": ckpt, "saving": saving,
                     "slowdown": slowdown})
        print(f"{model:<8} {plain['parameters_m']:>7.0f}M {plain['peak_mb']:>10.0f} {ckpt['peak_mb']:>10.0f} "
              f"{saving:>7.0%} {slowdown:>6.2f}x   ({time.time() - started:.0f} s)")
        if not (plain["peak_reset"] and ckpt["peak_reset"]):
            print("  (peak-RSS counter could not be reset: the figures include the warm-up step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
                       "rows": rows},
                      f, indent=1)

