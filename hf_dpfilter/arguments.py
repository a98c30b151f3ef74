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
    # --- DiceSGD / DIFF2 ---
    dice_error_max_grad_norm: float | None = field(
        default=None,
        metadata={"help": "DiceSGD: clip norm C2 of the error-feedback buffer e (mean scale, as in Alg. 2). "
                  "Default (None): C2 = per_sample_max_grad_norm. The noise scales with C1 + 2 B C2; "
                  "C2 = r C1 / B is the paper's sum-scale reading. See docs/privacy.md."},
    )
    dice_accounting: str = field(
        default="default",
        metadata={"help": "DiceSGD noise calibration for target_epsilon: 'default' (the library's sound bound, "
                  "docs/privacy.md) or 'paper' (Zhang et al. 2024 Thm 3.7 formula, an unverified claim; the "
                  "reported epsilon stays the sound bound, the claim is reported as epsilon_paper_claim).",
                  "choices": ["default", "paper"]},
    )
    dice_save_error_buffer: bool = field(
        default=False,
        metadata={"help": "DiceSGD: also save the error buffer (a NON-private function of the data) in "
                  "checkpoints, for exact resumption. Such checkpoints must not be published. Default: not "
                  "saved; resuming restarts the buffer at zero with a warning."},
    )
    diff2_restart_every: int = field(
        default=10,
        metadata={"help": "DIFF2: restart period T (optimizer steps): a clipped full gradient every T steps, "
                  "clipped gradient differences in between. 1 = DP-GD / DP-SGD."},
    )
    diff2_difference_max_grad_norm: float | None = field(
        default=None,
        metadata={"help": "DIFF2: coefficient C2 of the difference threshold C2 * ||x_{r-1} - x_{r-2}||. "
                  "Required when diff2_restart_every > 1."},
    )
    diff2_difference_noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "DIFF2: noise multiplier of the difference steps when noise_multiplier is given "
                  "(default: the same). With target_epsilon both are calibrated (diff2_budget_split)."},
    )
    diff2_budget_split: float = field(
        default=1.25,
        metadata={"help": "DIFF2: the paper's budget split u > 1 (restarts get 1/u of it); fixes the ratio of "
                  "the two noise multipliers when calibrating for target_epsilon."},
    )
    diff2_neighbouring: str = field(
        default="add_remove",
        metadata={"help": "DIFF2: neighbouring relation, 'add_remove' (library default) or 'replace_one' (the "
                  "paper; doubles the sensitivity and the noise; full batch only).",
                  "choices": ["add_remove", "replace_one"]},
    )
    # --- DOPPLER / DiSK / DP-PMLF ---
    disk_kappa: float = field(
        default=0.7,
        metadata={"help": "DiSK: Kalman gain kappa in (0, 1], the weight on the new privatized gradient "
                  "(g~_t = (1-kappa) g~_{t-1} + kappa g_t). 1 = the base DP optimizer. With Adam, multiply a "
                  "DP-Adam-tuned learning rate by sqrt(kappa/(2-kappa)) (0.73 at 0.7; docs/results.md)."},
    )
    disk_gamma: float | None = field(
        default=None,
        metadata={"help": "DiSK: finite-difference step gamma (!= 0). Default (None): (1-kappa)/kappa, one "
                  "gradient pass at x_t + gamma d_{t-1}. Other values (the paper: 0.5) evaluate two points."},
    )
    doppler_preset: str = field(
        default="first_order_v1",
        metadata={"help": "DOPPLER: named low-pass filter (hf_dpfilter.optimizers.filters.FILTER_PRESETS: "
                  "'first_order_v1' b=[1/11,1/11] a=[-9/11], 'first_order_v2', 'second_order', 'momentum', "
                  "'sgd', 'f1'..'f6'). Ignored when doppler_b is given."},
    )
    doppler_b: list[float] | None = field(
        default=None,
        metadata={"help": "DOPPLER: filter numerator [b_0, ..., b_nb] (scipy.signal.lfilter convention); "
                  "overrides doppler_preset. Needs unit DC gain sum(b) - sum(a) = 1."},
    )
    doppler_a: list[float] | None = field(
        default=None,
        metadata={"help": "DOPPLER: filter denominator without the leading 1, [a_1, ..., a_na] (momentum 0.9 is "
                  "[-0.9]); poles must lie inside the unit circle. Omit for an FIR filter."},
    )
    doppler_base: str = field(
        default="optimizer",
        metadata={"help": "DOPPLER: 'optimizer' hands the filtered gradient to the Trainer's optimizer ('sgd': "
                  "the same, checking it is plain SGD; LP-DPSGD). 'adam' (LP-DPAdam) and 'adam_bc' (LP-DPAdamBC) "
                  "are the paper's Adam variants: the filter replaces Adam's first moment, the second moment is "
                  "of the unfiltered gradient (needs optim='sgd'). Use them rather than 'optimizer' with AdamW, "
                  "which filters twice and normalizes by the filtered gradient's second moment.",
                  "choices": ["optimizer", "sgd", "adam", "adam_bc"]},
    )
    doppler_beta2: float = field(
        default=0.999, metadata={"help": "DOPPLER adam_bc: decay of the second moment of the unfiltered gradient."}
    )
    doppler_eps: float = field(
        default=1e-8,
        metadata={"help": "DOPPLER adam/adam_bc: floor of sqrt(v_hat) (adam, the literal Alg. 3) or of "
                  "v_hat - (sigma C / B)^2 (adam_bc, DPAdamBC)."},
    )
    pmlf_k: int = field(
        default=2,
        metadata={"help": "DP-PMLF: number of parameter points per step (current + k-1 past copies; k forward/"
                  "backward passes). 1 = DOPPLER."},
    )
    pmlf_beta: float = field(
        default=0.1, metadata={"help": "DP-PMLF: per-sample momentum decay; weights beta^lag, normalized to sum 1."}
    )
    pmlf_preset: str = field(
        default="pmlf_mnist",
        metadata={"help": "DP-PMLF: named low-pass filter ('pmlf_mnist' b=[0.1] a=[-0.9], 'pmlf_cifar' "
                  "b=[0.15,-0.05] a=[-0.9], or any DOPPLER preset). Ignored when pmlf_b is given."},
    )
    pmlf_b: list[float] | None = field(
        default=None, metadata={"help": "DP-PMLF: filter numerator [b_0, ...]; overrides pmlf_preset."}
    )
    pmlf_a: list[float] | None = field(
        default=None, metadata={"help": "DP-PMLF: filter denominator without the leading 1, [a_1, ...]."}
    )
    pmlf_base: str = field(
        default="optimizer",
        metadata={"help": "DP-PMLF: how the filtered gradient is used, as doppler_base ('optimizer' is the paper, "
                  "with optim='sgd'; 'adam'/'adam_bc' are DOPPLER's Adam variants, an extension; they need "
                  "optim='sgd').", "choices": ["optimizer", "sgd", "adam", "adam_bc"]},
    )
    pmlf_beta2: float = field(
        default=0.999, metadata={"help": "DP-PMLF adam/adam_bc: decay of the second moment (as doppler_beta2)."}
    )
    pmlf_eps: float = field(default=1e-8, metadata={"help": "DP-PMLF adam/adam_bc: floor (as doppler_eps)."})

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
