"""DP-SGD / DP-Adam: the baseline DP optimizer, and the base class every DP method extends.

Per logical step t with Poisson batch B_t (expected size B, sample rate q)::

    g_t = (1/B) * ( sum_{i in B_t} clip(v_i, C) + N(0, sigma^2 Delta^2 I) )      # privatize (once per step)
    x_{t+1} = BaseOptimizerUpdate(x_t, postprocess(g_t))                         # any torch optimizer

with v_i = grad f(x_t; xi_i) and Delta = C for DP-SGD (Abadi et al., 2016). With Adam/AdamW as the base
this is DP-Adam(W). The base optimizer and ``postprocess`` (filters, momentum) only see the privatized
g_t, so they are post-processing.

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
  A combination with a negative weight has cancellation and is computed in precise mode (float64 terms and
  proven norm bounds, :class:`hf_dpfilter.engine.PerExampleGradients`).
* :meth:`accumulate_per_example` -- how one micro-batch's per-example gradients add to the pre-noise sums
  (DiceSGD also keeps the residual sum).
* :meth:`sensitivity` / :meth:`privatize` -- the noise, calibrated to the real L2 sensitivity.
* :meth:`postprocess` -- the filter applied to the privatized gradient.
* :meth:`method_state_dict` / :meth:`load_method_state_dict` -- extra state, saved with checkpoints.

Noise comes from a torch generator seeded from the plan's secret seed (its own stream,
:func:`hf_dpfilter.secure_rng.derive_seed`), or from the OS CSPRNG with ``secure_noise=True``. Under several
processes the clipped sums are summed through the plan's collectives and every process adds the *same*
noise draw, so noise enters once in total and all replicas stay identical.
"""

from __future__ import annotations

import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_dpfilter.accounting import PrivacyAccountant
from hf_dpfilter.clipping import clip_factors
from hf_dpfilter.collectives import Collectives, as_layout_of, default_collectives, is_sharded
from hf_dpfilter.engine import GhostClippingEngine, PerExampleGradients
from hf_dpfilter.optimizers.method_config import DPSGDConfig, Mechanism, MethodConfig  # noqa: F401 (DPSGDConfig: re-exported)
from hf_dpfilter.secure_rng import derive_seed

if TYPE_CHECKING:
    from hf_dpfilter.plan import PrivacyPlan

LossFn = Callable[[dict[nn.Parameter, torch.Tensor] | None], torch.Tensor]


class CurrentPoint(dict):
    """Values of a gradient point that IS the current point, given explicitly (DIFF2 gives it in float64): its
    losses are the ones the step reports, as for a point given as ``None``."""


class PrivacyBudgetExceededError(RuntimeError):
    """A step would take the epsilon spent above ``target_epsilon``; the step was not taken."""


class UnprivatizedGradientError(RuntimeError):
    """``step()`` was asked to release a gradient that the DP optimizer's own accumulation did not build."""


