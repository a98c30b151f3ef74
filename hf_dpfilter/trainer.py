"""``DPTrainer``: ``transformers.Trainer`` with per-example clipping, noise and accounting.

Thin glue over the Trainer's own loop, through its hooks:

* ``get_train_dataloader`` yields one *logical* batch per optimizer step, Poisson-sampled (possibly empty);
* ``training_step`` splits it into micro-batches of ``per_device_train_batch_size``, computes per-example
  losses (:mod:`hf_dpfilter.losses`), and lets the DP optimizer accumulate the clipped per-example
  (combinations of) gradients via the clipping engine (:mod:`hf_dpfilter.engine`);
* ``create_optimizer`` wraps the Trainer's optimizer in the DP optimizer of ``dp_method``, which alone clips,
  adds the noise once per step and records the step with the accountant;

Everything about the privacy of the run (N, q, steps, delta, sigma, the method's mechanisms, the sampler and
the randomness) comes from one :class:`hf_dpfilter.plan.PrivacyPlan`, built once from the arguments.
* ``log`` adds the epsilon spent so far to every log line (progress bar, TensorBoard, W&B, ...).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput

from hf_dpfilter import units as privacy_units
from hf_dpfilter.accounting import PrivacyAccountant
from hf_dpfilter.arguments import DPTrainingArguments
from hf_dpfilter.batch_structure import BatchStructure, probe_batch_structure
from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.first_step_check import verify_per_example
from hf_dpfilter.ledger import PrivacyLedger
from hf_dpfilter.loss_policy import check_hook_verified_when_sharded, check_loss_policy, check_prompt_learning
from hf_dpfilter.losses import per_example_loss
from hf_dpfilter.optimizers import DPOptimizer
from hf_dpfilter.packing import (
    PackedLayout,
    PackingError,
    check_attention_stays_inside_examples,
    packed_token_mean_loss,
)
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.processes import check_one_dp_run
from hf_dpfilter.run_guard import RunGuard

logger = logging.getLogger(__name__)

#: Key under which the training collator reports how many examples it collated (popped before the forward):
#: the number of examples a packed batch must hold, declared by the sampler's draw, not inferred from rows.
NUM_EXAMPLES_KEY = "_dp_num_examples"


class _EmptySafeCollator:
    """Collates a (possibly empty) list of examples; an empty batch keeps the keys with 0 rows."""

    def __init__(self, collate_fn: Callable, dataset: Any) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, examples: list) -> dict[str, Any]:
        if len(examples) > 0:
            return {**self.collate_fn(examples), NUM_EXAMPLES_KEY: len(examples)}
        # Collate one real example for the structure, then keep zero rows of it: nothing private is used.
        template = self.collate_fn([self.dataset[0]])
        empty = {k: v[:0] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in template.items()}
        return {**empty, NUM_EXAMPLES_KEY: 0}


class _LogicalBatchLoader(DataLoader):
    """A DataLoader over logical batches that forwards ``set_epoch`` to its Poisson sampler."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)


class _PrivacyCallback(TrainerCallback):
    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        planned = self.trainer.planned_steps
        if state.max_steps != planned:
            raise RuntimeError(
                f"The Trainer plans {state.max_steps} optimizer steps but the noise was calibrated for {planned}. "
                "Do not change num_train_epochs/max_steps after creating the DPTrainer."
            )
        self.trainer._attach_engine_to_prepared_model()
        self.trainer._refuse_resume_without_dp_state(state.global_step)
        self.trainer._refuse_parameters_of_another_run()
        self.trainer._begin_privacy_session()
        self.trainer._check_resumed_budget()
        self.trainer._announce_plan()

    def on_train_end(self, args, state, control, **kwargs):
        # a non-private run (dp_method="none") releases nothing to account, and opened no ledger session (whose
        # reading is collective: opening one here, on the saving process only, would hang the others)
        if self.trainer.dp_optimizer is not None and self.trainer.privacy_plan.is_private:
            self.trainer._write_privacy_ledger(self.trainer.dp_optimizer, in_flight=False)


def _is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return type(base).__name__ in names or type(base).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _check_sequence_length(model: nn.Module, inputs: dict[str, Any], packed: bool = False) -> None:
    """Clear error for sequences longer than the model's position embeddings (instead of an index error).

    ``packed``: a row holds several examples, each with its own positions; the longest example must fit, not the
    row (which holds the whole Poisson batch).
    """
    config = getattr(model, "config", None)
    ids = inputs.get("input_ids")
    if config is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return
    length = ids.shape[1]
    positions = inputs.get("position_ids")
    if packed and isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.numel():
        length = PackedLayout.from_position_ids(positions).max_length
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl"):
        limit -= (getattr(config, "pad_token_id", 1) or 0) + 1  # positions start after the padding index
    if length > limit:
        raise ValueError(
            f"A batch has sequences of length {length}, longer than the model's maximum of {limit} "
            f"positions (config.max_position_embeddings). Truncate in the tokenizer (truncation=True, "
            f"max_length={limit}) or lower max_seq_length."
        )


