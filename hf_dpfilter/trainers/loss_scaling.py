"""fp16 loss scaling that releases nothing the noise does not cover: :class:`DPLossScaler`.

fp16 has 5 exponent bits: output gradients below ~6e-8 underflow to zero and above 65504 overflow to inf. Loss
scaling multiplies the loss by a scale S before the backward so that small gradients stay representable, and
divides S out afterwards. Here S is always a power of two, and three things hold:

* **Exact clipping of the scaled gradients.** The engine's backward runs on ``S * sum_i loss_i``, so its terms
  are those of ``S g_i``; :class:`~hf_dpfilter.engine.PerExampleGradients` divides the float64 squared norms
  and their rounding bounds by ``S^2`` and the fp32/fp64 clip coefficients by ``S``. Dividing by a power of
  two changes only the exponent: no rounding, so the proven bound of ``||S g_i||`` divided by S is a proven
  bound of ``||g_i||`` and every example is clipped to C as without scaling (the clipped sum equals the
  unscaled run's up to the fp16 rounding of the backward itself; tests/trainers/test_loss_scaling.py).
* **Overflow is decided per example, before the release.** An example whose loss or gradient norm is NaN/inf
  (an fp16 overflow in its own backward: the batch axis is proven separate, so it stays in its own rows) is
  replaced by the zero vector (:func:`hf_dpfilter.optimizers.clipping.zero_nonfinite_examples`), a
  deterministic function of that example alone, within the sensitivity C like any clipped contribution. No
  batch-level "any inf?" test reads the sum of the private gradients: that is ``torch.amp.GradScaler``'s rule
  (skip the step when any gradient is inf), a noiseless function of one example that would decide whether the
  step is released.
* **The scale moves only on released quantities.** :meth:`DPLossScaler.after_noise` reads the *noised*
  gradient of the step (post-processing): a non-finite noised gradient skips the base optimizer's update and
  halves S; ``growth_interval`` finite noised steps in a row double it (0: never grows). A skipped step is
  still a release and is accounted (one privacy step = one accounted step, whatever the scaler decides).

What is given up, and why: GradScaler lowers its scale on the overflow of private gradients; here an example
that overflows is dropped (zeroed) instead, and how many were dropped is a noiseless count of private data
that the scaler never reads (it is kept in memory and published only with ``dp_log_nonprivate_metrics``). So
pick a scale that leaves room: the per-example losses are summed, not averaged over the batch, so one
example's gradient at the logits is at most ~2 S in fp16 and ``DEFAULT_INIT_SCALE`` = 2^10 keeps it far below
65504.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEFAULT_INIT_SCALE", "FP16_METHODS", "MAX_INIT_SCALE", "DPLossScaler", "all_finite",
           "check_fp16_method"]

#: the default fp16 loss scale: 2^10 (see the module docstring)
DEFAULT_INIT_SCALE = 2.0**10
#: the largest scale accepted: a cross-entropy's gradient at the logits has entries up to 1 per example, so S
#: of them reach S; from 2^16 on that is past fp16's largest value (65504) and every confidently wrong example
#: overflows and is zeroed, silently (how many is a private count)
MAX_INIT_SCALE = 2.0**15


def _check_power_of_two(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5):
        raise ValueError(f"{name} must be a power of two (dividing it out is then exact), got {value!r}.")


#: the methods trained with fp16 loss scaling: their optimizer state follows the noised gradient only. The
#: others keep state tied to every base step (DiSK's parameter change, DIFF2's rounds, DiceSGD's residual,
#: PMLF's snapshots), which a step the scaler does not apply would desynchronise: refused until that is
#: modelled
FP16_METHODS = ("dpsgd", "none")


def check_fp16_method(method: str, scale: float, source: str | None = None) -> None:
    """Refuse fp16 with a method whose state a skipped step would desynchronise, or a scale that is not 2^k.

    ``source`` names how fp16 was asked for when not by ``fp16=True`` (Accelerate's mixed precision)."""
    if method not in FP16_METHODS:
        asked = "fp16=True" if source is None else f"fp16 ({source})"
        raise ValueError(
            f"{asked} is supported with dp_method in {FP16_METHODS}, not {method!r}: a step the loss scaler "
            "does not apply (a non-finite noised gradient) would desynchronise that method's state, which "
            "follows every base optimizer step. Use bf16=True (same memory, no loss scaling needed) or fp32 "
            "with this method."
        )
    _check_power_of_two("dp_fp16_loss_scale", float(scale))
    if scale > MAX_INIT_SCALE:
        raise ValueError(
            f"dp_fp16_loss_scale={scale:g} is above 2^15: a cross-entropy's gradient at the logits has "
            "entries up to 1 per example, S times that passes fp16's largest value (65504), and every "
            "example that overflows is replaced by zero without a trace (their number is private). Use at "
            "most 2^15 (default 2^10)."
        )


def all_finite(tensors: dict[Any, torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one device sync per device)."""
    flags = [torch.isfinite(t).all() for t in tensors.values()]
    return all(bool(f) for f in flags)


@dataclass
class DPLossScaler:
    """The fp16 loss scale of a DP run: a public power of two, moved only by noised (released) quantities.

    ``scale`` multiplies the summed per-example losses before the engine's backward (the engine divides it out
    exactly). After the noise of each step, :meth:`after_noise` is given the noised gradient: non-finite means
    skip the base optimizer's update and multiply the scale by ``backoff_factor``; ``growth_interval`` finite
    steps in a row (0: never) multiply it by ``growth_factor``. Nothing else ever changes the scale.
    """

    scale: float = DEFAULT_INIT_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 0
    min_scale: float = 1.0
    max_scale: float = 2.0**16
    #: finite noised steps since the last change (public: a function of released gradients)
    finite_steps: int = 0
    #: steps whose noised gradient was non-finite, so the base update was skipped (public, accounted)
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            _check_power_of_two(name, float(getattr(self, name)))
        if self.growth_interval < 0:
            raise ValueError(f"growth_interval must be >= 0, got {self.growth_interval}.")
        self.scale = float(self.scale)

    def after_noise(self, noised: dict[Any, torch.Tensor]) -> bool:
        """Whether the base optimizer may apply this step's *noised* gradient; updates the scale.

        Reads only ``noised``, the privatized gradient already released to the optimizer, so the decision and
        the new scale are post-processing of the release (no extra privacy cost)."""
        finite = all_finite(noised)
        self.update(finite)
        return finite

    def update(self, noised_finite: bool) -> None:
        """The scale after a step whose noised gradient was (not) finite: the only way the scale changes."""
        if not noised_finite:
            self.skipped_steps += 1
            self.finite_steps = 0
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self.finite_steps += 1
        if self.growth_interval and self.finite_steps >= self.growth_interval:
            self.finite_steps = 0
            self.scale = min(self.max_scale, self.scale * self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        """Public state (saved with the DP optimizer's checkpoint)."""
        return {"scale": self.scale, "finite_steps": self.finite_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_power_of_two("scale", float(state["scale"]))
        self.scale = float(state["scale"])
        self.finite_steps = int(state.get("finite_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


def attach_loss_scaler(trainer: Any) -> None:
    """fp16 (``fp16=True``, or Accelerate's mixed precision): give the trainer's DP optimizer a
    :class:`DPLossScaler`; take Accelerate's ``GradScaler`` away in every run.

    Accelerate builds a ``torch.amp.GradScaler`` for fp16 on an accelerator and wraps the optimizer's step in
    ``scaler.step`` / ``scaler.update``, which skip the step when *any* gradient is inf: a noiseless function
    of the private batch (and here ``p.grad`` is empty until the DP optimizer fills it). The DP optimizer
    scales, divides out and decides instead, so the accelerator's scaler is removed before ``prepare`` wraps
    the optimizer; fp16 autocast (Accelerate's wrapping of the model's forward) is kept.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and getattr(accelerator, "scaler", None) is not None:
        # whatever asked for it: its skip test reads private gradients without noise
        accelerator.scaler = None
    fp16 = getattr(trainer.args, "fp16", False) or getattr(accelerator, "mixed_precision", "no") == "fp16"
    if not fp16:
        return
    # the accelerator's own precision too (arguments changed after it was built): checked before any step
    check_fp16_method(trainer.args.dp_method, float(trainer.args.dp_fp16_loss_scale),
                      source="the accelerator's mixed_precision='fp16'")
    trainer.dp_optimizer.loss_scaler = DPLossScaler(scale=float(trainer.args.dp_fp16_loss_scale))