class DPOptimizer(torch.optim.Optimizer):
    """Wraps a base ``torch.optim.Optimizer``; clips, privatizes and accounts (DP-SGD / DP-Adam).

    Build it from a plan (``plan.make_optimizer(params, base=...)``) or with :func:`make_dp_optimizer`. Per
    step: one :meth:`accumulate` per micro-batch, then :meth:`step` (noise once, account, base step).
    """

    method_name = "dpsgd"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: PrivacyPlan,
        *,
        accountant: PrivacyAccountant | None = None,
        collectives: Collectives | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
    ) -> None:
        if plan.method != self.method_name:
            raise ValueError(f"{type(self).__name__} implements {self.method_name!r}, the plan is for {plan.method!r}.")
        self.original_optimizer = optimizer
        self.plan = plan
        self.accountant = accountant if accountant is not None else PrivacyAccountant(plan.accountant)
        if collectives is None:
            # custom loops too: processes started by a launcher are one DP run, or refused (hf_dpfilter.processes)
            from hf_dpfilter.processes import check_one_dp_run

            check_one_dp_run(torch.distributed.get_world_size() if torch.distributed.is_available()
                             and torch.distributed.is_initialized() else 1)
        self.collectives = collectives if collectives is not None else default_collectives()
        self.seed = plan.seed
        self._generators: dict[torch.device, torch.Generator] = {}
        #: a public random id of the run, kept in checkpoints: the privacy ledger recognises its own lineage
        self.run_id = uuid.uuid4().hex
        #: True once load_state_dict restored a checkpoint (its randomness was then refreshed)
        self.restored_from_checkpoint = False
        self.dp_steps = 0
        # The step token: set by accumulate(), consumed by step(). Nothing else fills the buffer.
        self._accumulated = False
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._engine_checked: GhostClippingEngine | None = None
        self._sharded: bool | None = None
        # Budget guard (opt-in): refuse a step that would take epsilon(target_delta) above target_epsilon.
        if (target_epsilon is None) != (target_delta is None):
            raise ValueError("Give both target_epsilon and target_delta (the budget guard needs both), or neither.")
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self._budget_safe_until = 0  # dp_steps up to which the budget is known to hold
        self._budget_horizon = 1
        #: callables ``hook(optimizer)`` run at the start of every step, before any noise is drawn or released
        #: (DPTrainer writes its privacy ledger here).
        self.pre_release_hooks: list[Callable[[DPOptimizer], None]] = []
        #: examples whose loss or gradient was NaN/inf and whose contribution was replaced by 0. A noiseless count
        #: of sampled examples (a membership signal): kept in memory, published nowhere unless asked
        self.nonfinite_examples = 0
        #: warn at every step that zeroes examples, with the count (off by default: the warning is that signal;
        #: DPTrainer sets it from ``dp_log_nonprivate_metrics``)
        self.warn_nonfinite = False
        # What torch.optim.Optimizer.__init__ would set; the base optimizer owns param_groups and state.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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
    def secure_noise(self) -> bool:
        return self.plan.secure_rng

    # --------------------------------------------------------------- torch.optim.Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> dict:
        return self.original_optimizer.state

    @state.setter
    def state(self, value: dict) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method_name!r}, base={self.original_optimizer!r})"

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and the clipped sums accumulated since the last step (torch semantics)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self._sums = {}
        self._accumulated = False

    # ---------------------------------------------------------------------------- method hooks
    def gradient_points(self) -> list[tuple[float, dict[nn.Parameter, torch.Tensor] | None]]:
        """(weight, parameter values or None for the current ones) of the per-example combination."""
        return [(1.0, None)]

    def sensitivity(self) -> float:
        """L2 sensitivity (add/remove one example) of the pre-noise sum this method privatizes."""
        return self.max_grad_norm

    def noise_variance(self) -> float:
        """Per-coordinate variance of the noise in the averaged privatized gradient, (sigma Delta / B)^2 (public)."""
        return (self.noise_multiplier * self.sensitivity() / self.expected_batch_size) ** 2

    def mechanisms(self) -> list[Mechanism]:
        """The mechanisms the next step releases, as the method's config declares them."""
        return self.config.mechanisms(self.dp_steps, self.plan.noise, self.plan)

    # ------------------------------------------------------------------------ accumulation
    def _check_engine(self, engine: GhostClippingEngine) -> None:
        if engine is self._engine_checked:
            return
        if not isinstance(engine, GhostClippingEngine):
            raise TypeError(f"accumulate() needs the GhostClippingEngine attached to the model, got {engine!r}.")
        mine, theirs = set(self.params), set(engine.trainable_parameters)
        if mine != theirs:
            raise ValueError(
                f"The engine's model has {len(theirs)} trainable parameters and the optimizer {len(mine)} "
                f"({len(theirs - mine)} only in the model, {len(mine - theirs)} only in the optimizer). Every "
                "trainable parameter must be clipped and noised by this optimizer: build both from the same model "
                "(engine, optimizer = plan.build(model, base=...)) or freeze the parameters you do not train."
            )
        self._engine_checked = engine

    def accumulate(self, engine: GhostClippingEngine | None, loss_fn: LossFn, batch_size: int) -> torch.Tensor:
        """Add one micro-batch to this step: forward at every gradient point, clip each example's combination.

        ``loss_fn(param_values)`` runs the forward at the given parameter values (None: the current ones; use
        ``engine.call_model(param_values, **inputs)``) and returns the per-example losses, shape
        ``(batch_size,)``. ``batch_size=0`` declares an empty micro-batch (an empty Poisson sample): nothing is
        run, and the step then adds noise to a zero sum. Returns the per-example losses at the current point
        (detached).
        """
        if batch_size == 0:
            self._accumulated = True
            return torch.zeros(0)
        self._check_engine(engine)
        return self._accumulate_gradients(*self._per_example_pass(engine, loss_fn, batch_size))

    def run_without_contributing(self, engine: GhostClippingEngine, loss_fn: LossFn, batch_size: int) -> None:
        """Run a micro-batch's forwards and backwards as :meth:`accumulate` does, and discard them.

        Nothing enters the step's sums (nothing is released). Under FSDP2 every forward and backward gathers
        parameters with collectives, so all processes must run the same number of micro-batches: a process
        whose share of the Poisson sample is smaller runs this for the difference (DPTrainer does).
        """
        self._check_engine(engine)
        self._per_example_pass(engine, loss_fn, batch_size)

    def _per_example_pass(
        self, engine: GhostClippingEngine, loss_fn: LossFn, batch_size: int
    ) -> tuple[PerExampleGradients, torch.Tensor, torch.Tensor | None]:
        """Forward(s) at the gradient points and the backward: (per-example gradients, combined losses, losses)."""
        points = self.gradient_points()
        precise = any(weight < 0 for weight, _ in points)
        if self.sharded and any(values is not None for _, values in points):
            return self._gradients_at_points_in_shards(engine, loss_fn, points, batch_size, precise)
        losses_here = None
        with engine.record(batch_size=batch_size):
            combined = None
            if len(points) == 1:
                weight, values = points[0]
                losses = loss_fn(values)
                combined = losses * weight if weight != 1.0 else losses
                losses_here = losses
            else:
                # The same dropout masks at every point: replay the RNG state of the first forward.
                devices = sorted({p.device for p in self.params if p.device.type == "cuda"}, key=str)
                cpu_state = torch.get_rng_state()
                cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
                for weight, values in points:
                    torch.set_rng_state(cpu_state)
                    for d, s in zip(devices, cuda_states):
                        torch.cuda.set_rng_state(s, d)
                    losses = loss_fn(values)
                    if values is None or isinstance(values, CurrentPoint):
                        losses_here = losses
                    combined = losses * weight if combined is None else combined + losses * weight
        return engine.per_example_gradients(combined, precise=precise), combined, losses_here

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

    def _gradients_at_points_in_shards(
        self, engine: GhostClippingEngine, loss_fn: LossFn, points: list, batch_size: int, precise: bool
    ) -> tuple[PerExampleGradients, torch.Tensor, torch.Tensor | None]:
        """The per-example combination of the gradient points under FSDP2: one forward and backward per point.

        FSDP2 gathers each layer's parameters from the shards when the layer runs (in the forward and again in
        the backward), so a functional call at other values would be overwritten by the gathered current ones.
        Each point's values are therefore written into this process's shards, its forward and backward run
        (the backward gives that point's output gradients, weighted), and the shards are restored exactly; the
        engine merges the terms of all points per example as one recorded forward would.
        """
        from torch.distributed.fsdp import FSDPModule

        fsdp_modules = [m for m in engine.model.modules() if isinstance(m, FSDPModule)]
        devices = sorted({p.device for p in self.params if p.device.type == "cuda"}, key=str)
        cpu_state = torch.get_rng_state()
        cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
        current = {p: p.detach().clone() for p in self.params}  # x_t, this process's shards
        combined = losses_here = None
        try:
            with engine.record(batch_size=batch_size):
                for weight, values in points:
                    # The same dropout masks at every point: replay the RNG state of the first forward.
                    torch.set_rng_state(cpu_state)
                    for d, state in zip(devices, cuda_states):
                        torch.cuda.set_rng_state(state, d)
                    with torch.no_grad():
                        for p, value in (values or {}).items():
                            p.detach().copy_(value.detach())
                    for module in fsdp_modules:
                        module.reshard()  # the next forward gathers the shards as they are now
                    losses = loss_fn(None)
                    engine.backward_recorded(losses * weight if weight != 1.0 else losses)
                    if values is None:
                        losses_here = losses
                    combined = losses.detach() * weight if combined is None else combined + losses.detach() * weight
                    with torch.no_grad():
                        for p in values or {}:
                            p.detach().copy_(current[p])
        finally:
            with torch.no_grad():
                for p, value in current.items():
                    p.detach().copy_(value)
            for module in fsdp_modules:
                module.reshard()
        return engine.recorded_gradients(precise=precise), combined, losses_here

    def clip_factors(self, grads: PerExampleGradients, max_grad_norm: float | None = None) -> torch.Tensor:
        """Per-example factors with ``||factor_i g_i|| <= max_grad_norm`` (default C) for the exact g_i."""
        norm = self.max_grad_norm if max_grad_norm is None else max_grad_norm
        return clip_factors(grads.clipping_norms(), norm, self.clipping_fn)

    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        """Add ``sum_i clip(g_i)`` to the step's clipped sum (the only private quantity DP-SGD keeps)."""
        self.add_to_sums(grads.weighted_sum(self.clip_factors(grads), release=True))  # frees A, B as it goes

    def add_to_sums(self, sums: dict[nn.Parameter, torch.Tensor]) -> None:
        """Add to the step's clipped-sum buffer (kept in the dtype of the first contribution, fp32 or fp64)."""
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
        from hf_dpfilter.secure_rng import fresh_seed

        self.seed = self.collectives.agree_on_seed(fresh_seed())
        self._generators = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            # The same stream on every process (and device): all processes must draw the same noise.
            generator.manual_seed(derive_seed(self.seed, "gaussian-noise"))
            self._generators[device] = generator
        return self._generators[device]

    def gaussian_noise(self, shape: torch.Size, std: float, like: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) noise of the given shape, from the seeded generator or a CSPRNG.

        For a sharded ``like`` (FSDP2), ``shape`` is the whole shape and the result this process's shard of one
        whole draw: :meth:`sharded_gaussian_noise`.
        """
        if is_sharded(like):
            return self.sharded_gaussian_noise(shape, std, like)
        if std == 0:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        if self.secure_noise:
            from hf_dpfilter.secure_rng import secure_gaussian

            noise = secure_gaussian(shape, std, dtype=like.dtype, device=like.device)
            self.collectives.share_(noise)  # OS randomness differs per process: use the main process's draw
            return noise
        noise = torch.empty(shape, dtype=like.dtype, device=like.device)
        return noise.normal_(0.0, std, generator=self._generator(like.device))  # one pass: draw and scale

    def sharded_gaussian_noise(self, shape: torch.Size, std: float, like: torch.Tensor) -> torch.Tensor:
        """This process's shard of one N(0, std^2 I) draw of the whole ``shape`` (docs/privacy.md, "Sharded noise").

        Seeded noise: every process draws the whole tensor from the shared stream, as one process would, and
        keeps its own rows. The shards are then disjoint pieces of exactly the one-process draw (no piece twice,
        none repeated across processes), and a sharded run releases bit for bit what one process releases.
        Drawing only one's own rows would need a stream keyed by (step, parameter, offset), which ties the noise
        to the shard layout; the whole draw costs each process what one process pays, as under DDP. With
        ``secure_noise`` each process draws its own rows from its own OS CSPRNG: independent draws, so the
        whole vector is again one Gaussian draw, with nothing to exchange.
        """
        local = like.to_local()
        if std == 0:
            return as_layout_of(like, torch.zeros_like(local))
        if self.secure_noise:
            from hf_dpfilter.secure_rng import secure_gaussian

            return as_layout_of(like, secure_gaussian(local.shape, std, dtype=local.dtype, device=local.device))
        whole = torch.empty(shape, dtype=local.dtype, device=local.device)
        whole.normal_(0.0, std, generator=self._generator(local.device))
        return self.collectives.shard_of(like, whole)

    def noisy_average(self, summed: torch.Tensor, std: float) -> torch.Tensor:
        """``(summed + N(0, std^2 I)) / B`` as a new tensor, in two memory passes.

        The noise is drawn directly at scale ``std / B`` and the sum added into it: on CPU the Gaussian draw for
        every trainable parameter is the largest cost of a DP step after the backward (124M draws for GPT-2
        small), so the separate scale / add / divide passes of the naive form are worth avoiding.
        """
        batch = self.expected_batch_size
        return self.gaussian_noise(summed.shape, std / batch, summed).add_(summed, alpha=1.0 / batch)

    def noisy_averages(
        self, sums: dict[nn.Parameter, torch.Tensor], std: float
    ) -> dict[nn.Parameter, torch.Tensor]:
        """``(sum_p + N(0, std^2 I)) / B`` for every parameter: the step's one Gaussian draw, taken at once.

        The noise of all parameters (per device and dtype, in the order of ``sums``) is **one** draw of
        ``sum_p numel(p)`` coordinates from the generator (or the CSPRNG), split into views, and the sums are
        added with one ``foreach`` kernel: a constant number of kernels per step instead of three per
        parameter. The values are views of one buffer (contiguous, disjoint).
        """
        batch = self.expected_batch_size
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p, s in sums.items():
            groups.setdefault((s.device, s.dtype), []).append(p)
        out: dict[nn.Parameter, torch.Tensor] = {}
        for params in groups.values():
            values = [sums[p] for p in params]
            sizes = [v.numel() for v in values]  # whole sizes, also for sharded (FSDP2) sums
            if any(is_sharded(v) for v in values):
                out.update(zip(params, self._sharded_noisy_averages(values, sizes, std / batch, 1.0 / batch)))
                continue
            flat = self.gaussian_noise(torch.Size([sum(sizes)]), std / batch, values[0])
            noisy = [piece.view(v.shape) for piece, v in zip(flat.split(sizes), values)]
            torch._foreach_add_(noisy, values, alpha=1.0 / batch)
            out.update(zip(params, noisy))
        return {p: out[p] for p in sums}

    def _sharded_noisy_averages(
        self, values: list[torch.Tensor], sizes: list[int], std: float, scale: float
    ) -> list[torch.Tensor]:
        """:meth:`noisy_averages` when some sums are shards (FSDP2): seeded noise is the one-process flat draw of
        the whole group, of which each process keeps its parameters' rows (so a sharded run releases exactly what
        one process releases); CSPRNG noise is each process's own draw of its rows (independent, no exchange)."""
        if std == 0 or self.secure_noise:
            noisy = [self.gaussian_noise(v.shape, std, v) for v in values]
        else:
            local = values[0].to_local() if is_sharded(values[0]) else values[0]
            whole = torch.empty(sum(sizes), dtype=local.dtype, device=local.device)
            whole.normal_(0.0, std, generator=self._generator(local.device))
            pieces = [piece.view(v.shape) for piece, v in zip(whole.split(sizes), values)]
            noisy = [self.collectives.shard_of(v, piece) if is_sharded(v) else piece for piece, v in zip(pieces, values)]
        for n, v in zip(noisy, values):
            n.add_(v, alpha=scale)
        return noisy

    def _summed_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """The step's pre-noise sums (zeros for an empty batch), summed across processes. Private."""
        foreign = [p for p in self.params if p.grad is not None]
        if foreign:
            raise UnprivatizedGradientError(
                f"{len(foreign)} trainable parameter(s) hold a .grad that the DP optimizer did not build (an "
                "ordinary loss.backward(), or a gradient written by other code). The DP optimizer only releases "
                "the clipped sums of its own accumulate(); call optimizer.zero_grad() and use "
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
        return self.noisy_averages(sums, std)

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
                f"{type(self).__name__}.step() was called without optimizer.accumulate(...) in this step, so there "
                "is no clipped sum to privatize (the DP optimizer never releases a gradient it did not build). "
                "Call optimizer.accumulate(engine, loss_fn, batch_size) for every micro-batch of the logical batch; "
                "for an empty Poisson batch call optimizer.accumulate(engine, loss_fn, batch_size=0), which "
                "declares the empty step (it still adds noise and is accounted)."
            )
        self.check_budget()
        for hook in self.pre_release_hooks:
            hook(self)
        noisy = self.privatize(self._summed_gradients())
        self._sums = {}
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

    # ------------------------------------------------------------------------- faults and budget
    def _zero_nonfinite(self, grads: PerExampleGradients, losses: torch.Tensor) -> torch.Tensor | None:
        """Zero the contribution of examples with a NaN/inf loss or gradient norm (counted; warned about only
        with ``warn_nonfinite``).

        The zeroed example contributes the zero vector, which is within the sensitivity bound, so the guarantee
        is unaffected; the other examples of the micro-batch are untouched (their gradients are per example).
        """
        bad = ~torch.isfinite(grads.norms()) | ~torch.isfinite(losses.to(grads.norms().device))
        if not bool(bad.any()):
            return None
        grads.zero_examples(bad)
        count = int(bad.sum())
        self.nonfinite_examples += count
        if not self.warn_nonfinite:
            return bad.to(losses.device)
        warnings.warn(
            f"{count} example(s) had a NaN or infinite loss or gradient; their contribution to this step was "
            f"replaced by zero ({self.nonfinite_examples} so far). Check the data (empty or corrupt examples) and "
            "the learning rate.",
            RuntimeWarning,
            stacklevel=3,
        )
        return bad.to(losses.device)

    def next_step_history(self) -> list[list]:
        """The accountant entries the next step will add (read from the method's declaration, nothing run)."""
        if self.sample_rate is None:
            return []
        return [[m.noise_multiplier, m.sample_rate, 1] for m in self.mechanisms()]

    def check_budget(self) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if the next step would spend more than ``target_epsilon``.

        Only with ``target_epsilon``/``target_delta`` given. The epsilon is evaluated a few steps ahead (doubling
        horizon, from the method's declared mechanisms) so that the accountant is not run at every step; near
        the end of the budget it is checked step by step.
        """
        if self.target_epsilon is None or self.sample_rate is None or self.dp_steps < self._budget_safe_until:
            return
        horizon = self._budget_horizon
        while True:
            projected = self.accountant.copy()
            for sigma, q, n in self.config.history(self.plan.noise, self.plan, horizon, start=self.dp_steps):
                projected.step(sigma, q, n)
            if projected.get_epsilon(self.target_delta) <= self.target_epsilon:
                self._budget_safe_until = self.dp_steps + horizon
                self._budget_horizon = 2 * horizon
                return
            if horizon == 1:
                raise PrivacyBudgetExceededError(
                    f"Step {self.dp_steps + 1} would take epsilon above target_epsilon={self.target_epsilon} "
                    f"(delta={self.target_delta}): {self.dp_steps} steps were already spent. Stop training here, "
                    "or recalibrate the noise for a larger budget (calibrate_noise_multiplier(..., extra_history="
                    "accountant.history)) and say so when you report epsilon."
                )
            horizon //= 2
            self._budget_horizon = horizon

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        param_index = {p: i for i, p in enumerate(self.params)}
        method_state = self.method_state_dict()
        # Never the seed nor a generator state: optimizer.pt is uploaded with the checkpoints (hub_strategy
        # "checkpoint"/"all_checkpoints"), and either would regenerate the noise. A loaded optimizer draws fresh
        # randomness instead (load_state_dict), so a resumed run is not bit-reproducible.
        return {
            "base": self.original_optimizer.state_dict(),
            "dp": {
                "method": self.method_name,
                "dp_steps": self.dp_steps,
                "noise_multiplier": self.noise_multiplier,
                "run_id": self.run_id,
                "accountant": self.accountant.state_dict(),
                "method_state": _params_to_index(method_state, param_index),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "base" not in state_dict or "dp" not in state_dict:
            raise ValueError(
                "This is not a DPOptimizer state dict (no 'base'/'dp' entries); it may come from a non-private run."
            )
        dp_state = state_dict["dp"]
        if dp_state["method"] != self.method_name:
            raise ValueError(
                f"The checkpoint was written by method {dp_state['method']!r}, this optimizer is {self.method_name!r}."
            )
        self.original_optimizer.load_state_dict(state_dict["base"])
        self.dp_steps = dp_state["dp_steps"]
        self.loaded_noise_multiplier = dp_state["noise_multiplier"]
        self.run_id = dp_state.get("run_id", self.run_id)
        # Fresh noise after a resume: a restored generator (or one re-derived from the DP seed) would draw on the
        # branch from this checkpoint the noise another branch already released on other batches, and the two
        # noises would cancel in the difference of the branches. A seed or generator state in an older
        # checkpoint is ignored. All processes agree on the new seed (the same noise on every process). A state
        # of no step (Accelerate's prepare() round-trips the fresh optimizer's own state) has no noise to share.
        if self.dp_steps > 0:
            self.refresh_randomness()
            self.restored_from_checkpoint = True
        self.accountant.load_state_dict(dp_state["accountant"])
        params = self.params
        self.load_method_state_dict(_index_to_params(dp_state["method_state"], params))


def copy_all_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair: one fused call, or one call each for FSDP2's DTensors (no fused copy)."""
    if any(is_sharded(d) for d in destinations):
        for d, s in zip(destinations, sources):
            d.copy_(s)
    else:
        torch._foreach_copy_(destinations, sources)


def _params_to_index(obj: Any, index: dict[nn.Parameter, int]) -> Any:
    """Replace parameter keys by their position so method state survives pickling and reloading."""
    if isinstance(obj, dict):
        if obj and all(isinstance(k, nn.Parameter) for k in obj):
            return {"__param_keyed__": {index[k]: _params_to_index(v, index) for k, v in obj.items()}}
        return {k: _params_to_index(v, index) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_params_to_index(v, index) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _index_to_params(obj: Any, params: list[nn.Parameter]) -> Any:
    if isinstance(obj, dict):
        if "__param_keyed__" in obj:
            return {params[int(i)]: _index_to_params(v, params) for i, v in obj["__param_keyed__"].items()}
        return {k: _index_to_params(v, params) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_index_to_params(v, params) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return obj


def build_base_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer,
    **base_kwargs: Any,
) -> torch.optim.Optimizer:
    """An optimizer instance from a class (constructed on ``params``) or an existing instance."""
    if isinstance(base, torch.optim.Optimizer):
        if base_kwargs:
            raise ValueError(f"base is an optimizer instance; pass its settings to it, not here: {sorted(base_kwargs)}")
        return base
    if isinstance(base, type) and issubclass(base, torch.optim.Optimizer):
        return base(params, **base_kwargs)
    raise TypeError(f"base must be a torch.optim.Optimizer class or instance, got {base!r}.")


__all__ = [
    "DPOptimizer",
    "DPSGDConfig",
    "LossFn",
    "PrivacyBudgetExceededError",
    "UnprivatizedGradientError",
    "build_base_optimizer",
    "copy_all_",
]
