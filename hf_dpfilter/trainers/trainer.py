"""``DPTrainerMixin``: the DP glue over a ``transformers.Trainer`` loop; ``DPTrainer`` = the mixin +
``Trainer``.

Thin glue over the Trainer's own loop, through its hooks:

* ``get_train_dataloader`` yields one *logical* batch per optimizer step, Poisson-sampled (possibly empty);
* ``training_step`` splits it into micro-batches of ``per_device_train_batch_size``
  (:mod:`hf_dpfilter.data.micro_batches`), computes per-example losses (:mod:`hf_dpfilter.losses.tasks`), and
  lets the DP optimizer accumulate the clipped per-example (combinations of) gradients via the clipping
  engine;
* ``create_optimizer`` wraps the Trainer's optimizer in the DP optimizer of ``dp_method``, which alone clips,
  adds the noise once per step and records the step with the accountant (its ledger:
  :mod:`hf_dpfilter.run.session`);
* ``log`` adds the epsilon spent so far to every log line (progress bar, TensorBoard, W&B, ...).

Everything about the privacy of the run (N, q, steps, delta, sigma, the method's mechanisms, the sampler and
the randomness) comes from one :class:`hf_dpfilter.plan.PrivacyPlan`, built once from the arguments; the
engine, the optimizer and the sampler are built from it by :mod:`hf_dpfilter.factory`.

The mixin holds all of it, so another Trainer of the Hugging Face stack gets the same machinery with no copy:
``class DPSomethingTrainer(DPTrainerMixin, SomethingTrainer)`` with arguments that mix in
:class:`hf_dpfilter.trainers.arguments.DPArgumentsMixin`.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import TrainOutput

from hf_dpfilter.accounting.accountant import PrivacyAccountant
from hf_dpfilter.data import units as privacy_units
from hf_dpfilter.data.micro_batches import (
    NUM_EXAMPLES_KEY,
    RAW_EXAMPLES_KEY,
    EmptySafeCollator,
    FreshRowsCollator,
    LogicalBatchLoader,
    MicroBatchMixin,
    check_sequence_length,
    declared_padding_side,
    dropout_keys,
)
from hf_dpfilter.data.packing import PackingError, packed_token_mean_loss
from hf_dpfilter.data.row_checks import (
    check_labels_fit_the_head,
    check_training_columns,
    check_training_rows,
    collator_reads_model_inputs,
)
from hf_dpfilter.distributed.processes import check_one_dp_run
from hf_dpfilter.factory import AuditOptions, make_engine, make_optimizer, make_sampler
from hf_dpfilter.losses import question_answering as span_labels
from hf_dpfilter.losses.router import add_router_aux_loss
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.proofs import padding
from hf_dpfilter.proofs.batch_structure import probe_batch_structure
from hf_dpfilter.proofs.hooks import refuse_gradient_hooks
from hf_dpfilter.proofs.loss_policy import (
    check_hook_verified_when_sharded,
    check_loss_policy,
    check_prompt_learning,
)
from hf_dpfilter.proofs.row_examples import conversation_start_marker
from hf_dpfilter.proofs.row_segments import RowSegmentsGuard
from hf_dpfilter.proofs.separation import SeparationChecks
from hf_dpfilter.run.guard import RunGuard
from hf_dpfilter.run.progress import ProgressCallback
from hf_dpfilter.run.session import PrivacySessionMixin, _PrivacyCallback, read_privacy_ledger
from hf_dpfilter.run.start_report import announce_start
from hf_dpfilter.trainers.arguments import DPArgumentsMixin
from hf_dpfilter.trainers.loss_scaling import attach_loss_scaler

if TYPE_CHECKING:
    from hf_dpfilter.data.packing import PackedLayout
    from hf_dpfilter.engine import GhostClippingEngine
    from hf_dpfilter.optimizers.base import DPOptimizer
    from hf_dpfilter.proofs.batch_structure import BatchStructure
    from hf_dpfilter.run.ledger import PrivacyLedger

__all__ = ["NUM_EXAMPLES_KEY", "DPTrainer", "DPTrainerMixin", "read_privacy_ledger"]

logger = logging.getLogger(__name__)


def _is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return type(base).__name__ in names or type(base).__name__.endswith(("ForCausalLM", "LMHeadModel"))


class DPTrainerMixin(PrivacySessionMixin, MicroBatchMixin):
    """The DP glue of a ``transformers.Trainer`` (see the module docstring): put it first among the bases,
    ``class DPTrainer(DPTrainerMixin, Trainer)``, so that its hooks wrap the Trainer's.

    ``args`` must mix in :class:`~hf_dpfilter.trainers.arguments.DPArgumentsMixin`
    (:class:`DPTrainingArguments` does). The train dataset must have a length (N is needed for the sample rate
    and the default delta). After ``train()``, :meth:`privacy_report` gives the epsilon spent.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DPArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} needs DPTrainingArguments (a TrainingArguments subclass with the DP "
                "fields of hf_dpfilter.trainers.arguments.DPArgumentsMixin) as `args`."
            )
        self.dp_optimizer: DPOptimizer | None = None
        self.engine: GhostClippingEngine | None = None
        self._batch_structure: BatchStructure | None = None  # probed on the training collator
        self._packed_layout: PackedLayout | None = None  # the packed micro-batch being computed, if any
        # the per-micro-batch proofs, built at the first step
        self._separation: SeparationChecks | None = None
        self._packing_checked = False  # packed rows: attention proven to stay inside each example, once
        check_loss_policy(self, DPTrainerMixin)
        check_prompt_learning(self.model)
        self._setup_privacy()
        self.add_callback(_PrivacyCallback(self))
        self.add_callback(ProgressCallback(self))  # epsilon at each epoch's end; the duration estimate
        # What the plan was computed from; checked again when train() starts (hf_dpfilter/run/guard.py).
        self._run_guard = RunGuard(self, DPTrainerMixin)

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``, after the checks of :class:`hf_dpfilter.run.guard.RunGuard` (one run per
        trainer; the arguments, batch and processes the plan was computed for)."""
        self._run_guard.before_train(self)
        self._refuse_seed_to_loggers()  # callbacks may have been added since the trainer was created
        self._refuse_nonprivate_statistics()  # and the arguments changed (include_num_input_tokens_seen)
        if self.dp_optimizer is not None:
            # a train() refused part-way through a step (a re-check, a hook) left the clipped sums of its
            # first micro-batches, never released: kept, the next step would add them to its own (another
            # Poisson sample in it, an example sampled in both counted twice). The Trainer zeroes the model,
            # not them.
            self.dp_optimizer.zero_grad()
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        # a checkpoint of another output_dir: its ledger is this run's history too
        # (PrivacyLedger.open_session)
        self._resumed_checkpoint_dir = checkpoint if isinstance(checkpoint, str) else None
        return self._without_nonprivate_loss(super().train(*args, **kwargs))

    def _without_nonprivate_loss(self, output: TrainOutput) -> TrainOutput:
        """``training_loss`` NaN and no ``train_loss`` in the metrics unless ``dp_log_nonprivate_metrics``:
        the Trainer's value is the exact mean loss of the private batches (two runs on neighbouring data sets
        give an example's own loss), and the metrics are what scripts save (``trainer.save_metrics``)."""
        if not self.privacy_plan.is_private or self.args.dp_log_nonprivate_metrics:
            return output
        metrics = {k: v for k, v in (output.metrics or {}).items() if k not in self.NONPRIVATE_LOG_KEYS}
        self._total_loss_scalar = float("nan")  # the Trainer's running sum behind it, kept on the trainer
        return TrainOutput(output.global_step, float("nan"), metrics)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        # every evaluation, in training or not: a set sharing rows with the training set is refused
        # (run_guard)
        self._run_guard.check_eval_set(self, eval_dataset, "the evaluation set")
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        self._run_guard.check_eval_set(self, test_dataset, "predict()'s test_dataset")
        return super().get_test_dataloader(test_dataset)

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(
            "hyperparameter_search is not supported by DPTrainer: every trial trains on the private data and "
            "the choice of the best trial releases information about it, which no single run's epsilon "
            "accounts for. Tune on public data or on a public proxy task, or account the whole search "
            "(create one DPTrainer per trial and add up their epsilons)."
        )

    # ------------------------------------------------------------------------------ set-up
    def _setup_privacy(self) -> None:
        args = self.args
        self._refuse_sharded_training()
        check_one_dp_run(args.world_size)
        self._refuse_nonprivate_statistics()
        self._refuse_seed_to_loggers()
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("DPTrainer needs a train_dataset with a length (N sets the sample rate and "
                             "delta).")
        if len(self.train_dataset) == 0:
            raise ValueError("The training set is empty.")
        # privacy_unit='user': the plan is over users (N = number of users, q over users),
        # hf_dpfilter/data/units.py
        self._user_index = privacy_units.user_index_for(args, self.train_dataset)
        num_units = self._user_index.num_users if self._user_index is not None else len(self.train_dataset)
        self.privacy_plan = PrivacyPlan.from_training_args(args, num_units)
        self._causal_lm = _is_causal_lm(self.model)
        self.accountant = PrivacyAccountant(self.privacy_plan.accountant)
        self._ledger_last_call: float | None = None  # monotonic time of the last pre-release ledger call
        self._ledger_reserved_through = 0  # the steps the ledger on disk counts (see ledger_reserve_seconds)
        self._privacy_ledger: PrivacyLedger | None = None  # the session of train() extending the ledger
        if self.privacy_plan.is_private and not args.poisson_sampling:
            logger.warning(
                "poisson_sampling=False: batches are shuffled fixed-size batches; the reported epsilon "
                "assumes Poisson sampling and is not a proven guarantee for this run."
            )
        self.engine = make_engine(
            self.privacy_plan, self.model, verify_first_backward=args.dp_verify_first_step,
            stack_layers=args.dp_stack_layers,
            batchnorm_eval=args.dp_batchnorm_eval,
        )

    # The plan's numbers, under the names Trainer users look for.
    @property
    def num_train_examples(self) -> int:
        return self.privacy_plan.num_examples

    @property
    def logical_batch_size(self) -> int:
        return int(round(self.privacy_plan.expected_batch_size))

    @property
    def sample_rate(self) -> float:
        return self.privacy_plan.sample_rate

    @property
    def steps_per_epoch(self) -> int:
        return self.privacy_plan.steps_per_epoch

    @property
    def planned_steps(self) -> int:
        return self.privacy_plan.steps

    @property
    def delta(self) -> float:
        return self.privacy_plan.delta

    @property
    def noise_multiplier(self) -> float:
        return self.privacy_plan.noise_multiplier

    def _refuse_sharded_training(self) -> None:
        """Refuse DeepSpeed and FSDP1; FSDP2 (``fully_shard``, accelerate's ``fsdp_version: 2``) is
        supported."""
        deepspeed = getattr(self, "is_deepspeed_enabled",
                            False) or bool(getattr(self.args, "deepspeed", None))
        if deepspeed:
            raise ValueError(
                "DeepSpeed is not supported by DPTrainer: ZeRO partitions and reduces the gradients inside "
                "its own engine, where the DP optimizer cannot take each example's gradient from the whole "
                "layer activations, reduce-scatter the clipped sums and add the noise once. Shard with FSDP2 "
                "instead (accelerate launch --config_file accelerate_configs/fsdp.yaml; "
                "docs/large_models.md, 'FSDP2'), or use DDP (accelerate_configs/multi_gpu.yaml) with LoRA."
            )
        fsdp = getattr(self, "is_fsdp_enabled", False) or bool(getattr(self.args, "fsdp", None))
        if fsdp and self._fsdp_version() != 2:
            raise ValueError(
                "FSDP (version 1) is not supported by DPTrainer: it flattens the parameters into one buffer "
                "per unit, so the DP optimizer cannot clip, reduce-scatter and noise them per parameter. Use "
                "FSDP2: accelerate launch --config_file accelerate_configs/fsdp.yaml (fsdp_version: 2), or "
                "DDP."
            )

    def _refuse_nonprivate_statistics(self) -> None:
        """Options that publish exact statistics of the private batches need ``dp_log_nonprivate_metrics``."""
        tokens = getattr(self.args, "include_num_input_tokens_seen", "no")
        private = self.args.dp_method != "none"
        if private and tokens not in ("no", False, None) and not self.args.dp_log_nonprivate_metrics:
            raise ValueError(
                f"include_num_input_tokens_seen={tokens!r} logs and saves (trainer_state.json, loggers) the "
                "exact token count of every secret Poisson batch, without noise: adding one example moves it "
                "by that example's length. Leave it at 'no', or set dp_log_nonprivate_metrics=True to "
                "publish it knowingly (docs/threat_model.md: the reported epsilon then does not cover it)."
            )

    def _refuse_seed_to_loggers(self) -> None:
        """Loggers that read the arguments field by field (not through ``to_dict()``) would upload
        ``dp_seed``.

        transformers' ClearMLCallback copies ``getattr(args, f.name) for f in dataclasses.fields(args)`` (and
        ``Task.connect(args)`` when run remotely) to the ClearML server: the seed regenerates the noise and
        the batches. ``report_to="all"`` adds it whenever clearml is installed.
        """
        if self.args.dp_seed is None:
            return  # nothing secret in the field: the fresh per-run seed lives in the plan only
        try:
            from transformers.integrations import ClearMLCallback
        except ImportError:  # pragma: no cover -- an older transformers
            return
        if any(isinstance(callback, ClearMLCallback) for callback in self.callback_handler.callbacks):
            raise ValueError(
                "report_to includes ClearML (explicitly, or through report_to='all' with clearml installed), "
                "whose callback uploads every field of the arguments read one by one, dp_seed included: "
                "anyone with the logs could regenerate the noise and the batches. Leave dp_seed unset (a "
                "fresh secret seed per run, never stored in the arguments), or drop 'clearml' from report_to."
            )

    def _fsdp_version(self) -> int:
        plugin = getattr(getattr(getattr(self, "accelerator", None), "state", None), "fsdp_plugin", None)
        if plugin is not None:
            return int(getattr(plugin, "fsdp_version", 1) or 1)
        config = getattr(self.args, "fsdp_config", None) or {}
        return int(config.get("version", 2))  # transformers' default for `fsdp=...` in the TrainingArguments

    def _attach_engine_to_prepared_model(self) -> None:
        """Re-attach the engine when Accelerate replaced the parameters (FSDP2's ``fully_shard`` makes
        DTensors).

        The optimizer's parameters were switched to the sharded ones by Accelerate; the engine must key its
        terms by the same objects (the optimizer checks that both hold the same set).
        """
        if self.engine is not None and set(self.engine.trainable_parameters) != {
            p for p in self.model.parameters() if p.requires_grad
        }:
            self.engine.attach()

    # ------------------------------------------------------------------------ optimizer
    #: TEST-ONLY (hf_dpfilter.audit): the audit's observed or deliberately weakened optimizer, built by the
    #: factory. None in every real run.
    _dp_audit_options: AuditOptions | None = None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.dp_optimizer is not None:
            return self.optimizer
        base = super().create_optimizer(model) if model is not None else super().create_optimizer()
        self.dp_optimizer = make_optimizer(
            self.privacy_plan, None, base, accountant=self.accountant, audit=self._dp_audit_options
        )
        self.optimizer = self.dp_optimizer
        self.dp_optimizer.warn_nonfinite = self.args.dp_log_nonprivate_metrics
        attach_loss_scaler(self)  # fp16: the DP loss scaler replaces Accelerate's GradScaler
        if self.privacy_plan.is_private:
            self.dp_optimizer.pre_release_hooks.append(self._write_privacy_ledger)
            self.dp_optimizer.pre_release_hooks.append(self._mark_parameters_released)
        return self.optimizer

    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _announce_plan(self) -> None:
        """Log the privacy plan and warn, with the fix, when it cannot rise above the noise."""
        if not self.is_world_process_zero():
            return
        # epsilon, delta, sigma, q, steps where the script's user sees them; lr, unit warnings
        announce_start(self)
        count = self.trainable_parameter_count()
        logger.info("%s", self.privacy_plan.describe(count))
        if self._user_index is not None:  # the plan's N, B and q count users (hf_dpfilter/data/units.py)
            logger.info("%s", privacy_units.describe_users(self._user_index, self.args.max_examples_per_user))
        for message in self.privacy_plan.learnability_warnings(count):
            warnings.warn(message, UserWarning, stacklevel=2)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        # The Trainer would log the norm of p.grad, which here is the *pre-noise* clipped sum: private.
        return None

    # ---------------------------------------------------------------------------- data
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        import datasets

        dataset = self.train_dataset
        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        # QA: start/end positions as `labels`
        collator = span_labels.with_span_labels(collator, self.label_names)
        # each collation its own copy of the rows (a collator may edit them)
        collator = FreshRowsCollator(collator)
        rank, world = max(0, self.args.process_index), max(1, self.args.world_size)
        # privacy_unit='user': Poisson over users, up to k examples each (hf_dpfilter/data/units.py)
        sampler = make_sampler(self.privacy_plan, rank=rank, world_size=world, users=self._user_index,
                               max_examples_per_user=self.args.max_examples_per_user)
        loaded = dataset
        if self._user_index is not None:  # each example tagged with its user
            dataset = privacy_units.without_column(dataset, self._user_index.column)
            loaded, collator = privacy_units.user_loading(self._user_index, dataset, collator)
        self._dp_sampler = sampler  # reseeded after a resume (_begin_privacy_session)
        # packed batches: every segment one whole sampled row; every batch: no row holding several examples
        # unless dp_row_is_unit declares the row the unit (proofs/row_segments.py, proofs/row_examples.py)
        collator = RowSegmentsGuard(collator, row_is_unit=self.args.dp_row_is_unit,
                                    marker=conversation_start_marker(self.processing_class))
        check_rows = collator_reads_model_inputs(self.data_collator)
        self._padding_collator = EmptySafeCollator(collator, dataset, check_rows=check_rows)
        if check_rows:  # before the probe collates them; a datasets.Dataset's whole columns by their types
            check_training_columns(dataset)
            check_training_rows(dataset[i] for i in range(min(2, len(dataset))))
            # the head's targets, from the rows as given (a label under another name is dropped above)
            given = [self.train_dataset[i] for i in range(min(2, len(dataset)))]
            check_labels_fit_the_head(self.model, given, self.label_names)
        # the guard (packed rows) and the maskless-padding check see every batch collated from now on
        self._use_training_structure(
            probe_batch_structure(collator, dataset[0], dataset[1] if len(dataset) > 1 else None))
        padding.check_collator_padding(self.model, collator,
                                       [dataset[i] for i in range(min(2, len(dataset)))],
                                       self._batch_structure)  # early; every batch is checked too
        return LogicalBatchLoader(
            loaded,
            batch_sampler=sampler,
            collate_fn=self._padding_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    # --------------------------------------------------------------------------- steps
    def compute_per_example_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        labels: torch.Tensor,
        param_values: dict[nn.Parameter, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Per-example losses, shape (B,), optionally at other parameter values (a functional call).

        The documented hook for a loss of your own: override it to return one loss per example, each computed
        from that example's own inputs only. The contract: nothing batch-wide. No normalisation by the
        micro-batch (its mean token count, its number of examples), no statistic, branch or negative taken
        over the other examples: micro-batches are cut by the trainer, and whatever reads them lets one
        example move the others' losses, which per-example clipping does not bound. The first-step check
        verifies it example by example, and the re-checks (``dp_recheck_rate``, every new micro-batch shape)
        compare an example's loss in its micro-batch with its loss re-collated alone over the run
        (hf_dpfilter/proofs/separation.py). For packed rows (several examples per row) ``self.packed_layout``
        says which tokens belong to which example.
        """
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        smoothing = float(self.args.label_smoothing_factor or 0.0)
        # extractive QA's start/end logits (hf_dpfilter/losses/question_answering.py)
        if span_labels.is_span_output(outputs):
            return span_labels.span_loss(outputs, labels, inputs.get("attention_mask"),
                                         self._packed_layout is not None,
                                         label_smoothing=smoothing)
        logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
        problem_type = getattr(getattr(model, "config", None), "problem_type", None)
        if self._packed_layout is not None:
            if logits.dim() != 3:
                raise PackingError(
                    f"The model returns logits of shape {tuple(logits.shape)} for packed rows: a "
                    "sequence-level head pools over the whole row, mixing the examples packed in it. Use a "
                    "padding collator (one example per row) for this model."
                )
            return packed_token_mean_loss(logits, labels, self._packed_layout, shift=self._causal_lm,
                                          label_smoothing=smoothing)
        losses = per_example_loss(logits, labels, causal_lm=self._causal_lm, problem_type=problem_type,
                                  label_smoothing=smoothing)
        # the MoE load-balancing loss per example; TRL's SFTTrainer keeps its own coefficient (router_loss.py)
        return add_router_aux_loss(model, outputs, inputs, losses,
                                   getattr(self, "router_aux_loss_coef", None))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Evaluation keeps the model's own loss (no gradients, nothing private is released by training).
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One logical batch: micro-batches -> per-example losses -> clipped sums in ``p.grad``.

        Each micro-batch goes through the per-micro-batch proofs
        (:class:`~hf_dpfilter.proofs.separation.SeparationChecks`) before it is accumulated: a failure raises
        before the step is released."""
        model = self.model  # hooks live on the unwrapped modules; DDP reduction is done by the DP optimizer
        if self.privacy_plan.is_private:  # a callback may have hooked a gradient since the last step
            refuse_gradient_hooks(model)
        model.train()
        if self.engine is not None:
            self.engine.hold_eval_modes()  # modules the options keep in eval mode (dp_batchnorm_eval)
        inputs = dict(inputs)
        raw = inputs.pop(RAW_EXAMPLES_KEY, None)  # the collated rows, for re-collating an example alone
        if raw:  # a random collator's draws, each example's own (at this step: the loader may collate ahead)
            inputs = self._keyed_collator_draws(inputs, raw)
        inputs = dict(self._prepare_inputs(inputs))
        num_examples = inputs.pop(NUM_EXAMPLES_KEY, None)
        units = inputs.pop(privacy_units.UNITS_KEY, None)  # privacy_unit='user': each example's user
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(f"DPTrainer needs `labels` in every batch (got {sorted(inputs)}): return them "
                             "from the collator (a `label`/`labels` column, kept by remove_unused_columns), "
                             "or start_positions/end_positions with a *ForQuestionAnswering model "
                             "(hf_dpfilter/losses/question_answering.py).")
        batch = labels.shape[0]
        check_sequence_length(model, inputs, packed=self._training_batch_structure().packed)
        total = torch.zeros((), device=self.args.device)
        cut = self._cut_logical_batch(inputs, labels, num_examples, units,
                                      raw) if (batch and labels.numel()) else []
        micro_batches = [micro_batch for micro_batch, _ in cut]
        examples = sum(m[1].shape[0] if m[2] is None else m[2].num_examples for m in micro_batches)
        batch = examples
        if not self._packing_checked and self._training_batch_structure().packed:
            # on every process at its first step, whatever it sampled (FSDP2 runs collectives in the forward)
            self._check_packed_attention(model)
        if not self._per_example_checked and self.dp_optimizer.sharded:
            # the same on every process: all refuse together
            check_hook_verified_when_sharded(self, DPTrainerMixin)
        separation = self._separation_checks()
        side = declared_padding_side(self.data_collator, self.processing_class)  # the dropout indices' origin
        rounds = len(micro_batches)
        if self.dp_optimizer.sharded:
            # FSDP2 gathers parameters with collectives in every forward and backward: every process runs as
            # many micro-batches as the process with the largest share of the Poisson sample.
            rounds = self.dp_optimizer.collectives.max_over_processes(rounds)
        if batch == 0:
            # an empty Poisson batch, declared as such: the optimizer step still adds noise and is accounted
            self.dp_optimizer.accumulate(self.engine, None, batch_size=0)
        for index in range(rounds):
            micro, micro_labels, layout = micro_batches[min(index,
                                                            len(micro_batches) - 1)] if micro_batches else (
                self._padding_micro_batch()
            )
            size = micro_labels.shape[0] if layout is None else layout.num_examples

            here: list[torch.Tensor] = []  # the per-example losses of its forwards at the current parameters

            def loss_fn(values, micro=micro, micro_labels=micro_labels, here=here):
                with self.compute_loss_context_manager():
                    losses = self._after_forward(model,
                            self.compute_per_example_loss(model, micro, micro_labels, values))
                if values is None:
                    here.append(losses.detach())
                return losses

            units_layout = isinstance(layout, privacy_units.UnitLayout)
            if units_layout:  # one loss per unit: the sum of its examples' losses
                loss_fn = privacy_units.per_unit_loss(loss_fn, layout)

            recheck = None
            if separation is not None and index < len(micro_batches):  # before it is accumulated
                recheck = separation.before_accumulate(model, privacy_units.as_examples(cut[index][0]),
                                                       cut[index][1], step_losses=not units_layout,
                                                       per_unit=units_layout)
            with self._packed(layout):
                if index >= len(micro_batches):  # FSDP2 padding: run the collectives, contribute nothing
                    padding_row = [self._padding_collator.dataset[0]]
                    self.dp_optimizer.run_without_contributing(self.engine, loss_fn, batch_size=size,
                                                               example_keys=padding_row)
                    continue
                losses = self.dp_optimizer.accumulate(self.engine, loss_fn, batch_size=size,
                                                      **self._alone_declaration,
                                                      **dropout_keys(cut[index][0], cut[index][1], self.model,
                                                                     side))
            # a due re-check on this forward's own losses, before the step is released
            if recheck is not None:
                recheck(here[0] if len(here) == 1 else None)
            total = total + losses.sum()
        return total / max(batch, 1)
    def _after_forward(self, model: nn.Module, losses: torch.Tensor) -> torch.Tensor:
        """The losses of a forward, after the hook check again, before any backward reads them: a forward hook
        (or a forward of one's own) that registers a gradient hook while it runs is refused before that hook
        sees a gradient (the engine's first backward and the first-step check reach the parameters
        unclipped)."""
        if self.privacy_plan.is_private:
            refuse_gradient_hooks(model)
        return losses

    @property
    def _per_example_checked(self) -> bool:
        """Whether the first-step per-example check has passed (or is turned off:
        ``dp_verify_first_step=False``)."""
        if not self.args.dp_verify_first_step:
            return True
        return self._separation is not None and not self._separation.first_step_pending

    def _separation_checks(self) -> SeparationChecks | None:
        """The per-micro-batch proofs (hf_dpfilter/proofs/separation.py), built at the first step; None when
        they cannot run: no engine, or FSDP2 sharding (a forward on one process alone would stall the
        collectives)."""
        if self._separation is None and self.engine is not None and not self.dp_optimizer.sharded:
            model = self.model

            def loss_fn(inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
                with self.compute_loss_context_manager():
                    return self._after_forward(model, self.compute_per_example_loss(model, inputs, labels))

            self._separation = SeparationChecks(
                self.engine, loss_fn, self._packed, self._alone,
                first_step=self.args.dp_verify_first_step, rechecks=self.args.dp_verify_first_step,
                rate=self.args.dp_recheck_rate, min_examples=self._first_check_examples(),
                # the precision the accelerator really computes in (fixed when the Trainer was created)
                low_precision=getattr(getattr(self, "accelerator", None), "mixed_precision", "no") in ("bf16",
                        "fp16"),
                clipping=self._clipping,
            )
        return self._separation

    def _clipping(self) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
        """C and the run's per-example clip factors of norms, as the DP optimizer clips (the gradient argument
        of a re-check: hf_dpfilter/proofs/separation.py)."""
        optimizer = self.dp_optimizer
        bound, fn = float(optimizer.max_grad_norm), optimizer.clipping_fn
        return bound, lambda norms: clip_factors(norms, bound, fn)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0 unless ``dp_log_nonprivate_metrics``: the Trainer's count (``total_flos``) is a function of the
        private Poisson batch sizes and token counts, and is written to trainer_state.json and the loggers."""
        if self.privacy_plan.is_private and not self.args.dp_log_nonprivate_metrics:
            return 0
        return super().floating_point_ops(inputs)

    # ----------------------------------------------------------------------- reporting
    def current_epsilon(self, horizon: int | None = None) -> float:
        """Epsilon spent so far; ``horizon`` (planned total steps) allows the cheap log-line evaluation, see
        :meth:`hf_dpfilter.accounting.accountant.PrivacyAccountant.get_epsilon`."""
        if not self.privacy_plan.is_private:
            return float("inf")
        return self.accountant.get_epsilon(self.delta, horizon=horizon)

    #: log keys computed from the private batches without noise (the training loss): published only with
    #: ``dp_log_nonprivate_metrics``
    NONPRIVATE_LOG_KEYS = ("loss", "train_loss")

    #: log and metrics keys that count the training examples or their tokens. At ``privacy_unit='user'`` the
    #: number of examples is private (adding a user adds all of their examples): the Trainer's
    #: ``train_samples_per_second`` times ``train_runtime`` gives it back exactly, and Hugging Face's example
    #: scripts save ``train_samples = len(train_dataset)``. Published only with ``dp_log_nonprivate_metrics``.
    EXAMPLE_COUNT_KEYS = (
        "train_samples_per_second", "train_samples", "num_train_samples", "train_examples",
        "num_train_examples",
        "num_input_tokens_seen", "train_tokens_per_second", "num_tokens",
    )

    @property
    def _example_count_private(self) -> bool:
        """Whether the number of training examples must stay unpublished: a private run over users, without
        ``dp_log_nonprivate_metrics`` (at example level N is the plan's public number of units)."""
        return (self.privacy_plan.is_private and self._user_index is not None
                and not self.args.dp_log_nonprivate_metrics)

    def _drop_unpublished(self, logs: dict[str, Any]) -> None:
        """Remove, in place, what a private run does not publish: the caller's dict is train()'s and
        evaluate()'s returned metrics too, which scripts save (trainer.save_metrics -> train_results.json,
        all_results.json)."""
        if not self.privacy_plan.is_private or self.args.dp_log_nonprivate_metrics:
            return
        for key in self.NONPRIVATE_LOG_KEYS:
            logs.pop(key, None)
        # skip_memory_metrics=False: the memory deltas and peaks of training (train_mem_gpu_peaked_delta, ...)
        # grow with the longest padded Poisson micro-batch: one long example moves them, without noise
        for key in [k for k in logs if "_mem_" in k]:
            logs.pop(key)
        if self._example_count_private:
            for key in self.EXAMPLE_COUNT_KEYS:
                logs.pop(key, None)

    def num_examples(self, dataloader: DataLoader) -> int:
        """The Trainer's count of a loader's examples, logged ("Num examples") when training starts and, times
        the epochs, behind ``train_samples_per_second``. For the training loader of a user-level run: the
        number of users (the plan's public N), since its number of examples is private (see
        ``EXAMPLE_COUNT_KEYS``)."""
        if isinstance(dataloader, LogicalBatchLoader) and self._example_count_private:
            return self.privacy_plan.num_examples
        return super().num_examples(dataloader)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """``Trainer.log_metrics`` (printed) without what the run does not publish (a script's own counts)."""
        metrics = dict(metrics)
        self._drop_unpublished(metrics)
        super().log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """``Trainer.save_metrics`` (``{split}_results.json``, ``all_results.json``, uploaded with the model)
        without what the run does not publish: a script's own ``train_samples`` at user level."""
        metrics = dict(metrics)
        self._drop_unpublished(metrics)
        super().save_metrics(split, metrics, combined=combined)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        self._drop_unpublished(logs)
        if self.privacy_plan.is_private and self.accountant.steps > 0:
            logs = dict(logs)
            # A new step count costs up to ~1 s with the PRV accountant; with the run's planned length the log
            # lines share one discretisation (~0.1 s each). Reports and the ledger stay exact.
            horizon = self.state.max_steps if self.state.max_steps > 0 else None
            logs["epsilon"] = round(self.current_epsilon(horizon), 4)
        super().log(logs, *args, **kwargs)

    def privacy_report(self) -> dict[str, Any]:
        """epsilon spent so far and everything needed to interpret it (never the DP seed)."""
        plan = self.privacy_plan
        # the unit, the number of units and q over them (privacy_unit='user': over users),
        # hf_dpfilter/data/units.py
        return privacy_units.with_unit({
            "epsilon": self.current_epsilon(),
            "delta": self.delta,
            "target_epsilon": plan.target_epsilon,
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "logical_batch_size": self.logical_batch_size,
            "num_train_examples": plan.num_examples,
            "steps": self.accountant.steps,
            "planned_steps": plan.steps,
            "accountant": plan.accountant,
            "per_sample_max_grad_norm": plan.max_grad_norm,
            "clipping_fn": plan.clipping_fn,
            "method": plan.method,
            "method_args": plan.config.to_dict(),
            "poisson_sampling": plan.poisson_sampling,
            "randomness": plan.randomness,
            "neighbouring_relation": "add/remove one example",
            "accountant_history": [list(e) for e in self.accountant.history],
            # Method-specific accounting details (DiceSGD, DIFF2) extend or refine the entries above.
            **plan.config.report(plan.noise, plan, self.accountant.steps, self.delta),
        }, self.args.privacy_unit, plan.num_examples, plan.sample_rate, self.args.max_examples_per_user,
            row_is_unit=self.args.dp_row_is_unit)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer.create_model_card`` plus the privacy paragraph: the unit-level (epsilon, delta) of the
        run."""
        super().create_model_card(*args, **kwargs)
        if not self.privacy_plan.is_private or not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        if os.path.exists(path):
            with open(path, "a") as f:
                f.write("\n" + privacy_units.card_section(self.privacy_report()))


class DPTrainer(DPTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with (epsilon, delta)-differential privacy.

    Same constructor as ``Trainer``; ``args`` must be :class:`~hf_dpfilter.DPTrainingArguments`. The train
    dataset must have a length (N is needed for the sample rate and the default delta). After ``train()``,
    :meth:`privacy_report` gives the epsilon spent. All of the DP logic is in :class:`DPTrainerMixin`.
    """
