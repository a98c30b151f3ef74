"""Speed and memory of a private training step against the non-private one (and Opacus 1.6).

Models: GPT-2 small (124M, tied embeddings, ``GPT2Config()``) and RoBERTa-base (``RobertaConfig()``,
sequence classification), random weights (no download), float32, train mode (dropout on), AdamW.
Each is trained fully and with LoRA (peft, r=8 on the attention projections).

Variants of one training step on the same micro-batch:

* ``non-private`` -- what ``Trainer.training_step`` + the optimizer step do: forward with labels,
  ``loss.backward()``, ``AdamW.step()``, ``zero_grad()``.
* ``hf_dpfilter`` -- the path ``DPTrainer`` takes: ``DPOptimizer.accumulate(engine, loss_fn, B)`` (one
  forward, one backward to the layer outputs, ghost norms, clipped sums by book-keeping) and
  ``DPOptimizer.step()`` (noise + AdamW). The first-step verification runs in the warm-up step only.
* ``opacus ghost`` -- Opacus 1.6 ``make_private(..., grad_sample_mode="ghost")`` (its per-sample hooks if
  ghost mode fails). Opacus refuses GPT-2's tied embeddings; the table reports that and adds a row
  ``gpt2-untied`` (separate ``lm_head`` copy, explicit ``(B, T)`` position ids) for the comparison.

Time: after one warm-up step per variant, the variants run interleaved (A, B, C, A, B, C, ...) in one
process; the reported ratio is the median over rounds of ``time(variant) / time(non-private)`` of that
round, which cancels most of the drift of a shared machine. Memory: every variant runs in its own
subprocess (``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB so freed tensors go back to the OS); after building
the model and one warm-up step, the peak-RSS counter is reset (``/proc/self/clear_refs``) and two more
steps run. Reported: peak RSS of those steps minus the RSS after model build, i.e. gradients, optimizer
state, activations and every temporary of a steady-state step (the weights themselves are excluded).

GPU (``--device cuda``): the model, batch and optimizers live on the GPU; ``--bf16`` runs every forward
under ``torch.autocast("cuda", dtype=torch.bfloat16)`` (weights stay fp32, as with ``Trainer(bf16=True)``).
Each timed step is bracketed by ``torch.cuda.synchronize()``; the interleaving and the per-round median
ratio are the same as on CPU. Memory = ``torch.cuda.max_memory_allocated()`` over two steady-state steps
(after a warm-up step and ``reset_peak_memory_stats``) minus the memory allocated after building the
model (its weights), each variant in its own process. Without ``--points``, the CUDA cases are those of
the table in the GPU issue: RoBERTa-base/large full B=32 T=128, RoBERTa-base LoRA, GPT-2 small (tied and
untied) full and LoRA B=16 T=512, GPT-2 medium/large full B=8 T=512, GPT-2 small full B=8 T=1024; the
methods run on RoBERTa-base full B=32 T=128.

Usage::

    python -m benchmarks speed-memory              # default points (~10-15 min on 2 idle cores)
    python -m benchmarks speed-memory --quick      # smoke version (1-2 min)
    python -m benchmarks speed-memory --out docs/performance.md
    python -m benchmarks speed-memory --device cuda --bf16 --out docs/performance.md   # H100, bf16 autocast
    python -m benchmarks speed-memory --device cuda --cases roberta:full:32x128 --out docs/performance.md  # fp32
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.common import (
    ROOT,
    SETTINGS,
    Case,
    Step,
    autocast,
    build_model,
    current_rss_kb,
    device,
    make_batch,
    peak_rss_kb,
    reset_peak_rss,
    synchronize,
    time_interleaved,
    trainable,
)
from benchmarks.generated_markers import BEGIN, BEGIN_CUDA, END, END_CUDA, replace_between
from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers import available_methods, make_dp_optimizer

LR = 1e-5
NOISE = 1.0
CLIP = 1.0
#: the cases of the GPU issue's table (model, mode, batch, tokens)
CUDA_CASES = [
    ("roberta", "full", 32, 128), ("roberta-large", "full", 32, 128), ("roberta", "lora", 32, 128),
    ("gpt2", "full", 16, 512), ("gpt2-untied", "full", 16, 512), ("gpt2", "lora", 16, 512),
    ("gpt2-medium", "full", 8, 512), ("gpt2-large", "full", 8, 512), ("gpt2", "full", 8, 1024),
]


# ------------------------------------------------------------------------------------------ set-ups
def nonprivate_step(model: nn.Module, inputs: dict, labels: torch.Tensor) -> Step:
    opt = torch.optim.AdamW(trainable(model), lr=LR)

    def step() -> float:
        synchronize()
        t0 = time.perf_counter()
        with autocast():
            loss = model(**inputs, labels=labels).loss
        loss.backward()
        synchronize()
        elapsed = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return elapsed

    return step


def hf_dpfilter_step(
    model: nn.Module, inputs: dict, labels: torch.Tensor, causal: bool, method: str = "dpsgd",
    keyed: bool = True,
    **method_kwargs
) -> tuple[Step, object]:
    """The DP step; ``keyed=False``: dropout drawn from the shared stream (the step before keyed dropout, for
    measuring its cost only: it is not private)."""
    engine = GhostClippingEngine(model, verify_first_backward=True)
    opt = make_dp_optimizer(
        trainable(model), base=torch.optim.AdamW, method=method, lr=LR, noise_multiplier=NOISE,
        per_sample_max_grad_norm=CLIP, expected_batch_size=labels.shape[0], sample_rate=0.01, seed=0, **method_kwargs,
    )  # fmt: skip

    def loss_fn(values):
        with autocast():
            out = engine.call_model(values, **inputs)
        return per_example_loss(out.logits.float(), labels, causal_lm=causal)

    # one example's rows: all of the same length, so a slice is it collated alone
    def loss_fn_of(rows: slice):
        def one_loss_fn(values):
            with autocast():
                out = engine.call_model(values, **{k: v[rows] for k, v in inputs.items()})
            return per_example_loss(out.logits.float(), labels[rows], causal_lm=causal)

        return one_loss_fn

    keys = [row for row in inputs["input_ids"]]  # rows of one length: each row is its example's content

    def step() -> float:
        synchronize()
        t0 = time.perf_counter()
        with contextlib.nullcontext() if keyed else _shared_stream_dropout():
            # DIFF2's batch-invariant difference rounds: each example on its own
            if opt.wants_examples_alone():
                for i in range(labels.shape[0]):
                    opt.accumulate(engine, loss_fn_of(slice(i, i + 1)), 1, alone=True,
                                   example_keys=keys[i:i + 1])
            else:
                opt.accumulate(engine, loss_fn, labels.shape[0], example_keys=keys)
        synchronize()
        elapsed = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return elapsed

    return step, opt


@contextlib.contextmanager
def _shared_stream_dropout():
    """Dropout from torch's global stream, as before keyed dropout (benchmark only: not private)."""
    from hf_dpfilter.optimizers import base

    keyed = base.keyed_step
    base.keyed_step = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        base.keyed_step = keyed


