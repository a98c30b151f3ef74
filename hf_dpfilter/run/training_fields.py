"""The DP status of every ``TrainingArguments`` field: one table, and the refusals it declares.

Every field of the installed ``transformers.TrainingArguments`` (and every field ``DPTrainingArguments`` adds)
has one row in :data:`FIELD_POLICIES`, with one of four statuses:

* ``honoured`` -- the Trainer uses it as usual and it has no bearing on the guarantee (it acts on public
  quantities, on privatized gradients -- post-processing -- or on evaluation and bookkeeping);
* ``planned`` -- the privacy plan (sample rate, steps, noise, clipping) is computed from it when the
  ``DPTrainer`` is created; a later change is refused when ``train()`` starts;
* ``refused`` -- the values that would break the guarantee or be silently ignored are refused before training,
  with the fix (the row says which values; the others are honoured);
* ``opt_in`` -- trades privacy away, or rests on a claim the library cannot check, only behind an explicit
  option documented as such.

A field that a new transformers release adds has no row, and ``tests/run/test_training_fields.py`` fails until
it is classified here. Refusals run where the value is known: at ``DPTrainingArguments.__post_init__``
(``stage="arguments"``), and again when the ``DPTrainer`` is created and when ``train()`` starts
(``stage="trainer"``), for what can change after the arguments were built. docs/configuration.md holds the
rendered table (:func:`render_markdown`; a test keeps it in sync).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FIELD_POLICIES",
    "STATUSES",
    "FieldPolicy",
    "TrainingFieldError",
    "check_training_fields",
    "eval_driven_features",
    "render_markdown",
]

STATUSES = ("honoured", "planned", "refused", "opt_in")

#: ``check(args, stage) -> problem and fix, or None``; ``stage`` is "arguments" or "trainer"
Check = Callable[[Any, str], "str | None"]


class TrainingFieldError(ValueError):
    """A ``TrainingArguments`` value that DP training cannot honour safely (the message names the fix)."""


@dataclass(frozen=True)
class FieldPolicy:
    """One field's DP status, what happens to it, and the check that refuses its unsafe values."""

    status: str
    note: str
    check: Check | None = None


# ------------------------------------------------------------------------------------------------ checks
def _max_grad_norm(args: Any, stage: str) -> str | None:
    # The dataclass default (1.0) and the 0.0 that __post_init__ writes (also given back by
    # to_dict()/replace()) mean "not asked for"; any other value was asked for explicitly and would be
    # silently replaced.
    allowed = (None, 0, 0.0, 1.0) if stage == "arguments" else (None, 0, 0.0)
    value = args.max_grad_norm
    if value in allowed:
        return None
    return (
        f"max_grad_norm={value} is the Trainer's clipping of the batch gradient, which DP training does not "
        "use (it would act on the clipped sum before the noise and change nothing the guarantee needs). The "
        f"DP clipping bound is per_sample_max_grad_norm: pass per_sample_max_grad_norm={value} instead "
        "(and leave max_grad_norm unset)."
    )


def _gradient_accumulation(args: Any, stage: str) -> str | None:
    # At "arguments" the field is translated into logical_batch_size by __post_init__; any value > 1 seen
    # later was set after that (by hand, or by the Trainer from
    # accelerator_config.gradient_accumulation_kwargs).
    if stage == "arguments" or args.gradient_accumulation_steps == 1:
        return None
    return (
        f"gradient_accumulation_steps={args.gradient_accumulation_steps} was set after the "
        "DPTrainingArguments were created (by hand or through "
        "accelerator_config.gradient_accumulation_kwargs['num_steps']): the Trainer would merge that many "
        "Poisson batches into one noisy step that is accounted once. Give the logical batch instead: "
        "DPTrainingArguments(logical_batch_size=...) (or gradient_accumulation_steps=... when creating the "
        "arguments, which is translated into it), and leave gradient accumulation at 1 afterwards."
    )


