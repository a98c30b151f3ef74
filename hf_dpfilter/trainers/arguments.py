"""``DPTrainingArguments``: ``transformers.TrainingArguments`` plus the differential privacy settings, which
are declared once, in :class:`DPArgumentsMixin`, for every TrainingArguments subclass that needs them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from hf_dpfilter.accounting.accountant import ACCOUNTANTS
from hf_dpfilter.optimizers.clipping import CLIPPING_FNS
from hf_dpfilter.optimizers.registry import METHOD_NAMES
from hf_dpfilter.plan import check_dp_settings
from hf_dpfilter.retired_names import refuse_retired_names
from hf_dpfilter.run.training_fields import check_training_fields
from hf_dpfilter.trainers.loss_scaling import DEFAULT_INIT_SCALE, check_fp16_method

logger = logging.getLogger(__name__)

#: the methods ``dp_method`` accepts (the registry's list; "none" trains non-privately)
DP_METHODS = METHOD_NAMES


@dataclass(repr=False)
class DPArgumentsMixin:
    """The differential privacy fields, declared once, for any ``transformers.TrainingArguments`` subclass.

    Mix it in first, ``@dataclass(repr=False) class XArguments(DPArgumentsMixin, SomeTrainingArguments)``
    (:class:`DPTrainingArguments` is ``DPArgumentsMixin`` + ``TrainingArguments``): the DP fields follow the
    other class's fields, ``__post_init__`` checks them and then calls the other class's, and the secret
    ``dp_seed`` stays out of ``repr``/``to_dict``/pickles (``repr=False`` keeps the mixin's sanitised
    ``__repr__``). Decorate the result with :func:`hf_dpfilter.retired_names.refuse_retired_names` for clear
    errors on retired names.

    Give exactly one of ``target_epsilon`` (the noise is calibrated to reach it at the end of the run) or
    ``noise_multiplier``. ``logical_batch_size`` is the expected number of examples per optimizer step;
    ``per_device_train_batch_size`` is only the physical micro-batch the step is computed in.
    ``max_grad_norm`` (the Trainer's batch-level clipping) is set to 0: DP clips per example with
    ``per_sample_max_grad_norm``. The method's own settings go in ``dp_method_args`` (a dict of the fields of
    the method's config, e.g. ``{"kappa": 0.7}`` for DiSK; see docs/configuration.md); the retired flat names
    of earlier versions (``disk_kappa=0.7``) and ``secure_noise`` are refused with the field that replaced
    them.
    """

    dp_method: str = field(
        default="dpsgd",
        metadata={
            "help": "DP method: 'dpsgd' (DP-SGD, or DP-Adam with an Adam optimizer), 'disk', 'doppler', "
                    "'pmlf', "
            "'dicesgd', 'diff2'; 'none' trains non-privately through the same code path, for comparisons.",
            "choices": list(DP_METHODS),
        },
    )
    dp_method_args: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Settings of the chosen dp_method, as a dict or a JSON string of its config's fields, "
                    "e.g. "
            "{\"kappa\": 0.7, \"gamma\": 0.5} for disk (DiSKConfig), {\"restart_every\": 10, "
            "\"difference_max_grad_norm\": 2.0} for diff2 (Diff2Config; difference_max_grad_norm has no "
            "default there: tune it, docs/results.md). Unset fields keep the method's defaults (dicesgd: "
            "error_max_grad_norm = per_sample_max_grad_norm / logical_batch_size)."
        },
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget epsilon to reach at the end of training (calibrates the noise)."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "delta of the (epsilon, delta) guarantee. Default: N^-1.1 with N the training-set "
                          "size."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": "Noise standard deviation relative to the sensitivity (sigma). Give this or "
                    "target_epsilon, "
            "not both. 0.0 is allowed for testing and reports epsilon = inf."
        },
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "Per-example clipping norm C (the sensitivity of DP-SGD)."}
    )
    clipping_fn: str = field(
        default="abadi",
        metadata={
            "help": (
                "Per-example clipping: 'abadi' = min(1, C/||g||) (default), 'automatic' = C/(||g||+0.01)."
            ),
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
        metadata={"help": "Privacy accountant: 'prv' (default), 'rdp' or 'pld'.",
                  "choices": list(ACCOUNTANTS)},
    )
    dp_seed: int | None = field(
        default=None,
        repr=False,  # secret: never in repr/str, to_dict()/to_json_string() nor training_args.bin (see below)
        metadata={
            "help": "Secret seed of the noise generator and the Poisson sampler (separate streams). Default: "
                    "a "
            "fresh random seed per run, independent of `seed`. Anyone who knows it can regenerate the noise "
            "and the batches: keep it secret, never publish it, and prefer secure_rng=True for published "
            "runs."
        },
    )
    secure_rng: bool = field(
        default=False,
        metadata={
            "help": "Draw the noise AND the Poisson sampling from the operating system's cryptographically "
                    "secure "
            "generator (os.urandom). Recommended for every run whose results are published; not reproducible."
        },
    )
    dp_verify_first_step: bool = field(
        default=True,
        metadata={
            "help": "On the first micro-batch, compare up to 4 examples' losses and per-example gradients "
                    "with each "
            "example computed alone (hf_dpfilter.proofs.first_step_check), and the batch sums with an "
            "ordinary backward. Required (True) when compute_per_example_loss is overridden."
        },
    )
    dp_recheck_rate: float = field(
        default=0.05,
        metadata={
            "help": "With dp_verify_first_step: the probability that a micro-batch is re-checked over the "
                    "run (one "
            "random example's loss in the micro-batch against its loss re-collated alone, training mode, "
            "dropout off, no backward; hf_dpfilter.proofs.separation), drawn from a generator that is not "
            "the sampler's or the noise's. A micro-batch of a shape not seen before (longest length, padding "
            "side, number of examples, packed or not) is always re-checked; 0 turns the random schedule off, "
            "not those. At the default the schedule costs about 1 percent of a step on CPU, all the "
            "re-checks 3.6 percent averaged over a run (docs/performance.md)."
        },
    )
    dp_stack_layers: bool | None = field(
        default=None,
        metadata={
            "help": "Stack same-shape layers (the 12 query/key/value blocks of RoBERTa-base, ...) into one "
                    "batched "
            "product for the per-example norms and clipped sums: fewer kernel launches, at the cost of a "
            "transient copy of at most a quarter of the stored activations and output gradients. None "
            "(default): on CUDA only. The norms and sums are the same either way (docs/performance.md)."
        },
    )
    dp_group_by_length: bool = field(
        default=True,
        metadata={
            "help": "Order each step's sampled examples by length, longest first (an out-of-memory shows at "
                    "the "
            "first micro-batch), before they are cut into micro-batches of per_device_train_batch_size, so "
            "each micro-batch holds examples of similar length and is padded only to its own longest. The "
            "length is the row's attention_mask sum (else its input_ids length); without either the sampled "
            "order is kept. With privacy_unit='user' each user's examples stay together (users ordered by "
            "their longest). The run's first micro-batch (the one the first-step check verifies) keeps the "
            "first sampled examples. The sum of clipped gradients does not depend on the order "
            "(hf_dpfilter/data/length_grouping.py)."
        },
    )
    dp_micro_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "With dp_group_by_length: a token budget per micro-batch instead of a fixed number of "
                    "examples. "
            "Each micro-batch takes as many of the length-ordered examples as keep examples x padded length "
            "<= the budget (at least one example; per_device_train_batch_size is then not a cap), so memory "
            "stays flat across lengths. privacy_unit='example' only; packed rows keep their own sizes. None "
            "(default): per_device_train_batch_size examples per micro-batch."
        },
    )
    dp_batchnorm_eval: bool = field(
        default=False,
        metadata={
            "help": "Accept frozen BatchNorm layers (no trainable parameter, or affine=False) and keep them "
                    "in eval "
            "mode, normalising with their stored statistics, in every training step. Without it any "
            "BatchNorm is refused: in train mode it mixes the examples of a batch and writes running "
            "statistics from private data. A trainable BatchNorm is refused either way (convert it to "
            "GroupNorm/LayerNorm)."
        },
    )
    dp_fp16_loss_scale: float = field(
        default=DEFAULT_INIT_SCALE,
        metadata={
            "help": "fp16=True: the loss scale S, a power of two (default 2^10). The summed per-example "
                    "losses are "
            "multiplied by S before the backward and S is divided out exactly before clipping; an example "
            "whose fp16 gradient overflows is replaced by zero, and S is halved only when the noised "
            "gradient is non-finite (that step is then not applied, and still accounted). See "
            "hf_dpfilter/trainers/loss_scaling.py."
        },
    )

    # The privacy unit (hf_dpfilter/data/units.py): what one neighbouring data set adds or removes.
    privacy_unit: str = field(
        default="example",
        metadata={
            "help": "What the guarantee protects: 'example' (add/remove one example) or 'user' (add/remove "
                    "one user "
            "and all of their examples; needs user_id_column and max_examples_per_user). With 'user', "
            "sampling is Poisson over users, logical_batch_size counts users (q = logical_batch_size / "
            "number of users), and each sampled user's examples are clipped together as one vector to "
            "per_sample_max_grad_norm.",
            "choices": ["example", "user"],
        },
    )
    user_id_column: str | None = field(
        default=None,
        metadata={
            "help": "privacy_unit='user': the training set's column naming each example's user. The number "
                    "of "
            "distinct users in it is public, like the data set size. The column is not given to the model."
        },
    )
    max_examples_per_user: int | None = field(
        default=None,
        metadata={
            "help": "privacy_unit='user': k >= 1, the most examples of a sampled user that enter a step "
                    "(drawn "
            "uniformly at random afresh each step). The user's clipped contribution is bounded by C whatever "
            "k; k bounds the work per user and how much of a user's data one step can use."
        },
    )

    dp_row_is_unit: bool = field(
        default=False,
        metadata={
            "help": "Declare that a data-set row is the unit, whatever it holds. Default False: a row "
            "that visibly holds several examples (position_ids restarting inside it, a position_ids or "
            "seq_lengths column packed before the trainer, the chat template's start of a conversation more "
            "than once) is refused before its step, since adding an example to a row changes that row and "
            "the epsilon stated per example would not hold. With True such rows train, each clipped as one "
            "vector, and the privacy report, the start report and the model card state the guarantee as "
            "add/remove one row (a row may hold several examples). Packed batches still clip each segment on "
            "its own: a row of several segments stays refused."
        },
    )

    dp_eval_disjoint_from_train: bool = field(
        default=False,
        metadata={
            "help": "Declare that eval_dataset shares no example with the training set (a held-out split). "
                    "Needed "
            "for evaluation-driven settings (load_best_model_at_end, metric_for_best_model, "
            "save_strategy='best', lr_scheduler_type='reduce_lr_on_plateau', EarlyStoppingCallback): their "
            "metric picks checkpoints or drives the run without noise, so it must not be computed on private "
            "examples. Identical rows of datasets.Dataset train/eval sets are still looked for and refused. "
            "The eval set is not protected."
        },
    )

    dp_allow_eval_on_training_rows: bool = field(
        default=False,
        metadata={
            "help": "Allow evaluate()/predict() and the evaluations during training on a set that shares "
                    "rows with "
            "the training set (or that cannot be compared with it row by row). Default False: such a set is "
            "refused before anything is computed on it, since its loss, metrics and predictions are "
            "noiseless statistics of private examples. With True they are published with a warning, outside "
            "the reported epsilon (docs/threat_model.md)."
        },
    )

    dp_log_nonprivate_metrics: bool = field(
        default=False,
        metadata={
            "help": "Publish NON-PRIVATE statistics of the private batches: the training loss (log lines, "
            "train()'s training_loss, otherwise NaN, trainer_state.json, loggers, model card), total_flos "
            "from the real batch sizes, include_num_input_tokens_seen, the training's memory metrics "
            "(skip_memory_metrics=False), and the count of examples zeroed for a NaN/inf loss or gradient "
            "(privacy ledger and a per-step warning). None of them is noised or accounted: with True the "
            "reported epsilon does not cover them (docs/threat_model.md). Default False: none is computed or "
            "written."
        },
    )

    # ------------------------------------------------------------------ serialisation without the secret seed
    # Everything the Trainer publishes goes through these: to_dict() feeds to_json_string() (TensorBoard's
    # "args" text, the args JSON), to_sanitized_dict() (hparams), every report_to logger and the model card;
    # pickling writes training_args.bin. The DP seed regenerates the noise and the batches, so none of them
    # holds it.
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("dp_seed", None)
        return d

    def __str__(self) -> str:
        text = super().__str__()
        return "\n".join(line for line in text.split("\n") if not line.startswith("dp_seed="))

    __repr__ = __str__

    def __getstate__(self) -> dict[str, Any]:
        # pickle (training_args.bin, torch.save) and copy.copy; copy.deepcopy keeps the seed (__deepcopy__)
        state = dict(self.__dict__)
        state["dp_seed"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> DPArgumentsMixin:
        import copy

        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        return clone

    def __post_init__(self) -> None:
        # Every TrainingArguments field has a DP status (hf_dpfilter/run/training_fields.py); refuse before
        # the values are rewritten below and by TrainingArguments (max_grad_norm, debug, ...).
        check_training_fields(self, "arguments")
        self._validate_dp_fields()
        accumulation = self.gradient_accumulation_steps
        # Batch-level clipping would act on the clipped sum before the noise and change nothing useful.
        self.max_grad_norm = 0.0
        super().__post_init__()
        if getattr(self, "mixed_precision", "no") == "fp16" and not self.fp16:
            # `accelerate launch --mixed_precision fp16` (or its config file): TrainingArguments reads fp16
            # from ACCELERATE_MIXED_PRECISION and Accelerate then runs fp16 autocast with its GradScaler.
            # Under DP that run is the fp16=True one, with its method check and the DP loss scaler
            # (hf_dpfilter/trainers/loss_scaling.py)
            check_fp16_method(self.dp_method, self.dp_fp16_loss_scale,
                              source="ACCELERATE_MIXED_PRECISION=fp16")
            self.fp16 = True
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
        from hf_dpfilter.data.units import check_unit_arguments

        # privacy_unit, user_id_column, max_examples_per_user (hf_dpfilter/data/units.py)
        check_unit_arguments(self)
        if isinstance(self.dp_method_args, str):
            try:
                self.dp_method_args = json.loads(self.dp_method_args) if self.dp_method_args.strip() else None
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"dp_method_args is not valid JSON ({err}): {self.dp_method_args!r}.") from None
        if self.dp_method_args is not None and not isinstance(self.dp_method_args, dict):
            raise ValueError("dp_method_args must be a dict (or a JSON object string), got "
                             f"{self.dp_method_args!r}.")
        # The DP settings are checked by the plan's one check, now: clear errors before any model is loaded.
        config = check_dp_settings(
            method=self.dp_method, method_args=self.dp_method_args,
            per_sample_max_grad_norm=self.per_sample_max_grad_norm,
            clipping_fn=self.clipping_fn, accountant=self.accountant,
            logical_batch_size=self.logical_batch_size,
            target_epsilon=self.target_epsilon, noise_multiplier=self.noise_multiplier,
            target_delta=self.target_delta,
        )
        if self.dp_method_args is not None:  # stored as a plain dict of the fields given
            self.dp_method_args = {k: v for k, v in config.to_dict().items() if k in self.dp_method_args}
        if self.fp16:
            check_fp16_method(self.dp_method, self.dp_fp16_loss_scale)
        self._validate_token_budget()
        if _uses_reentrant_checkpointing(self):
            raise ValueError(
                "gradient_checkpointing with use_reentrant=True is not supported with per-example clipping: "
                "reentrant checkpointing runs the first forward of each checkpointed layer without autograd, "
                "so the clipping hooks never see those layers. Use the non-reentrant kind: "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (the default when no kwargs are "
                "given)."
            )

    def _validate_token_budget(self) -> None:
        budget = self.dp_micro_batch_tokens
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"dp_micro_batch_tokens must be a positive number of tokens, got {budget!r}.")
        if not self.dp_group_by_length:
            raise ValueError("dp_micro_batch_tokens cuts the length-ordered examples: set "
                             "dp_group_by_length=True (the default), or leave dp_micro_batch_tokens=None.")
        if self.privacy_unit != "example":
            raise ValueError("dp_micro_batch_tokens applies to privacy_unit='example': with "
                             "privacy_unit='user' the micro-batches hold whole users "
                             "(per_device_train_batch_size examples). Leave it None.")


@refuse_retired_names
@dataclass(repr=False)
class DPTrainingArguments(DPArgumentsMixin, TrainingArguments):
    """TrainingArguments for differentially private training with :class:`hf_dpfilter.DPTrainer`: the DP
    fields of :class:`DPArgumentsMixin` (see there) after those of ``transformers.TrainingArguments``."""


def _uses_reentrant_checkpointing(args: DPArgumentsMixin) -> bool:
    """Whether the arguments ask for reentrant gradient checkpointing (read before TrainingArguments resolves
    its deprecated ``gradient_checkpointing*`` aliases, so both names are read)."""
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    if not on:
        return False
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args,
            "gradient_checkpointing_kwargs", None)
    if isinstance(kwargs, str) and kwargs.strip().startswith("{"):
        kwargs = json.loads(kwargs)
    if not isinstance(kwargs, dict):
        return False
    # transformers takes these two out; with nothing left it passes use_reentrant=False, else torch's default
    # (reentrant) applies unless use_reentrant is given.
    checkpoint_kwargs = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    return bool(checkpoint_kwargs) and bool(checkpoint_kwargs.get("use_reentrant", True))
