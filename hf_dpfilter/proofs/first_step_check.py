"""The first-step check, per example: each example's loss and gradient in the batch equal those of the example
alone.

The engine's own first-backward check (``GhostClippingEngine(verify_first_backward=True)``) compares batch
*sums* with autograd. A sum cannot see a per-example rule that is wrong per example but right in sum, nor a
loss or module that couples the examples (batch statistics, in-batch negatives in an overridden
``compute_per_example_loss``, attention across packed examples): those keep the sum of the gradients an
ordinary gradient while each example's clipped share is not its own. So, once per run, on a few examples of
the first micro-batch (:data:`EXAMPLES_CHECKED`), this check compares

* each example's loss in the batch with its loss computed alone (the example as a batch of one; for packed
  rows, its segment alone as its own row): a difference means the loss or the model couples examples;
* each example's per-example gradient as the engine holds it (``weighted_sum`` with that example's indicator)
  and its norm by the engine's norm path (ghost identity or materialised) with the ordinary autograd gradient
  of the example alone, parameter by parameter: a difference names the parameter (its layer rule is wrong per
  example, or its layer couples examples).

A mismatch raises :class:`PerExampleCheckError` before anything is released (the check runs before the first
micro-batch with two examples or more is accumulated); its message names the example's position and the
parameter, never a loss, gradient or norm value (noiseless functions of private data). "The example alone" is
that example's raw data-set row run through the training collator alone, then the trainer's own micro-batch
path with one example (:mod:`hf_dpfilter.proofs.separation` builds it), never a row sliced out of the collated
batch: what padding, packing or any other batch-wide collation does to an example is part of what is compared.
The two computations run in training mode with dropout off and the same random draws
(:mod:`hf_dpfilter.proofs.randomness`); a forward still random after that is refused, never checked in eval
mode.

This check is a sample: a few examples of one micro-batch of the run. What it proves (each rule right per
example, the model and the loss separating those examples) holds for every later step only where it does not
depend on the batch; the loss-only re-checks of :mod:`hf_dpfilter.proofs.separation` (every new micro-batch
shape, and a random schedule) are the second line over the run, and the per-micro-batch checks and
constructions are the first.

Tolerances (relative to the example's own gradient or loss, plus a floor of 1e-3 of that relative to the
whole gradient, for parameters whose gradient is zero up to rounding): float64 1e-6 (the computations alone
and in the batch group the same sums differently; some models compute parts in float32 inside a float64 model,
e.g. rotary embeddings, which moves fp64 results by ~1e-8 relative); float32 1e-4 (~1000 units of rounding
over reductions of a few thousand terms); float32 with TF32 matmuls allowed on CUDA 2e-2 (inputs rounded to
10 bits of mantissa); bf16/fp16 5e-2 (8 bits of mantissa), under autocast or where the model holds
half-precision weights (:func:`computes_in_low_precision`: a bf16 frozen base under fp32 LoRA adapters, as
``get_peft_model`` leaves a base loaded in bf16, computes its matmuls in bf16 without any autocast). A
coupling or a wrong rule moves the result by O(1) of the example's gradient, far above each; a weaker coupling
(a little attention across packed examples) is checked directly, on synthetic tokens, by
:func:`hf_dpfilter.data.packing.check_attention_stays_inside_examples`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_dpfilter.proofs.randomness import check_deterministic, checking_forward, same_draws

__all__ = ["CHECK_SEED", "EXAMPLES_CHECKED", "PerExampleCheckError", "computes_in_low_precision",
           "verify_per_example"]

#: How many examples of the first micro-batch are recomputed alone (one extra forward and backward each): the
#: first ones and the last one.
EXAMPLES_CHECKED = 4


#: the seed of the forked RNG every checking forward runs on (the in-batch one and each example alone)
CHECK_SEED = 1


class PerExampleCheckError(RuntimeError):
    """An example's loss or gradient in the batch differs from the example's own, computed alone."""


def rounds_to_tf32(device: torch.device) -> bool:
    """float32 matmuls on CUDA may round their inputs to TF32 (10-bit mantissa;
    TrainingArguments(tf32=True))."""
    return device.type == "cuda" and (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )


def computes_in_low_precision(model: nn.Module) -> bool:
    """Whether some floating-point weight of the model (trainable or frozen) is bf16 or fp16: its layers then
    compute in that precision whatever the trainable parameters' dtype, and a batch and an example alone round
    differently."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()
               if p.is_floating_point())


def loss_tolerance(dtype: torch.dtype, low_precision: bool, tf32: bool = False) -> float:
    if low_precision:
        return 5e-2
    if dtype == torch.float64:
        return 1e-6
    return 2e-2 if tf32 else 1e-4