def _accelerator_accumulation(args: Any, stage: str) -> str | None:
    config = args.accelerator_config
    if isinstance(config, str):
        if not config.strip().startswith("{"):
            return None  # a JSON file: read by TrainingArguments; checked again at stage "trainer"
        config = json.loads(config)
    kwargs = config.get("gradient_accumulation_kwargs") if isinstance(config, dict) else getattr(
        config, "gradient_accumulation_kwargs", None
    )
    steps = (kwargs or {}).get("num_steps", 1)
    if steps in (None, 1):
        return None
    return (
        f"accelerator_config.gradient_accumulation_kwargs={{'num_steps': {steps}}} makes the Trainer merge "
        f"{steps} "
        "Poisson batches into one noisy step, accounted once. Remove it and set "
        f"DPTrainingArguments(logical_batch_size=...) to the examples per step you want (micro-batches of "
        "per_device_train_batch_size are accumulated inside each DP step)."
    )


def _truthy(name: str, message: str) -> Check:
    def check(args: Any, stage: str) -> str | None:
        return message.format(value=getattr(args, name)) if getattr(args, name, None) else None

    return check


def _not_none(name: str, message: str) -> Check:
    def check(args: Any, stage: str) -> str | None:
        value = getattr(args, name, None)
        return message.format(value=value) if value is not None else None

    return check


def _optim(args: Any, stage: str) -> str | None:
    value = str(getattr(args.optim, "value", args.optim))
    if value not in ("lomo", "adalomo"):
        return None
    return (
        f"optim={value!r}: LOMO/AdaLomo update each parameter inside its backward hook, from the ordinary "
        "(unclipped, noiseless) gradient, so no DP optimizer can stand between the data and the update. Use "
        "an optimizer that steps on the privatized gradient: optim='adamw_torch' (DP-Adam) or 'sgd', and "
        "LoRA (peft) to save memory."
    )


def _debug(args: Any, stage: str) -> str | None:
    value = args.debug
    options = value.split() if isinstance(value,
                                          str) else [str(getattr(o, "value", o)) for o in (value or [])]
    if "underflow_overflow" not in options:
        return None
    return (
        "debug='underflow_overflow' inspects the activations of the private batch: it aborts training on the "
        "first batch holding an overflowing example and prints activation extremes computed from private "
        "examples without noise. Remove it; debug numerics on public or synthetic data with dp_method='none'."
    )


def _torch_compile(args: Any, stage: str) -> str | None:
    if not (args.torch_compile or args.torch_compile_backend or args.torch_compile_mode):
        return None
    return (
        "torch_compile (or torch_compile_backend/torch_compile_mode, which turn it on) is not supported with "
        "per-example clipping: the clipping engine's module hooks record each layer's inputs and output "
        "gradients, and a compiled model is not verified to run them. Train without it (remove "
        "torch_compile*)."
    )


def _sampling_strategy(args: Any, stage: str) -> str | None:
    value = str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy))
    if value == "random":
        return None
    if value == "group_by_length" and getattr(args, "dp_group_by_length", True):
        # what it asks for, inside each Poisson sample: the sample ordered by length (dp_group_by_length)
        return None
    if value == "group_by_length":
        return ("train_sampling_strategy='group_by_length' with dp_group_by_length=False: DPTrainer groups "
                "by length inside each Poisson sample only (the sampling stays Poisson), which "
                "dp_group_by_length=False turns off. Keep dp_group_by_length=True (the default), or remove "
                "train_sampling_strategy.")
    return (
        f"train_sampling_strategy={value!r} cannot apply: DPTrainer draws each step's batch by Poisson "
        "sampling, which the privacy accounting assumes (a fixed order or batches chosen by length would "
        "need another analysis). Remove it (the default 'random' is what DPTrainer's Poisson sampler "
        "replaces); each step's sample is already ordered by length into its micro-batches "
        "(dp_group_by_length)."
    )


def _parallelism(args: Any, stage: str) -> str | None:
    if args.parallelism_config is None:
        return None
    return (
        "parallelism_config (tensor, context or sequence parallelism) splits an example's computation over "
        "processes, where the clipping engine cannot see each example's whole gradient. Remove it; shard "
        "large models with FSDP2 (accelerate launch --config_file accelerate_configs/fsdp.yaml) or use DDP "
        "with LoRA."
    )