def read_privacy_ledger(output_dir: str) -> dict[str, Any]:
    """The privacy ledger of a run (output_dir/privacy_ledger.json), with ``epsilon`` computed from its history.

    The ledger counts every step whose noise may have been released, including one in flight at a crash, so
    its epsilon is never below what was spent.
    """
    import json
    import os

    with open(os.path.join(output_dir, "privacy_ledger.json")) as f:
        ledger = json.load(f)
    accountant = PrivacyAccountant(ledger["accountant"]["accountant"])
    accountant.load_state_dict(ledger["accountant"])
    ledger["epsilon"] = accountant.get_epsilon(ledger["delta"])
    return ledger


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with (epsilon, delta)-differential privacy.

    Same constructor as ``Trainer``; ``args`` must be :class:`DPTrainingArguments`. The train dataset must
    have a length (N is needed for the sample rate and the default delta). After ``train()``,
    :meth:`privacy_report` gives the epsilon spent.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (a TrainingArguments subclass) as `args`.")
        self.dp_optimizer: DPOptimizer | None = None
        self.engine: GhostClippingEngine | None = None
        self._batch_structure: BatchStructure | None = None  # probed on the training collator
        self._packed_layout: PackedLayout | None = None  # the packed micro-batch being computed, if any
        self._per_example_checked = not self.args.dp_verify_first_step
        self._packing_checked = False  # packed rows: attention proven to stay inside each example, once
        check_loss_policy(self, DPTrainer)
        check_prompt_learning(self.model)
        self._setup_privacy()
        self.add_callback(_PrivacyCallback(self))
        # What the plan was computed from; checked again when train() starts (hf_dpfilter/run_guard.py).
        self._run_guard = RunGuard(self)

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``, after the checks of :class:`hf_dpfilter.run_guard.RunGuard` (one run per trainer;
        the arguments, batch and processes the plan was computed for)."""
        self._run_guard.before_train(self)
        self._refuse_seed_to_loggers()  # callbacks may have been added since the trainer was created
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        # a checkpoint of another output_dir: its ledger is this run's history too (PrivacyLedger.open_session)
        self._resumed_checkpoint_dir = checkpoint if isinstance(checkpoint, str) else None
        return super().train(*args, **kwargs)

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(
            "hyperparameter_search is not supported by DPTrainer: every trial trains on the private data and the "
            "choice of the best trial releases information about it, which no single run's epsilon accounts for. "
            "Tune on public data or on a public proxy task, or account the whole search (create one DPTrainer per "
            "trial and add up their epsilons)."
        )

    # ------------------------------------------------------------------------------ set-up
    def _setup_privacy(self) -> None:
        args = self.args
        self._refuse_sharded_training()
        check_one_dp_run(args.world_size)
        self._refuse_nonprivate_statistics()
        self._refuse_seed_to_loggers()
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("DPTrainer needs a train_dataset with a length (N sets the sample rate and delta).")
        if len(self.train_dataset) == 0:
            raise ValueError("The training set is empty.")
        # privacy_unit='user': the plan is over users (N = number of users, q over users), hf_dpfilter/units.py
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
                "poisson_sampling=False: batches are shuffled fixed-size batches; the reported epsilon assumes "
                "Poisson sampling and is not a proven guarantee for this run."
            )
        self.engine = self.privacy_plan.make_engine(
            self.model, verify_first_backward=args.dp_verify_first_step, stack_layers=args.dp_stack_layers,
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
        """Refuse DeepSpeed and FSDP1; FSDP2 (``fully_shard``, accelerate's ``fsdp_version: 2``) is supported."""
        deepspeed = getattr(self, "is_deepspeed_enabled", False) or bool(getattr(self.args, "deepspeed", None))
        if deepspeed:
            raise ValueError(
                "DeepSpeed is not supported by DPTrainer: ZeRO partitions and reduces the gradients inside its own "
                "engine, where the DP optimizer cannot take each example's gradient from the whole layer "
                "activations, reduce-scatter the clipped sums and add the noise once. Shard with FSDP2 instead "
                "(accelerate launch --config_file accelerate_configs/fsdp.yaml, README 'Large models: FSDP2'), or "
                "use DDP (accelerate_configs/multi_gpu.yaml) with LoRA."
            )
        fsdp = getattr(self, "is_fsdp_enabled", False) or bool(getattr(self.args, "fsdp", None))
        if fsdp and self._fsdp_version() != 2:
            raise ValueError(
                "FSDP (version 1) is not supported by DPTrainer: it flattens the parameters into one buffer per "
                "unit, so the DP optimizer cannot clip, reduce-scatter and noise them per parameter. Use FSDP2: "
                "accelerate launch --config_file accelerate_configs/fsdp.yaml (fsdp_version: 2), or DDP."
            )

    def _refuse_nonprivate_statistics(self) -> None:
        """Options that publish exact statistics of the private batches need ``dp_log_nonprivate_metrics``."""
        tokens = getattr(self.args, "include_num_input_tokens_seen", "no")
        private = self.args.dp_method != "none"
        if private and tokens not in ("no", False, None) and not self.args.dp_log_nonprivate_metrics:
            raise ValueError(
                f"include_num_input_tokens_seen={tokens!r} logs and saves (trainer_state.json, loggers) the exact "
                "token count of every secret Poisson batch, without noise: adding one example moves it by that "
                "example's length. Leave it at 'no', or set dp_log_nonprivate_metrics=True to publish it knowingly "
                "(docs/threat_model.md: the reported epsilon then does not cover it)."
            )

    def _refuse_seed_to_loggers(self) -> None:
        """Loggers that read the arguments field by field (not through ``to_dict()``) would upload ``dp_seed``.

        transformers' ClearMLCallback copies ``getattr(args, f.name) for f in dataclasses.fields(args)`` (and
        ``Task.connect(args)`` when run remotely) to the ClearML server: the seed regenerates the noise and the
        batches. ``report_to="all"`` adds it whenever clearml is installed.
        """
        if self.args.dp_seed is None:
            return  # nothing secret in the field: the fresh per-run seed lives in the plan only
        try:
            from transformers.integrations import ClearMLCallback
        except ImportError:  # pragma: no cover -- an older transformers
            return
        if any(isinstance(callback, ClearMLCallback) for callback in self.callback_handler.callbacks):
            raise ValueError(
                "report_to includes ClearML (explicitly, or through report_to='all' with clearml installed), whose "
                "callback uploads every field of the arguments read one by one, dp_seed included: anyone with the "
                "logs could regenerate the noise and the batches. Leave dp_seed unset (a fresh secret seed per run, "
                "never stored in the arguments), or drop 'clearml' from report_to."
            )

    def _fsdp_version(self) -> int:
        plugin = getattr(getattr(getattr(self, "accelerator", None), "state", None), "fsdp_plugin", None)
        if plugin is not None:
            return int(getattr(plugin, "fsdp_version", 1) or 1)
        config = getattr(self.args, "fsdp_config", None) or {}
        return int(config.get("version", 2))  # transformers' default for `fsdp=...` in the TrainingArguments

    def _attach_engine_to_prepared_model(self) -> None:
        """Re-attach the engine when Accelerate replaced the parameters (FSDP2's ``fully_shard`` makes DTensors).

        The optimizer's parameters were switched to the sharded ones by Accelerate; the engine must key its
        terms by the same objects (the optimizer checks that both hold the same set).
        """
        if self.engine is not None and set(self.engine.trainable_parameters) != {
            p for p in self.model.parameters() if p.requires_grad
        }:
            self.engine.attach()

    # ------------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.dp_optimizer is not None:
            return self.optimizer
        base = super().create_optimizer(model) if model is not None else super().create_optimizer()
        self.dp_optimizer = self.privacy_plan.make_optimizer(None, base=base, accountant=self.accountant)
        self.optimizer = self.dp_optimizer
        self.dp_optimizer.warn_nonfinite = self.args.dp_log_nonprivate_metrics
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
        count = self.trainable_parameter_count()
        logger.info("%s", self.privacy_plan.describe(count))
        if self._user_index is not None:  # the plan's N, B and q count users (hf_dpfilter/units.py)
            logger.info("%s", privacy_units.describe_users(self._user_index, self.args.max_examples_per_user))
        for message in self.privacy_plan.learnability_warnings(count):
            warnings.warn(message, UserWarning, stacklevel=2)

    # ----------------------------------------------------------------- budget and ledger
    def _check_resumed_budget(self) -> None:
        """Refuse to resume a target_epsilon run whose plan changed: the restored history would overspend."""
        optimizer = self.dp_optimizer
        if optimizer is None or self.args.target_epsilon is None or optimizer.dp_steps == 0:
            return
        previous = getattr(optimizer, "loaded_noise_multiplier", None)
        if optimizer.dp_steps > self.planned_steps or (previous is not None and previous != self.noise_multiplier):
            raise ValueError(
                f"Cannot resume: the checkpoint spent {optimizer.dp_steps} steps at noise_multiplier={previous}, "
                f"calibrated for a different plan than this run's {self.planned_steps} steps at "
                f"noise_multiplier={self.noise_multiplier:.6g}. Continuing would exceed target_epsilon="
                f"{self.args.target_epsilon}. Resume with the original max_steps/num_train_epochs and target_epsilon, "
                "or re-calibrate explicitly: pass noise_multiplier instead of target_epsilon (the reported epsilon "
                "then counts every step, including the checkpoint's)."
            )

    #: attribute set on every trainable parameter once a DP run releases a step into it: the run's id
    RELEASED_BY_ATTRIBUTE = "_hf_dpfilter_released_by"

    def _mark_parameters_released(self, optimizer: DPOptimizer) -> None:
        """Before each release: mark the trainable parameters with this run's id (see the refusal below)."""
        for param in optimizer.params:
            setattr(param, self.RELEASED_BY_ATTRIBUTE, optimizer.run_id)

    def _refuse_parameters_of_another_run(self) -> None:
        """A new DPTrainer on parameters another DPTrainer of this process already released noisy steps into.

        The second run's epsilon would count its own steps only, while the model it releases holds both runs'.
        A resume loads the checkpoint's values (and its run's history) into the parameters: not refused.
        """
        optimizer = self.dp_optimizer
        if optimizer is None or not self.privacy_plan.is_private or optimizer.restored_from_checkpoint:
            return
        earlier = {getattr(p, self.RELEASED_BY_ATTRIBUTE, None) for p in optimizer.params} - {None, optimizer.run_id}
        if earlier:
            raise ValueError(
                f"The model's trainable parameters already received noisy steps from another DP run in this process "
                f"(run_id {', '.join(sorted(earlier))}, see its privacy_ledger.json): this run's epsilon would count "
                "only its own steps, while the model it releases holds both. Continue the earlier run by resuming from "
                "its checkpoint (train(resume_from_checkpoint=...)), or train a fresh copy of the original model. If "
                "the runs use disjoint data and you account them yourself, remove the mark first: "
                f"for p in model.parameters(): p.__dict__.pop('{self.RELEASED_BY_ATTRIBUTE}', None)."
            )

    def _refuse_resume_without_dp_state(self, global_step: int) -> None:
        """A resumed step count without the DP optimizer's state: its released steps would go uncounted.

        The Trainer restores the model and ``trainer_state.json`` and skips a missing ``optimizer.pt`` without a
        word (``save_only_model=True``, or the file deleted): the accountant would restart at 0 on a model that
        already holds the checkpoint's noisy steps.
        """
        optimizer = self.dp_optimizer
        if global_step == 0 or optimizer is None or not self.privacy_plan.is_private:
            return
        if not optimizer.restored_from_checkpoint:
            raise ValueError(
                f"Cannot resume from a checkpoint at step {global_step} without the DP optimizer's state "
                "(optimizer.pt missing: save_only_model=True, or the file was removed): the model already holds "
                f"{global_step} noisy steps that the accountant could not count, so the reported epsilon would leave "
                "them out. Resume from a checkpoint saved with save_only_model=False, or start a fresh run from the "
                "original model."
            )

    def _begin_privacy_session(self) -> None:
        """At the start of every ``train()``: fresh randomness after a resume, and the ledger's session.

        A restored optimizer already drew a fresh noise seed (``DPOptimizer.load_state_dict``); the sampler gets
        one too, so the batches after a resume are not derivable from ``dp_seed`` and the step either. The
        accountant then continues from the privacy ledger of this run (every branch's releases), and a
        ``target_epsilon`` run whose ledger counts releases beyond the checkpoint is refused when the
        remaining plan would take it above the target.
        """
        optimizer = self.dp_optimizer
        if optimizer is None or not self.privacy_plan.is_private:
            return
        resumed = optimizer.restored_from_checkpoint
        sampler = getattr(self, "_dp_sampler", None)
        if resumed and sampler is not None and not self.privacy_plan.secure_rng:
            from hf_dpfilter.secure_rng import fresh_seed

            sampler.seed = optimizer.collectives.agree_on_seed(fresh_seed())
        ledger = PrivacyLedger(self.args.output_dir)
        ledger.open_session(optimizer.run_id, optimizer.accountant, optimizer.dp_steps if resumed else None,
                            getattr(self, "_resumed_checkpoint_dir", None))
        self._privacy_ledger = ledger
        self._ledger_reserved_through, self._ledger_last_call = 0, None
        extra = ledger.steps_beyond_checkpoint
        if extra == 0:
            return
        logger.warning(
            "Resuming from a checkpoint at step %d while the privacy ledger %s counts %d steps of this run: the %d "
            "step(s) released after this checkpoint (another branch, or before a crash) stay counted in every "
            "epsilon reported from now on.", optimizer.dp_steps, ledger.path, optimizer.accountant.steps, extra,
        )
        target = self.args.target_epsilon
        if target is None:
            return
        remaining = max(0, self.planned_steps - optimizer.dp_steps)
        projected = optimizer.accountant.copy()
        plan = self.privacy_plan
        for sigma, q, n in plan.config.history(plan.noise, plan, remaining, start=optimizer.dp_steps):
            projected.step(sigma, q, n)
        epsilon = projected.get_epsilon(self.delta)
        if epsilon > target:
            raise ValueError(
                f"Cannot resume from the checkpoint at step {optimizer.dp_steps}: the privacy ledger {ledger.path} "
                f"already counts {optimizer.accountant.steps} released steps of this run ({extra} after this "
                f"checkpoint, on another branch or before a crash), and the {remaining} remaining planned steps "
                f"would take epsilon to {epsilon:.4g} > target_epsilon={target}. Resume from the newest checkpoint "
                "(resume_from_checkpoint=True), or lower max_steps/num_train_epochs so that the whole history fits "
                "the target, or pass noise_multiplier instead of target_epsilon (the reported epsilon then counts "
                "every release)."
            )

    @property
    def privacy_ledger_path(self) -> str:
        import os

        return os.path.join(self.args.output_dir, "privacy_ledger.json")

    #: The ledger written before a step may already count the next steps, up to this many seconds of them (at
    #: the measured step time, never beyond the planned steps): a fast GPU step then pays one ledger write
    #: every few steps instead of one each (the atomic rename costs milliseconds on network or overlay file
    #: systems). After a crash the ledger may count up to that many steps that never ran, never fewer than
    #: ran; a finished run's ledger is exact. 0 writes before every step.
    ledger_reserve_seconds: float = 0.5

    def _write_privacy_ledger(self, optimizer: DPOptimizer, in_flight: bool = True) -> None:
        """Write output_dir/privacy_ledger.json; called BEFORE each noisy step is computed and released, so it
        counts the step in flight (and possibly a few reserved after it, see ``ledger_reserve_seconds``) and
        a crash can never leave a ledger below what was spent."""
        if not self.args.should_save:
            return
        ledger = self._privacy_ledger
        if ledger is None:  # the optimizer stepped outside train() (no session opened)
            ledger = self._privacy_ledger = PrivacyLedger(self.args.output_dir)
            ledger.open_session(optimizer.run_id, optimizer.accountant, None, all_processes=False)
        in_flight_step, ahead = optimizer.accountant.steps + 1, 0
        if in_flight:
            now, last = time.monotonic(), self._ledger_last_call
            self._ledger_last_call = now
            if in_flight_step <= self._ledger_reserved_through:
                return  # this step is already counted by the ledger on disk
            # Only where every step releases the same mechanisms (not DIFF2's restarts), so that the reserved
            # steps are counted as what they will release.
            uniform = all(n == self.planned_steps for _, _, n in self.privacy_plan.history())
            if uniform and last is not None and now > last and self.ledger_reserve_seconds > 0:
                remaining = max(0, self.planned_steps - (optimizer.dp_steps + 1))  # the plan's steps, this branch
                ahead = min(int(self.ledger_reserve_seconds / (now - last)), remaining)
        history = optimizer.accountant.copy()
        if in_flight:
            for _ in range(1 + ahead):  # the step about to be released counts already, and the reserved ones
                history.record_step(optimizer.mechanisms())
        fields = {
            "steps_reserved_ahead": ahead,
            "delta": self.delta,
            "epsilon": None if in_flight else history.get_epsilon(self.delta),
            "target_epsilon": self.args.target_epsilon,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "method": self.privacy_plan.method,
        }
        if self.args.dp_log_nonprivate_metrics:
            # a noiseless count of sampled examples with a NaN/inf loss or gradient: a membership signal
            fields["nonfinite_examples_zeroed"] = optimizer.nonfinite_examples
        ledger.record(fields, history, "step_in_flight" if in_flight else "finished")
        self._ledger_reserved_through = history.steps if in_flight else 0

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
        rank, world = max(0, self.args.process_index), max(1, self.args.world_size)
        sampler = self.privacy_plan.make_sampler(rank=rank, world_size=world)
        loaded = dataset
        if self._user_index is not None:  # Poisson over users, each example tagged with its user (units.py)
            dataset = privacy_units.without_column(dataset, self._user_index.column)
            sampler, loaded, collator = privacy_units.user_loading(
                self.privacy_plan, self._user_index, self.args.max_examples_per_user, dataset, collator, rank, world
            )
        self._dp_sampler = sampler  # reseeded after a resume (_begin_privacy_session)
        self._padding_collator = _EmptySafeCollator(collator, dataset)
        self._batch_structure = probe_batch_structure(collator, dataset[0], dataset[1] if len(dataset) > 1 else None)
        return _LogicalBatchLoader(
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
        from that example only (the first-step check verifies it example by example). For packed rows
        (several examples per row) ``self.packed_layout`` says which tokens belong to which example.
        """
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
        problem_type = getattr(getattr(model, "config", None), "problem_type", None)
        smoothing = float(self.args.label_smoothing_factor or 0.0)
        if self._packed_layout is not None:
            if logits.dim() != 3:
                raise PackingError(
                    f"The model returns logits of shape {tuple(logits.shape)} for packed rows: a sequence-level head "
                    "pools over the whole row, mixing the examples packed in it. Use a padding collator (one "
                    "example per row) for this model."
                )
            return packed_token_mean_loss(logits, labels, self._packed_layout, shift=self._causal_lm,
                                          label_smoothing=smoothing)
        return per_example_loss(logits, labels, causal_lm=self._causal_lm, problem_type=problem_type,
                                label_smoothing=smoothing)

    @property
    def packed_layout(self) -> PackedLayout | None:
        """The example boundaries of the packed micro-batch being computed (None: one example per row)."""
        return self._packed_layout

    @contextlib.contextmanager
    def _packed(self, layout: PackedLayout | None):
        """Declare a micro-batch's packing (or its absence) to the loss and the engine for the block."""
        # privacy_unit='user': the loss sees the examples, the engine the units (clipped as one vector each)
        previous, self._packed_layout = self._packed_layout, privacy_units.examples_layout(layout)
        try:
            with self.engine.packed(layout) if self.engine is not None else contextlib.nullcontext():
                yield
        finally:
            self._packed_layout = previous

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Evaluation keeps the model's own loss (no gradients, nothing private is released by training).
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)

    def _training_batch_structure(self) -> BatchStructure:
        """Which keys carry the example axis, probed on the training collator (see hf_dpfilter.batch_structure)."""
        if self._batch_structure is None:
            collator = getattr(self, "_padding_collator", None)
            if collator is not None:
                data = collator.dataset
                self._batch_structure = probe_batch_structure(
                    collator.collate_fn, data[0], data[1] if len(data) > 1 else None
                )
            else:
                self.get_train_dataloader()  # builds the training collator and probes it
        return self._batch_structure

    def _micro_batches(
        self, inputs: dict[str, Any], labels: torch.Tensor, num_examples: int | None = None, size: int | None = None
    ):
        """Micro-batches of at most ``per_device_train_batch_size`` examples: ``(inputs, labels, layout)`` each.

        Cut at example boundaries: rows of the keys that carry the example axis (as probed on the collator), or
        the segments of packed rows (re-packed one row per micro-batch; ``layout`` says where each example is).
        """
        size = size or self.args.per_device_train_batch_size
        structure = self._training_batch_structure()
        for micro, micro_labels, layout in structure.micro_batches(inputs, labels, size, num_examples):
            if layout is not None:
                yield micro, micro_labels, layout
                continue
            mask = micro.get("attention_mask") if "attention_mask" in structure.per_example else None
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
                # Drop trailing columns that are padding in every example of this micro-batch.
                used = int(mask.any(dim=0).nonzero().max().item()) + 1 if mask.any() else 1
                if used < mask.shape[1] and bool(mask[:, used:].eq(0).all()):
                    seq = mask.shape[1]
                    micro = {
                        k: v[:, :used]
                        if k in structure.per_example and isinstance(v, torch.Tensor) and v.dim() >= 2
                        and v.shape[1] == seq else v
                        for k, v in micro.items()
                    }
                    if micro_labels.dim() >= 2 and micro_labels.shape[1] == seq:
                        micro_labels = micro_labels[:, :used]
            yield micro, micro_labels, None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """One logical batch: micro-batches -> per-example losses -> clipped sums in ``p.grad``."""
        model = self.model  # hooks live on the unwrapped modules; DDP reduction is done by the DP optimizer
        model.train()
        if self.engine is not None:
            self.engine.hold_eval_modes()  # modules the options keep in eval mode (dp_batchnorm_eval)
        inputs = dict(self._prepare_inputs(inputs))
        num_examples = inputs.pop(NUM_EXAMPLES_KEY, None)
        units = inputs.pop(privacy_units.UNITS_KEY, None)  # privacy_unit='user': each example's user
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer needs `labels` in every batch to compute per-example losses.")
        batch = labels.shape[0]
        _check_sequence_length(model, inputs, packed=self._training_batch_structure().packed)
        total = torch.zeros((), device=self.args.device)
        cut = self._micro_batches(inputs, labels, num_examples) if units is None else privacy_units.unit_micro_batches(
            self._training_batch_structure(), self._micro_batches, inputs, labels, units,
            self.args.per_device_train_batch_size)
        micro_batches = [self._no_cache_when_packed(m) for m in cut] if (batch and labels.numel()) else []
        examples = sum(m[1].shape[0] if m[2] is None else m[2].num_examples for m in micro_batches)
        batch = examples
        if not self._packing_checked and self._training_batch_structure().packed:
            # on every process at its first step, whatever it sampled (FSDP2 runs collectives in the forward)
            self._check_packed_attention(model)
        if not self._per_example_checked and self.dp_optimizer.sharded:
            check_hook_verified_when_sharded(self, DPTrainer)  # the same on every process: all refuse together
        if micro_batches and not self._per_example_checked and self.engine is not None and not self.dp_optimizer.sharded:
            candidate = self._micro_batch_to_check(micro_batches)
            if candidate is not None:
                self._check_first_micro_batch(model, privacy_units.as_examples(candidate))
        rounds = len(micro_batches)
        if self.dp_optimizer.sharded:
            # FSDP2 gathers parameters with collectives in every forward and backward: every process runs as
            # many micro-batches as the process with the largest share of the Poisson sample.
            rounds = self.dp_optimizer.collectives.max_over_processes(rounds)
        if batch == 0:
            # an empty Poisson batch, declared as such: the optimizer step still adds noise and is accounted
            self.dp_optimizer.accumulate(self.engine, None, batch_size=0)
        for index in range(rounds):
            micro, micro_labels, layout = micro_batches[min(index, len(micro_batches) - 1)] if micro_batches else (
                self._padding_micro_batch()
            )
            size = micro_labels.shape[0] if layout is None else layout.num_examples

            def loss_fn(values, micro=micro, micro_labels=micro_labels):
                with self.compute_loss_context_manager():
                    return self.compute_per_example_loss(model, micro, micro_labels, values)

            if isinstance(layout, privacy_units.UnitLayout):  # one loss per unit: the sum of its examples' losses
                loss_fn = privacy_units.per_unit_loss(loss_fn, layout)

            with self._packed(layout):
                if index >= len(micro_batches):  # FSDP2 padding: run the collectives, contribute nothing
                    self.dp_optimizer.run_without_contributing(self.engine, loss_fn, batch_size=size)
                    continue
                losses = self.dp_optimizer.accumulate(self.engine, loss_fn, batch_size=size)
            total = total + losses.sum()
        return total / max(batch, 1)

    def _no_cache_when_packed(self, micro_batch: tuple) -> tuple:
        """Packed rows: ``use_cache=False``. transformers keeps attention inside each packed example only when no
        cache is passed (``masking_utils``: packed sequences are detected from ``position_ids`` when there are
        no past key values); a causal LM with ``config.use_cache`` would create an empty cache in its forward
        and let every example attend to those before it in the row."""
        micro, micro_labels, layout = micro_batch
        if layout is not None and hasattr(getattr(self.model, "config", None), "use_cache"):
            micro = {**micro, "use_cache": False}
        return micro, micro_labels, layout

    def _check_packed_attention(self, model: nn.Module) -> None:
        """Before the first packed step: prove on synthetic tokens that attention stays inside each example,
        with the inputs a packed micro-batch gets (``use_cache=False``, see :meth:`_no_cache_when_packed`)."""
        probe = {"position_ids": torch.zeros(1, 1, dtype=torch.long)}
        extra, _, _ = self._no_cache_when_packed((probe, None, PackedLayout(((0, 0, 1),), 1, 1)))
        extra = {k: v for k, v in extra.items() if k != "position_ids"}
        proven = check_attention_stays_inside_examples(model, self._training_batch_structure().position_start, extra)
        if not proven and not self.args.dp_verify_first_step:
            raise PackingError(
                f"Packed rows with a model ({type(model).__name__}) on which the synthetic-token probe cannot run (no "
                "vocabulary size in get_input_embeddings() or config.vocab_size, or not one output per token), and "
                "dp_verify_first_step=False: nothing would show that its attention keeps the examples of a row apart. "
                "Keep dp_verify_first_step=True (the per-example check then compares each example with itself alone), "
                "or use a padding collator (one example per row)."
            )
        self._packing_checked = True

    def _check_first_micro_batch(self, model: nn.Module, micro_batch: tuple) -> None:
        """The per-example first-step check (hf_dpfilter.first_step_check), once per run, before any release."""
        micro, micro_labels, layout = micro_batch
        singles = [self._no_cache_when_packed(self._without_leading_padding(m)) for m in self._micro_batches(
            {k: v for k, v in micro.items() if k != "use_cache"}, micro_labels, size=1)]

        def loss_fn(inputs, labels):
            with self.compute_loss_context_manager():
                return self.compute_per_example_loss(model, inputs, labels)

        worst = verify_per_example(
            self.engine, model, loss_fn, micro_batch, lambda i: singles[i], self._packed,
            # the precision the accelerator really computes in (fixed when the Trainer was created), not args.bf16 now
            low_precision=getattr(getattr(self, "accelerator", None), "mixed_precision", "no") in ("bf16", "fp16"),
        )
        self._per_example_checked = True
        logger.info("First-step per-example check passed (largest relative errors: %s).", worst)

    def _micro_batch_to_check(self, micro_batches: list[tuple]) -> tuple | None:
        """The first micro-batch with two examples or more: one example alone equals itself alone, so it cannot show
        a coupling. Until one comes (Poisson batches of one example), the check waits; a micro-batch of one example
        cannot couple examples, and a rule right in sum is right for it. With per_device_train_batch_size=1 any."""
        need = min(2, self.args.per_device_train_batch_size)
        for micro_batch in micro_batches:
            count = micro_batch[1].shape[0] if micro_batch[2] is None else micro_batch[2].num_examples
            if count >= need:
                return micro_batch
        return None

    def _without_leading_padding(self, micro_batch: tuple) -> tuple:
        """One example as it is alone: without the leading columns that are padding (``attention_mask`` 0). Left
        padding depends on the longest example of the batch; a model that numbers positions from the first column
        (GPT-2, BERT) then gives each example other positions depending on the others, which the first-step check
        must see (the trailing padding is dropped by :meth:`_micro_batches`)."""
        micro, labels, layout = micro_batch
        structure = self._training_batch_structure()
        mask = micro.get("attention_mask") if "attention_mask" in structure.per_example else None
        if layout is not None or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.any()):
            return micro_batch
        first = int(mask.any(dim=0).nonzero().min().item())
        if first == 0:
            return micro_batch
        seq = mask.shape[1]
        micro = {
            k: v[:, first:] if k in structure.per_example and isinstance(v, torch.Tensor) and v.dim() >= 2
            and v.shape[1] == seq else v
            for k, v in micro.items()
        }
        if labels.dim() >= 2 and labels.shape[1] == seq:
            labels = labels[:, first:]
        return micro, labels, layout

    def _padding_micro_batch(self) -> tuple[dict[str, Any], torch.Tensor]:
        """One training example as a micro-batch, for a process with no example of its own under FSDP2.

        Its forward and backward only keep the processes' collectives in step; the result is discarded.
        """
        collator: _EmptySafeCollator = self._padding_collator
        inputs = dict(self._prepare_inputs(collator.collate_fn([collator.dataset[0]])))
        inputs.pop(privacy_units.UNITS_KEY, None)
        labels = inputs.pop("labels")
        return self._no_cache_when_packed(next(iter(self._micro_batches(inputs, labels, 1))))

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0 unless ``dp_log_nonprivate_metrics``: the Trainer's count (``total_flos``) is a function of the private
        Poisson batch sizes and token counts, and is written to trainer_state.json and the loggers."""
        if self.privacy_plan.is_private and not self.args.dp_log_nonprivate_metrics:
            return 0
        return super().floating_point_ops(inputs)

    # ----------------------------------------------------------------------- reporting
    def current_epsilon(self, horizon: int | None = None) -> float:
        """Epsilon spent so far; ``horizon`` (planned total steps) allows the cheap log-line evaluation, see
        :meth:`hf_dpfilter.accounting.PrivacyAccountant.get_epsilon`."""
        if not self.privacy_plan.is_private:
            return float("inf")
        return self.accountant.get_epsilon(self.delta, horizon=horizon)

    #: log keys computed from the private batches without noise (the training loss): published only with
    #: ``dp_log_nonprivate_metrics``
    NONPRIVATE_LOG_KEYS = ("loss", "train_loss")

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.privacy_plan.is_private and not self.args.dp_log_nonprivate_metrics:
            # Removed from the caller's dict too: train()'s returned metrics are what scripts save
            # (trainer.save_metrics -> train_results.json, all_results.json).
            for key in self.NONPRIVATE_LOG_KEYS:
                logs.pop(key, None)
            # skip_memory_metrics=False: the memory deltas and peaks of training (train_mem_gpu_peaked_delta, ...)
            # grow with the longest padded Poisson micro-batch: one long example moves them, without noise
            for key in [k for k in logs if "_mem_" in k]:
                logs.pop(key)
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
        # the unit, the number of units and q over them (privacy_unit='user': over users), hf_dpfilter/units.py
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
            "max_grad_norm": plan.max_grad_norm,
            "clipping_fn": plan.clipping_fn,
            "method": plan.method,
            "method_args": plan.config.to_dict(),
            "poisson_sampling": plan.poisson_sampling,
            "randomness": plan.randomness,
            "neighbouring_relation": "add/remove one example",
            "accountant_history": [list(e) for e in self.accountant.history],
            # Method-specific accounting details (DiceSGD, DIFF2) extend or refine the entries above.
            **plan.config.report(plan.noise, plan, self.accountant.steps, self.delta),
        }, self.args.privacy_unit, plan.num_examples, plan.sample_rate, self.args.max_examples_per_user)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer.create_model_card`` plus the privacy paragraph: the unit-level (epsilon, delta) of the run."""
        super().create_model_card(*args, **kwargs)
        if not self.privacy_plan.is_private or not self.is_world_process_zero():
            return
        import os

        path = os.path.join(self.args.output_dir, "README.md")
        if os.path.exists(path):
            with open(path, "a") as f:
                f.write("\n" + privacy_units.card_section(self.privacy_report()))
