"""The one entry of the per-micro-batch proofs: each micro-batch checked (or not) before it is accumulated.

:class:`SeparationChecks` is what the trainer calls once per micro-batch of a logical batch, before the
micro-batch's clipped gradients are accumulated (so before the optimizer step that would release them). It
holds the proofs that compare an example in its micro-batch with the same example *re-collated alone* (its raw
data-set row through the training collator alone, then the trainer's micro-batch path with one example, built
by the trainer's ``alone`` callable; the keys the collator draws at random keep the example's draw in the
micro-batch, :mod:`hf_dpfilter.proofs.collator_draws`), all in training mode with dropout off and the same
random draws (:mod:`hf_dpfilter.proofs.randomness`; a forward still random is refused):

* the **first-step check** (:mod:`hf_dpfilter.proofs.first_step_check`), once per run, on the first
  micro-batch with two examples or more: losses, per-example gradients and norms of a few examples against
  autograd alone;
* the **re-checks**, loss only (no backward; two forwards: the micro-batch's and one
  example's): one example of the micro-batch, chosen at random among those with a non-zero loss (an example
  whose every label is ignored has loss 0 whatever the others do), in the micro-batch and alone. The forward
  is proven deterministic (dropout off) by the first-step check (before it, only micro-batches of one example
  come, which cannot mix examples); on a mismatch the micro-batch runs again under another seed, to refuse a
  random forward as such. When the model has no dropout to turn off
  (:func:`~hf_dpfilter.proofs.randomness.dropout_free`), the training forward is the checking forward: the
  trainer then runs the re-check after the micro-batch's own training forward (before the step is released) on
  that forward's per-example losses, one forward more (the example's alone) instead of two, and compares the
  loss the released gradient comes from (a coupling that only a forward recording gradients takes shows too).
  A re-check runs on every micro-batch whose shape is new in the run (its longest length, padding side, number
  of examples, packed or not), and on each other micro-batch with probability ``dp_recheck_rate``. The choices
  come from a generator seeded from ``os.urandom`` that is neither the sampler's nor the noise's and is never
  saved: the checks change no batch, no noise and no dropout mask of a seeded run.

Every checking forward records gradients as the training forward does (no backward; the graph is dropped at
once), so a model branching on ``torch.is_grad_enabled()`` or on its activations' ``requires_grad`` computes
there what it computes in training.

A float32 mismatch below ``ROUNDING_BOUND`` (1e-2 relative; absolute 1e-5 for a loss under
``LOSS_ROUNDING_FLOOR``, 1e-3, as a log-softmax rounds) gets a gradient argument before it refuses, in the
run's own precision: the example's clipped gradient in its micro-batch, as the engine computes it from a
recorded forward of the micro-batch (whose loss must reproduce the compared one), against its clipped gradient
alone (autograd). ``||clip(g_batch) - clip(g_alone)|| <= GRADIENT_TOLERANCE * C`` (1e-4) passes: what the
micro-batch adds to the example's released contribution is then bounded by 1e-4 C whatever the loss shows, the
criterion is about the very vector that is summed (a rounding that moves only the loss, or only the norm of a
clipped gradient, passes; a coupling that moves the clipped vector refuses), and no precision other than the
run's is involved, so a forward branching on the dtype has nothing to hide behind. (The earlier argument
recomputed both losses in float64: a statement about float64 losses, which bounds no float32 gradient.)

What the re-checks prove: for the examples they draw, that the loss in the released micro-batch is the loss of
the example alone (no coupling through the loss, a data-dependent branch over the micro-batch, padding or
positions that depend on the others). What they cannot prove: a coupling that shows on no drawn example and no
new shape (a branch taken on a shape already seen, for examples not drawn), or one that moves the gradient but
not the loss. They are the second line; the first is what holds on every micro-batch by construction or by a
cheap check (the validators, the traced batch axis, the probed collator structure, the loss policy, the
packing and padding checks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hf_dpfilter.proofs.first_step_check import (
    CHECK_SEED,
    PerExampleCheckError,
    computes_in_low_precision,
    loss_tolerance,
    rounds_to_tf32,
    verify_per_example,
)
from hf_dpfilter.proofs.randomness import check_deterministic, checking_forward, dropout_free, same_draws

#: the largest relative float32 loss mismatch the gradient argument may settle (measured: up to 8e-4 on a
#: confident model's top layers); a larger one refuses without it
ROUNDING_BOUND = 1e-2
#: how far (in units of C) an example's clipped gradient in its micro-batch may be from its clipped gradient
#: alone for a loss mismatch under ROUNDING_BOUND to pass: the bound on what the micro-batch adds to its
#: contribution
GRADIENT_TOLERANCE = 1e-4
#: the loss below which ROUNDING_BOUND is an absolute bound (ROUNDING_BOUND x LOSS_ROUNDING_FLOOR = 1e-5, 84
#: float32 ulps of 1): a per-example loss through a log-softmax is log(1 + sum_j exp(z_j - z_y)), a sum with
#: a term of order 1, so its float32 rounding is absolute, a few ulps of 1 however small the loss; a
#: confident example (loss 1e-5) shows a relative mismatch past ROUNDING_BOUND from rounding alone (the likely
#: cause of a full MiniLM fine-tune stopped at its 3,011th micro-batch). It only admits the mismatch to the
#: gradient argument, which alone passes it
LOSS_ROUNDING_FLOOR = 1e-3

__all__ = [
    "DEFAULT_RECHECK_RATE", "GRADIENT_TOLERANCE", "LOSS_ROUNDING_FLOOR", "ROUNDING_BOUND", "SeparationChecks",
    "SeparationError", "micro_batch_shape",
]

logger = logging.getLogger(__name__)

#: The default probability that a micro-batch whose shape was seen before is re-checked: two forwards without
#: gradient (the micro-batch's, one example's alone) against a step's forward and ghost-clipping backward;
#: measured on CPU with ``python -m benchmarks recheck-cost`` (docs/performance.md).
DEFAULT_RECHECK_RATE = 0.05

MicroBatch = tuple[dict[str, Any], torch.Tensor, Any]


class SeparationError(PerExampleCheckError):
    """A re-check found an example whose loss in its micro-batch differs from its loss re-collated alone."""


def _count(micro_batch: MicroBatch) -> int:
    _, labels, layout = micro_batch
    return labels.shape[0] if layout is None else layout.num_examples


def micro_batch_shape(micro_batch: MicroBatch) -> tuple:
    """What makes a micro-batch's shape new: (packed, number of examples, longest length, padding side).

    The padding side is read from the ``attention_mask`` (a column of padding in every row at the start: left;
    none: no leading padding); the longest length is the width the model sees (the packed row's, or the padded
    one's)."""
    inputs, labels, layout = micro_batch
    if layout is not None:
        return ("packed", layout.num_examples, layout.length, "none")
    mask = inputs.get("attention_mask")
    width = labels.shape[1] if labels.dim() >= 2 else None
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        width = ids.shape[1]
    side = "none"
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        if bool((mask[:, 0] == 0).any()):
            side = "left"
        elif bool((mask[:, -1] == 0).any()):
            side = "right"
    return ("padded", labels.shape[0], width, side)


def _unclipped(norms: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(norms)


class SeparationChecks:
    """The per-micro-batch proofs of a run (see the module docstring); :meth:`before_accumulate` is the entry.

    ``loss_fn(inputs, labels)``: the trainer's per-example losses; ``packed(layout)``: the context declaring a
    micro-batch's layout to the loss and the engine; ``alone(raw, micro_batch, i, each_row)``: the micro-batch
    of one raw example collated alone, example ``i`` of ``micro_batch`` (whose draws of the collator's random
    keys it keeps; ``each_row``: the random keys also probed on that row); ``first_step``: run the first-step
    check (False: done, or turned off); ``rate``: ``dp_recheck_rate``. ``clipping()``: (C, the run's clip
    factors of per-example norms), for the gradient argument of a loss mismatch under ROUNDING_BOUND (None: no
    argument, such a mismatch refuses).
    """

    def __init__(
        self,
        engine: Any,
        loss_fn: Callable[[dict[str, Any], torch.Tensor], torch.Tensor],
        packed: Callable[[Any], contextlib.AbstractContextManager],
        alone: Callable[[Any, MicroBatch, int, bool], MicroBatch],
        *,
        first_step: bool,
        rechecks: bool,
        rate: float,
        min_examples: int,
        low_precision: bool = False,
        clipping: Callable[[], tuple[float, Callable[[torch.Tensor], torch.Tensor]]] | None = None,
    ) -> None:
        self.engine = engine
        self.clipping = clipping
        self.loss_fn = loss_fn
        self.packed = packed
        self.alone = alone
        self.first_step_pending = first_step
        self.rechecks = rechecks
        self.rate = float(rate)
        self.min_examples = min_examples
        self.low_precision = low_precision
        self.seen: set[tuple] = set()
        self.micro_batches = 0  # micro-batches seen by the entry (for the messages)
        self.rechecks_run = 0
        self.rounding_rechecks = 0  # loss mismatches the clipped gradients settled (counted, never logged)
        # not the sampler's, not the noise's, not torch's global stream; never saved
        self._choices = random.Random(int.from_bytes(os.urandom(8), "little"))

    def before_accumulate(
        self, model: nn.Module, micro_batch: MicroBatch, raw: Sequence[Any] | None, *,
        step_losses: bool = False,
        per_unit: bool = False,
    ) -> Callable[[torch.Tensor | None], None] | None:
        """Check one micro-batch before it is accumulated; raises before anything of its step is released.

        ``raw``: the raw examples of the micro-batch, in its order (the i-th example of ``micro_batch`` is
        ``raw[i]``); None when the batch did not come from the trainer's training collator. ``step_losses``:
        the caller can hand over the per-example losses of the micro-batch's own training forward at the
        current parameters (one loss per example of ``micro_batch``). When a re-check is due and that forward
        is the checking forward itself (no dropout: :func:`~hf_dpfilter.proofs.randomness.dropout_free`), the
        re-check is returned instead of run: the caller calls it with those losses (None: not available) after
        the micro-batch's forward and before the step is released, and the re-check runs one forward (the
        example's alone) instead of two, comparing the loss the released gradient comes from."""
        self.micro_batches += 1
        count = _count(micro_batch)
        if count == 0:
            return None
        shape = micro_batch_shape(micro_batch)
        if self.first_step_pending and count >= self.min_examples:
            self._first_step(model, micro_batch, self._raw(raw, count))
            self.seen.add(shape)
            return None
        if not self.rechecks:
            return None
        new = shape not in self.seen
        if new or (self.rate > 0 and self._choices.random() < self.rate):
            examples, why = self._raw(raw, count), "a new shape" if new else "the schedule"
            if step_losses and dropout_free(model):

                def recheck_on_step_losses(losses: torch.Tensor | None) -> None:
                    self.recheck(model, micro_batch, examples, why, losses, per_unit=per_unit)
                    self.seen.add(shape)  # once passed: a shape refused stays new for a train() run again

                return recheck_on_step_losses
            self.recheck(model, micro_batch, examples, why, per_unit=per_unit)
            # once passed: a shape refused stays new for a train() run again after a refusal
            self.seen.add(shape)
        return None

    def _raw(self, raw: Sequence[Any] | None, count: int) -> Sequence[Any]:
        if raw is None or len(raw) != count:
            raise SeparationError(
                f"A micro-batch of {count} examples reached the per-example checks with "
                f"{'no' if raw is None else len(raw)} raw examples: the checks re-collate each example alone "
                "from its data-set row, which the trainer's training collator attaches to every logical "
                "batch. Train with the batches of get_train_dataloader() (do not override it or feed "
                "training_step by hand), or set dp_verify_first_step=False to turn the per-example checks "
                "off (not with an own loss)."
            )
        return raw

    def _first_step(self, model: nn.Module, micro_batch: MicroBatch, raw: Sequence[Any]) -> None:
        verify_per_example(
            self.engine, model, self.loss_fn, micro_batch, lambda i: self.alone(raw[i], micro_batch, i, True),
            self.packed,
            low_precision=self.low_precision,
        )
        self.first_step_pending = False
        # not the errors measured: the rounding of the first examples' losses and gradients, without noise
        logger.info("First-step per-example check passed (within its public tolerance).")

    def recheck(
        self, model: nn.Module, micro_batch: MicroBatch, raw: Sequence[Any], why: str,
        step_losses: torch.Tensor | None = None, *, per_unit: bool = False,
    ) -> None:
        """Loss first: one random example of the micro-batch in it and re-collated alone, training mode,
        dropout off, the same draws, gradients recorded as in training (no backward). On a mismatch, the
        micro-batch again under another seed tells a random forward (:class:`TrainingRandomnessError`) from a
        coupling (:class:`SeparationError`), and a mismatch under ROUNDING_BOUND gets the gradient argument
        (:meth:`_same_clipped_gradient`). Two forwards when it passes (the micro-batch's and the example's);
        one (the example's) with ``step_losses``: the per-example losses of the micro-batch's own training
        forward, dropout-free (see :meth:`before_accumulate`), whose values are those of the checking forward
        (no dropout to turn off; the training forward draws no random number that matters, else the mismatch's
        second forward refuses it as random)."""
        inputs, labels, layout = micro_batch
        count = _count(micro_batch)

        def in_batch(seed: int) -> torch.Tensor:
            # recording as the training forward does: a branch on torch.is_grad_enabled() (or on an
            # activation's requires_grad) takes here the path it takes in training; the graph goes with the
            # detached losses
            with same_draws(model, seed), self.packed(layout), torch.enable_grad():
                return self.loss_fn(inputs, labels).detach()

        settled = False
        with checking_forward(model):
            reused = step_losses is not None and step_losses.dim() == 1 and step_losses.shape[0] == count
            losses = step_losses.detach().double() if reused else in_batch(CHECK_SEED).double()
            if losses.dim() != 1 or losses.shape[0] != count:
                raise SeparationError(
                    f"compute_per_example_loss returned shape {tuple(losses.shape)} for {count} examples: it "
                    "must return one loss per example, shape (batch,)."
                )
            # an example whose loss is exactly 0 (every label ignored) cannot show a coupling in its loss, and
            # one whose loss is not finite is zeroed by the optimizer: the draw is among the others, when
            # there are any
            informative = [i for i in range(count) if math.isfinite(float(losses[i]))
                           and float(losses[i]) != 0.0]
            informative = informative or list(range(count))
            index = informative[self._choices.randrange(len(informative))]
            low_precision = self.low_precision or computes_in_low_precision(model)
            mine, tol = float(losses[index]), loss_tolerance(self._dtype(model), low_precision,
                                                         rounds_to_tf32(labels.device))
            self.rechecks_run += 1
            # the collator's random keys as probed on the training set's first rows; on a mismatch, also as
            # this example's own row shows them (a first row with nothing to mask shows none: collator_draws)
            # a mismatch small enough to be rounding: the gradient argument may settle it
            rounding_size = False
            for by_itself in self._losses_alone(model, micro_batch, raw[index], index):
                by_itself = by_itself.detach().double()
                if by_itself.numel() != 1:
                    raise SeparationError(
                        f"compute_per_example_loss returned {by_itself.numel()} losses for one example "
                        "alone: it must return one loss per example."
                    )
                own = float(by_itself.sum())
                if mine == own or (math.isnan(mine)
                                   and math.isnan(own)) or abs(mine - own) <= tol * max(abs(own), 1e-6):
                    # the same loss (a non-finite one alone too: the example's own, zeroed by the optimizer)
                    return
                rounding_size = rounding_size or abs(mine - own) <= ROUNDING_BOUND * max(abs(own),
                                                                                     LOSS_ROUNDING_FLOOR)
            # random: refused as such
            check_deterministic(model, in_batch, f"micro-batch {self.micro_batches}")
            settled = rounding_size and not low_precision and self._same_clipped_gradient(
                model, micro_batch, raw[index], index, mine, tol, per_unit=per_unit)
        if settled:
            # counted, never logged: whether float32 rounding differed is a noiseless function of private data
            self.rounding_rechecks += 1
            return
        raise SeparationError(
            f"Re-check ({why}) of micro-batch {self.micro_batches}, shape {micro_batch_shape(micro_batch)}: "
            f"example {index} has another loss in the micro-batch than re-collated alone (values not shown: "
            "they are noiseless functions of private data), so "
            "the other examples of the micro-batch change its loss and per-example clipping would not bound "
            "their influence. Causes: a compute_per_example_loss normalised over the micro-batch (a mean "
            "token count, a batch-wide statistic: each example's loss must use its own inputs only), a "
            "forward hook or module with a branch or statistic over the micro-batch, padding the model "
            "attends to (return an attention_mask), or left padding with absolute positions (pad on the "
            "right). In a run that has diverged (a learning rate too high: activations far beyond their "
            "usual range), float32 rounding that differs between the two shapes can exceed the check's "
            "tolerance, and a small mismatch passes only if the example's clipped gradient in the "
            f"micro-batch is within {GRADIENT_TOLERANCE:.0e} C of its clipped gradient alone: lower the "
            "learning rate. Nothing of this step was released."
        )

    def _losses_alone(self, model: nn.Module, micro_batch: MicroBatch, raw: Any, index: int,
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The example's loss re-collated alone (detached), with the collator's random keys as probed on the
        training set's first rows, then as this example's own row shows them; recorded as in training."""
        for loss in self._alone_forwards(model, micro_batch, raw, index):
            yield loss.detach()

    def _alone_forwards(self, model: nn.Module, micro_batch: MicroBatch, raw: Any, index: int,
                        ) -> Iterator[torch.Tensor]:
        """The example's loss re-collated alone with its graph (see :meth:`_losses_alone`)."""
        for each_row in (False, True):
            one_inputs, one_labels, one_layout = self.alone(raw, micro_batch, index, each_row)
            with same_draws(model, CHECK_SEED), self.packed(one_layout), torch.enable_grad():
                loss = self.loss_fn(one_inputs, one_labels)
            yield loss  # outside the contexts: the caller's code runs on the run's own stream and grad mode

    def _same_clipped_gradient(self, model: nn.Module, micro_batch: MicroBatch, raw: Any, index: int,
                               mine: float, tol: float, *, per_unit: bool = False) -> bool:
        """The gradient argument of a small loss mismatch, in the run's own precision (inside
        checking_forward).

        The micro-batch's forward again, recorded by the engine (gradients recorded, as in training; its loss
        must reproduce ``mine``, the loss compared, within ``tol``, else this forward is not the one that was
        compared), and the engine's per-example gradient of the example, clipped by the run's clip factors:
        the vector the step sums. Against the example alone (each way the collator's random keys are probed):
        its autograd gradient, clipped the same way. Within GRADIENT_TOLERANCE * C passes, whatever the loss
        showed: the micro-batch then moves this example's contribution by at most that. ``per_unit``: the
        example is clipped with the rest of its privacy unit, so the unclipped gradients are compared
        (clipping, a projection onto the ball of radius C, moves two vectors' difference by no more than their
        distance). False without ``clipping``, or when a value is not finite."""
        if self.engine is None or self.clipping is None:
            return False
        inputs, labels, layout = micro_batch
        count, engine = _count(micro_batch), self.engine
        params = list(engine.trainable_parameters)
        bound, clip = self.clipping()
        clip = _unclipped if per_unit else clip
        verify_sum, engine.verify_first_backward = engine.verify_first_backward, False
        try:
            with self.packed(layout), torch.enable_grad():
                with engine.record(batch_size=count), same_draws(model, CHECK_SEED):
                    losses = self.loss_fn(inputs, labels)
                if losses.dim() != 1 or losses.shape[0] != count:
                    return False
                again = float(losses[index].detach().double())
                if not abs(again - mine) <= tol * max(abs(mine), 1e-6):
                    return False  # the forward recorded here is not the one whose loss was compared
                grads = engine.per_example_gradients(losses)
                factors = clip(grads.clipping_norms())
                coefficients = torch.zeros_like(factors)
                coefficients[index] = factors[index]
                ours = grads.weighted_sum(coefficients, release=True)
        finally:
            engine.verify_first_backward = verify_sum
        ours = {id(p): g.detach().double() for p, g in ours.items()}
        if not ours.keys() <= {id(p) for p in params}:
            return False  # a gradient for a parameter the engine does not train: nothing to compare it with
        for loss_alone in self._alone_forwards(model, micro_batch, raw, index):
            if loss_alone.numel() != 1 or not loss_alone.requires_grad:
                return False
            with torch.enable_grad():
                reference = torch.autograd.grad(loss_alone.sum(), params, allow_unused=True)
            reference = [torch.zeros(()) if g is None else g.detach().double() for g in reference]
            norm = math.sqrt(sum(float(g.norm()) ** 2 for g in reference))
            factor = float(clip(torch.tensor([norm], dtype=torch.float64))[0])
            # a parameter the engine holds no gradient for contributes the reference's own norm
            apart = math.sqrt(sum(
                float(((ours[id(p)] if id(p) in ours else 0.0) - factor * g).norm()) ** 2
                for p, g in zip(params, reference)
            ))
            if math.isfinite(apart) and math.isfinite(norm) and apart <= GRADIENT_TOLERANCE * bound:
                return True
        return False

    @staticmethod
    def _dtype(model: nn.Module) -> torch.dtype:
        for param in model.parameters():
            if param.is_floating_point():
                return torch.float64 if param.dtype == torch.float64 else torch.float32
        return torch.float32
