"""``DPTrainingArguments``: ``transformers.TrainingArguments`` plus the differential privacy settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_dpfilter.accounting import ACCOUNTANTS
from hf_dpfilter.clipping import CLIPPING_FNS

logger = logging.getLogger(__name__)

DP_METHODS = ("none", "dpsgd", "disk", "doppler", "pmlf", "dicesgd", "diff2")


@dataclass
class DPTrainingArguments(TrainingArguments):
    """TrainingArguments for differentially private training with :class:`hf_dpfilter.DPTrainer`.

    Give exactly one of ``target_epsilon`` (the noise is calibrated to reach it at the end of the run) or
    ``noise_multiplier``. ``logical_batch_size`` is the expected number of examples per optimizer step;
    ``per_device_train_batch_size`` is only the physical micro-batch the step is computed in.
    ``max_grad_norm`` (the Trainer's batch-level clipping) is set to 0: DP clips per example with
    ``per_sample_max_grad_norm``.
    """

    dp_method: str = field(
        default="dpsgd",
        metadata={
            "help": "DP method: 'dpsgd' (DP-SGD, or DP-Adam with an Adam optimizer), 'disk', 'doppler', 'pmlf', "
            "'dicesgd', 'diff2'; 'none' trains non-privately through the same code path, for comparisons.",
            "choices": list(DP_METHODS),
        },
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget epsilon to reach at the end of training (calibrates the noise)."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "delta of the (epsilon, delta) guarantee. Default: N^-1.1 with N the training-set size."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": "Noise standard deviation relative to the sensitivity (sigma). Give this or target_epsilon, "
            "not both. 0.0 is allowed for testing and reports epsilon = inf."
        },
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "Per-example clipping norm C (the sensitivity of DP-SGD)."}
    )
    clipping_fn: str = field(
        default="abadi",
        metadata={
            "help": "Per-example clipping: 'abadi' = min(1, C/||g||) (default), 'automatic' = C/(||g||+0.01).",
            "choices": list(CLIPPING_FNS),
        },
    )
    logical_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Expected number of examples per optimizer step (over all processes); the sample rate is "
            "logical_batch_size / N. Micro-batches of per_device_train_batch_size are accumulated inside the "
            "step. Default: per_device_train_batch_size x gradient_accumulation_steps x world size."
        },
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={
            "help": "Poisson sampling (each example joins each step with probability q), which the privacy "
            "accounting assumes. False uses shuffled fixed-size batches: the reported epsilon then assumes "
            "Poisson sampling and is not a proven guarantee."
        },
    )
    accountant: str = field(
        default="prv",
        metadata={"help": "Privacy accountant: 'prv' (default), 'rdp' or 'pld'.", "choices": list(ACCOUNTANTS)},
    )
    dp_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the noise generator and the Poisson sampler. Default: derived from `seed`. Two runs "
            "with the same dp_seed draw the same noise (do not reuse seeds across published runs)."
        },
    )
    secure_noise: bool = field(
        default=False,
        metadata={"help": "Draw the noise from the operating system's cryptographically secure generator."},
    )
    dp_verify_first_step: bool = field(
        default=True,
        metadata={
            "help": "On the first micro-batch, check with an extra ordinary backward that the per-example "
            "gradients add up to the ordinary gradient for every trainable parameter."
        },
    )

    def __post_init__(self) -> None:
        self._validate_dp_fields()
        accumulation = self.gradient_accumulation_steps
        # Batch-level clipping would act on the clipped sum before the noise and change nothing useful.
        self.max_grad_norm = 0.0
        super().__post_init__()
        if accumulation > 1:
            # HF's fixed accumulation does not fit Poisson batches of random size: translate it into the
            # logical batch (accumulated inside one DP step) instead of silently changing the semantics.
            translated = self.per_device_train_batch_size * accumulation * max(1, self.world_size)
            if self.logical_batch_size is not None and self.logical_batch_size != translated:
                raise ValueError(
                    f"gradient_accumulation_steps={accumulation} conflicts with logical_batch_size="
                    f"{self.logical_batch_size}: hf_dpfilter accumulates micro-batches inside each DP step. "
                    "Set only logical_batch_size (and leave gradient_accumulation_steps at 1)."
                )
            logger.info(
                "gradient_accumulation_steps=%d is translated into logical_batch_size=%d "
                "(accumulated inside each DP step).",
                accumulation,
                translated,
            )
            self.logical_batch_size = translated
            self.gradient_accumulation_steps = 1

    def _validate_dp_fields(self) -> None:
        if self.dp_method not in DP_METHODS:
            raise ValueError(f"dp_method must be one of {DP_METHODS}, got {self.dp_method!r}.")
        if self.fp16:
            raise ValueError(
                "fp16 is not supported by hf_dpfilter yet (fp16 loss scaling interacts with per-example "
                "clipping and is untested). Use bf16=True (bf16 autocast with fp32 norms and sums) or fp32."
            )
        if getattr(self, "gradient_checkpointing", False):
            raise ValueError(
                "gradient_checkpointing is not supported with per-example clipping (the recomputed layers "
                "are invisible to the clipping hooks). Set gradient_checkpointing=False and reduce "
                "per_device_train_batch_size to save memory instead."
            )
        if self.clipping_fn not in CLIPPING_FNS:
            raise ValueError(f"clipping_fn must be one of {CLIPPING_FNS}, got {self.clipping_fn!r}.")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}.")
        if self.per_sample_max_grad_norm is None or not self.per_sample_max_grad_norm > 0:
            raise ValueError(
                f"per_sample_max_grad_norm must be > 0, got {self.per_sample_max_grad_norm}: it is the "
                "per-example clipping norm C."
            )
        if self.logical_batch_size is not None and self.logical_batch_size < 1:
            raise ValueError(f"logical_batch_size must be >= 1, got {self.logical_batch_size}.")
        if self.dp_method == "none":
            return
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            given = "both" if self.target_epsilon is not None else "neither"
            raise ValueError(
                f"Give exactly one of target_epsilon and noise_multiplier ({given} was given): target_epsilon "
                "calibrates the noise to a budget; noise_multiplier fixes sigma and reports the epsilon spent."
            )
        if self.target_epsilon is not None and not (0 < self.target_epsilon < float("inf")):
            raise ValueError(
                f"target_epsilon must be a positive finite number, got {self.target_epsilon}. For training "
                "without privacy use dp_method='none'."
            )
        if self.noise_multiplier is not None and not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}.")
        if self.target_delta is not None and not (0 < self.target_delta < 1):
            raise ValueError(
                f"target_delta must be in (0, 1/N), got {self.target_delta}. Leave it unset for the default N^-1.1."
            )