def eval_driven_features(args: Any) -> list[str]:
    """The settings by which an evaluation metric chooses checkpoints or drives the training (not logging)."""
    found = []
    if getattr(args, "load_best_model_at_end", False):
        found.append("load_best_model_at_end=True")
    if getattr(args, "metric_for_best_model", None) is not None:
        found.append(f"metric_for_best_model={args.metric_for_best_model!r}")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
        found.append("save_strategy='best'")
    if str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "reduce_lr_on_plateau":
        found.append("lr_scheduler_type='reduce_lr_on_plateau'")
    return found


def _eval_driven(args: Any, stage: str) -> str | None:
    found = eval_driven_features(args)
    if not found or getattr(args, "dp_eval_disjoint_from_train", False):
        return None
    return (
        f"{', '.join(found)}: an evaluation metric would pick checkpoints or drive the learning rate. "
        "Computed on training examples it is noiseless and unaccounted (an added example's loss can be read "
        "back from it). If eval_dataset shares no example with the training set (a held-out split), declare "
        "it with dp_eval_disjoint_from_train=True (identical rows are then looked for and refused); "
        "otherwise remove these settings. Plain evaluation on a held-out set is allowed without the "
        "declaration."
    )


# ------------------------------------------------------------------------------------------------ the table
_H, _P, _R, _O = STATUSES
_EVAL = ("evaluation only (allowed on a held-out set; a set sharing a row with the training set is refused "
         "unless dp_allow_eval_on_training_rows=True)")
_HUB = "honoured: no published file holds the DP seed or a generator state (see 'Published files')"
_INERT_DATA = ("no effect on training: DPTrainer's loader yields the Poisson batches (used for evaluation "
               "only)")

