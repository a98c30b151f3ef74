"""DP-SGD / DP-Adam: the baseline DP optimizer, and the base class every DP method extends.

Per logical step t with Poisson batch B_t (expected size B, sample rate q)::

    g_t = (1/B) * ( sum_{i in B_t} clip(v_i, C) + N(0, sigma^2 Delta^2 I) )      # privatize (once per step)
    x_{t+1} = BaseOptimizerUpdate(x_t, postprocess(g_t))                         # any torch optimizer

with v_i = grad f(x_t; xi_i) and Delta = C for DP-SGD (Abadi et al., "Deep Learning with Differential
Privacy", CCS 2016). With Adam/AdamW as the base
this is DP-Adam(W). The base optimizer and ``postprocess`` (filters, momentum) only see the privatized
g_t, so they are post-processing.

**The step's order** (:meth:`step`): clip -> sum -> noise -> post-process -> base step -> account; the pieces
live elsewhere (the engine and its multi-point service :mod:`hf_dpfilter.engine.points`,
:mod:`hf_dpfilter.randomness.noise`, :mod:`hf_dpfilter.accounting.budget`, the accountant), the order and the
state live here.

**One owner.** The optimizer is the only code that clips, adds noise and records a step. Its
:meth:`accumulate` drives the clipping engine (forward(s) at the method's parameter points, one backward,
per-example clipping of the combination) and keeps the clipped sum in a buffer of its own; :meth:`step`
privatizes that buffer and refuses to run if no :meth:`accumulate` call (an empty micro-batch is declared with
``batch_size=0``) built it in this step, or if ``p.grad`` holds a gradient it did not build (an ordinary
``loss.backward()``). Its settings come from one :class:`hf_dpfilter.plan.PrivacyPlan`.

Extension points for the methods (``hf_dpfilter/optimizers/<method>.py``; their privacy is declared by
their :class:`~hf_dpfilter.optimizers.method_config.MethodConfig`):

* :meth:`gradient_points` -- the parameter points and weights of the per-example *combination* that is
  clipped (DiSK's two points, DP-PMLF's k snapshots, DIFF2's differences). One point, weight 1, here.
  The engine's service :func:`hf_dpfilter.engine.points.per_example_combination` runs the passes (RNG
  replayed at every point; precise mode for a negative weight) and returns the combination, clipped once.
* :meth:`accumulate_per_example` -- how one micro-batch's per-example gradients add to the pre-noise sums
  (DiceSGD also keeps the residual sum).
* :meth:`sensitivity` / :meth:`privatize` -- the noise, calibrated to the real L2 sensitivity.
* :meth:`postprocess` -- the filter applied to the privatized gradient.
* :meth:`method_state_dict` / :meth:`load_method_state_dict` -- extra state, saved with checkpoints.

Noise comes from a torch generator seeded from the plan's secret seed (its own stream,
:func:`hf_dpfilter.randomness.noise.seeded_generator`), or from the OS CSPRNG with ``secure_rng=True``. Under
several processes the clipped sums are summed through the plan's collectives and every process adds the *same*
noise draw, so noise enters once in total and all replicas stay identical.
"""

from __future__ import annotations

import contextlib
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_dpfilter.accounting.accountant import PrivacyAccountant
from hf_dpfilter.accounting.budget import BudgetGuard, PrivacyBudgetExceededError
from hf_dpfilter.distributed.collectives import Collectives, default_collectives, is_sharded
from hf_dpfilter.engine import GhostClippingEngine, PerExampleGradients
from hf_dpfilter.engine.points import LossFn, per_example_combination
from hf_dpfilter.optimizers.clipping import clip_factors, zero_nonfinite_examples
from hf_dpfilter.optimizers.method_config import (
    DPSGDConfig,  # noqa: F401 (re-exported)
    Mechanism,
    MethodConfig,
    PlanSettings,
)
from hf_dpfilter.optimizers.method_state import copy_all_, index_to_params, params_to_index
from hf_dpfilter.optimizers.wrapped import WrappedOptimizer, build_base_optimizer
from hf_dpfilter.randomness.example_keys import ExampleRandomness, example_digest, keyed_step
from hf_dpfilter.randomness.noise import NoiseSource, gaussian_noise, noisy_averages, seeded_generator

