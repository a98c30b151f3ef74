"""DP-SGD / DP-Adam: the baseline DP optimizer, and the base class every DP method extends.

Per logical step t with Poisson batch B_t (expected size B, sample rate q)::

    g_t = (1/B) * ( sum_{i in B_t} clip(v_i, C) + N(0, sigma^2 Delta^2 I) )      # privatize (once per step)
    x_{t+1} = BaseOptimizerUpdate(x_t, postprocess(g_t))                         # any torch optimizer

with v_i = grad f(x_t; xi_i) and Delta = C for DP-SGD (Abadi et al., 2016). With Adam/AdamW as the base
this is DP-Adam(W). The base optimizer and ``postprocess`` (filters, momentum) only see the privatized
g_t, so they are post-processing.

Extension points for the methods (``hf_dpfilter/optimizers/<method>.py``):

* :meth:`gradient_points` -- the parameter points and weights of the per-example *combination* that is
  clipped (DiSK's two points, DP-PMLF's k snapshots, DIFF2's differences). One point, weight 1, here.
* :meth:`accumulate` -- how one recorded micro-batch adds to the pre-noise sums (DiceSGD also needs the
  unclipped sum).
* :meth:`sensitivity` / :meth:`privatize` -- the noise, calibrated to the real L2 sensitivity.
* :meth:`postprocess` -- the filter applied to the privatized gradient.
* :meth:`method_state_dict` / :meth:`load_method_state_dict` -- extra state, saved with checkpoints.

Noise is drawn from a seedable ``torch.Generator`` (or a CSPRNG with ``secure_noise=True``). Under several
processes the clipped sums are all-reduced and every process adds the *same* noise draw (same seed), so
noise enters once in total and all replicas stay identical.
"""

from __future__ import annotations

import secrets
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_dpfilter.accounting import PrivacyAccountant
from hf_dpfilter.clipping import CLIPPING_FNS, clip_factors
from hf_dpfilter.engine import GhostClippingEngine, PerExampleGradients, accumulate_into_grad

LossFn = Callable[[dict[nn.Parameter, torch.Tensor] | None], torch.Tensor]


class PrivacyBudgetExceededError(RuntimeError):
    """A step would take the epsilon spent above ``target_epsilon``; the step was not taken."""