FIELD_POLICIES: dict[str, FieldPolicy] = {
    # ---- run length and batches: what the plan is computed from
    "output_dir": FieldPolicy(_H, "where checkpoints and privacy_ledger.json are written"),
    "per_device_train_batch_size": FieldPolicy(
        _P, "the micro-batch; with logical_batch_size unset, logical batch = it x world size (frozen at "
            "DPTrainer "
        "creation: a later change of the logical batch is refused)"),
    "num_train_epochs": FieldPolicy(_P, "planned steps (a change after DPTrainer creation is refused)"),
    "max_steps": FieldPolicy(_P, "planned steps (a change after DPTrainer creation is refused)"),
    "gradient_accumulation_steps": FieldPolicy(
        _P, "translated into logical_batch_size at creation; > 1 afterwards (by hand or through "
            "accelerator_config) "
        "is refused", _gradient_accumulation),
    "accelerator_config": FieldPolicy(
        _R, "honoured, except gradient_accumulation_kwargs num_steps > 1 (refused: one noisy step per "
            "Poisson batch)",
        _accelerator_accumulation),
    "auto_find_batch_size": FieldPolicy(
        _R, "True is refused: an out-of-memory retry would release clipped sums twice, redraw the same "
            "batches "
        "and ignore the halved size", _truthy(
            "auto_find_batch_size",
            "auto_find_batch_size=True is not supported: after an out-of-memory error the Trainer retries "
            "the run, and the clipped sums already built, the Poisson batches already drawn and the planned "
            "batch size would not be reset consistently (an example counted twice, batches booked twice). "
            "Set per_device_train_batch_size to a micro-batch that fits (the logical batch does not depend "
            "on it) and leave auto_find_batch_size=False.")),
    "train_sampling_strategy": FieldPolicy(
        _R, "'random' is replaced by Poisson sampling; 'group_by_length' by each Poisson sample ordered by "
            "length "
        "(dp_group_by_length, refused with it off); 'sequential'/'batch_rebalance' are refused",
        _sampling_strategy),
    "length_column_name": FieldPolicy(
        _H, "no effect: dp_group_by_length reads each example's length from its attention mask or input_ids"),
    "dataloader_drop_last": FieldPolicy(_H, _INERT_DATA),
    "dataloader_num_workers": FieldPolicy(_H, "loader workers (public)"),
    "dataloader_pin_memory": FieldPolicy(_H, "loader setting (public)"),
    "dataloader_persistent_workers": FieldPolicy(_H, _INERT_DATA),
    "dataloader_prefetch_factor": FieldPolicy(_H, _INERT_DATA),
    "dataloader_multiprocessing_context": FieldPolicy(_H, _INERT_DATA),
    "dataloader_in_order": FieldPolicy(_H, _INERT_DATA),
    "remove_unused_columns": FieldPolicy(_H, "column selection (public)"),
    "label_names": FieldPolicy(_H, "which inputs are labels (public)"),
    "seed": FieldPolicy(_H, "model init and dropout; not the DP seed (dp_seed), which is independent"),
    "data_seed": FieldPolicy(_H, "no effect on training: the Poisson sampler draws from dp_seed or the OS "
                                 "CSPRNG"),
    "full_determinism": FieldPolicy(_H, "deterministic kernels (public)"),
    "ignore_data_skip": FieldPolicy(
        _H, "after a resume the noise and the Poisson batches are drawn fresh (see 'Checkpoints'), skipped "
            "or not"),
    # ---- the optimizer and the learning rate: act on the privatized gradient (post-processing)
    "learning_rate": FieldPolicy(_H, "post-processing of the privatized gradient"),
    "lr_scheduler_type": FieldPolicy(
        _R, "honoured (a schedule is public), except 'reduce_lr_on_plateau' (driven by an evaluation "
            "metric): "
        "refused unless dp_eval_disjoint_from_train=True", _eval_driven),
    "lr_scheduler_kwargs": FieldPolicy(_H, "schedule settings (public)"),
    "warmup_steps": FieldPolicy(_H, "schedule setting (public)"),
    "optim": FieldPolicy(_R, "wrapped by the DP optimizer (post-processing); 'lomo'/'adalomo' (update inside "
                             "the "
                         "backward, from the unclipped gradient) are refused", _optim),
    "optim_args": FieldPolicy(_H, "base optimizer settings (post-processing)"),
    "optim_target_modules": FieldPolicy(_H, "base optimizer settings (post-processing)"),
    "weight_decay": FieldPolicy(_H, "base optimizer setting (post-processing)"),
    "adam_beta1": FieldPolicy(_H, "base optimizer setting (post-processing)"),
    "adam_beta2": FieldPolicy(_H, "base optimizer setting (post-processing)"),
    "adam_epsilon": FieldPolicy(_H, "base optimizer setting (post-processing)"),
    "max_grad_norm": FieldPolicy(
        _R, "the Trainer's batch clipping, set to 0; an explicit value other than the default 1.0 is refused "
            "with a "
        "pointer to per_sample_max_grad_norm (the DP bound)", _max_grad_norm),
    # ---- the loss and the forward
    "label_smoothing_factor": FieldPolicy(
        _H, "applied per example: the Trainer's LabelSmoother (smoothed cross-entropy) over each example's "
            "own "
        "tokens or class, packed rows included; refused at the first step, before any release, where the "
        "loss has no smoothing (regression, multi-label, extractive QA's start/end)"),
    "average_tokens_across_devices": FieldPolicy(
        _H, "no effect on training: the DP loss is per example, normalized by the declared logical batch"),
    "neftune_noise_alpha": FieldPolicy(
        _R, "refused: NEFTune scales an example's embedding noise by the longest example of its micro-batch "
        "(examples coupled)", _not_none(
            "neftune_noise_alpha",
            "neftune_noise_alpha={value}: NEFTune scales the noise added to an example's embeddings by the "
            "length of the longest example of its micro-batch, so one example's gradient depends on the "
            "others (the per-example clipping bound no longer holds). Remove neftune_noise_alpha; its noise "
            "is not DP noise.")),
    "use_liger_kernel": FieldPolicy(
        _R, "True is refused: Liger replaces layers and the loss by fused kernels without per-example rules",
        _truthy(
            "use_liger_kernel",
            "use_liger_kernel=True replaces the model's layers and loss with fused Liger kernels, which have "
            "no per-example gradient rule and compute a batch loss. Remove it (set "
            "use_liger_kernel=False).")),
    "liger_kernel_config": FieldPolicy(_H, "only read with use_liger_kernel, which is refused"),
    "use_cache": FieldPolicy(_H, "key/value cache of the forward (no gradient through it)"),
    "bf16": FieldPolicy(_H, "bf16 autocast; per-example norms and clipped sums in fp32"),
    "fp16": FieldPolicy(
        _H, "fp16 autocast with the DP loss scaler (dp_fp16_loss_scale): exact per-example clipping of the "
            "scaled "
        "gradients, overflow zeroed per example, the scale moved only by the noised gradient; dpsgd (and "
        "none) only"),
    "bf16_full_eval": FieldPolicy(_H, "evaluation only"),
    "fp16_full_eval": FieldPolicy(_H, "evaluation only"),
    "tf32": FieldPolicy(_H, "matmul precision (public)"),
    "activation_checkpointing": FieldPolicy(_H, "non-reentrant checkpointing is supported "
                                                "(docs/large_models.md)"),
    "activation_checkpointing_kwargs": FieldPolicy(_R, "use_reentrant=True is refused"),
    "gradient_checkpointing": FieldPolicy(_H, "deprecated alias of activation_checkpointing"),
    "gradient_checkpointing_kwargs": FieldPolicy(_R, "use_reentrant=True is refused"),
    "torch_compile": FieldPolicy(_R, "True is refused (not verified with the clipping hooks)",
                                 _torch_compile),
    "torch_compile_backend": FieldPolicy(_R, "turns torch_compile on: refused"),
    "torch_compile_mode": FieldPolicy(_R, "turns torch_compile on: refused"),
    "torch_empty_cache_steps": FieldPolicy(_H, "memory management (public)"),
    "debug": FieldPolicy(
        _R, "'underflow_overflow' is refused (inspects and prints the private batch's activations); "
        "'tpu_metrics_debug' is honoured", _debug),
    "skip_memory_metrics": FieldPolicy(
        _H, "memory peaks grow with the longest padded private batch: published only with "
            "dp_log_nonprivate_metrics"),
    # ---- logging and reporting
    "logging_strategy": FieldPolicy(_H, "when to log (what is logged: see 'Published files')"),
    "logging_steps": FieldPolicy(_H, "when to log"),
    "logging_first_step": FieldPolicy(_H, "when to log"),
    "log_on_each_node": FieldPolicy(_H, "which processes log"),
    "logging_nan_inf_filter": FieldPolicy(_H, "filters the logged loss (logged only with "
                                              "dp_log_nonprivate_metrics)"),
    "include_num_input_tokens_seen": FieldPolicy(
        _O, "token counts of the private Poisson batches: refused unless dp_log_nonprivate_metrics=True "
            "(then "
        "published, non-private)"),
    "log_level": FieldPolicy(_H, "logging verbosity"),
    "log_level_replica": FieldPolicy(_H, "logging verbosity"),
    "disable_tqdm": FieldPolicy(_H, "progress bar"),
    "report_to": FieldPolicy(_H, "honoured: the arguments the integrations receive hold no DP seed"),
    "run_name": FieldPolicy(_H, "name of the run (public)"),
    "project": FieldPolicy(_H, "logger project name (public)"),
    "trackio_space_id": FieldPolicy(_H, "logger destination (public)"),
    "trackio_bucket_id": FieldPolicy(_H, "logger destination (public)"),
    "trackio_static_space_id": FieldPolicy(_H, "logger destination (public)"),
    # ---- evaluation
    "eval_strategy": FieldPolicy(_H, _EVAL),
    "eval_steps": FieldPolicy(_H, _EVAL),
    "eval_delay": FieldPolicy(_H, _EVAL),
    "eval_on_start": FieldPolicy(_H, _EVAL),
    "per_device_eval_batch_size": FieldPolicy(_H, _EVAL),
    "prediction_loss_only": FieldPolicy(_H, _EVAL),
    "eval_do_concat_batches": FieldPolicy(_H, _EVAL),
    "eval_use_gather_object": FieldPolicy(_H, _EVAL),
    "eval_accumulation_steps": FieldPolicy(_H, _EVAL),
    "include_for_metrics": FieldPolicy(_H, _EVAL),
    "batch_eval_metrics": FieldPolicy(_H, _EVAL),
    "load_best_model_at_end": FieldPolicy(
        _R, "refused unless dp_eval_disjoint_from_train=True (an eval metric picks the checkpoint)",
        _eval_driven),
    "metric_for_best_model": FieldPolicy(
        _R, "refused unless dp_eval_disjoint_from_train=True (checkpoint selection, early stopping)",
        _eval_driven),
    "greater_is_better": FieldPolicy(_H, "only read with metric_for_best_model"),
    # ---- checkpoints and the Hub
    "save_strategy": FieldPolicy(
        _R, "honoured, except 'best' (an eval metric picks what is saved): refused unless "
        "dp_eval_disjoint_from_train=True", _eval_driven),
    "save_steps": FieldPolicy(_H, "when to save"),
    "save_on_each_node": FieldPolicy(_H, "where to save"),
    "save_total_limit": FieldPolicy(_H, "how many checkpoints are kept (the ledger is kept in output_dir)"),
    "save_only_model": FieldPolicy(_H, "checkpoints without optimizer state (cannot be resumed)"),
    "enable_jit_checkpoint": FieldPolicy(_H, "checkpoint on SIGTERM; same contents as any checkpoint"),
    "restore_callback_states_from_checkpoint": FieldPolicy(_H, "callback states (public)"),
    "resume_from_checkpoint": FieldPolicy(
        _H, "the ledger is append-only across resumes; noise and sampling are drawn fresh after a resume"),
    "push_to_hub": FieldPolicy(_H, _HUB),
    "hub_token": FieldPolicy(_H, "credentials (never written to the ledger)"),
    "hub_private_repo": FieldPolicy(_H, _HUB),
    "hub_model_id": FieldPolicy(_H, _HUB),
    "hub_strategy": FieldPolicy(_H, _HUB),
    "hub_always_push": FieldPolicy(_H, _HUB),
    "hub_revision": FieldPolicy(_H, _HUB),
    # ---- processes
    "use_cpu": FieldPolicy(_H, "device choice"),
    "local_rank": FieldPolicy(_H, "process rank (several processes are one DP run, noise added once)"),
    "ddp_find_unused_parameters": FieldPolicy(_H, "DDP setting (the DP optimizer reduces the clipped sums)"),
    "ddp_bucket_cap_mb": FieldPolicy(_H, "DDP setting"),
    "ddp_broadcast_buffers": FieldPolicy(_H, "DDP setting"),
    "ddp_static_graph": FieldPolicy(_H, "DDP setting"),
    "ddp_backend": FieldPolicy(_H, "DDP setting"),
    "ddp_timeout": FieldPolicy(_H, "DDP setting"),
    "fsdp": FieldPolicy(_R, "FSDP2 is supported; FSDP1 is refused at DPTrainer creation"),
    "fsdp_config": FieldPolicy(_R, "FSDP2 is supported; FSDP1 is refused at DPTrainer creation"),
    "deepspeed": FieldPolicy(_R, "refused at DPTrainer creation (ZeRO reduces gradients inside its engine)"),
    "parallelism_config": FieldPolicy(_R, "refused (splits an example's computation over processes)",
                                      _parallelism),
    "do_train": FieldPolicy(_H, "read by scripts only"),
    "do_eval": FieldPolicy(_H, "read by scripts only"),
    "do_predict": FieldPolicy(_H, "read by scripts only"),
    # ---- DPTrainingArguments' own fields
    "dp_method": FieldPolicy(_P, "the DP method (docs/configuration.md, 'Method settings')"),
    "dp_method_args": FieldPolicy(_P, "the method's settings"),
    "target_epsilon": FieldPolicy(_P, "calibrates the noise for the planned steps"),
    "target_delta": FieldPolicy(_P, "delta of the guarantee"),
    "noise_multiplier": FieldPolicy(_P, "fixed noise; epsilon reported"),
    "per_sample_max_grad_norm": FieldPolicy(_P, "the clipping bound C (the DP sensitivity)"),
    "clipping_fn": FieldPolicy(_P, "per-example clipping function"),
    "logical_batch_size": FieldPolicy(
        _P, "expected examples per step (users with privacy_unit='user'): the sample rate q = B / N"),
    "poisson_sampling": FieldPolicy(
        _O, "False (shuffled fixed-size batches) trades the proof away: the reported epsilon assumes Poisson "
        "sampling (a warning says so)"),
    "accountant": FieldPolicy(_P, "the privacy accountant"),
    "privacy_unit": FieldPolicy(
        _P, "the unit the guarantee protects: 'example', or 'user' (Poisson over users, each user's examples "
            "clipped "
        "as one vector, epsilon over users); a user declaration without its column or k is refused"
    ),
    "dp_row_is_unit": FieldPolicy(
        _P, "declares a data-set row the unit, whatever it holds: rows holding several examples "
        "(restarting position_ids, several chat conversations) are refused without it; with it the report, "
        "the start report and the model card say add/remove one row (a row may hold several examples); part "
        "of a resume's identity"),
    "user_id_column": FieldPolicy(_P, "privacy_unit='user': the column naming each example's user (N = its "
                                      "distinct values)"),
    "max_examples_per_user": FieldPolicy(_P, "privacy_unit='user': at most k random examples of a sampled "
                                             "user per step"),
    "dp_seed": FieldPolicy(
        _P, "secret: never written to to_dict()/to_json_string()/to_sanitized_dict()/training_args.bin"),
    "secure_rng": FieldPolicy(_P, "noise and sampling from the OS CSPRNG"),
    "dp_verify_first_step": FieldPolicy(
        _H, "a check of the per-example gradients on the first micro-batch, and the loss-only re-checks over "
            "the run"),
    "dp_micro_batch_tokens": FieldPolicy(
        _H, "a memory setting: micro-batches of the length-ordered examples cut by a token budget instead of "
            "a "
        "number of examples; the clipped sum is the same"),
    "dp_recheck_rate": FieldPolicy(
        _H,
        "the probability that a micro-batch of a shape already seen is re-checked (new shapes always are)"),
    "dp_stack_layers": FieldPolicy(_H, "a speed setting; the norms and sums are the same"),
    "dp_group_by_length": FieldPolicy(
        _H, "a speed setting: each step's sample ordered by length, longest first, before it is cut into "
        "micro-batches; the clipped sum is the same"),
    "dp_batchnorm_eval": FieldPolicy(
        _H, "frozen BatchNorms run in eval mode (stored statistics) in every step; without it every "
            "BatchNorm is "
        "refused, and a trainable one is refused either way"),
    "dp_fp16_loss_scale": FieldPolicy(
        _H, "fp16: the loss scale (a power of two, public), divided out exactly before clipping; halved only "
            "when "
        "the noised gradient is non-finite"),
    "dp_eval_disjoint_from_train": FieldPolicy(
        _O, "the user's declaration that eval_dataset shares no example with the training set; allows "
        "evaluation-driven checkpoint selection, lr scheduling and early stopping (identical rows refused)"),
    "dp_allow_eval_on_training_rows": FieldPolicy(
        _O, "evaluation and prediction on a set sharing rows with the training set (refused by default): its "
        "noiseless loss, metrics and predictions are then published with a warning, outside the guarantee"),
    "dp_log_nonprivate_metrics": FieldPolicy(
        _O, "publishes the training loss (log lines and train()'s training_loss, NaN otherwise), total_flos "
            "and "
        "include_num_input_tokens_seen, computed from private batches without noise (non-private); off by "
        "default"),
}



