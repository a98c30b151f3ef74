"""Shared test utilities: tiny data sets, collators, per-example reference gradients in float64."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset

from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors


def freeze_imported_objects() -> None:
    """Take the objects alive now (the imported modules) out of the garbage collector, for worker processes.

    Trainer.train() starts with a full gc.collect() (accelerate's free_memory), which walks every object of
    the process; the modules of torch and transformers are most of them and are never garbage. Freezing them
    leaves each collection only the objects created afterwards (tests/conftest.py does the same for
    pytest)."""
    gc.collect()
    gc.freeze()


@functools.cache
def script_help(script: str) -> subprocess.CompletedProcess:
    """``python <script> --help`` (``script``: a path from the checkout root), started as a user would from
    another directory, with nothing on PYTHONPATH.

    Run once per test session: each run starts an interpreter that imports torch and transformers (~6 CPU s),
    and tests/apps/test_application_layout.py, tests/apps/test_recipes.py and
    tests/apps/test_readme_commands.py all check the same run."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as elsewhere:
        return subprocess.run([sys.executable, str(root / script), "--help"], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)


def recipe_help(script: str) -> str:
    """What ``python recipes/<script> --help`` prints (one run per session, see ``script_help``)."""
    result = script_help(f"recipes/{script}")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def recipe_flags(script: str) -> set[str]:
    """The option strings ``python recipes/<script> --help`` lists (each option's line starts with them; the
    help texts and the examples under it are left out)."""
    import re

    flags: set[str] = set()
    for line in recipe_help(script).splitlines():
        if re.match(r"^  -", line):  # argparse's option lines: two spaces, then the option strings
            flags.update(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", line.strip().split("  ")[0]))
    return flags


class ListDataset(Dataset):
    def __init__(self, examples: list[dict]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


def make_examples(n: int, vocab: int, causal: bool, seed: int = 0, min_len: int = 3,
                  max_len: int = 10) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = max_len if i == 0 else int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g)
        if causal:
            labels = ids.clone()
            labels[0] = -100  # some ignored label tokens inside the example too
        else:
            labels = int(torch.randint(0, 2, (1,), generator=g))
        out.append({"input_ids": ids, "labels": labels})
    return out


class PadCollator:
    """Right-pads input_ids with pad_id, builds attention_mask, pads token labels with -100."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict]) -> dict:
        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), longest), dtype=torch.long)
        token_labels = isinstance(examples[0]["labels"], torch.Tensor)
        labels = torch.full((len(examples), longest), -100, dtype=torch.long) if token_labels else None
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = e["input_ids"]
            mask[i, :n] = 1
            if token_labels:
                labels[i, :n] = e["labels"]
        if not token_labels:
            labels = torch.tensor([e["labels"] for e in examples], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class LeftPadCollator(PadCollator):
    """PadCollator's batch padded on the left (as for generation): each row's real tokens moved to its end, so
    an example's pad count depends on the longest example of its batch; pads hold pad_id, token labels
    -100."""

    def __init__(self, pad_id: int = 0) -> None:
        super().__init__(pad_id)

    def __call__(self, examples: list[dict]) -> dict:
        batch = super().__call__(examples)
        lengths = batch["attention_mask"].sum(1).tolist()
        return {k: torch.stack([torch.cat([row[n:], row[:n]]) for row, n in zip(v, lengths)]) if v.dim() == 2
                else v
                for k, v in batch.items()}


def reference_clipped_sum(model, examples, causal: bool, max_grad_norm: float, clipping_fn: str = "abadi"):
    """Sum of clipped per-example gradients, one example at a time, no padding: the ground truth."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for e in examples:
        ids = e["input_ids"].unsqueeze(0)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        labels = e["labels"].unsqueeze(0) if causal else torch.tensor([e["labels"]])
        loss = per_example_loss(out.logits, labels, causal_lm=causal)
        grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        norms.append(norm)
        factor = clip_factors(norm.reshape(1), max_grad_norm, clipping_fn)[0]
        for t, g in zip(total, grads):
            t += factor * g
    return dict(zip(params, total)), torch.stack(norms)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def noise_free_args(tmp_path, n: int, clip: float, micro: int = 2, **kw):
    """DPTrainingArguments of one DP-SGD step at noise 0 over a logical batch of ``n`` (SGD, lr 1, no saving,
    ``dp_seed=0``): the clipped sum is then the released update, for neighbouring-data-set tests."""
    from hf_dpfilter import DPTrainingArguments

    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=clip,
        logical_batch_size=n, per_device_train_batch_size=micro, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)