class DPOptimizer(torch.optim.Optimizer):
    """Wraps a base ``torch.optim.Optimizer`` and privatizes the gradient it is given (DP-SGD / DP-Adam).

    ``p.grad`` is expected to hold the *sum* of clipped per-example gradients of the logical batch (as
    :meth:`accumulate` or :meth:`GhostClippingEngine.clip_and_accumulate` leave it); ``step()`` adds the
    noise, divides by the expected batch size, post-processes and calls the base optimizer.
    """

    method_name = "dpsgd"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        sample_rate: float | None = None,
        clipping_fn: str = "abadi",
        seed: int | None = None,
        secure_noise: bool = False,
        accountant: PrivacyAccountant | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
    ) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm (the clipping norm C) must be > 0, got {max_grad_norm}.")
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}.")
        if clipping_fn not in CLIPPING_FNS:
            raise ValueError(f"clipping_fn must be one of {CLIPPING_FNS}, got {clipping_fn!r}.")
        self.original_optimizer = optimizer
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.sample_rate = sample_rate
        self.clipping_fn = clipping_fn
        self.secure_noise = secure_noise
        self.accountant = accountant if accountant is not None else PrivacyAccountant("prv")
        self.seed = secrets.randbits(62) if seed is None else int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self.dp_steps = 0
        self.examples_in_step = 0
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
        #: examples whose loss or gradient was NaN/inf and whose contribution was replaced by 0
        self.nonfinite_examples = 0
        # What torch.optim.Optimizer.__init__ would set; the base optimizer owns param_groups and state.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

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

    def accumulate(self, engine: GhostClippingEngine, loss_fn: LossFn, batch_size: int) -> torch.Tensor:
        """Record a micro-batch at every gradient point, clip each example's combination, add to ``p.grad``.

        ``loss_fn(param_values)`` runs the forward at the given parameter values (None: the current ones)
        and returns the per-example losses. Returns the per-example losses at the current point (detached).
        """
        points = self.gradient_points()
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
                    if values is None:
                        losses_here = losses
                    combined = losses * weight if combined is None else combined + losses * weight
        grads = engine.per_example_gradients(combined)
        dropped = self._zero_nonfinite(grads, combined.detach())
        if dropped is not None and losses_here is not None:
            losses_here = torch.where(dropped, torch.zeros_like(losses_here), losses_here)
        self.accumulate_per_example(grads)
        if losses_here is None:
            losses_here = combined
        return losses_here.detach()

    def accumulate_per_example(self, grads: PerExampleGradients) -> None:
        """Add ``sum_i clip(g_i)`` to ``p.grad`` (the only private quantity DP-SGD keeps)."""
        factors = clip_factors(grads.norms(), self.max_grad_norm, self.clipping_fn)
        accumulate_into_grad(grads.weighted_sum(factors, release=True))  # frees A, B as the sums are built
        self.examples_in_step += grads.batch_size

    def postprocess(self, grads: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Post-processing of the privatized gradient (identity for DP-SGD)."""
        return grads

    def after_step(self) -> None:
        """Called after the base optimizer's step (DiSK records the real parameter change here)."""

    def method_state_dict(self) -> dict[str, Any]:
        return {}

    def load_method_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------- the step
    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]

    def gaussian_noise(self, shape: torch.Size, std: float, like: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) noise of the given shape, from the seeded generator or a CSPRNG."""
        if std == 0:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        if self.secure_noise:
            from hf_dpfilter.secure_rng import secure_gaussian

            noise = secure_gaussian(shape, std, dtype=like.dtype, device=like.device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(noise, src=0)  # OS randomness differs per process: use the main process's draw
            return noise
        noise = torch.empty(shape, dtype=like.dtype, device=like.device)
        return noise.normal_(0.0, std, generator=self._generator(like.device))  # one pass: draw and scale

    def noisy_average(self, summed: torch.Tensor, std: float) -> torch.Tensor:
        """``(summed + N(0, std^2 I)) / B`` as a new tensor, in two memory passes.

        The noise is drawn directly at scale ``std / B`` and the sum added into it: on CPU the Gaussian draw for
        every trainable parameter is the largest cost of a DP step after the backward (124M draws for GPT-2
        small), so the separate scale / add / divide passes of the naive form are worth avoiding.
        """
        batch = self.expected_batch_size
        return self.gaussian_noise(summed.shape, std / batch, summed).add_(summed, alpha=1.0 / batch)

    def summed_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """The pre-noise sums of this step (zeros for an empty batch), all-reduced across processes."""
        sums = {}
        for p in self.params:
            sums[p] = p.grad if p.grad is not None else torch.zeros_like(p)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for tensor in sums.values():
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return sums

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """``(sum + N(0, sigma^2 Delta^2)) / B`` -- the one noise draw of the step."""
        std = self.noise_multiplier * self.sensitivity()
        return {p: self.noisy_average(s, std) for p, s in sums.items()}

    def record_privacy_step(self) -> None:
        """Tell the accountant about the step just taken (one Poisson-subsampled Gaussian mechanism)."""
        if self.sample_rate is not None:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_budget()
        for hook in self.pre_release_hooks:
            hook(self)
        noisy = self.privatize(self.summed_gradients())
        for p, g in self.postprocess(noisy).items():
            p.grad = g.to(p.dtype)
        self.original_optimizer.step()
        self.after_step()
        self.record_privacy_step()
        self.dp_steps += 1
        self.examples_in_step = 0
        return loss

    # ------------------------------------------------------------------------- faults and budget
    def _zero_nonfinite(self, grads: PerExampleGradients, losses: torch.Tensor) -> torch.Tensor | None:
        """Zero the contribution of examples with a NaN/inf loss or gradient norm (counted, warned about).

        The zeroed example contributes the zero vector, which is within the sensitivity bound, so the guarantee
        is unaffected; the other examples of the micro-batch are untouched (their gradients are per example).
        """
        bad = ~torch.isfinite(grads.norms()) | ~torch.isfinite(losses.to(grads.norms().device))
        if not bool(bad.any()):
            return None
        grads.zero_examples(bad)
        count = int(bad.sum())
        self.nonfinite_examples += count
        warnings.warn(
            f"{count} example(s) had a NaN or infinite loss or gradient; their contribution to this step was "
            f"replaced by zero ({self.nonfinite_examples} so far). Check the data (empty or corrupt examples) and "
            "the learning rate.",
            RuntimeWarning,
            stacklevel=3,
        )
        return bad.to(losses.device)

    def next_step_history(self) -> list[list]:
        """The accountant entries the next step will add: a dry run of :meth:`record_privacy_step` on a scratch
        accountant (the optimizer's own attributes are restored afterwards)."""
        saved = dict(self.__dict__)
        scratch = PrivacyAccountant(self.accountant.accountant)
        self.accountant = scratch
        try:
            self.record_privacy_step()
        finally:
            self.__dict__.clear()
            self.__dict__.update(saved)
        return scratch.history

    def check_budget(self) -> None:
        """Raise :class:`PrivacyBudgetExceededError` if the next step would spend more than ``target_epsilon``.

        Only with ``target_epsilon``/``target_delta`` given. The epsilon is evaluated a few steps ahead (doubling
        horizon, assuming the next steps cost what the next one does) so that the accountant is not run at every
        step; near the end of the budget it is checked step by step.
        """
        if self.target_epsilon is None or self.sample_rate is None or self.dp_steps < self._budget_safe_until:
            return
        step = self.next_step_history()
        horizon = self._budget_horizon
        while True:
            projected = self.accountant.copy()
            for sigma, q, n in step:
                projected.step(sigma, q, n * horizon)
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
        return {
            "base": self.original_optimizer.state_dict(),
            "dp": {
                "method": self.method_name,
                "dp_steps": self.dp_steps,
                "noise_multiplier": self.noise_multiplier,
                "seed": self.seed,
                "generators": {str(d): g.get_state() for d, g in self._generators.items()},
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
        self.seed = dp_state["seed"]
        self._generators = {}
        for device_name, gen_state in dp_state["generators"].items():
            device = torch.device(device_name)
            self._generator(device).set_state(gen_state)
        self.accountant.load_state_dict(dp_state["accountant"])
        params = self.params
        self.load_method_state_dict(_index_to_params(dp_state["method_state"], params))


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


__all__ = ["DPOptimizer", "LossFn", "PrivacyBudgetExceededError", "build_base_optimizer"]
