"""The one set-up the benchmarks share: paths, devices, models, data, and the timing and memory measurements.

* models: GPT-2 (tied, untied, medium, large) and RoBERTa (base, large) from their configs (random weights,
  nothing downloaded), full or LoRA (:func:`build_model`, :class:`Case`, :func:`make_batch`); the packaged
  pretrained MiniLM for the utility benchmarks (:func:`minilm_path`);
* data: SST-2 in the GLUE TSV layout (:func:`sst2_dir`, :func:`read_glue_tsv`), E2E for the recipe benchmark;
* time: :func:`time_interleaved` runs the variants interleaved (A, B, C, A, B, C, ...) after their warm-up and
  reports the median over rounds of each variant's per-round ratio to the first, which cancels most of the
  drift of a shared machine (every time ratio the docs quote is measured this way);
* memory: peak RSS of a process since a reset (:func:`reset_peak_rss`, :func:`peak_rss_kb`) on CPU,
  ``torch.cuda.max_memory_allocated`` on GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # recipes.common (data, models) lives in the checkout, beside the package
    sys.path.insert(0, ROOT)

from recipes.common.data import read_glue_tsv  # noqa: E402
from recipes.common.models import packaged_model_path as minilm_path  # noqa: E402

__all__ = [
    "DEFAULT_DATA", "NUM_LABELS", "ROOT", "SETTINGS", "Case", "Step", "autocast", "build_model",
    "current_rss_kb",
    "device", "e2e_dir", "make_batch", "minilm_path", "peak_rss_kb", "read_glue_tsv", "reset_peak_rss",
    "sst2_dir", "synchronize", "time_interleaved", "time_rechecks", "trainable", "write_json", "PadCollator",
]

#: the data sets the benchmarks read, relative to the repository root (where the benchmarks are run from)
DEFAULT_DATA = "../shared/data"

NUM_LABELS = 2
#: where and in what precision the steps run (set once by main(); memory workers get it on their command line)
SETTINGS = {"device": "cpu", "bf16": False}


# --------------------------------------------------------------------------------------------- devices
def device() -> torch.device:
    return torch.device(SETTINGS["device"])


def autocast() -> contextlib.AbstractContextManager:
    """bf16 autocast around a forward (weights stay fp32), or nothing."""
    if SETTINGS["bf16"]:
        return torch.autocast(device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize() -> None:
    """Wait for the GPU, so that a wall-clock interval covers the kernels launched in it."""
    if device().type == "cuda":
        torch.cuda.synchronize()


class PadCollator:
    """Right-pads ``input_ids`` to the batch's longest example, with an attention mask and the examples'
    ``labels`` (``DataCollatorWithPadding``'s output: dynamic padding)."""

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.zeros((len(examples), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(examples):
            ids[i, : len(e["input_ids"])], mask[i, : len(e["input_ids"])] = torch.as_tensor(e["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([e["labels"] for e in examples], dtype=torch.long)}


def time_rechecks(trainer: Any, record: Callable[[float], None]) -> bool:
    """Time a DPTrainer's re-checks where they run: ``record(seconds)`` after each (CUDA-synchronized). The
    checks' instance is built at the trainer's first step, so call it after that step; False while there is
    none yet (or the checks are off), True once wrapped (a second call leaves the first wrapper in place)."""
    checks = getattr(trainer, "_separation", None)
    if checks is None:
        return False
    if getattr(checks, "_timed", False):
        return True
    recheck = checks.recheck

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            recheck(*args, **kwargs)
        finally:
            synchronize()
            record(time.perf_counter() - start)

    checks.recheck, checks._timed = timed, True
    return True


# --------------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Case:
    model: str  # "gpt2", "gpt2-untied" or "roberta"
    mode: str  # "full" or "lora"
    batch: int
    seq: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.mode} B={self.batch} T={self.seq}"


def build_model(name: str, mode: str, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, RobertaConfig, RobertaForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    # Tiny architectures for a self-test of the script (HF_DPFILTER_BENCH_TINY=1); never for the numbers.
    tiny = os.environ.get("HF_DPFILTER_BENCH_TINY") == "1"
    small = {"n_layer": 2, "n_embd": 64, "n_head": 4} if tiny else {}
    small_bert = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "intermediate_size": 128}
    gpt2_sizes = {"gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
                  "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20}}
    roberta_large = {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                     "intermediate_size": 4096}
    if name.startswith("gpt2"):
        model = GPT2LMHeadModel(GPT2Config(**(small if tiny else gpt2_sizes.get(name, {}))))
        if name == "gpt2-untied":
            model.config.tie_word_embeddings = False
            model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    elif name in ("roberta", "roberta-large"):
        size = small_bert if tiny else (roberta_large if name == "roberta-large" else {})
        model = RobertaForSequenceClassification(RobertaConfig(num_labels=NUM_LABELS, **size))
    else:
        raise ValueError(f"unknown model {name!r}")
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        if name.startswith("gpt2"):
            config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                                lora_dropout=0.0)
        else:
            config = LoraConfig(
                r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0,
                modules_to_save=["classifier"]
            )
        model = get_peft_model(model, config)
    model.train()
    return model.to(device())


def make_batch(case: Case, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
    g = torch.Generator().manual_seed(seed)
    causal = case.model.startswith("gpt2")
    ids = torch.randint(3, 50257, (case.batch, case.seq), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if case.model == "gpt2-untied":
        inputs["position_ids"] = torch.arange(case.seq).expand(case.batch, -1).contiguous()
    labels = ids.clone() if causal else torch.randint(0, NUM_LABELS, (case.batch,), generator=g)
    return {k: v.to(device()) for k, v in inputs.items()}, labels.to(device()), causal


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


Step = Callable[[], float]  # runs one step; returns the seconds spent before optimizer.step()


# ------------------------------------------------------------------------------------------------ data
def sst2_dir(data_dir: str | None = None) -> str:
    """The SST-2 folder (``train.tsv``, ``dev.tsv``): ``data_dir`` itself if it holds them, else its
    ``glue/SST-2``; default ``$HF_DPFILTER_DATA`` or ``../shared/data``."""
    base = data_dir or os.environ.get("HF_DPFILTER_DATA", DEFAULT_DATA)
    for candidate in (base, os.path.join(base, "glue", "SST-2")):
        if os.path.isfile(os.path.join(candidate, "train.tsv")):
            return candidate
    raise SystemExit(f"SST-2 not found in {base!r} (expected train.tsv and dev.tsv, or glue/SST-2 below it).")


def e2e_dir(data_dir: str | None = None) -> str:
    """The E2E folder of the recipe benchmark: ``data_dir``, else ``../shared/data/e2e`` or
    ``shared/data/e2e``."""
    if data_dir:
        return data_dir
    for candidate in (os.path.join(DEFAULT_DATA, "e2e"), os.path.join("shared", "data", "e2e")):
        if os.path.isdir(candidate):
            return candidate
    return os.path.join(DEFAULT_DATA, "e2e")


def write_json(path: str, payload: Any) -> None:
    """Write ``payload`` to ``path`` (folders created), so a run killed later keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


# ---------------------------------------------------------------------------------------------- memory
def current_rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ time
def time_interleaved(steps: dict[str, Step], rounds: int) -> dict[str, dict]:
    """Median over rounds of each variant's time and of its per-round ratio to the first variant."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    grad_times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            synchronize()
            t0 = time.perf_counter()
            grad_times[n].append(steps[n]())
            synchronize()
            times[n].append(time.perf_counter() - t0)
    ref, grad_ref = times[names[0]], grad_times[names[0]]
    return {
        n: {
            "time_s": statistics.median(ts),
            "ratio": statistics.median(t / r for t, r in zip(ts, ref)),
            "ratios": [t / r for t, r in zip(ts, ref)],
            "grad_ratio": statistics.median(t / r for t, r in zip(grad_times[n], grad_ref)),
        }
        for n, ts in times.items()
    }
