"""What a swapped script shows when training starts: the privacy plan, and the settings left from a
non-private run.

A script made private by swapping ``Trainer`` -> ``DPTrainer`` keeps everything else, its learning rate and
the way it preprocessed its rows included. Three things are shown once, on the main process, where the
script's user sees them (a WARNING on this module's logger, which Python prints on stderr when no logging is
configured and through the script's handlers when it is; and ``warnings.warn``), at the start of ``train()``:

* :func:`plan_banner` -- epsilon, delta, sigma, q, the number of steps and the unit: the plan, public
  quantities computed from the arguments and N before any private data is read; with ``dp_row_is_unit``, that
  a row may hold several examples.
* :func:`learning_rate_problems` -- one warning when the learning rate or its warmup is the non-private
  script's:
  ``Trainer``'s default 5e-5 and TRL's 2e-5 are 10-100x under what DP-Adam needed in every measured setting of
  docs/choosing.md (5e-4 to 2e-3 full fine-tuning, 2e-3 LoRA, 1e-2 a head); a long warmup spends the noisy
  steps at a small learning rate. Read from the arguments and the base optimizer built for the run (its class
  and initial rates: a script's own optimizer runs at its own rate, not at ``args.learning_rate``).
* :func:`fixed_length_blocks` -- one warning when the rows look like run_clm's ``group_texts`` blocks
  (documents concatenated and cut into fixed-length blocks): then the protected unit is a block, not a
  document. Read from the collator the script passes (one that cannot pad, as run_clm's
  ``default_data_collator``), never from the rows: whether it warns is no function of the private data.
* :data:`QA_FEATURES_WARNING` -- one warning for extractive QA at example level: run_qa's preprocessing splits
  a long context into several rows (features) and drops the mapping, so the unit is then a feature; read from
  the model's declared labels only (a training set that keeps ``overflow_to_sample_mapping`` is refused,
  units.py).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from hf_dpfilter.losses.question_answering import SPAN_LABEL_NAMES

__all__ = ["DP_ADAM_LR_RANGE", "QA_FEATURES_WARNING", "announce_start", "fixed_length_blocks",
           "learning_rate_problems", "plan_banner"]

logger = logging.getLogger(__name__)

#: the learning rates DP-Adam needed in the measured settings of docs/choosing.md (full fine-tuning 5e-4 to
#: 2e-3, LoRA 2e-3, a linear head 1e-2); an Adam-type learning rate below a fifth of the lower end is a
#: non-private one
DP_ADAM_LR_RANGE = (5e-4, 1e-2)
#: warmup over more than this share of the planned steps: the measured runs used a constant schedule, no
#: warmup
MAX_WARMUP_SHARE = 0.1


def plan_banner(trainer: Any) -> str:
    """The plan in one block (public: computed from the arguments and N; never the seed)."""
    plan = trainer.privacy_plan
    args = trainer.args
    unit = "user" if getattr(args, "privacy_unit", "example") == "user" else "example"
    row_is_unit = bool(getattr(args, "dp_row_is_unit", False))
    counted = "row" if row_is_unit and unit == "example" else unit  # dp_row_is_unit: N and q count rows
    if not plan.is_private:
        return ("***** Differential privacy: none (dp_method='none', a non-private run: no guarantee) "
                f"*****\n  N = {plan.num_examples:,}, logical batch {plan.expected_batch_size:g}, "
                f"{plan.steps} steps")
    # a trainer's plan always has its number of steps (max_steps or epochs); a bare optimizer's plan may not
    if plan.steps is not None:
        spent = (f"epsilon = {plan.epsilon():.4g}, delta = {plan.delta:.3g} (accountant {plan.accountant}), "
                 f"for {plan.steps:,} steps")
    else:
        spent = f"delta = {plan.delta:.3g}, steps not planned"
    lines = [
        "***** Differential privacy *****",
        f"  {spent}",
        f"  sigma = {plan.noise_multiplier:.4g}, q = {plan.sample_rate:.4g} (expected logical batch "
        f"{plan.expected_batch_size:g} of N = {plan.num_examples:,} {counted}s), C = {plan.max_grad_norm:g}, "
        f"method {plan.method}",
        f"  protected unit: one {counted} (add/remove one {counted}"
        + (", all of its examples" if unit == "user" else ": one row of the training set") + ")",
    ]
    if row_is_unit:  # declared, so said where the run starts: not each example inside a row
        lines.append("  a row may hold several examples (dp_row_is_unit=True): the guarantee protects whole "
                     "rows, not each example inside a row")
    # said where it is decided, not found in the docs afterwards
    if not getattr(args, "dp_verify_first_step", True):
        lines.append("  per-example checks: off (dp_verify_first_step=False: no first-step check, no "
                     "re-checks); still on: the engine's batch-axis proof of each input shape, the "
                     "collator's probed structure, the packed-row guard; an own compute_per_example_loss is "
                     "refused")
    return "\n".join(lines)


def _judged_optimizer(args: Any, optimizer: torch.optim.Optimizer | None) -> tuple[str, float]:
    """(name, learning rate) of the optimizer the run uses: the one built, when given (a script's own through
    ``optimizers=`` or ``optimizer_cls_and_kwargs``, whose rate ``args.learning_rate`` is not), its largest
    initial rate over the parameter groups; else ``args.optim`` and ``args.learning_rate``."""
    if optimizer is not None and optimizer.param_groups:
        rate = max(float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups)
        return type(optimizer).__name__.lower(), rate
    optim = getattr(args, "optim", "")
    return str(getattr(optim, "value", optim)).lower(), float(args.learning_rate)


def learning_rate_problems(args: Any, steps: int | None,
                           optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """The learning-rate settings far from what the measured DP settings needed: the rate of ``optimizer``
    (the base optimizer built for the run) or of ``args``, and the warmup of ``args``."""
    problems = []
    optim, lr = _judged_optimizer(args, optimizer)
    if "adam" in optim and lr < DP_ADAM_LR_RANGE[0] / 5:
        problems.append(
            f"learning_rate={lr:g} with {optim}: DP-Adam needed {DP_ADAM_LR_RANGE[0]:g} to 2e-3 in every "
            f"measured full fine-tuning, 2e-3 with LoRA and 1e-2 for a head (docs/choosing.md); at {lr:g} "
            "the noisy updates barely move the model. Non-private defaults (Trainer 5e-5, SFTConfig 2e-5) "
            "are 10-100x too small"
        )
    warmup = args.get_warmup_steps(steps) if steps and hasattr(args, "get_warmup_steps") else 0
    if steps and warmup > MAX_WARMUP_SHARE * steps:
        problems.append(
            f"warmup of {warmup} of the {steps} planned steps: every step costs privacy, and warmup spends "
            f"{warmup / steps:.0%} of them at a reduced learning rate (the measured DP runs used a constant "
            "schedule without warmup: lr_scheduler_type='constant', warmup_steps=0)"
        )
    return problems


def fixed_length_blocks(collator: Any, causal_lm: bool) -> bool:
    """Whether a causal LM's rows are collated by a collator that cannot pad
    (``transformers.default_data_collator`` or ``DefaultDataCollator``), so every row has one length:
    run_clm's ``group_texts`` blocks, documents concatenated and cut into fixed-length blocks.

    Read from the script's code (the collator it passes) and the model's head, never from the rows: whether a
    warning is printed is then no function of the private data (a check on the rows' lengths would print one
    bit about the first rows). Whole documents truncated or padded to one length beforehand match it too,
    which is why it warns and never refuses."""
    if not causal_lm:
        return False
    from transformers import DefaultDataCollator, default_data_collator

    return collator is default_data_collator or isinstance(collator, DefaultDataCollator)


def _block_warning() -> str:
    return (
        "A causal LM's rows collated by default_data_collator (which cannot pad) all have one length: "
        "they look like documents concatenated and cut into fixed-length blocks (run_clm's group_texts). "
        "Then the protected unit is one block, not one document: a document spread over several blocks, or "
        "several documents in one block, are not protected as a whole. To protect documents, pack after "
        "sampling (DPSFTTrainer with packing=True: each sampled document clipped as one unit), or keep a "
        "document id column and train with "
        "privacy_unit='user', user_id_column=<that column> (docs/choosing.md, 'The unit of a preprocessed "
        "row'). If each row is one whole document truncated to one length, the unit is the document and this "
        "warning does not apply."
    )


QA_FEATURES_WARNING = (
    "Extractive QA at privacy_unit='example': each training row is protected. run_qa's "
    "prepare_train_features splits a context longer than max_seq_length into several rows "
    "(return_overflowing_tokens=True, doc_stride): such an example is then several units, not one. To "
    "protect examples, keep each row's example id (example_id = examples['id'][sample_mapping[i]], as run_qa "
    "does for validation features) and train with privacy_unit='user', user_id_column='example_id', "
    "max_examples_per_user=k (docs/tasks.md, 'Extractive QA'). If every example gives one row (no overflow), "
    "this warning does not apply."
)


def announce_start(trainer: Any) -> None:
    """At the start of training, on the main process: the plan banner, then the warnings above (each once)."""
    plan = trainer.privacy_plan
    logger.warning("%s", plan_banner(trainer))
    if not plan.is_private:
        return
    base = getattr(getattr(trainer, "dp_optimizer", None), "original_optimizer", None)
    built = base if isinstance(base, torch.optim.Optimizer) else None
    problems = learning_rate_problems(trainer.args, plan.steps, built)
    if problems:
        warnings.warn(
            "Settings left from a non-private script: " + "; ".join(problems) + ". Tune the learning rate "
                "for DP "
            "(docs/choosing.md, 'Where to start'), on public data or with the tuning runs accounted.",
            UserWarning, stacklevel=3,
        )
    structure = getattr(trainer, "_batch_structure", None)
    packed = bool(getattr(structure, "packed", False))
    if getattr(trainer.args, "privacy_unit", "example") == "example" and not packed:
        if fixed_length_blocks(trainer.data_collator, bool(getattr(trainer, "_causal_lm", False))):
            warnings.warn(_block_warning(), UserWarning, stacklevel=3)
        names = getattr(trainer, "label_names", None) or ()
        if sorted(names) == sorted(SPAN_LABEL_NAMES):
            warnings.warn(QA_FEATURES_WARNING, UserWarning, stacklevel=3)
