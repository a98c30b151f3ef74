"""The privacy session of a run: the ledger written before every release, resumes, and runs on one model.

Every ``train()`` opens a session on ``output_dir/privacy_ledger.json`` (:mod:`hf_dpfilter.run.ledger`), which
counts every step whose noise may have been released (a step in flight at a crash included), across resumes
and branches. A resume refreshes the randomness and refuses what would overspend or go uncounted: a changed
plan, a checkpoint without the DP optimizer's state, parameters another DP run of this process already
released into. The methods here are a mixin of :class:`hf_dpfilter.trainers.trainer.DPTrainerMixin`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from hf_dpfilter.accounting.accountant import PrivacyAccountant
from hf_dpfilter.run import unit_identity
from hf_dpfilter.run.ledger import PrivacyLedger

if TYPE_CHECKING:
    from transformers import Trainer  # the DPTrainerMixin subclass of one (built above this room)

    from hf_dpfilter.optimizers.base import DPOptimizer

logger = logging.getLogger(__name__)

__all__ = ["PrivacySessionMixin", "privacy_summary", "read_privacy_ledger"]


class _PrivacyCallback(TrainerCallback):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        planned = self.trainer.planned_steps
        if state.max_steps != planned:
            raise RuntimeError(
                f"The Trainer plans {state.max_steps} optimizer steps but the noise was calibrated for "
                f"{planned}. "
                "Do not change num_train_epochs/max_steps after creating the DPTrainer."
            )
        self.trainer._attach_engine_to_prepared_model()
        self.trainer._refuse_resume_without_dp_state(state.global_step)
        self.trainer._refuse_parameters_of_another_run()
        self.trainer._begin_privacy_session()
        self.trainer._check_resumed_budget()
        self.trainer._announce_plan()

    def on_train_end(self, args, state, control, **kwargs):
        # a non-private run (dp_method="none") releases nothing to account, and opened no ledger session
        # (whose reading is collective: opening one here, on the saving process only, would hang the others)
        if self.trainer.dp_optimizer is not None and self.trainer.privacy_plan.is_private:
            self.trainer._write_privacy_ledger(self.trainer.dp_optimizer, in_flight=False)
            if self.trainer.is_world_process_zero():
                logger.warning("%s", privacy_summary(self.trainer.privacy_report()))


def privacy_summary(report: dict[str, Any]) -> str:
    """The privacy a finished run spent, in one line a script's user sees at the end of ``train()`` (public:
    from the plan and the accountant; never the seed)."""
    return (
        f"***** Privacy spent: epsilon = {report['epsilon']:.4g} at delta = {report['delta']:.3g} "
        f"({report['accountant']}) over {report['steps']} of {report['planned_steps']} planned steps; "
        f"{report['method']}, sigma = {report['noise_multiplier']:.4g}, q = {report['sample_rate']:.4g}, "
        f"C = {report['per_sample_max_grad_norm']:g}; {report['neighbouring_relation']} *****"
    )


def read_privacy_ledger(output_dir: str) -> dict[str, Any]:
    """The privacy ledger of a run (output_dir/privacy_ledger.json), with ``epsilon`` computed from its
    history.

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


