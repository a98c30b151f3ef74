"""Which loss DPTrainer trains with: built per example by the library, or supplied through one documented
hook.

DP needs one loss per example that depends on that example only. The library builds it from the model's
logits (:mod:`hf_dpfilter.losses.tasks`). The Trainer offers other ways to define a loss, each of which
computes one number for the whole (micro-)batch, so an example's weight could depend on the others: a
``compute_loss`` override, ``compute_loss_func=...``, and the model's own loss. These are refused, never
silently replaced, unless the user supplies the per-example loss through the documented hook -- an override of
:meth:`hf_dpfilter.DPTrainer.compute_per_example_loss` -- which the first-step check
(:mod:`hf_dpfilter.proofs.first_step_check`) then verifies example by example. The hook with the check turned
off (``dp_verify_first_step=False``) is refused: nothing would verify it. (A trainer class whose loss is per
example by construction may declare so with the class attribute ``per_example_loss_verified = True``; the
library's privacy audit does, for its canary loss.)

The per-example losses support label smoothing exactly (the smoothed cross-entropy of the Trainer's
``LabelSmoother``, token by token, averaged over each example's own tokens, not over the batch's), and
``compute_per_example_loss`` passes ``label_smoothing_factor``; the fields table
(:mod:`hf_dpfilter.run.training_fields`) refuses ``label_smoothing_factor > 0`` today, so it only takes effect
once that row honours it.

PEFT prompt learning (prompt tuning, P-tuning, prefix tuning) is refused: its virtual-token parameters are
shared by every example and broadcast inside PEFT's forward (peft 0.21 widens the prompt to the batch and
then repeats it per example, B^2 rows), outside any module the engine records per example, and for causal
LMs the logits then include virtual tokens the labels do not have.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LossPolicyError", "check_hook_verified_when_sharded", "check_loss_policy",
           "check_prompt_learning"]


class LossPolicyError(ValueError):
    """A loss that may couple examples, with no per-example loss supplied through the documented hook."""


_HOOK = (
    "To train with your own loss, override DPTrainer.compute_per_example_loss(model, inputs, labels, "
    "param_values=None) to return one loss per example, shape (batch,), each computed from that example "
    "only; the first-step check (dp_verify_first_step=True) verifies it example by example."
)


def _overrides(trainer: Any, base: type, name: str) -> bool:
    """The trainer's ``name`` is not the library's: a subclass method, or an attribute set on the instance."""
    return name in vars(trainer) or getattr(type(trainer), name) is not getattr(base, name)


def check_loss_policy(trainer: Any, base: type) -> None:
    """Refuse every batch-level loss definition unless ``compute_per_example_loss`` is overridden.

    ``base`` is the DPTrainer class whose methods are the library's own (a subclass overriding them is the
    user's).
    """
    cls = type(trainer)
    own_per_example = _overrides(trainer, base, "compute_per_example_loss")
    if own_per_example:
        # The hook is accepted because the first-step check verifies it; without the check nothing would.
        if not trainer.args.dp_verify_first_step and not getattr(cls, "per_example_loss_verified", False):
            raise LossPolicyError(
                f"{cls.__name__} overrides compute_per_example_loss and dp_verify_first_step=False: nothing "
                "would verify that each example's loss depends on that example only (a loss over the batch "
                "would train silently with unbounded per-example influence). Keep dp_verify_first_step=True "
                "(the default)."
            )
        return
    if _overrides(trainer, base, "compute_loss"):
        raise LossPolicyError(
            f"{cls.__name__} overrides compute_loss, which computes one loss for the whole batch: DPTrainer "
            "would not use it for training (each example needs its own loss, computed by DPTrainer."
            "compute_per_example_loss), and replacing it silently would train another loss than yours. "
            f"{_HOOK}"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise LossPolicyError(
            "compute_loss_func=... defines the loss over the whole batch (and normalises it by "
            f"num_items_in_batch), which couples examples; DPTrainer does not replace it silently. {_HOOK}"
        )


def check_hook_verified_when_sharded(trainer: Any, base: type) -> None:
    """FSDP2 sharding skips the first-step check (its collectives run in every forward, which the check's
    extra per-example forwards would put out of step): an overridden ``compute_per_example_loss`` would then
    train unverified."""
    cls = type(trainer)
    if _overrides(trainer, base, "compute_per_example_loss") and not getattr(cls, "per_example_loss_verified",
                                                                             False):
        raise LossPolicyError(
            f"{cls.__name__} overrides compute_per_example_loss, and the first-step check that verifies it "
            "does not run under FSDP2 sharding: nothing would verify that each example's loss depends on "
            "that example only. Verify the loss in an unsharded run first (one process, or LoRA with DDP), "
            "or use the library's loss."
        )


def check_prompt_learning(model: nn.Module) -> None:
    """Refuse PEFT prompt learning before the first step (see the module docstring)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    for name, config in configs.items():
        if getattr(config, "is_prompt_learning", False):
            kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
            raise LossPolicyError(
                f"PEFT adapter '{name}' is {kind}, a prompt-learning method: its virtual tokens are one "
                "shared prompt broadcast to the batch inside PEFT's forward, where per-example clipping "
                "cannot see each example's use of it (with micro-batch > 1 peft 0.21 repeats the widened "
                "prompt: B^2 rows), and a causal LM's logits then include the virtual tokens while the "
                "labels do not. Use LoRA (or another adapter made of Linear/Embedding layers) instead."
            )
