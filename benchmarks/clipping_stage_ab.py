"""A/B of the clipping stage (per-example norms and the clipped sum) against the engine of another revision.

The stage that runs after the backward, ``PerExampleGradients(...)`` then ``clipping_norms()`` and
``weighted_sum(c, release=True)``, is timed for this checkout's engine and for ``hf_dpfilter/engine.py`` as it
was at ``--base`` (loaded from git under another module name; the rest of the package is shared). Both get the
same recorded terms: each round runs one recorded forward and backward, copies the terms, and times each
variant on its own copy, in alternating order. Reported: the median over rounds of the per-round time ratio
(this checkout / base), and the largest difference between the two variants' norms and sums (they must
agree to rounding).

Usage::

    python benchmarks/clipping_stage_ab.py --base HEAD~1                       # RoBERTa-base, B=4, T=128
    python benchmarks/clipping_stage_ab.py --base HEAD~1 --stack-layers on    # the CUDA default, on CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import RobertaConfig, RobertaForSequenceClassification

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hf_dpfilter import engine as current_engine  # noqa: E402
from hf_dpfilter.losses import per_example_loss  # noqa: E402


def load_engine_at(revision: str):
    """``hf_dpfilter/engine.py`` at ``revision`` as a module of its own."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:hf_dpfilter/engine.py"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "engine_base.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("engine_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_base"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def copy_terms(terms: dict) -> dict:
    """A copy that shares no tensor object with ``terms`` but keeps which tensors were shared (fusion needs it)."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        return copies[id(t)]

    out = {}
    for param, ts in terms.items():
        out[param] = [type(t)(**{k: copy(v) if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()})
                      for t in ts]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision of the engine to compare against")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stack-layers", default="auto", choices=("auto", "on", "off"))
    args = parser.parse_args(argv)
    stack = {"auto": None, "on": True, "off": False}[args.stack_layers]
    base_engine = load_engine_at(args.base)

    config = RobertaConfig(vocab_size=1000, hidden_size=args.width, num_hidden_layers=args.layers,
                           num_attention_heads=max(1, args.width // 64), intermediate_size=4 * args.width,
                           max_position_embeddings=args.tokens + 4, num_labels=2)
    torch.manual_seed(0)
    model = RobertaForSequenceClassification(config).train()
    engine = current_engine.GhostClippingEngine(model, verify_first_backward=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (args.batch, args.tokens), generator=g)
    labels = torch.randint(0, 2, (args.batch,), generator=g)
    coefficients = torch.rand(args.batch, generator=g)

    def stage(cls, terms, **kwargs):
        start = time.perf_counter()
        grads = cls(terms, args.batch, torch.float32, **kwargs)
        norms = grads.clipping_norms()
        sums = grads.weighted_sum(coefficients, release=True)
        return time.perf_counter() - start, norms, sums

    ratios, times = [], {"this checkout": [], args.base: []}
    worst_norm = worst_sum = 0.0
    for round_ in range(args.rounds + 1):
        with engine.record(batch_size=args.batch):
            losses = per_example_loss(model(input_ids=ids).logits, labels, causal_lm=False)
        engine.backward_recorded(losses)
        terms, engine._pending_terms = engine._pending_terms, {}
        base_terms = copy_terms(terms)
        runs = [("this checkout", current_engine.PerExampleGradients, terms, {"stack_layers": stack}),
                (args.base, base_engine.PerExampleGradients, base_terms, {})]
        if round_ % 2:
            runs.reverse()
        results = {}
        for name, cls, ts, kwargs in runs:
            results[name] = stage(cls, ts, **kwargs)
        del terms, base_terms, runs
        (t_new, n_new, s_new), (t_old, n_old, s_old) = results["this checkout"], results[args.base]
        worst_norm = max(worst_norm, float(((n_new - n_old).abs() / n_old).max()))
        worst_sum = max(worst_sum, max(float((s_new[p] - s_old[p]).norm() / s_old[p].norm().clamp_min(1e-30))
                                       for p in s_old))
        if round_ == 0:
            continue  # warm-up
        times["this checkout"].append(t_new)
        times[args.base].append(t_old)
        ratios.append(t_new / t_old)
        print(f"round {round_}: this checkout {t_new * 1e3:.0f} ms, {args.base} {t_old * 1e3:.0f} ms, "
              f"ratio {t_new / t_old:.3f}", flush=True)
    print(f"\nRoBERTa-shaped width {args.width}, {args.layers} layers, B={args.batch}, T={args.tokens}, "
          f"stack_layers={args.stack_layers}, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        print(f"  {name}: median {statistics.median(ts) * 1e3:.0f} ms")
    print(f"  median per-round ratio (this checkout / {args.base}): {statistics.median(ratios):.3f}")
    print(f"  largest relative difference: norms {worst_norm:.2e}, sums {worst_sum:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
