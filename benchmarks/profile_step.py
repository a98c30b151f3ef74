"""Count the operators (kernels) one private training step launches, per DP method.

A RoBERTa-base-*shaped* model (12 layers, the same ~200 parameter tensors as RoBERTa-base) at a tiny width
(64, T = 16, so every full layer takes the ghost path as RoBERTa-base does at T = 128), so the count, which
is what makes a GPU step launch-bound on small models, is measured in seconds on a CPU. Counted per step
(averaged over ``--steps`` steps after two warm-up steps), for the whole step: ``optimizer.accumulate``
(forward, backward, norms, clipped sums) and ``optimizer.step`` (noise, filter, AdamW), with a
``TorchDispatchMode`` that sees every operator reaching a kernel; views (``view``, ``t``, ``expand``, ...)
launch nothing and are left out. ``AdamW`` counts the base optimizer's share (the non-private step runs it
too; its CPU implementation loops over parameters, its CUDA default is ``foreach``).

Usage::

    python -m benchmarks operator-count                 # dpsgd and the methods, fp32
    python -m benchmarks operator-count --bf16          # under CPU bf16 autocast
    python -m benchmarks operator-count --stack-layers on --layers 24   # the CUDA default (same-shape layers
                                                        # stacked), forced on CPU; at another depth
    python -m benchmarks operator-count --json out.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import RobertaConfig, RobertaForSequenceClassification

from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers import make_dp_optimizer

METHODS = {
    "dpsgd": {},
    "disk": {},
    "doppler": {},
    "pmlf": {"k": 2},
    "dicesgd": {},
}
WATCH = ("mm", "bmm", "addmm", "mv", "_to_copy", "copy_", "sum", "normal_", "add_", "mul",
         "linalg_vector_norm")
VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "reshape", "as_strided", "detach", "alias",
         "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "permute", "diagonal",
         "_reshape_alias", "unbind", "narrow"}
OPTIM = os.path.join("torch", "optim", "")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.base_optimizer = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
            frame = sys._getframe(1)
            while frame is not None and OPTIM not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None:
                self.base_optimizer += 1
        return func(*args, **(kwargs or {}))


def build(method: str, width: int, seed: int = 0, layers: int = 12, stack_layers: bool | None = None):
    config = RobertaConfig(vocab_size=500, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=4 * width, max_position_embeddings=80, num_labels=2)
    torch.manual_seed(seed)
    model = RobertaForSequenceClassification(config).train()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    engine.stack_layers = stack_layers
    optimizer = make_dp_optimizer(model.parameters(), method=method, base=torch.optim.AdamW, lr=1e-4,
                                  noise_multiplier=1.0, per_sample_max_grad_norm=1.0, expected_batch_size=8,
                                  sample_rate=0.01, seed=0, method_args=METHODS[method] or None)
    return model, engine, optimizer


def count_ops(
    method: str, width: int, batch: int, tokens: int, steps: int, bf16: bool, layers: int = 12,
    stack_layers: bool | None = None,
) -> dict[str, float]:
    model, engine, optimizer = build(method, width, layers=layers, stack_layers=stack_layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (batch, tokens), generator=g)
    labels = torch.randint(0, 2, (batch,), generator=g)

    def loss_fn(values):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            logits = engine.call_model(values, input_ids=ids).logits
        return per_example_loss(logits.float(), labels, causal_lm=False)

    def step():
        # rows of one length: the examples
        optimizer.accumulate(engine, loss_fn, batch, example_keys=list(ids))
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()  # the methods' buffers exist from here on
    counter = _CountOps()
    with counter:
        for _ in range(steps):
            step()
    result = {"ops": sum(counter.counts.values()) / steps, "AdamW": counter.base_optimizer / steps}
    result.update({k: counter.counts.get(k, 0) / steps for k in WATCH})
    result["parameters"] = len(optimizer.params)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (RoBERTa-base has 12)")
    parser.add_argument(
        "--stack-layers", default="auto", choices=("auto", "on", "off"),
        help="stack same-shape layers into batched products (auto: on CUDA only, so off in this CPU count)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    stack = {"auto": None, "on": True, "off": False}[args.stack_layers]
    rows = {}
    for method in args.methods.split(","):
        rows[method] = count_ops(method, args.width, args.batch, args.tokens, args.steps, args.bf16,
                                 args.layers,
                                 stack)
        cells = ", ".join(f"{k} {v:.0f}" for k, v in rows[method].items())
        print(f"{method:8s} {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