def check_training_fields(args: Any, stage: str, policies: dict[str, FieldPolicy] | None = None) -> None:
    """Raise :class:`TrainingFieldError` listing every refused value of ``args`` (each with its fix), by the
    policies of ``policies`` (default: :data:`FIELD_POLICIES`; TRL's SFT options pass theirs).

    ``stage="arguments"`` in ``DPTrainingArguments.__post_init__`` (before TrainingArguments rewrites the
    values), ``"trainer"`` at ``DPTrainer`` creation and ``train()`` start. Each check runs once even when
    several fields share it (the eval-driven settings).
    """
    problems: list[str] = []
    seen: set[Check] = set()
    for policy in (FIELD_POLICIES if policies is None else policies).values():
        if policy.check is None or policy.check in seen:
            continue
        seen.add(policy.check)
        problem = policy.check(args, stage)
        if problem and problem not in problems:
            problems.append(problem)
    if problems:
        raise TrainingFieldError("\n".join(problems))


def render_markdown(policies: dict[str, FieldPolicy] | None = None, column: str = "field") -> str:
    """The table as Markdown (docs/configuration.md, 'Every TrainingArguments field'), one row per field."""
    policies = FIELD_POLICIES if policies is None else policies
    lines = [f"| {column} | status | what happens |", "|---|---|---|"]
    for name in sorted(policies):
        policy = policies[name]
        lines.append(f"| `{name}` | {policy.status} | {policy.note} |")
    return "\n".join(lines) + "\n"