if TYPE_CHECKING:
    from hf_dpfilter.trainers.loss_scaling import DPLossScaler


class UnprivatizedGradientError(RuntimeError):
    """``step()`` was asked to release a gradient that the DP optimizer's own accumulation did not build."""


class DPOptimizer(WrappedOptimizer):
    """Wraps a base ``torch.optim.Optimizer``; clips, privatizes and accounts (DP-SGD / DP-Adam).

    Build it from a plan (``hf_dpfilter.factory.make_private(plan, model, base=...)``) or with
    :func:`make_dp_optimizer`. Per step: one :meth:`accumulate` per micro-batch, then :meth:`step` (noise
    once, account, base step).
    """

    method_name = "dpsgd"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: PlanSettings,
        *,
        accountant: PrivacyAccountant | None = None,
        collectives: Collectives | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
    ) -> None:
        if plan.method != self.method_name:
            raise ValueError(f"{type(self).__name__} implements {self.method_name!r}, the plan is for "
                             f"{plan.method!r}.")
        self.wrap(optimizer)  # the base optimizer owns param_groups and state (WrappedOptimizer)
        self.plan = plan
        self.accountant = accountant if accountant is not None else PrivacyAccountant(plan.accountant)
        if collectives is None:
            # custom loops too: processes started by a launcher are one DP run, or refused
            # (hf_dpfilter.distributed.processes)
            from hf_dpfilter.distributed.processes import check_one_dp_run

            check_one_dp_run(torch.distributed.get_world_size() if torch.distributed.is_available()
                             and torch.distributed.is_initialized() else 1)
        self.collectives = collectives if collectives is not None else default_collectives()
        self.seed = plan.seed
        self._generators: dict[torch.device, torch.Generator] = {}
        #: the secret key of each example's dropout masks and collator draws (never saved nor logged)
        self.example_randomness = ExampleRandomness.for_plan(plan.secure_rng, plan.seed,
                                                             self.collectives.agree_on_seed)
        #: a public random id of the run, kept in checkpoints: the privacy ledger recognises its own lineage
        self.run_id = uuid.uuid4().hex
        #: True once load_state_dict restored a checkpoint (its randomness was then refreshed)
        self.restored_from_checkpoint = False
        #: the privacy unit this run counts (public: unit, id column, k, number of units), saved in
        #: checkpoints; and the one a loaded checkpoint recorded (None: none, or a checkpoint of an earlier
        #: version). hf_dpfilter.run.unit_identity compares them before the first step of a resume.
        self.unit_identity: dict[str, Any] | None = None
        self.loaded_unit_identity: dict[str, Any] | None = None
        self.dp_steps = 0
        # The step token: set by accumulate(), consumed by step(). Nothing else fills the buffer.
        self._accumulated = False
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._engine_checked: GhostClippingEngine | None = None
        self._sharded: bool | None = None
        #: opt-in: refuse a step that would take epsilon(target_delta) above target_epsilon
        #: (hf_dpfilter.accounting.budget)
        self.budget = BudgetGuard(target_epsilon, target_delta)
        #: callables ``hook(optimizer)`` run at the start of every step, before any noise is drawn or released
        #: (DPTrainer writes its privacy ledger here).
        self.pre_release_hooks: list[Callable[[DPOptimizer], None]] = []
        #: examples whose loss or gradient was NaN/inf and whose contribution was replaced by 0. A noiseless
        #: count of sampled examples (a membership signal): kept in memory, published nowhere unless asked
        self.nonfinite_examples = 0
        #: warn at every step that zeroes examples, with the count (off by default: the warning is that
        #: signal; DPTrainer sets it from ``dp_log_nonprivate_metrics``)
        self.warn_nonfinite = False
        #: fp16 loss scaling (hf_dpfilter.trainers.loss_scaling): the scale of the engine's backward, divided
        #: out exactly, and moved only by the noised gradient. None: no scaling (fp32, bf16)
        self.loss_scaler: DPLossScaler | None = None

    # ------------------------------------------------------------------------- the plan's settings
    @property
    def config(self) -> MethodConfig:
        return self.plan.config

    @property
    def noise_multiplier(self) -> float:
        return self.plan.noise.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        return self.plan.max_grad_norm

    @property
    def clipping_fn(self) -> str:
        return self.plan.clipping_fn

    @property
    def expected_batch_size(self) -> float:
        return self.plan.expected_batch_size

    @property
    def sample_rate(self) -> float | None:
        return self.plan.sample_rate

    @property
    def secure_rng(self) -> bool:
        return self.plan.secure_rng

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method_name!r}, base={self.original_optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and the clipped sums accumulated since the last step (torch semantics)."""
        super().zero_grad(set_to_none=set_to_none)
        self._sums = {}
        self._accumulated = False

    # ---------------------------------------------------------------------------- method hooks
    def gradient_points(self) -> list[tuple[float, dict[nn.Parameter, torch.Tensor] | None]]:
        """(weight, parameter values or None for the current ones) of the per-example combination."""
        return [(1.0, None)]

    def wants_examples_alone(self) -> bool:
        """Whether the next micro-batches should each be ONE example collated alone, declared to
        ``accumulate(..., alone=True)`` (DIFF2's batch-invariant difference rounds); False: any grouping."""
        return False

    def sensitivity(self) -> float:
        """L2 sensitivity (add/remove one example) of the pre-noise sum this method privatizes."""
        return self.max_grad_norm

    def noise_variance(self) -> float:
        """Per-coordinate variance of the noise in the averaged privatized gradient, (sigma Delta / B)^2
        (public)."""
        return (self.noise_multiplier * self.sensitivity() / self.expected_batch_size) ** 2

    def mechanisms(self) -> list[Mechanism]:
        """The mechanisms the next step releases, as the method's config declares them."""
        return self.config.mechanisms(self.dp_steps, self.plan.noise, self.plan)

    # ------------------------------------------------------------------------ accumulation
    def _check_engine(self, engine: GhostClippingEngine) -> None:
        if engine is self._engine_checked:
            return
        if not isinstance(engine, GhostClippingEngine):
            raise TypeError("accumulate() needs the GhostClippingEngine attached to the model, got "
                            f"{engine!r}.")
        mine, theirs = set(self.params), set(engine.trainable_parameters)
        if mine != theirs:
            raise ValueError(
                f"The engine's model has {len(theirs)} trainable parameters and the optimizer {len(mine)} "
                f"({len(theirs - mine)} only in the model, {len(mine - theirs)} only in the optimizer). "
                "Every trainable parameter must be clipped and noised by this optimizer: build both from the "
                "same model (engine, optimizer, _ = make_private(plan, model, base=...), from "
                "hf_dpfilter.factory) or freeze the parameters you do not train."
            )
        self._engine_checked = engine

    def accumulate(self, engine: GhostClippingEngine | None, loss_fn: LossFn, batch_size: int,
                   example_keys: Sequence[Any] | None = None, padding_side: str = "right",
                   unkeyed_reason: str | None = None) -> torch.Tensor:
        """Add one micro-batch to this step: forward at every gradient point, clip each example's combination.

        Args:
            engine: the clipping engine attached to the model.
            loss_fn: ``loss_fn(param_values)`` runs the forward at the given parameter values (None: the
                current ones; use ``engine.call_model(param_values, **inputs)``) and returns the per-example
                losses, shape ``(batch_size,)``.
            batch_size: the micro-batch's examples; 0 declares an empty micro-batch (an empty Poisson sample):
                nothing is run, and the step then adds noise to a zero sum.
            example_keys: one entry per row of the micro-batch, in order: the example's own content (its raw
                data-set row, or a tensor of its unpadded values), never its padded row. Each example's
                dropout masks are keyed to it (:mod:`hf_dpfilter.randomness.example_keys`); without keys a
                dropout draw in the forward is refused.
            padding_side: the side the rows are padded on (``"left"``: dropout indices run from the end).
            unkeyed_reason: why no keys are given (named in the refusal if the forward draws dropout).

        Returns:
            The per-example losses at the current point (detached).
        """
        if batch_size == 0:
            self._accumulated = True
            return torch.zeros(0)
        self._check_engine(engine)
        with self._keyed(engine, example_keys, padding_side, unkeyed_reason):
            pass_result = self._per_example_pass(engine, loss_fn, batch_size)
        # clipping and summing draw nothing and run no forward: outside the keyed block, so the engine's many
        # small tensor operations there skip the keyed-dropout mode's dispatch
        return self._accumulate_gradients(*pass_result)

    def run_without_contributing(self, engine: GhostClippingEngine, loss_fn: LossFn, batch_size: int,
                                 example_keys: Sequence[Any] | None = None,
                                 padding_side: str = "right") -> None:
        """Run a micro-batch's forwards and backwards as :meth:`accumulate` does, and discard them.

        Nothing enters the step's sums (nothing is released). Under FSDP2 every forward and backward gathers
        parameters with collectives, so all processes must run the same number of micro-batches: a process
        whose share of the Poisson sample is smaller runs this for the difference (DPTrainer does).
        """
        self._check_engine(engine)
        with self._keyed(engine, example_keys, padding_side, None):
            self._per_example_pass(engine, loss_fn, batch_size)

    def _keyed(self, engine: GhostClippingEngine, example_keys: Sequence[Any] | None, padding_side: str,
               unkeyed_reason: str | None) -> contextlib.AbstractContextManager:
        """The micro-batch's forwards and backward with each row's dropout keyed to its example."""
        step = self.accountant.steps
        randomness = self.example_randomness
        seeds = None
        if example_keys is not None:
            digests = [k if isinstance(k, bytes) else example_digest(k) for k in example_keys]
            seeds = randomness.row_seeds(step, "dropout", digests)
        why = unkeyed_reason or ("no example_keys were given to accumulate() (pass one entry per row: the "
                                 "example's own content, e.g. its raw data-set row)")
        devices = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        return keyed_step(randomness.step_seed(step, "dropout"), seeds, padding_side, why, devices, engine)

    def _per_example_pass(
        self, engine: GhostClippingEngine, loss_fn: LossFn, batch_size: int
    ) -> tuple[PerExampleGradients, torch.Tensor, torch.Tensor | None]:
        """The engine's pass at the method's gradient points: (per-example gradients of the combination,
        combined losses, losses at the current point);
        :func:`hf_dpfilter.engine.points.per_example_combination`."""
        engine.loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return per_example_combination(engine, loss_fn, self.gradient_points(), batch_size, self.params,
                                       self.sharded)

    def _accumulate_gradients(
        self, grads: PerExampleGradients, combined: torch.Tensor, losses_here: torch.Tensor | None
    ) -> torch.Tensor:
        dropped = self._zero_nonfinite(grads, combined.detach())
        if dropped is not None and losses_here is not None:
            losses_here = torch.where(dropped, torch.zeros_like(losses_here), losses_here)
        self.accumulate_per_example(grads)
        self._accumulated = True
        if losses_here is None:
            losses_here = combined
        return losses_here.detach()

    @property
    def sharded(self) -> bool:
        """True when FSDP2 shards the trainable parameters (DTensors) over the processes."""
        if self._sharded is None:
            self._sharded = any(is_sharded(p) for p in self.params)
        return self._sharded

    def clip_factors(self, grads: PerExampleGradients, max_grad_norm: float | None = None) -> torch.Tensor:
        """Per-example factors with ``||factor_i g_i|| <= max_grad_norm`` (default C) for the exact g_i."""
        norm = self.max_grad_norm if max_grad_norm is None else max_grad_norm
        return clip_factors(grads.clipping_norms(), norm, self.clipping_fn)

    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        """Add ``sum_i clip(g_i)`` to the step's clipped sum (the only private quantity DP-SGD keeps)."""
        self.add_to_sums(grads.weighted_sum(self.clip_factors(grads), release=True))  # frees A, B as it goes

    def add_to_sums(self, sums: dict[nn.Parameter, torch.Tensor]) -> None:
        """Add to the step's clipped-sum buffer (kept in the dtype of the first contribution, fp32 or
        fp64)."""
        for param, value in sums.items():
            if param in self._sums:
                self._sums[param].add_(value.to(self._sums[param].dtype))
            else:
                self._sums[param] = value

    def _local_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """This process's pre-noise sums of the step so far (private; for tests)."""
        return dict(self._sums)

    def postprocess(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Post-processing of the privatized gradient (identity for DP-SGD)."""
        return grads

    def base_step(self) -> None:
        """The base optimizer's update on the privatized (and post-processed) gradients in ``p.grad``."""
        self.original_optimizer.step()

    def after_step(self) -> None:
        """Called after the base optimizer's step (DiSK records the real parameter change here)."""

    def method_state_dict(self) -> dict[str, Any]:
        return {}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------- the step
    def refresh_randomness(self) -> None:
        """Draw the noise from now on from a fresh secret seed (OS CSPRNG, agreed on by all processes).

        The new stream is not derivable from ``dp_seed`` nor from the step: two branches resumed from one
        checkpoint never share noise.
        """
        from hf_dpfilter.randomness.secure_rng import fresh_seed

        self.seed = self.collectives.agree_on_seed(fresh_seed())
        self._generators = {}
        self.example_randomness = ExampleRandomness.for_plan(True, 0, self.collectives.agree_on_seed)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = seeded_generator(self.seed, device)
        return self._generators[device]

    def gaussian_noise(self, shape: torch.Size, std: float, like: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) noise of ``shape`` (:func:`hf_dpfilter.randomness.noise.gaussian_noise`): every
        non-sharded draw of a step passes here."""
        return gaussian_noise(shape, std, like, secure=self.secure_rng, generator=self._generator,
                              collectives=self.collectives)

    def noise_source(self) -> NoiseSource:
        """Where this optimizer's noise comes from, for the functions of
        :mod:`hf_dpfilter.randomness.noise`."""
        return NoiseSource(draw=self.gaussian_noise, generator=self._generator, secure=self.secure_rng,
                           collectives=self.collectives)

    def _summed_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """The step's pre-noise sums (zeros for an empty batch), summed across processes. Private."""
        foreign = [p for p in self.params if p.grad is not None]
        if foreign:
            raise UnprivatizedGradientError(
                f"{len(foreign)} trainable parameter(s) hold a .grad that the DP optimizer did not build (an "
                "ordinary loss.backward(), or a gradient written by other code). The DP optimizer only "
                "releases the clipped sums of its own accumulate(); call optimizer.zero_grad() and use "
                "optimizer.accumulate(engine, loss_fn, batch_size) instead of backward()."
            )
        params = self.params
        sums = [
            self._sums[p] if p in self._sums
            else torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32,
                             device=p.device)
            for p in params
        ]
        # replicated parameters get the whole sum (all-reduce), sharded ones their shard (reduce-scatter)
        return dict(zip(params, self.collectives.sum_as_params(params, sums)))

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """``(sum + N(0, sigma^2 Delta^2)) / B`` -- the one noise draw of the step."""
        std = self.noise_multiplier * self.sensitivity()
        return noisy_averages(sums, std, self.expected_batch_size, self.noise_source())

    def record_privacy_step(self) -> None:
        """Tell the accountant about the step just taken: the mechanisms the method's config declares."""
        if self.sample_rate is not None:
            self.accountant.record_step(self.mechanisms())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._accumulated:
            raise UnprivatizedGradientError(
                f"{type(self).__name__}.step() was called without optimizer.accumulate(...) in this step, so "
                "there is no clipped sum to privatize (the DP optimizer never releases a gradient it did not "
                "build). Call optimizer.accumulate(engine, loss_fn, batch_size) for every micro-batch of the "
                "logical batch; for an empty Poisson batch call optimizer.accumulate(engine, loss_fn, "
                "batch_size=0), which declares the empty step (it still adds noise and is accounted)."
            )
        self.budget.check(self.accountant, self.plan, self.dp_steps)
        for hook in self.pre_release_hooks:
            hook(self)
        noisy = self.privatize(self._summed_gradients())
        self._sums = {}
        # fp16: the loss scaler reads the noised gradient only (post-processing); a non-finite one is not
        # applied, and the step is accounted all the same (it was released)
        if self.loss_scaler is None or self.loss_scaler.after_noise(noisy):
            for p, g in self.postprocess(noisy).items():
                p.grad = g.to(p.dtype)
            self.base_step()
            for p in self.params:
                p.grad = None  # consumed: a stale privatized gradient must not look like a new one
            self.after_step()
        self.record_privacy_step()
        self.dp_steps += 1
        self._accumulated = False
        return loss

    # ------------------------------------------------------------------------------- faults
    def _zero_nonfinite(self, grads: PerExampleGradients, losses: torch.Tensor) -> torch.Tensor | None:
        """Zero the examples with a NaN/inf loss or gradient
        (:func:`hf_dpfilter.optimizers.clipping.zero_nonfinite_examples`); counted, and warned about only with
        ``warn_nonfinite``."""
        bad = zero_nonfinite_examples(grads, losses)
        if bad is None:
            return None
        count = int(bad.sum())
        self.nonfinite_examples += count
        if self.warn_nonfinite:
            warnings.warn(
                f"{count} example(s) had a NaN or infinite loss or gradient; their contribution to this step "
                f"was replaced by zero ({self.nonfinite_examples} so far). Check the data (empty or corrupt "
                "examples) and the learning rate.",
                RuntimeWarning,
                stacklevel=3,
            )
        return bad

    def next_step_history(self) -> list[list]:
        """The accountant entries the next step will add (read from the method's declaration, nothing run)."""
        if self.sample_rate is None:
            return []
        return [[m.noise_multiplier, m.sample_rate, 1] for m in self.mechanisms()]

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        param_index = {p: i for i, p in enumerate(self.params)}
        method_state = self.method_state_dict()
        # Never the seed nor a generator state: optimizer.pt is uploaded with the checkpoints (hub_strategy
        # "checkpoint"/"all_checkpoints"), and either would regenerate the noise. A loaded optimizer draws
        # fresh randomness instead (load_state_dict), so a resumed run is not bit-reproducible.
        return {
            "base": self.original_optimizer.state_dict(),
            "dp": {
                "method": self.method_name,
                "dp_steps": self.dp_steps,
                "noise_multiplier": self.noise_multiplier,
                "run_id": self.run_id,
                **({"privacy_unit": self.unit_identity} if self.unit_identity is not None else {}),
                **({"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}),
                "accountant": self.accountant.state_dict(),
                "method_state": params_to_index(method_state, param_index),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "base" not in state_dict or "dp" not in state_dict:
            raise ValueError(
                "This is not a DPOptimizer state dict (no 'base'/'dp' entries); it may come from a "
                "non-private run."
            )
        dp_state = state_dict["dp"]
        if dp_state["method"] != self.method_name:
            raise ValueError(
                f"The checkpoint was written by method {dp_state['method']!r}, this optimizer is "
                f"{self.method_name!r}."
            )
        self.original_optimizer.load_state_dict(state_dict["base"])
        self.dp_steps = dp_state["dp_steps"]
        self.loaded_noise_multiplier = dp_state["noise_multiplier"]
        self.run_id = dp_state.get("run_id", self.run_id)
        # the checkpoint's unit stays this optimizer's until the session compares it
        # (hf_dpfilter/run/unit_identity.py)
        self.unit_identity = self.loaded_unit_identity = dp_state.get("privacy_unit")
        # Fresh noise after a resume: a restored generator (or one re-derived from the DP seed) would draw on
        # the branch from this checkpoint the noise another branch already released on other batches, and the
        # two noises would cancel in the difference of the branches. A seed or generator state in an older
        # checkpoint is ignored. All processes agree on the new seed (the same noise on every process). A
        # state of no step (Accelerate's prepare() round-trips the fresh optimizer's own state) has no noise
        # to share.
        if self.dp_steps > 0:
            self.refresh_randomness()
            self.restored_from_checkpoint = True
        self.accountant.load_state_dict(dp_state["accountant"])
        if self.loss_scaler is not None and "loss_scaler" in dp_state:
            self.loss_scaler.load_state_dict(dp_state["loss_scaler"])
        params = self.params
        self.load_method_state_dict(index_to_params(dp_state["method_state"], params))


__all__ = [
    "DPOptimizer",
    "DPSGDConfig",
    "LossFn",
    "PrivacyBudgetExceededError",
    "UnprivatizedGradientError",
    "build_base_optimizer",
    "copy_all_",
]
