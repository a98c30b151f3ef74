"""DP-Adam parity with Opacus: paired seeds of the two pipelines of ``benchmarks/utility_sst2.py``.

    python -m benchmarks opacus-parity --check                      # deterministic checks (about 2 minutes)
    python -m benchmarks opacus-parity --seeds 0 1 2 3 4            # paired runs (resumable), then the
    summary python -m benchmarks opacus-parity --summary                    # the summary of the finished runs
    only python -m benchmarks opacus-parity --head_only --seeds $(seq 0 19)   # level 1: linear head, frozen
    MiniLM

Level 1 (``--head_only``) runs the same two pipelines (DPTrainer DP-Adam; Opacus make_private_with_epsilon,
ghost clipping, AdamW, Poisson DPDataLoader, BatchMemoryManager) on a linear classifier over the frozen
MiniLM's mean-pooled sentence embeddings, computed once: seconds per run, so many paired seeds. Its learning
rate is chosen with ``--head_only --tune`` on a validation split carved from the training set (training
examples outside the subset), never on the dev set.

``--check`` feeds the same 16 SST-2 examples to the pretrained MiniLM (dropout off, float64) through both
libraries with sigma = 0 and compares the per-example gradient norms and the clipped sums with a
one-example-at-a-time autograd reference, and prints the run plan (sample rate, steps, expected batch, sigma,
noise std of the averaged gradient) that each library derives from the same N, B, epochs, epsilon and delta.

The paired runs call ``run_hf_dpfilter("dpsgd", ...)`` and ``run_opacus(...)`` of
``benchmarks/utility_sst2.py`` unchanged (DP-Adam: AdamW, constant lr, Abadi clipping, Poisson sampling, ghost
clipping in both) with the same seed per pair: the same training subset, classifier initialisation and dropout
seed. The default N = 2048 is a multiple of the logical batch 256, so both libraries run the same plan (q =
1/8, 24 steps, expected batch 256); with another N they differ in the step count (see
``docs/opacus_parity.md``). Rows go to ``benchmarks/results/opacus_parity.json`` keyed by scale, pipeline and
seed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time

import torch

from benchmarks.common import minilm_path, read_glue_tsv, sst2_dir
from benchmarks.utility_sst2 import load_data, run_hf_dpfilter, run_opacus, save_row

PIPELINES = ("hf_dpfilter", "opacus")


def opacus_plan(num_examples: int, logical_batch_size: int, epochs: int) -> dict:
    """What ``make_private_with_epsilon`` derives from a DataLoader(batch_size=B) over N examples (Opacus 1.6
    ``privacy_engine.py``, ``data_loader.py``, ``uniform_sampler.py``): q = 1 / len(loader) = 1 / ceil(N / B),
    1 / q steps per epoch, and ``expected_batch_size = int(N q)``, the divisor of the noisy sum."""
    batches = math.ceil(num_examples / logical_batch_size)
    sample_rate = 1 / batches
    return {"sample_rate": sample_rate, "steps": int(1 / sample_rate) * epochs,
            "expected_batch_size": int(num_examples * sample_rate)}


def print_plans(args: argparse.Namespace) -> None:
    from opacus.accountants.utils import get_noise_multiplier

    from hf_dpfilter.accounting.accountant import compute_epsilon
    from hf_dpfilter.plan import PrivacyPlan

    scales = [(args.train_samples, args.logical_batch_size), (2000, 256), (8000, 256), (67349, 1024)]
    print("| N | B | eps | library | q | steps | divisor | sigma | sigma C / divisor | eps (hf_dpfilter "
          "accountant) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, b in scales:
        for eps in args.epsilons:
            delta = n ** -1.1
            plan = PrivacyPlan.create(num_examples=n, logical_batch_size=b, epochs=args.epochs,
                                      target_epsilon=eps,
                                      per_sample_max_grad_norm=args.max_grad_norm, seed=0)
            theirs = opacus_plan(n, b, int(args.epochs))
            sigma = get_noise_multiplier(target_epsilon=eps, target_delta=delta,
                                         sample_rate=theirs["sample_rate"],
                                         epochs=int(args.epochs), accountant="prv")
            their_eps = compute_epsilon([(sigma, theirs["sample_rate"], theirs["steps"])], delta, "prv")
            c = args.max_grad_norm
            print(f"| {n} | {b} | {eps:g} | hf_dpfilter | {plan.sample_rate:.5f} | {plan.steps} | {b} | "
                  f"{plan.noise_multiplier:.4f} | {plan.noise_multiplier * c / b:.3g} | {plan.epsilon():.3f} "
                  "|")
            print(f"| {n} | {b} | {eps:g} | Opacus | {theirs['sample_rate']:.5f} | {theirs['steps']} | "
                  f"{theirs['expected_batch_size']} | {sigma:.4f} | "
                  f"{sigma * c / theirs['expected_batch_size']:.3g} | {their_eps:.3f} |")


def check_gradients(args: argparse.Namespace) -> None:
    """Per-example norms and clipped sums of both libraries against a float64 per-example reference."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_dpfilter.factory import make_private
    from hf_dpfilter.losses.tasks import per_example_loss
    from hf_dpfilter.plan import PrivacyPlan

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts, labels = read_glue_tsv(os.path.join(args.data_dir, "train.tsv"))
    size = 16
    batch = dict(tokenizer(texts[:size], padding=True, truncation=True, max_length=args.max_seq_length,
                           return_tensors="pt"))
    y = torch.tensor(labels[:size])
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(
        minilm_path(), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).double()
    base.train()  # Opacus records activations only in train mode; dropout is off
    for c in (args.max_grad_norm, 1e6):
        model = copy.deepcopy(base)
        ref_norms, ref_sum = [], None
        for i in range(size):
            model.zero_grad()
            logits = model(**{k: v[i : i + 1] for k, v in batch.items()}).logits
            torch.nn.functional.cross_entropy(logits, y[i : i + 1]).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            norm = torch.sqrt(sum((g**2).sum() for g in grads))
            ref_norms.append(norm)
            factor = min(1.0, c / (float(norm) + 1e-6))
            ref_sum = [g * factor for g in grads] if ref_sum is None else [a + g * factor for a,
                                                                           g in zip(ref_sum, grads)]
        ref_norms = torch.stack(ref_norms)

        ours_model = copy.deepcopy(base)
        plan = PrivacyPlan.create(num_examples=1000, logical_batch_size=size, epochs=1, noise_multiplier=0.0,
                                  per_sample_max_grad_norm=c, seed=0)
        engine, optimizer, _ = make_private(plan, ours_model, base=torch.optim.SGD, lr=0.0)

        def loss_fn(values, model=ours_model, engine=engine):
            logits = engine.call_model(values, **batch).logits if values else model(**batch).logits
            return per_example_loss(logits, y, causal_lm=False)

        optimizer.accumulate(engine, loss_fn, batch_size=size)
        ours = [optimizer._local_sums()[p] for p in ours_model.parameters()]

        their_model = copy.deepcopy(base)
        their_optimizer = torch.optim.SGD(their_model.parameters(), lr=0.0)
        loader = DataLoader(TensorDataset(torch.arange(size)), batch_size=size)
        their_model, their_optimizer, criterion, _ = PrivacyEngine(accountant="prv").make_private(
            module=their_model, optimizer=their_optimizer, data_loader=loader,
            criterion=torch.nn.CrossEntropyLoss(),
            noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode="ghost", poisson_sampling=False)
        their_optimizer.zero_grad()
        seq = batch["input_ids"].shape[1]
        logits = their_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=torch.arange(seq).unsqueeze(0).repeat(size, 1)).logits
        criterion(logits, y).backward()
        their_norms = their_model.per_sample_gradient_norms.double()
        their_optimizer.accumulate()
        theirs = [p.summed_grad for p in their_model._module.parameters()]

        def relative(a, b):
            return float(torch.sqrt(sum(((x - z) ** 2).sum() for x, z in zip(a, b)))
                         / torch.sqrt(sum((z**2).sum() for z in b)))

        print(f"C = {c:g}: Opacus per-example norms, max relative error "
              f"{float(((their_norms - ref_norms).abs() / ref_norms).max()):.1e}; clipped sum relative "
              f"error: hf_dpfilter {relative(ours, ref_sum):.1e}, Opacus {relative(theirs, ref_sum):.1e} "
              f"(norms {float(ref_norms.min()):.2f}-{float(ref_norms.max()):.2f})")


