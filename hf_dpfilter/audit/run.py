"""The one-run empirical privacy audit of a DP method, run through the real :class:`~hf_dpfilter.DPTrainer`.

Design (Steinke, Nasr & Jagielski 2023; the project's write-up is ``docs/audit.md`` §8 and §9):

* **Model.** :class:`AuditModel` is a tiny classifier (``head``: ``nn.Linear``) plus an ``audit_probe``
  ``nn.Linear(d_a, 1, bias=False)`` with ``d_a = m + spare`` coordinates that real examples never read
  (their probe input is 0, so their probe gradient is exactly 0). The probe is an ordinary trainable
  parameter: the clipping engine's hooks see it, it enters every per-example norm and gets the same noise.
* **Canaries.** Canary i is a training *example* whose loss is ``lambda * <probe.weight, e_{j(i)}>``, so its
  per-example gradient is exactly ``lambda * e_{j(i)}`` (a Dirac canary, zero on the head). Membership
  ``S_i`` comes from a dedicated seeded generator; IN canaries are simply part of the training set, so the
  trainer's own Poisson sampler draws them at the real rate q, and they go through the same micro-batching,
  ghost norms, clipping, summation, noise and update code as real examples. OUT canaries never exist in
  the run. The accountant's N counts the IN canaries.
* **Score.** Right after the one noise draw of a step (the output of ``DPOptimizer.privatize``, before any
  filter, momentum or base optimizer) ``s_i += <g~_t, e_{j(i)}>`` in float64, summed over all steps. For
  DiceSGD ``privatize`` returns the released update (clipped sum + clipped error feedback + noise), never
  the error buffer itself.
* **Guesses** are fixed before the run (k+ = k- = 50 for m = 1000 by default); the bound is
  :func:`~hf_dpfilter.audit.bounds.best_guess_bound` (Steinke et al., valid for every (eps, delta) claim)
  and, for full-batch (q = 1) Gaussian methods, the f-DP bound of Mahloujifar, Melis & Chaudhuri with the
  mu-GDP curve ``mu = sqrt(T) / sigma``.

A lower bound above the claimed epsilon is evidence of a bug (or of a wrong privacy analysis); a lower bound
below it proves nothing. :class:`NoiseTooSmallDPSGD` and :class:`SeparatelyClippedPiecesDPSGD` are
deliberately broken optimizers (never registered as methods) that demonstrate the audit's power.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hf_dpfilter.audit.bounds import best_guess_bound
from hf_dpfilter.factory import AuditOptions
from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.trainers.arguments import DPTrainingArguments
from hf_dpfilter.trainers.trainer import DPTrainer

logger = logging.getLogger(__name__)

__all__ = [
    "AuditConfig",
    "AuditModel",
    "AuditResult",
    "NoiseTooSmallDPSGD",
    "SeparatelyClippedPiecesDPSGD",
    "run_audit",
]

#: Methods whose claimed trade-off curve is exactly mu-GDP with mu = sqrt(T)/sigma when q = 1 (the noise is
#: added once per step with std sigma * C to a sum of sensitivity C; filters are post-processing).
GDP_METHODS = ("dpsgd", "disk", "doppler", "pmlf")

_MEMBERSHIP_SEED_OFFSET = 0x5EED_A0D1  # keeps the membership coins independent of every training generator


# ------------------------------------------------------------------------------------------- the model
class AuditModel(nn.Module):
    """A small classifier plus an ``audit_probe`` that only canaries read (see the module docstring)."""

    def __init__(self, num_features: int, num_classes: int, probe_size: int) -> None:
        super().__init__()
        self.head = nn.Linear(num_features, num_classes)
        self.audit_probe = nn.Linear(probe_size, 1, bias=False)
        nn.init.zeros_(self.audit_probe.weight)

    def forward(self, features: torch.Tensor, probe_input: torch.Tensor, is_canary: torch.Tensor) -> dict:
        return {"logits": self.head(features), "probe": self.audit_probe(probe_input).squeeze(-1)}


class _AuditDataset(Dataset):
    def __init__(self, features: torch.Tensor, labels: torch.Tensor, canary_coords: np.ndarray,
                 probe_size: int):
        self.features, self.labels = features, labels
        self.canary_coords = [int(c) for c in canary_coords]
        self.probe_size = probe_size
        self.num_real = features.shape[0]

    def __len__(self) -> int:
        return self.num_real + len(self.canary_coords)

    def __getitem__(self, i: int) -> dict:
        dtype = self.features.dtype
        probe = torch.zeros(self.probe_size, dtype=dtype)
        if i < self.num_real:
            return {"features": self.features[i], "probe_input": probe, "is_canary": False,
                    "labels": self.labels[i]}
        probe[self.canary_coords[i - self.num_real]] = 1.0
        feats = torch.zeros(self.features.shape[1], dtype=dtype)
        return {"features": feats, "probe_input": probe, "is_canary": True, "labels": 0}


def _collate(examples: list[dict]) -> dict:
    return {
        "features": torch.stack([e["features"] for e in examples]),
        "probe_input": torch.stack([e["probe_input"] for e in examples]),
        "is_canary": torch.tensor([e["is_canary"] for e in examples], dtype=torch.bool),
        "labels": torch.tensor([int(e["labels"]) for e in examples], dtype=torch.long),
    }


# ------------------------------------------------------------------------- deliberately broken variants
class NoiseTooSmallDPSGD(DPOptimizer):
    """BROKEN ON PURPOSE (audit power check): adds noise 7x smaller than the accountant assumes."""

    noise_scale = 1.0 / 7.0

    def gaussian_noise(self, shape: torch.Size, std: float, like: torch.Tensor) -> torch.Tensor:
        return super().gaussian_noise(shape, std * self.noise_scale, like)


class SeparatelyClippedPiecesDPSGD(DPOptimizer):
    """BROKEN ON PURPOSE (audit power check): each example's gradient is computed as 4 pieces that are clipped
    *separately* and summed (sensitivity 4C) while the noise is calibrated for one clipped vector (C) -- the
    bug multi-point methods avoid by clipping the per-example combination once."""

    num_pieces = 4

    def accumulate(self, engine, loss_fn, batch_size: int, example_keys=None, padding_side: str = "right",
                   unkeyed_reason: str | None = None) -> torch.Tensor:
        losses = None
        with self._keyed(engine, example_keys, padding_side, unkeyed_reason):
            for _ in range(self.num_pieces):
                with engine.record(batch_size=batch_size):
                    piece = loss_fn(None)
                self.accumulate_per_example(engine.per_example_gradients(piece))
                losses = piece.detach()
        self._accumulated = True
        return losses


# --------------------------------------------------------------------------------------- the trainer
class _AuditTrainer(DPTrainer):
    """DPTrainer whose per-example loss is the audit model's (real: cross-entropy; canary: lambda * probe)."""

    #: each term reads only its own example's row (no reduction over the batch), so the run skips the check
    per_example_loss_verified = True

    def __init__(self, *args: Any, canary_gradient_norm: float, optimizer_override: type | None,
                 recorder: _ScoreRecorder, **kwargs: Any) -> None:
        self.canary_gradient_norm = canary_gradient_norm
        self.optimizer_override = optimizer_override
        self.recorder = recorder
        super().__init__(*args, **kwargs)

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        real = (~inputs["is_canary"]).to(outputs["logits"].dtype)
        cross_entropy = F.cross_entropy(outputs["logits"], labels, reduction="none")
        return cross_entropy * real + self.canary_gradient_norm * outputs["probe"]

    @property
    def _dp_audit_options(self) -> AuditOptions:
        # Built by the factory (hf_dpfilter.factory.AuditOptions): the released (post-noise, pre-filter)
        # gradient is observed by a subclass created before the optimizer exists, and the power controls'
        # weakened class replaces the method's -- never a change to a live optimizer or to a model forward.
        return AuditOptions(weakened=self.optimizer_override, observe_release=self.recorder.observe)