def keyed_dropout_cost(case: Case, rounds: int, log) -> dict:
    """The DP step with dropout keyed to each example against the same step with dropout from the shared
    stream (interleaved; median of the per-round ratios)."""
    inputs, labels, causal = make_batch(case)
    steps = {}
    for name, keyed in (("keyed", True), ("shared", False)):
        model = build_model(case.model, case.mode)
        steps[name] = hf_dpfilter_step(model, inputs, labels, causal, keyed=keyed)[0]
        steps[name]()
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(step())
    ratio = statistics.median(k / s for k, s in zip(times["keyed"], times["shared"]))
    row = {"case": case.label, "keyed_s": statistics.median(times["keyed"]),
           "shared_s": statistics.median(times["shared"]), "ratio": ratio}
    row.update(dropout_masks_cost(build_model(case.model, case.mode), inputs, rounds))
    log(f"  keyed dropout {row['keyed_s']:.3f}s, shared-stream dropout {row['shared_s']:.3f}s: {ratio:.3f}x; "
        f"the forward's dropout alone: keyed {row['masks_keyed_ms']:.1f} ms, torch's "
        f"{row['masks_shared_ms']:.1f} ms")
    return row


def dropout_masks_cost(model: nn.Module, inputs: dict, rounds: int) -> dict:
    """The dropout of one training forward alone, keyed masks against torch's ``F.dropout``: the part of the
    step that keyed dropout changes, timed without the rest of the step's noise (median over ``rounds``)."""
    from torch.overrides import TorchFunctionMode

    from hf_dpfilter.randomness.example_keys import keyed_mask

    shapes: list[tuple[int, ...]] = []

    class _Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
                shapes.append(tuple(args[0].shape))
            elif func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0):
                query, key = args[0], args[1]
                shapes.append((*query.shape[:-1], key.shape[-2]))
            return func(*args, **kwargs)

    model.train()
    with torch.no_grad(), _Record():
        model(**inputs)
    seeds = torch.arange(1, shapes[0][0] + 1, dtype=torch.int64) if shapes else torch.zeros(0,
                                                                                            dtype=torch.int64)
    values = [torch.ones(shape) for shape in shapes]

    def keyed() -> None:
        for value in values:
            keep = keyed_mask(value.shape, seeds[: value.shape[0]], 7, 0.1, False, value.device)
            value * keep.to(value.dtype) * (1 / 0.9)

    def shared() -> None:
        for value in values:
            F.dropout(value, 0.1, True)

    times: dict[str, list[float]] = {"keyed": [], "shared": []}
    keyed(), shared()
    for _ in range(rounds):
        for name, run in (("keyed", keyed), ("shared", shared)):
            begin = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - begin)
    return {"dropout_calls": len(shapes), "masks_keyed_ms": 1e3 * statistics.median(times["keyed"]),
            "masks_shared_ms": 1e3 * statistics.median(times["shared"])}