class PrivacySessionMixin:
    """Budget, ledger and resume checks of a DP run (a mixin of
    :class:`hf_dpfilter.trainers.trainer.DPTrainerMixin`)."""

    def _check_resumed_budget(self) -> None:
        """Refuse to resume a target_epsilon run whose plan changed: the restored history would overspend."""
        optimizer = self.dp_optimizer
        if optimizer is None or self.args.target_epsilon is None or optimizer.dp_steps == 0:
            return
        previous = getattr(optimizer, "loaded_noise_multiplier", None)
        if optimizer.dp_steps > self.planned_steps or (previous is not None
                                                       and previous != self.noise_multiplier):
            raise ValueError(
                f"Cannot resume: the checkpoint spent {optimizer.dp_steps} steps at "
                f"noise_multiplier={previous}, calibrated for a different plan than this run's "
                f"{self.planned_steps} steps at noise_multiplier={self.noise_multiplier:.6g}. Continuing "
                f"would exceed target_epsilon={self.args.target_epsilon}. Resume with the original "
                "max_steps/num_train_epochs and target_epsilon, or re-calibrate explicitly: pass "
                "noise_multiplier instead of target_epsilon (the reported epsilon then counts every step, "
                "including the checkpoint's)."
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
        earlier = {getattr(p, self.RELEASED_BY_ATTRIBUTE, None) for p in optimizer.params} - {None,
                optimizer.run_id}
        if earlier:
            raise ValueError(
                "The model's trainable parameters already received noisy steps from another DP run in this "
                f"process (run_id {', '.join(sorted(earlier))}, see its privacy_ledger.json): this run's "
                "epsilon would count only its own steps, while the model it releases holds both. Continue "
                "the earlier run by resuming from its checkpoint (train(resume_from_checkpoint=...)), or "
                "train a fresh copy of the original model. If the runs use disjoint data and you account "
                "them yourself, remove the mark first: for p in model.parameters(): "
                f"p.__dict__.pop('{self.RELEASED_BY_ATTRIBUTE}', None)."
            )

    def _refuse_resume_without_dp_state(self, global_step: int) -> None:
        """A resumed step count without the DP optimizer's state: its released steps would go uncounted.

        The Trainer restores the model and ``trainer_state.json`` and skips a missing ``optimizer.pt`` without
        a word (``save_only_model=True``, or the file deleted): the accountant would restart at 0 on a model
        that already holds the checkpoint's noisy steps.
        """
        optimizer = self.dp_optimizer
        if global_step == 0 or optimizer is None or not self.privacy_plan.is_private:
            return
        if not optimizer.restored_from_checkpoint:
            raise ValueError(
                f"Cannot resume from a checkpoint at step {global_step} without the DP optimizer's state "
                "(optimizer.pt missing: save_only_model=True, or the file was removed): the model already "
                f"holds {global_step} noisy steps that the accountant could not count, so the reported "
                "epsilon would leave them out. Resume from a checkpoint saved with save_only_model=False, or "
                "start a fresh run from the original model."
            )

    def _begin_privacy_session(self) -> None:
        """At the start of every ``train()``: fresh randomness after a resume, and the ledger's session.

        A restored optimizer already drew a fresh noise seed (``DPOptimizer.load_state_dict``); the sampler
        gets one too, so the batches after a resume are not derivable from ``dp_seed`` and the step either.
        The accountant then continues from the privacy ledger of this run (every branch's releases), and a
        ``target_epsilon`` run whose ledger counts releases beyond the checkpoint is refused when the
        remaining plan would take it above the target.
        """
        optimizer = self.dp_optimizer
        if optimizer is None or not self.privacy_plan.is_private:
            return
        resumed = optimizer.restored_from_checkpoint
        sampler = getattr(self, "_dp_sampler", None)
        if resumed and sampler is not None and not self.privacy_plan.secure_rng:
            from hf_dpfilter.randomness.secure_rng import fresh_seed

            sampler.seed = optimizer.collectives.agree_on_seed(fresh_seed())
        ledger = PrivacyLedger(self.args.output_dir)
        checkpoint_dir = getattr(self, "_resumed_checkpoint_dir", None)
        ledger.open_session(optimizer.run_id, optimizer.accountant, optimizer.dp_steps if resumed else None,
                            checkpoint_dir)
        self._record_unit(ledger, resumed, checkpoint_dir)
        self._privacy_ledger = ledger
        self._ledger_reserved_through, self._ledger_last_call = 0, None
        extra = ledger.steps_beyond_checkpoint
        if extra == 0:
            return
        logger.warning(
            "Resuming from a checkpoint at step %d while the privacy ledger %s counts %d steps of this run: "
            "the %d step(s) released after this checkpoint (another branch, or before a crash) stay counted "
            "in every epsilon reported from now on.", optimizer.dp_steps, ledger.path,
            optimizer.accountant.steps, extra,
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
                f"Cannot resume from the checkpoint at step {optimizer.dp_steps}: the privacy ledger "
                f"{ledger.path} already counts {optimizer.accountant.steps} released steps of this run "
                f"({extra} after this checkpoint, on another branch or before a crash), and the {remaining} "
                f"remaining planned steps would take epsilon to {epsilon:.4g} > target_epsilon={target}. "
                "Resume from the newest checkpoint (resume_from_checkpoint=True), or lower "
                "max_steps/num_train_epochs so that the whole history fits the target, or pass "
                "noise_multiplier instead of target_epsilon (the reported epsilon then counts every release)."
            )

    def _record_unit(self, ledger: PrivacyLedger, resumed: bool, checkpoint_dir: str | None) -> None:
        """The unit is part of the run's identity (hf_dpfilter/run/unit_identity.py): a resume whose unit, id
        column, k or user partition differs from what the checkpoint and the ledger counted is refused here,
        before the first step; then this session's unit is recorded (ledger entry, checkpoints, the private
        partition file)."""
        users = getattr(self, "_user_index", None)
        record = unit_identity.unit_record(self.args, users)
        digest = unit_identity.partition_digest(users) if users is not None else None
        optimizer = self.dp_optimizer
        unit_identity.check_resumed_unit(
            optimizer.run_id, record, digest, optimizer.loaded_unit_identity if resumed else None,
            ledger.source_unit, self.args.output_dir, checkpoint_dir if resumed else None, resumed,
        )
        ledger.unit = optimizer.unit_identity = record
        if digest is not None and self.args.should_save:
            unit_identity.record_partition(self.args.output_dir, optimizer.run_id, digest)

    def _save_rng_state(self, output_dir: str) -> None:
        """``Trainer._save_rng_state`` after the global generators (Python, NumPy, torch on every device) are
        reseeded from the public ``seed`` and the step alone, in a private run.

        Their states are advanced by every draw of the run so far: dropout masks (one draw per element of each
        micro-batch's activations), a collator's random masking, and both follow the secret Poisson batches'
        sizes and lengths. Saved as they are, ``rng_state.pth`` (in every checkpoint, uploaded with
        ``hub_strategy="checkpoint"``) would be a noiseless function of the batches: with the public seed, a
        replaced example changes it. Reseeded, the run itself goes on from the state saved, the one a resume
        restores (dropout after the checkpoint draws alike in both)."""
        if self.privacy_plan.is_private:
            import hashlib

            from transformers import set_seed

            step = f"{self.args.seed}:{self.state.global_step}".encode()
            set_seed(int.from_bytes(hashlib.blake2b(step, digest_size=4).digest(), "little"))
        super()._save_rng_state(output_dir)

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
                # the plan's steps, this branch
                remaining = max(0, self.planned_steps - (optimizer.dp_steps + 1))
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