def head_features(args: argparse.Namespace) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Mean-pooled frozen-MiniLM embeddings of the training subset, a validation split (other training
    examples) and the dev set, cached under ``--work_dir``."""
    import numpy as np
    from transformers import AutoModel, AutoTokenizer

    from recipes.common.models import mean_pooled_embeddings

    path = os.path.join(args.work_dir, f"features_N{args.train_samples}_V{args.validation_samples}_"
                                       f"T{args.max_seq_length}_data{args.data_seed}.pt")
    if os.path.exists(path):
        return torch.load(path)
    texts, labels = read_glue_tsv(os.path.join(args.data_dir, "train.tsv"))
    order = np.random.default_rng(args.data_seed).permutation(len(texts))
    splits = {"train": order[: args.train_samples],
              "validation": order[args.train_samples : args.train_samples + args.validation_samples]}
    dev_texts, dev_labels = read_glue_tsv(os.path.join(args.data_dir, "dev.tsv"))
    encoder, tokenizer = (AutoModel.from_pretrained(minilm_path()),
                          AutoTokenizer.from_pretrained(minilm_path()))
    out = {name: (mean_pooled_embeddings(encoder, tokenizer, [texts[i] for i in idx], args.max_seq_length),
                  torch.tensor([labels[i] for i in idx])) for name, idx in splits.items()}
    out["dev"] = (mean_pooled_embeddings(encoder, tokenizer, dev_texts, args.max_seq_length),
                  torch.tensor(dev_labels))
    os.makedirs(args.work_dir, exist_ok=True)
    torch.save(out, path)
    return out


class _Rows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"sentence_embedding": self.x[i], "labels": self.y[i]}


def _head_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(sentence_embedding=x)["logits"].argmax(-1) == y).float().mean())


def run_head(pipeline: str, seed: int, args: argparse.Namespace, data: dict, evaluate_on: str) -> dict:
    """One head-only run of ``pipeline`` with the benchmark's settings; accuracy on ``evaluate_on``."""
    from recipes.common.models import MeanPooledClassifier

    x, y = data["train"]
    torch.manual_seed(seed)  # the same classifier initialisation in both pipelines
    model = MeanPooledClassifier(x.shape[1], num_labels=2)
    n = len(y)
    if pipeline == "hf_dpfilter":
        from transformers import default_data_collator

        from hf_dpfilter import DPTrainer, DPTrainingArguments

        training_args = DPTrainingArguments(
            output_dir=os.path.join(args.work_dir, "head"), dp_method="dpsgd", target_epsilon=args.epsilon,
            per_sample_max_grad_norm=args.max_grad_norm, logical_batch_size=args.logical_batch_size,
            per_device_train_batch_size=args.micro_batch_size, num_train_epochs=args.epochs,
            learning_rate=args.learning_rate, lr_scheduler_type="constant", weight_decay=0.0,
            save_strategy="no",
            report_to=[], use_cpu=True, seed=seed, disable_tqdm=True, remove_unused_columns=False,
            logging_steps=10_000)
        trainer = DPTrainer(model=model, args=training_args, train_dataset=_Rows(x, y),
                            data_collator=default_data_collator)
        trainer.train()
        report = trainer.privacy_report()
        row = {"epsilon": report["epsilon"], "noise_multiplier": report["noise_multiplier"],
               "steps": report["steps"]}
    else:
        from opacus import PrivacyEngine
        from opacus.utils.batch_memory_manager import BatchMemoryManager
        from torch.utils.data import DataLoader

        loader = DataLoader(_Rows(x, y), batch_size=args.logical_batch_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        model.train()
        engine = PrivacyEngine(accountant="prv")
        delta = n ** -1.1
        model, optimizer, criterion, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
            target_epsilon=args.epsilon, target_delta=delta, epochs=int(args.epochs),
            max_grad_norm=args.max_grad_norm, grad_sample_mode="ghost")
        steps = 0
        for _ in range(int(args.epochs)):
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.micro_batch_size,
                                    optimizer=optimizer) as memory_safe_loader:
                for batch in memory_safe_loader:
                    optimizer.zero_grad()
                    if batch["labels"].numel() > 0:  # an empty Poisson batch still takes its noisy step
                        loss = criterion(model(sentence_embedding=batch["sentence_embedding"])["logits"],
                                         batch["labels"])
                        loss.backward()
                    else:
                        for p in model.parameters():
                            p.grad = torch.zeros_like(p)
                    steps += not optimizer._check_skip_next_step(pop_next=False)
                    optimizer.step()
        model = model._module
        row = {"epsilon": engine.get_epsilon(delta), "noise_multiplier": optimizer.noise_multiplier,
               "steps": steps}
    row["accuracy"] = _head_accuracy(model, *data[evaluate_on])
    return row


