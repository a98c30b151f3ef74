"""What a run says while it trains: epsilon at every epoch's end and at the last step, and how long it will
take when that is more than a few minutes.

* Epsilon is added to every log line by ``DPTrainerMixin.log``; the Trainer logs every ``logging_steps``
  steps, so a run shorter than ``logging_steps`` (or an epoch ending between two log lines) would show no
  epsilon until the final metrics. :class:`ProgressCallback` asks the Trainer for one more log line at each
  epoch's end and at the last step, unless a line was just logged at that step (``logging_strategy="no"`` is
  the user's choice and is kept). Epsilon is public: a function of the plan and the step count only.
* After the first step of ``train()``, when the remaining planned steps at that step's duration would take
  longer than :data:`ESTIMATE_ABOVE_SECONDS`, the expected duration and how to shorten it are printed once, on
  the main process, as a WARNING of this module's logger (stderr, where the plan banner is). Never in a log
  line: ``log_history`` is written to ``trainer_state.json``, which users publish, and a step's duration
  grows with the size and the length of its secret Poisson batch.
"""

from __future__ import annotations

import logging
from time import monotonic
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

if TYPE_CHECKING:
    from transformers import Trainer  # the DPTrainerMixin subclass of one (built above this room)

__all__ = ["ESTIMATE_ABOVE_SECONDS", "ProgressCallback", "duration_estimate"]

logger = logging.getLogger(__name__)

#: a run expected to take longer than this (seconds, after its first step) says how long and how to shorten it
ESTIMATE_ABOVE_SECONDS = 300.0


def _clock() -> float:
    # a module-level reader of the monotonic clock, so that tests replace the clock here, never time itself
    return monotonic()


def _duration(seconds: float) -> str:
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = minutes / 60
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def duration_estimate(trainer: Trainer, step_seconds: float, steps_left: int) -> str:
    """The expected duration of the rest of a run and how to shorten it (one message, public except for the
    step's duration, which is printed only).

    Args:
        trainer: the ``DPTrainer`` (its plan and arguments).
        step_seconds: the measured duration of one logical step.
        steps_left: the planned steps still to run.
    """
    plan, args = trainer.privacy_plan, trainer.args
    per_epoch = plan.steps_per_epoch or 1
    micro = args.per_device_train_batch_size
    batch = plan.expected_batch_size
    return (
        f"***** Expected duration: about {_duration(step_seconds * steps_left)} for the {steps_left:,} "
        f"remaining steps ({step_seconds:.3g} s for the first step, which also ran the one-time checks; "
        "evaluation and saving not counted). To shorten it: fewer num_train_epochs "
        f"({per_epoch:,} steps per epoch) or a smaller max_steps, or a smaller training set (both change the "
        "plan: a target_epsilon run is recalibrated, a fixed noise_multiplier spends less); or, if memory "
        f"allows, a larger per_device_train_batch_size (now {micro}: each step of an expected {batch:g} "
        "examples is computed in fewer micro-batches; the privacy is unchanged). *****"
    )


class ProgressCallback(TrainerCallback):
    """Epsilon logged at every epoch's end and at the last step; the duration estimate after the first step
    (see the module docstring). Added by ``DPTrainerMixin``."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._logged_at: int | None = None  # the step of the last log line
        self._first_step: tuple[int, float] | None = None  # (step, start time) of train()'s first step

    def _wants_epsilon(self, args: TrainingArguments, state: TrainerState) -> bool:
        return (self.trainer.privacy_plan.is_private and args.logging_strategy != IntervalStrategy.NO
                and self._logged_at != state.global_step and state.global_step > 0)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._logged_at, self._first_step = None, None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._first_step is None:
            self._first_step = (state.global_step, _clock())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._first_step is not None and self._first_step[0] == state.global_step - 1:
            seconds = _clock() - self._first_step[1]
            self._first_step = (-1, 0.0)  # once per train()
            steps_left = max(0, state.max_steps - state.global_step)
            if seconds * steps_left > ESTIMATE_ABOVE_SECONDS and self.trainer.is_world_process_zero():
                logger.warning("%s", duration_estimate(self.trainer, seconds, steps_left))
        if state.global_step >= state.max_steps and self._wants_epsilon(args, state):
            control.should_log = True

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._wants_epsilon(args, state):
            control.should_log = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._logged_at = state.global_step