class _ScoreRecorder:
    def __init__(self, probe: nn.Parameter, coords: np.ndarray, spare: np.ndarray) -> None:
        self.probe, self.coords, self.spare = probe, torch.as_tensor(coords), torch.as_tensor(spare)
        self.scores = np.zeros(len(coords), dtype=np.float64)
        self.spare_sq = 0.0
        self.spare_count = 0
        self.releases = 0

    def observe(self, released: dict[nn.Parameter, torch.Tensor], optimizer: DPOptimizer) -> None:
        if self.probe not in released:
            raise RuntimeError("The privatized gradient has no entry for the audit probe.")
        current_round = getattr(optimizer, "current_round", None)
        if current_round is not None and not current_round().restart:
            # DIFF2 difference round: a constant canary's gradient difference is 0, so only the restart
            # rounds (whose release is the fresh noisy clipped sum) carry canary signal.
            return
        row = released[self.probe].detach().reshape(-1).to(torch.float64).cpu()
        self.scores += row[self.coords].numpy()
        if self.spare.numel():
            self.spare_sq += float(row[self.spare].pow(2).sum())
            self.spare_count += int(self.spare.numel())
        self.releases += 1


# ----------------------------------------------------------------------------------- configuration
@dataclass
class AuditConfig:
    """One audit run. Defaults: m = 1000 Dirac canaries, full batch (q = 1), T = 100, (eps, 1e-5) claim."""

    method: str = "dpsgd"
    target_epsilon: float = 1.0
    delta: float = 1e-5
    num_canaries: int = 1000
    spare_coordinates: int = 64
    num_real_examples: int = 64
    num_features: int = 8
    steps: int = 100
    sample_rate: float = 1.0
    max_grad_norm: float = 1.0
    canary_gradient_multiple: float = 1.0  # lambda / C; > 1 exercises the clip (and DiceSGD's error buffer)
    guess_counts: tuple = (50,)
    confidence: float = 0.95
    seed: int = 0
    learning_rate: float = 0.05
    optim: str = "sgd"
    accountant: str = "prv"
    method_hyperparameters: dict = field(default_factory=dict)  # the method's dp_method_args
    optimizer_override: type | None = None
    label: str | None = None