def head_only(args: argparse.Namespace) -> None:
    data = head_features(args)
    if args.tune:
        # the learning rate of both pipelines, chosen for hf_dpfilter on the validation split (3 seeds each)
        for lr in args.tune_grid:
            args.learning_rate = lr
            accs = [run_head("hf_dpfilter", 1000 + s, args, data, "validation")["accuracy"] for s in range(3)]
            print(f"lr {lr:g}: validation accuracy {100 * statistics.mean(accs):.2f}% "
                  f"({', '.join(f'{100 * a:.1f}' for a in accs)})", flush=True)
        return
    for key, pipeline, seed in pending_runs(args, prefix="head "):
        start = time.time()
        row = run_head(pipeline, seed, args, data, "dev")
        row["seconds"] = time.time() - start
        print(key, row, flush=True)
        save_row(args.json, key, row)
    summary(args, prefix="head ")


def pending_runs(args: argparse.Namespace, prefix: str = ""):
    """(key, pipeline, seed) of every paired run not yet in ``args.json`` (re-read, so reruns resume)."""
    for seed in args.seeds:
        for pipeline in args.pipelines:
            key = f"{prefix}{scale_key(args)} {pipeline} seed={seed}"
            if key not in (json.load(open(args.json)) if os.path.exists(args.json) else {}):
                yield key, pipeline, seed


