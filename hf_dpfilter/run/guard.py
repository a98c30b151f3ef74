"""What ``DPTrainer`` checks when it is created and when ``train()`` starts, beyond the arguments themselves.

The privacy plan is computed once, from the arguments and the training set as they are when the ``DPTrainer``
is created. Everything the training loop later reads must still say the same when it runs:

* the refusals of :mod:`hf_dpfilter.run.training_fields` (stage ``"trainer"``: values set after the arguments
  were built, e.g. ``gradient_accumulation_steps`` written by the Trainer from ``accelerator_config``);
* the planned DP settings, the logical batch and the world size are the planned ones;
* one ``train()`` per trainer once a step was released (its noise was calibrated for one run);
* no ``model_init`` (the clipping engine and the plan belong to one model), and the model, the loss and the
  size of the training set are still those of creation (``trainer.model``, ``compute_loss_func``,
  ``train_dataset`` set afterwards are refused);
* no hook that would see a gradient before the noise (:mod:`hf_dpfilter.proofs.hooks`; again at every step)
  and no ``WANDB_WATCH=gradients|all`` in the environment;
* no evaluation or prediction set shares a row with the training set (:mod:`hf_dpfilter.run.eval_overlap`;
  again at every evaluation and prediction) unless ``dp_allow_eval_on_training_rows=True``; an evaluation that
  picks checkpoints, drives the learning rate or stops the run needs ``dp_eval_disjoint_from_train=True`` and
  shares no row with it whatever the opt-in.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from hf_dpfilter.proofs.hooks import refuse_gradient_hooks, refuse_wandb_watch_gradients
from hf_dpfilter.run.eval_overlap import EvalRowsGuard, overlapping_rows
from hf_dpfilter.run.training_fields import TrainingFieldError, check_training_fields, eval_driven_features

if TYPE_CHECKING:
    from transformers import Trainer  # the DPTrainerMixin subclass of one (built above this room)

__all__ = ["RunGuard", "overlapping_rows"]

#: DP settings the plan is built from; a change after DPTrainer creation would be silently ignored
PLANNED_DP_FIELDS = (
    "dp_method", "dp_method_args", "target_epsilon", "target_delta", "noise_multiplier",
    "per_sample_max_grad_norm",
    "clipping_fn", "logical_batch_size", "poisson_sampling", "accountant", "dp_seed", "secure_rng",
)
#: fields whose values are secret: a message names the change, never the values
SECRET_FIELDS = ("dp_seed",)


class RunGuard:
    """Snapshot of what the plan was built from (at DPTrainer creation), and the checks run before
    training."""

    def __init__(self, trainer: Trainer, library_class: type) -> None:
        """``library_class``: the class whose methods are the library's own (``DPTrainerMixin``), for the loss
        policy (a method of a subclass is the user's)."""
        self.library_class = library_class
        args = trainer.args
        self.planned = {name: copy.deepcopy(getattr(args, name, None)) for name in PLANNED_DP_FIELDS}
        self.world_size = max(1, args.world_size)
        self.eval_rows = EvalRowsGuard()  # each eval set's verdict, kept: its rows are hashed once
        self.check(trainer)

    def check(self, trainer: Trainer) -> None:
        """Everything that must hold before a step is released (raises with the fix)."""
        if trainer.model_init is not None:
            raise TrainingFieldError(
                "model_init is not supported by DPTrainer: train() would build a new model while the "
                "clipping engine and the privacy plan stay attached to the first one (hyperparameter_search "
                "needs it, and each trial would be a new release of the same data). Pass model=... and "
                "create one DPTrainer per run; account every run you publish or select from."
            )
        check_training_fields(trainer.args, "trainer")
        if trainer.privacy_plan.is_private:  # hooks that would see unclipped gradients (proofs/hooks.py)
            refuse_wandb_watch_gradients()
            refuse_gradient_hooks(trainer.model)
        self._check_model_loss_and_data(trainer)
        self._check_plan_inputs(trainer)
        self._check_evaluation(trainer)

    def before_train(self, trainer: Trainer) -> None:
        """Called at the start of every ``train()``: refuse a second run of the same trainer, then
        :meth:`check`."""
        plan = trainer.privacy_plan
        released = trainer.accountant.steps
        if trainer.dp_optimizer is not None:
            released = max(released, trainer.dp_optimizer.dp_steps)
        if plan.is_private and released > 0:
            raise RuntimeError(
                f"train() was already run on this DPTrainer and released {released} noisy steps; its noise "
                f"was calibrated for one run of {plan.steps} steps, so a second run would spend beyond the "
                "plan"
                + (f" (target_epsilon={plan.target_epsilon})" if plan.target_epsilon is not None else "")
                + ". Create a new DPTrainer for a new run; to continue this one, create it with the same "
                  "arguments "
                "and call train(resume_from_checkpoint=...), which restores and keeps counting the spent "
                "steps."
            )
        self.check(trainer)

    # ------------------------------------------------------------------------------------------ checks
    def _check_model_loss_and_data(self, trainer: Trainer) -> None:
        """The model, the loss and the training set the plan and the clipping engine were built for, at
        creation; attributes set on the trainer afterwards would otherwise be used unchecked or silently
        ignored."""
        from hf_dpfilter.proofs.loss_policy import check_loss_policy, check_prompt_learning

        engine = getattr(trainer, "engine", None)
        if engine is not None and engine.model is not trainer.model:
            raise TrainingFieldError(
                "trainer.model was replaced after the DPTrainer was created: the clipping engine is attached "
                "to the model given at creation, so the new one's per-example gradients would not be "
                "clipped. Create a new DPTrainer for the new model."
            )
        check_loss_policy(trainer, self.library_class)  # compute_loss_func set on the trainer after creation
        check_prompt_learning(trainer.model)
        dataset = trainer.train_dataset
        size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        from hf_dpfilter.data.units import planned_dataset_size

        # privacy_unit='user': the examples the users were read from
        if size != planned_dataset_size(trainer):
            raise TrainingFieldError(
                f"trainer.train_dataset now has {size} examples but the privacy plan (sample rate, delta, "
                f"noise) was computed for {trainer.privacy_plan.num_examples}. Create a new DPTrainer with "
                "the training set."
            )

    def _check_plan_inputs(self, trainer: Trainer) -> None:
        args, plan = trainer.args, trainer.privacy_plan
        for name, value in self.planned.items():
            now = getattr(args, name, None)
            if now != value:
                change = "" if name in SECRET_FIELDS else f" from {value!r} to {now!r}"
                raise TrainingFieldError(
                    f"args.{name} was changed{change} after the DPTrainer was created, but the privacy plan "
                    "(noise, sample rate, clipping, accounting) was computed from the value at creation. Set "
                    "it before creating the DPTrainer (create a new DPTrainer)."
                )
        world = max(1, args.world_size)
        if world != self.world_size:
            raise TrainingFieldError(
                f"The run has {world} processes but the privacy plan was computed for {self.world_size}. "
                "Create the DPTrainer in the processes that train."
            )
        batch = args.logical_batch_size or args.per_device_train_batch_size * world
        if float(batch) != plan.expected_batch_size:
            raise TrainingFieldError(
                f"The logical batch is now {batch} examples (per_device_train_batch_size="
                f"{args.per_device_train_batch_size} x {world} processes) but the privacy plan was computed "
                f"for {plan.expected_batch_size:g}. Set logical_batch_size (or per_device_train_batch_size) "
                "before creating the DPTrainer; per_device_train_batch_size alone only sets the micro-batch "
                "once logical_batch_size is given."
            )
        accelerator = getattr(trainer, "accelerator", None)
        accumulation = getattr(accelerator, "gradient_accumulation_steps",
                               1) if accelerator is not None else 1
        if accumulation not in (None, 1):
            raise TrainingFieldError(
                f"The accelerator accumulates gradients over {accumulation} batches: Poisson batches would "
                "be merged into one noisy step, accounted once. Remove gradient accumulation from the "
                "accelerator's configuration and set DPTrainingArguments(logical_batch_size=...) instead."
            )

    def _check_evaluation(self, trainer: Trainer) -> None:
        args = trainer.args
        evals = _eval_datasets(trainer.eval_dataset)
        train = trainer.train_dataset
        for name, dataset in evals:
            if dataset is train or _same_fingerprint(dataset, train):
                raise TrainingFieldError(
                    f"eval_dataset{name} is the training set: its evaluation loss and metrics are computed "
                    "from the private examples without noise and published (logs, trainer_state.json). "
                    "Evaluate a held-out split (e.g. the validation split), or remove eval_dataset."
                )
        driven = eval_driven_features(args) + _early_stopping(trainer)
        if driven and not args.dp_eval_disjoint_from_train:
            raise TrainingFieldError(
                f"{', '.join(driven)}: an evaluation metric would pick checkpoints, drive the learning rate "
                "or stop the run, unaccounted. If eval_dataset is a held-out split sharing no example with "
                "the training set, declare it with dp_eval_disjoint_from_train=True; otherwise remove these "
                "settings."
            )
        for name, dataset in evals:
            self.check_eval_set(trainer, dataset, f"eval_dataset{name}", driven)

    def check_eval_set(self, trainer: Trainer, dataset: Any, label: str,
                       driven: list[str] | None = None) -> None:
        """Refuse an evaluation (or prediction) set that shares a row with the training set, before anything
        is computed on it (:mod:`hf_dpfilter.run.eval_overlap`): at creation, when ``train()`` starts, and at
        every evaluation and prediction (``get_eval_dataloader``/``get_test_dataloader``)."""
        if isinstance(dataset, str):  # the Trainer's key into a dict of eval sets
            dataset, label = trainer.eval_dataset[dataset], f"eval_dataset[{dataset!r}]"
        elif dataset is None:
            dataset = trainer.eval_dataset
        if isinstance(dataset, dict):
            for key, value in dataset.items():
                self.check_eval_set(trainer, value, f"eval_dataset[{key!r}]", driven)
            return
        if dataset is None:
            return
        args = trainer.args
        self.eval_rows.check(
            trainer.train_dataset, dataset, label, private=trainer.privacy_plan.is_private,
            allowed=args.dp_allow_eval_on_training_rows, disjoint=args.dp_eval_disjoint_from_train,
            driven=eval_driven_features(args) + _early_stopping(trainer) if driven is None else driven,
        )


def _eval_datasets(eval_dataset: Any) -> list[tuple[str, Any]]:
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"[{key!r}]", value) for key, value in eval_dataset.items()]
    return [("", eval_dataset)]


def _same_fingerprint(a: Any, b: Any) -> bool:
    fa, fb = getattr(a, "_fingerprint", None), getattr(b, "_fingerprint", None)
    return fa is not None and fa == fb


def _early_stopping(trainer: Trainer) -> list[str]:
    from transformers import EarlyStoppingCallback

    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    return ["EarlyStoppingCallback"] if any(isinstance(c, EarlyStoppingCallback) for c in callbacks) else []