def verify_per_example(
    engine: Any,
    model: nn.Module,
    loss_fn: Callable[[dict[str, Any], torch.Tensor], torch.Tensor],
    batch: tuple[dict[str, Any], torch.Tensor, Any],
    alone: Callable[[int], tuple[dict[str, Any], torch.Tensor, Any]],
    packed: Callable[[Any], contextlib.AbstractContextManager],
    examples: int = EXAMPLES_CHECKED,
    low_precision: bool = False,
) -> dict[str, float]:
    """Run the check (see the module docstring); returns the largest relative errors found, for the log.

    ``batch`` is ``(inputs, labels, layout)`` of the micro-batch; ``alone(i)`` the same for example i
    re-collated alone;
    ``packed(layout)`` the context that declares a layout (None: one example per row) to the engine and to the
    loss; ``loss_fn(inputs, labels)`` the per-example losses, shape (n,); ``low_precision``: bf16/fp16
    autocast.
    """
    inputs, labels, layout = batch
    params = list(engine.trainable_parameters)

    def in_batch(seed: int) -> torch.Tensor:
        with same_draws(model, seed), torch.no_grad(), packed(layout):
            return loss_fn(inputs, labels)

    with checking_forward(model):
        check_deterministic(model, in_batch, "the first micro-batch")
        verify_sum, engine.verify_first_backward = engine.verify_first_backward, False
        try:
            with packed(layout):
                n = layout.num_examples if layout is not None else labels.shape[0]
                with engine.record(batch_size=n), same_draws(model, CHECK_SEED):
                    losses = loss_fn(inputs, labels)
                    if losses.dim() != 1 or losses.shape[0] != n:
                        raise PerExampleCheckError(
                            f"compute_per_example_loss returned shape {tuple(losses.shape)} for {n} "
                            "examples; it must return one loss per example, shape (batch,)."
                        )
                grads = engine.per_example_gradients(losses)
        finally:
            engine.verify_first_backward = verify_sum
        engine_norms = grads.norms().double()
        worst = {"loss": 0.0, "norm": 0.0, "gradient": 0.0}
        # the first examples and the last one: a rule wrong at the end of the batch (an off-by-one) shows too
        checked = sorted(set(range(min(examples - 1, n))) | {n - 1}) if examples > 0 and n > 0 else []
        for i in checked:
            # one example at a time: at most two whole gradients (the engine's and the reference) are held
            indicator = torch.zeros(n, dtype=grads.dtype, device=engine_norms.device)
            indicator[i] = 1.0
            ours = grads.weighted_sum(indicator)
            one_inputs, one_labels, one_layout = alone(i)
            with packed(one_layout), same_draws(model, CHECK_SEED):
                loss_alone = loss_fn(one_inputs, one_labels)
            if loss_alone.numel() != 1:
                raise PerExampleCheckError(
                    f"compute_per_example_loss returned {loss_alone.numel()} losses for one example alone."
                )
            reference = torch.autograd.grad(loss_alone.sum(), params, allow_unused=True)
            reference = [torch.zeros_like(p) if g is None else g for g, p in zip(reference, params)]
            dtype = losses.dtype if losses.dtype == torch.float64 else torch.float32
            tol = loss_tolerance(dtype, low_precision or computes_in_low_precision(model),
                                 rounds_to_tf32(losses.device))
            in_batch, by_itself = (float(losses[i].detach().double()),
                                   float(loss_alone.detach().double().sum()))
            loss_error = abs(in_batch - by_itself) / max(abs(by_itself), 1e-12)
            worst["loss"] = max(worst["loss"], loss_error)
            if abs(in_batch - by_itself) > tol * max(abs(by_itself), 1e-6):
                raise PerExampleCheckError(
                    f"Example {i} of the first micro-batch has another loss in the batch than computed alone "
                    f"(beyond the tolerance {tol:.0e}): the loss or the model couples examples (a loss over "
                    "the batch such as in-batch negatives, batch statistics, attention across the examples "
                    "packed in a row, or left padding with a model that numbers positions from the first "
                    "column: pad on the right). Each example's loss must depend on that example only; "
                    "per-example clipping would not bound its influence."
                )
            total = sum(float(g.double().norm()) ** 2 for g in reference) ** 0.5
            # a parameter whose exact gradient is 0 (a key bias under softmax's shift invariance) carries the
            # rounding of the whole gradient: a few ulps of the run's dtype times the total (measured: 1.1e-7
            # of the total in float32, past the 1e-7 that tol * 1e-3 allows), far inside what the norm check
            # below allows (tol * total)
            floor = max(tol * 1e-3, 16 * torch.finfo(dtype).eps) * total
            norm_error = abs(float(engine_norms[i]) - total) / max(total, 1e-30)
            worst["norm"] = max(worst["norm"], norm_error)
            for param, ref in zip(params, reference):
                mine = ours.get(param)
                mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
                err = float((mine - ref).double().norm())
                scale = float(ref.double().norm())
                worst["gradient"] = max(worst["gradient"], err / max(scale + floor / tol, 1e-30))
                if err > tol * scale + floor + 1e-12:
                    raise PerExampleCheckError(
                        f"The per-example gradient of '{engine.parameter_name(param)}' for example {i} of "
                        "the first micro-batch differs from the gradient of that example computed alone "
                        f"(beyond the tolerance {tol:.0e}): the rule of its layer is wrong per example (even "
                        "if right in sum), or the layer couples examples (batch statistics). Freeze the "
                        "parameter, or fix or register the layer's rule (hf_dpfilter.register_grad_rule)."
                    )
            if abs(float(engine_norms[i]) - total) > tol * total + 1e-12:
                raise PerExampleCheckError(
                    f"The engine's norm of example {i}'s gradient differs from the norm of its gradient "
                    f"computed alone (beyond the tolerance {tol:.0e}): the per-example norm path is wrong."
                )
    return worst