@dataclass
class AuditResult:
    config: AuditConfig
    label: str
    claimed_epsilon: float
    noise_multiplier: float
    steps: int
    num_included: int
    num_guesses: int
    num_correct: int
    epsilon_lower_bound: float
    fdp_epsilon_lower_bound: float | None
    noise_std_estimate: float | None
    seconds: float
    details: dict = field(default_factory=dict)

    @property
    def exceeds_claim(self) -> bool:
        bounds = [self.epsilon_lower_bound] + ([self.fdp_epsilon_lower_bound] if self.fdp_epsilon_lower_bound
                                               else [])
        return max(bounds) > self.claimed_epsilon


def _make_data(config: AuditConfig, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(config.seed)
    features = torch.randn(config.num_real_examples, config.num_features, generator=generator, dtype=dtype)
    weights = torch.randn(config.num_features, generator=generator, dtype=dtype)
    labels = (features @ weights > 0).long()
    rng = np.random.default_rng(config.seed + _MEMBERSHIP_SEED_OFFSET)
    included = rng.random(config.num_canaries) < 0.5
    probe_size = config.num_canaries + config.spare_coordinates
    coords = rng.permutation(probe_size)
    return features, labels, included, coords[: config.num_canaries], coords[config.num_canaries :]


def run_audit(config: AuditConfig, output_dir: str | None = None) -> AuditResult:
    """Train ``config.method`` with canaries through :class:`DPTrainer` and return the empirical lower
    bound."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tensors are tiny: thread start-up dominates and contends with other jobs
    try:
        return _run_audit(config, output_dir)
    finally:
        torch.set_num_threads(threads)


def _run_audit(config: AuditConfig, output_dir: str | None) -> AuditResult:
    start = time.perf_counter()
    dtype = torch.float64
    features, labels, included, coords, spare = _make_data(config, dtype)
    dataset = _AuditDataset(features, labels, coords[included],
                            config.num_canaries + config.spare_coordinates)
    n = len(dataset)
    logical = n if config.sample_rate >= 1 else max(1, round(config.sample_rate * n))
    torch.manual_seed(config.seed)
    model = AuditModel(config.num_features, 2, config.num_canaries + config.spare_coordinates).to(dtype)
    recorder = _ScoreRecorder(model.audit_probe.weight, coords, spare)
    hyper = dict(config.method_hyperparameters)
    # DiceSGD runs with the library's default C2 = C1 / B (the paper's App. C.4 reading: G~ = 3 C1^2,
    # sensitivity 3 C1).
    if config.method == "diff2":
        # DIFF2 has no default C2. Any threshold is valid for the audit (constant canaries have zero
        # differences); this one is typical.
        hyper.setdefault("difference_max_grad_norm", 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPTrainingArguments(
            output_dir=output_dir or tmp,
            dp_method=config.method,
            target_epsilon=config.target_epsilon,
            target_delta=config.delta,
            per_sample_max_grad_norm=config.max_grad_norm,
            logical_batch_size=logical,
            per_device_train_batch_size=max(logical, 1),
            max_steps=config.steps,
            optim=config.optim,
            learning_rate=config.learning_rate,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            accountant=config.accountant,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            dp_seed=config.seed + 1,
            seed=config.seed,
            dp_verify_first_step=False,
            dp_method_args=hyper or None,
        )
        trainer = _AuditTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=_collate,
            canary_gradient_norm=config.canary_gradient_multiple * config.max_grad_norm,
            optimizer_override=config.optimizer_override,
            recorder=recorder,
        )
        trainer.train()
    report = trainer.privacy_report()
    claimed = float(report["epsilon"])
    scores = recorder.scores
    steinke = best_guess_bound(
        scores, included, delta=config.delta, confidence=config.confidence, guess_counts=config.guess_counts
    )
    fdp = None
    if config.method in GDP_METHODS and logical == n:
        fdp = best_guess_bound(
            scores, included, delta=config.delta, confidence=config.confidence,
            guess_counts=config.guess_counts, method="fdp_gdp",
        )["epsilon_lower_bound"]
    noise_std = None
    if recorder.spare_count:
        # Spare probe coordinates carry no canary: their released values are pure noise (mean scale).
        noise_std = math.sqrt(recorder.spare_sq / recorder.spare_count) * trainer.logical_batch_size
    label = config.label or config.method
    return AuditResult(
        config=config,
        label=label,
        claimed_epsilon=claimed,
        noise_multiplier=float(report["noise_multiplier"]),
        steps=int(report["steps"]),
        num_included=int(included.sum()),
        num_guesses=int(steinke["num_guesses"]),
        num_correct=int(steinke["num_correct"]),
        epsilon_lower_bound=float(steinke["epsilon_lower_bound"]),
        fdp_epsilon_lower_bound=None if fdp is None else float(fdp),
        noise_std_estimate=noise_std,
        seconds=time.perf_counter() - start,
        details={
            "steinke": steinke,
            "scored_releases": recorder.releases,
            "sample_rate": trainer.sample_rate,
            "method_hyperparameters": hyper,
            "privacy_report": report,
        },
    )