def scale_key(args: argparse.Namespace) -> str:
    return (f"N={args.train_samples} T={args.max_seq_length} B={args.logical_batch_size} "
            f"epochs={args.epochs:g} lr={args.learning_rate:g} C={args.max_grad_norm:g} eps={args.epsilon:g}")


def summary(args: argparse.Namespace, prefix: str = "") -> None:
    results = json.load(open(args.json)) if os.path.exists(args.json) else {}
    prefix = prefix + scale_key(args)
    acc = {p: {int(k.split("seed=")[1]): v["accuracy"] for k, v in results.items()
               if k.startswith(prefix + f" {p} ")} for p in PIPELINES}
    seeds = sorted(set(acc["hf_dpfilter"]) & set(acc["opacus"]))
    print(f"\n{prefix}: {len(seeds)} paired seeds {seeds}")
    if not seeds:
        return
    print("| seed | hf_dpfilter | Opacus | difference (hf_dpfilter - Opacus) |\n|---|---|---|---|")
    for s in seeds:
        a, b = 100 * acc["hf_dpfilter"][s], 100 * acc["opacus"][s]
        print(f"| {s} | {a:.1f}% | {b:.1f}% | {a - b:+.1f} |")
    diffs = [100 * (acc["hf_dpfilter"][s] - acc["opacus"][s]) for s in seeds]

    def mean_std(values):
        return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))

    for name in PIPELINES:
        m, s = mean_std([100 * acc[name][k] for k in seeds])
        print(f"{name}: {m:.2f} +- {s:.2f} %")
    m, s = mean_std(diffs)
    half = {3: 4.303, 4: 3.182, 5: 2.776}.get(len(seeds), 2.09)  # t(0.975, n - 1); 2.09 for n = 20
    print(f"paired difference: {m:+.2f} +- {s:.2f} points (standard error {s / math.sqrt(len(seeds)):.2f}; "
          f"95% interval about {m - half * s / math.sqrt(len(seeds)):+.2f} to "
          f"{m + half * s / math.sqrt(len(seeds)):+.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="SST-2 folder (default: ../shared/data/glue/SST-2)")
    parser.add_argument("--train_samples", type=int, default=2048)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--logical_batch_size", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--max_grad_norm", type=float, default=0.1)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0], help="--check: plans to "
        "print")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    parser.add_argument("--data_seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="deterministic checks only")
    parser.add_argument("--head_only", action="store_true", help="level 1: linear head on frozen MiniLM "
        "embeddings")
    parser.add_argument("--validation_samples", type=int, default=1024, help="--head_only: the validation "
        "split")
    parser.add_argument("--tune", action="store_true", help="--head_only: learning rates on the validation "
                                                            "split")
    parser.add_argument("--tune_grid", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    parser.add_argument("--summary", action="store_true", help="summarize the finished runs only")
    parser.add_argument("--json", default="benchmarks/results/opacus_parity.json")
    parser.add_argument("--work_dir", default="outputs/opacus_parity")
    args = parser.parse_args(argv)
    args.data_dir = sst2_dir(args.data_dir)
    args.full = False
    args.settings = []
    torch.set_num_threads(args.threads)
    if args.check:
        print_plans(args)
        check_gradients(args)
        return
    if args.head_only:
        head_only(args)
        return
    if args.summary:
        summary(args)
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train, dev = load_data(args, tokenizer)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    for key, pipeline, seed in pending_runs(args):
        args.seed = seed
        start = time.time()
        if pipeline == "opacus":
            row = run_opacus(args.epsilon, args, train, dev, tokenizer)
        else:
            row = run_hf_dpfilter("dpsgd", args.epsilon, args, train, dev, tokenizer)
        row["wall_seconds"] = time.time() - start
        print(key, {k: row[k] for k in ("accuracy", "epsilon", "noise_multiplier", "seconds")}, flush=True)
        save_row(args.json, key, row)
    summary(args)