def opacus_step(model: nn.Module, inputs: dict, labels: torch.Tensor, causal: bool) -> tuple[Step, str]:
    """Opacus 1.6 on the same model: ghost clipping if it runs, else its per-sample hooks."""
    from opacus import PrivacyEngine

    batch = labels.shape[0]
    data = torch.utils.data.TensorDataset(torch.zeros(batch * 4, 1))
    errors = []
    for mode in ("ghost", "hooks"):
        candidate = copy.deepcopy(model)
        opt = torch.optim.AdamW(trainable(candidate), lr=LR)
        loader = torch.utils.data.DataLoader(data, batch_size=batch)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = PrivacyEngine(accountant="prv")
                kwargs = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
                made = engine.make_private(
                    module=candidate, optimizer=opt, data_loader=loader, noise_multiplier=NOISE,
                    max_grad_norm=CLIP, grad_sample_mode=mode, poisson_sampling=False, **kwargs,
                )  # fmt: skip
            dp_model, dp_opt = made[0], made[1]
            criterion = made[2] if mode == "ghost" else nn.CrossEntropyLoss()

            def step(dp_model=dp_model, dp_opt=dp_opt, criterion=criterion, mode=mode) -> float:
                synchronize()
                t0 = time.perf_counter()
                with autocast():
                    logits = dp_model(**inputs).logits.float()
                if causal:
                    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
                    target = labels[:, 1:].reshape(-1)
                    if mode == "ghost":
                        loss = criterion(flat, target, shape=(batch, logits.shape[1] - 1, logits.shape[-1]))
                    else:
                        loss = criterion(flat, target)
                else:
                    loss = criterion(logits, labels)
                loss.backward()
                synchronize()
                elapsed = time.perf_counter() - t0
                dp_opt.step()
                dp_opt.zero_grad(set_to_none=True)
                return elapsed

            step()  # fail here, not in the timed loop
            # Forget the trial step's optimizer state so that a memory measurement sees it being created.
            dp_opt.zero_grad(set_to_none=True)
            opt.state.clear()
            return step, mode
        except Exception as err:  # noqa: BLE001 - report why Opacus cannot run this model
            errors.append(f"{mode}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
    raise RuntimeError("; ".join(errors))


def build_variant(name: str, case: Case) -> tuple[Step, str]:
    """A ready-to-time step for one variant; the note says how it ran."""
    model = build_model(case.model, case.mode)
    inputs, labels, causal = make_batch(case)
    if name == "non-private":
        return nonprivate_step(model, inputs, labels), ""
    if name == "hf_dpfilter":
        return hf_dpfilter_step(model, inputs, labels, causal)[0], ""
    if name == "opacus":
        step, mode = opacus_step(model, inputs, labels, causal)
        return step, mode
    raise ValueError(name)


# ------------------------------------------------------------------------------------------ measuring
def memory_worker(variant: str, case: Case) -> dict:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    baseline = None
    try:
        if device().type == "cuda":
            step, note = build_variant(variant, case)
            synchronize()
            weights = torch.cuda.memory_allocated()
            step()  # warm-up: Adam state, first-step verification, Opacus set-up
            synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                step()
            synchronize()
            return {"peak_mb": (torch.cuda.max_memory_allocated() - weights) / 2**20, "note": note,
                    "reset": True,
                    "model_mb": weights / 2**20}
        model_rss = current_rss_kb()
        step, note = build_variant(variant, case)
        baseline = current_rss_kb()
        step()  # warm-up: Adam state, first-step verification, Opacus set-up
        reset = reset_peak_rss()
        for _ in range(2):
            step()
        peak = peak_rss_kb()
        return {
            "peak_mb": (peak - baseline) / 1024,
            "note": note,
            "reset": reset,
            "model_mb": (baseline - model_rss) / 1024,
        }
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def measure_memory(variant: str, case: Case, timeout: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "benchmarks", "speed-memory", "--_memory_worker",
           json.dumps([variant, case.__dict__, SETTINGS])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"worker failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}


# ------------------------------------------------------------------------------------------ the run
def run_case(case: Case, rounds: int, memory: bool, opacus: bool, timeout: float, log) -> list[dict]:
    """Rows for one (model, mode, B, T): the variants' times and memory, with ratios to non-private."""
    variants = ["non-private", "hf_dpfilter"] + (["opacus"] if opacus else [])
    steps: dict[str, Step] = {}
    notes: dict[str, str] = {}
    for v in variants:
        try:
            step, note = build_variant(v, case)
            step()  # warm-up (and, for hf_dpfilter, the first-step verification)
            steps[v], notes[v] = step, note
        except Exception as err:  # noqa: BLE001
            notes[v] = f"not run: {str(err)[:200]}"
            log(f"  {v}: {notes[v]}")
    timing = time_interleaved(steps, rounds) if "non-private" in steps else {}
    mem: dict[str, dict] = {}
    if memory:
        for v in steps:
            mem[v] = measure_memory(v, case, timeout)
            if "error" in mem[v]:
                log(f"  memory {v}: {mem[v]['error']}")
    rows = []
    base_mem = mem.get("non-private", {}).get("peak_mb")
    for v in variants:
        row = {"case": case.label, "variant": v, "note": notes.get(v, "")}
        if v in timing:
            row.update(
                time_s=timing[v]["time_s"],
                time_ratio=timing[v]["ratio"],
                ratios=timing[v]["ratios"],
                grad_ratio=timing[v]["grad_ratio"],
            )
        if v in mem and "peak_mb" in mem[v]:
            row["peak_mb"] = mem[v]["peak_mb"]
            if base_mem:
                row["mem_ratio"] = mem[v]["peak_mb"] / base_mem
        rows.append(row)
        log("  " + format_row(row))
    for s in list(steps):
        del steps[s]
    return rows


def method_overheads(case: Case, rounds: int, log, only: list[str] | None = None) -> list[dict]:
    """DiSK / DOPPLER / DiceSGD / DIFF2 step cost and DP-PMLF's k-point cost, against DP-SGD, interleaved.

    DIFF2 alternates restart rounds (one gradient point) and difference rounds (two); its median over the
    rounds is a difference round's cost (restart_every = 10); ``diff2 float64`` is its float64 route.
    ``only``: the methods to run (with DP-SGD), each model held at once (RoBERTa-base with AdamW: about 2 GB
    each)."""
    methods = available_methods()
    wanted = [("dpsgd", {}), ("disk", {}), ("doppler", {}), ("pmlf", {"k": 2}), ("pmlf", {"k": 3}),
              ("dicesgd", {}),
              ("diff2", {}), ("diff2", {"difference_precision": "float64"})]
    wanted = [(m, kw) for m, kw in wanted if m in methods and (only is None or m == "dpsgd" or m in only)]
    inputs, labels, causal = make_batch(case)
    runners = {}
    for method, kwargs in wanted:
        name = method + "".join(f" k={v}" if k == "k" else f" {v}" for k, v in kwargs.items())
        model = build_model(case.model, case.mode)
        # DIFF2's C2 has no default; its value does not change the cost (one clip factor per example)
        settings = {"difference_max_grad_norm": 2.0, **kwargs} if method == "diff2" else kwargs
        step, opt = hf_dpfilter_step(model, inputs, labels, causal, method=method, method_args=settings)
        step()
        runners[name] = (step, opt)
    # Time the whole step and, within it, the optimizer step (noise + filter + AdamW on the real clipped
    # sums).
    total: dict[str, list[float]] = {n: [] for n in runners}
    opt_only: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(rounds):
        for n, (step, _opt) in runners.items():
            synchronize()
            t0 = time.perf_counter()
            grad_seconds = step()  # accumulate (timed inside) + optimizer.step() on the real clipped sums
            synchronize()
            total[n].append(time.perf_counter() - t0)
            opt_only[n].append(total[n][-1] - grad_seconds)
    rows = []
    ref_total, ref_opt = total["dpsgd"], opt_only["dpsgd"]
    for n in runners:
        extra_opt = statistics.median((o - r) / t for o, r, t in zip(opt_only[n], ref_opt, ref_total))
        row = {
            "case": case.label,
            "method": n,
            "step_s": statistics.median(total[n]),
            "step_ratio": statistics.median(t / r for t, r in zip(total[n], ref_total)),
            "opt_step_s": statistics.median(opt_only[n]),
            "opt_extra_frac": extra_opt,
        }
        rows.append(row)
        log(
            f"  {n:10s} step {row['step_s']:.2f}s ({row['step_ratio']:.2f}x dpsgd); optimizer step "
            f"{row['opt_step_s']:.3f}s, extra vs dpsgd = {100 * extra_opt:+.1f}% of a training step"
        )
    return rows


def format_row(row: dict) -> str:
    t = (f"{row['time_s']:.2f}s ({row['time_ratio']:.2f}x, fwd+bwd {row['grad_ratio']:.2f}x)"
         if "time_s" in row else "-")
    m = f"{row['peak_mb']:.0f} MB ({row['mem_ratio']:.2f}x)" if "mem_ratio" in row else (
        f"{row['peak_mb']:.0f} MB" if "peak_mb" in row else "-")  # fmt: skip
    return f"{row['case']:28s} {row['variant']:12s} time {t:34s} memory {m:18s} {row['note']}"


def _cell(row: dict, key: str, fmt: str) -> str:
    return fmt.format(row[key]) if key in row else "-"


def markdown(rows: list[dict], method_rows: list[dict], command: str, elapsed: float,
             threads: str = "") -> str:
    threads = threads or str(torch.get_num_threads())
    if device().type == "cuda":
        machine = (f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                   f"{'bf16 autocast (fp32 weights)' if SETTINGS['bf16'] else 'float32'}, dropout on, AdamW. "
                   f"Run time {elapsed / 60:.1f} min.")
        memory = ("Memory = `torch.cuda.max_memory_allocated()` of two steady-state steps minus the memory "
                  "allocated after model build (the weights), each variant in its own process.")
    else:
        machine = (f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
                   f"({threads} torch threads), float32, dropout on, AdamW. Run time {elapsed / 60:.1f} min "
                   "(summed over the runs merged here).")
        memory = ("Memory = peak RSS of two steady-state steps minus the RSS after model build "
                  "(gradients, optimizer state, activations, temporaries), each variant in its own process.")
    lines = [
        "## Measured: private vs non-private training steps" + (" (GPU)" if device().type == "cuda" else ""),
        "",
        "Generated by `python -m benchmarks speed-memory` (benchmarks/speed_memory.py; its docstring has the "
        "method). Command:",
        "",
        f"    {command}",
        "",
        machine,
        "",
        "Time = median seconds per step; ratio = median over interleaved rounds of time / non-private time "
        "of the same round. fwd+bwd ratio = the same for the part before `optimizer.step()` (forward, "
        "backward, clipping): the per-micro-batch cost under gradient accumulation, where the noise and "
        "AdamW cost of `step()` is paid once per logical batch. " + memory,
        "",
        "| model / mode / batch | variant | time per step | time ratio | fwd+bwd ratio | peak memory | "
        "memory ratio | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            _cell(r, "time_s", "{:.2f} s"),
            _cell(r, "time_ratio", "{:.2f}x"),
            _cell(r, "grad_ratio", "{:.2f}x"),
            _cell(r, "peak_mb", "{:.0f} MB"),
            _cell(r, "mem_ratio", "{:.2f}x"),
        ]
        lines.append(f"| {r['case']} | {r['variant']} | {' | '.join(cells)} | {r['note']} |")
    if method_rows:
        lines += [
            "",
            "## DP methods (same engine), relative to DP-SGD",
            "",
            "`optimizer-step extra` = (the method's `optimizer.step()` time - DP-SGD's) / DP-SGD's whole "
            "training step (noise + filter + AdamW on the step's real clipped sums). DP-PMLF with k points "
            "runs k forwards at k parameter snapshots, so its step ratio should be about k (the backward is "
            "shared).",
            "",
            "| model / mode / batch | method | step time | step ratio to DP-SGD | optimizer step | "
            "optimizer-step extra |",
            "|---|---|---|---|---|---|",
        ]
        for r in method_rows:
            lines.append(
                f"| {r['case']} | {r['method']} | {r['step_s']:.2f} s | {r['step_ratio']:.2f}x | "
                f"{r['opt_step_s']:.3f} s | {100 * r['opt_extra_frac']:+.1f}% |"
            )
    return "\n".join(lines) + "\n"




def write_markdown(path: str, text: str) -> None:
    """Write the tables into ``path``; if it has the GENERATED markers, replace only what is between them.

    CPU runs fill the CPU markers, CUDA runs the CUDA ones; a CUDA run never overwrites a file without them.
    """
    begin, end = (BEGIN_CUDA, END_CUDA) if device().type == "cuda" else (BEGIN, END)
    if device().type == "cuda":
        replace_between(path, begin, end, text)
        return
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if BEGIN in old and END in old:
            head, rest = old.split(BEGIN, 1)
            text = head + BEGIN + "\n" + text + rest[rest.index(END) :]
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke version: small points, 2 rounds (1-2 min)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds after warm-up")
    parser.add_argument("--models", default="gpt2,roberta", help="comma-separated: gpt2, roberta")
    parser.add_argument("--modes", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--points", default=None, help="B x T points, e.g. '4x128,2x256'")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--no-opacus", action="store_true", help="skip Opacus")
    parser.add_argument("--no-methods", action="store_true", help="skip the DiSK/DOPPLER/DP-PMLF section")
    parser.add_argument("--only-methods", action="store_true", help="run only the DiSK/DOPPLER/DP-PMLF "
        "section")
    parser.add_argument("--keyed-dropout", action="store_true",
                        help="run only the cost of keyed dropout: the DP step against its shared-stream form")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the methods section (dpsgd is always run), e.g. "
                             "'diff2'")
    parser.add_argument("--out", default=None,
                        help="write the markdown table here (e.g. docs/performance.md)")
    parser.add_argument("--json", default=None, help="also write the raw rows as JSON here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per memory subprocess")
    parser.add_argument(
        "--from-json", default=None, help="comma-separated JSON files of earlier runs: merge them into one "
                                          "table"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the steps run")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for every forward (weights stay "
                                                            "fp32)")
    parser.add_argument(
        "--cases", default=None,
        help="explicit cases 'model:mode:BxT,...' (e.g. 'roberta:full:32x128,gpt2:lora:16x512'); "
        "default on CUDA: the GPU issue's table; on CPU: --models x --modes x --points",
    )
    parser.add_argument("--_memory_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False).")
    SETTINGS.update(device=args.device, bf16=args.bf16)

    if args.from_json:
        rows, method_rows, commands, elapsed, threads = [], [], [], 0.0, set()
        for path in args.from_json.split(","):
            with open(path) as f:
                saved = json.load(f)
            rows += saved["rows"]
            method_rows += saved["methods"]
            commands.append(saved.get("command", "?"))
            elapsed += saved.get("elapsed", 0.0)
            threads.add(str(saved.get("threads", "?")))
        text = markdown(rows, method_rows, "\n    ".join(commands), elapsed, "/".join(sorted(threads)))
        print(text)
        if args.out:
            write_markdown(args.out, text)
        return 0

    if args._memory_worker:
        variant, fields, settings = json.loads(args._memory_worker)
        SETTINGS.update(settings)
        print("RESULT " + json.dumps(memory_worker(variant, Case(**fields))), flush=True)
        return 0

    warnings.filterwarnings("ignore")
    points = args.points or ("2x64" if args.quick else "4x128,2x256")
    rounds = args.rounds or (2 if args.quick else (10 if args.device == "cuda" else 3))
    pts = [tuple(int(x) for x in p.split("x")) for p in points.split(",")]
    models = args.models.split(",")
    modes = args.modes.split(",")
    cases = []
    if args.cases or (args.device == "cuda" and not args.points):
        explicit = [c.split(":") for c in args.cases.split(",")] if args.cases else None
        for model, mode, b, t in (
            [(m, mode, *(int(x) for x in bt.split("x"))) for m, mode, bt in explicit] if explicit
            else CUDA_CASES
        ):
            cases.append(Case(model, mode, b, t))
        pts = [(cases[0].batch, cases[0].seq)] if explicit else [(32, 128)]
    else:
        for model in models:
            for mode in modes:
                for b, t in pts if mode == "full" else pts[:1]:
                    cases.append(Case(model, mode, b, t))
                    if model == "gpt2" and mode == "full" and not args.no_opacus and (b, t) == pts[0]:
                        cases.append(Case("gpt2-untied", mode, b, t))

    def log(msg: str) -> None:
        print(msg, flush=True)

    start = time.perf_counter()
    command = "python -m benchmarks speed-memory " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    method_rows: list[dict] = []

    def save_json() -> None:
        # after every case: a run killed later (out of memory, time limit) keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "methods": method_rows, "command": command.strip(),
                           "threads": torch.get_num_threads(),
                           "elapsed": time.perf_counter() - start}, f, indent=1)

    if args.keyed_dropout:  # the cost of keyed dropout only
        keyed_rows = []
        for case in cases:
            log(f"== keyed dropout on {case.label}")
            keyed_rows.append(keyed_dropout_cost(case, rounds, log))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"keyed_dropout": keyed_rows, "command": command.strip(),
                           "threads": torch.get_num_threads()}, f, indent=1)
        return 0
    for case in [] if args.only_methods else cases:
        log(f"== {case.label}")
        try:
            rows += run_case(case, rounds, not args.no_memory, not args.no_opacus, args.timeout, log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        gc.collect()  # the case's models and optimizers are garbage now; free them before the next case
        save_json()
    if not args.no_methods:
        case = Case("roberta", "full", *pts[0])
        log(f"== DP methods on {case.label}")
        try:
            method_rows = method_overheads(case, rounds, log,
                                           args.methods.split(",") if args.methods else None)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
    elapsed = time.perf_counter() - start
    save_json()
    text = markdown(rows, method_rows, command.strip(), elapsed)
    print()
    print(text)
    if args.out:
        write_markdown(args.out, text)
    return 0

