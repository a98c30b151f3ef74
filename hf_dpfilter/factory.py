"""The one factory: what a :class:`~hf_dpfilter.plan.PrivacyPlan` says, built into the objects that run it.

The plan is declarative (it imports no engine or optimizer); this module turns it into the clipping engine,
the method's DP optimizer and the batch sampler, so that every entry point builds them the same way:

* :func:`make_private` -- the three at once, for a custom loop;
* :func:`make_engine`, :func:`make_optimizer`, :func:`make_sampler` -- one each, for ``DPTrainer``, which
  builds them at different points of the Trainer's life (the engine with the model, the optimizer in
  ``create_optimizer``, the sampler in ``get_train_dataloader``);
* :func:`make_dp_optimizer` -- the optimizer alone from flat DP settings (``hf_dpfilter.make_dp_optimizer``);
* the audit (:mod:`hf_dpfilter.audit.run`) builds its deliberately weakened mechanisms here too, through the
  explicit, test-only :class:`AuditOptions` -- never by changing a live optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from hf_dpfilter.optimizers.method_config import MethodConfig
from hf_dpfilter.optimizers.registry import method_spec
from hf_dpfilter.plan import PrivacyPlan

if TYPE_CHECKING:
    from hf_dpfilter.accounting.accountant import PrivacyAccountant
    from hf_dpfilter.data.units import UserIndex
    from hf_dpfilter.distributed.collectives import Collectives
    from hf_dpfilter.engine import GhostClippingEngine
    from hf_dpfilter.optimizers.base import DPOptimizer

__all__ = [
    "DP_SETTINGS",
    "AuditOptions",
    "PrivateTraining",
    "make_dp_optimizer",
    "make_engine",
    "make_optimizer",
    "make_private",
    "make_sampler",
]


class PrivateTraining(NamedTuple):
    """What :func:`make_private` returns: unpack it as ``engine, optimizer, sampler = make_private(...)``."""

    #: the clipping engine (None for the null plan ``method="none"``: a non-private run needs no hooks)
    engine: GhostClippingEngine | None
    #: the method's DP optimizer, the only owner of clipping, noise and accounting
    optimizer: DPOptimizer
    #: the plan's batch sampler (None for a plan without a data set, built with ``PrivacyPlan.for_optimizer``)
    sampler: torch.utils.data.Sampler | None


@dataclass(frozen=True)
class AuditOptions:
    """TEST-ONLY options of :func:`make_optimizer`, for the empirical privacy audit
    (:mod:`hf_dpfilter.audit`).

    ``weakened`` replaces the method's optimizer class with a deliberately broken subclass (the audit's power
    controls: too little noise, separately clipped pieces); ``observe_release`` is called with every
    privatized gradient (after the one noise draw of a release, before any filter or base step) and the
    optimizer. A real run never passes these: a weakened optimizer does NOT give the guarantee the accountant
    reports.
    """

    weakened: type[DPOptimizer] | None = None
    observe_release: Callable[[dict[nn.Parameter, torch.Tensor], DPOptimizer], None] | None = None

    def optimizer_class(self, method_class: type[DPOptimizer]) -> type[DPOptimizer]:
        """The class to build: the method's, or the weakened subclass, observed if asked (a new class, built
        before any optimizer exists)."""
        cls = method_class
        if self.weakened is not None:
            if not issubclass(self.weakened, method_class):
                raise TypeError(f"{self.weakened.__name__} must subclass {method_class.__name__}.")
            cls = self.weakened
        observe = self.observe_release
        if observe is None:
            return cls

        class Observed(cls):  # type: ignore[misc, valid-type]
            def privatize(self, sums):
                released = super().privatize(sums)
                observe(released, self)
                return released

        Observed.__name__ = Observed.__qualname__ = f"Audited{cls.__name__}"
        return Observed


def make_engine(
    plan: PrivacyPlan,
    model: nn.Module,
    *,
    verify_first_backward: bool = True,
    stack_layers: bool | None = None,
    batchnorm_eval: bool = False,
) -> GhostClippingEngine | None:
    """The clipping engine for ``model`` (None for the null plan: non-private runs need no hooks)."""
    if not plan.is_private:
        return None
    from hf_dpfilter.engine import GhostClippingEngine

    return GhostClippingEngine(
        model, verify_first_backward=verify_first_backward, stack_layers=stack_layers,
        batchnorm_eval=batchnorm_eval
    )


def make_optimizer(
    plan: PrivacyPlan,
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None,
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.SGD,
    *,
    accountant: PrivacyAccountant | None = None,
    collectives: Collectives | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    audit: AuditOptions | None = None,
    **base_kwargs: Any,
) -> DPOptimizer:
    """The plan's method's DP optimizer around ``base`` (a class built on ``params`` with ``base_kwargs``, or
    an instance). ``target_epsilon``/``target_delta`` turn on the budget guard; ``audit`` is test-only
    (:class:`AuditOptions`)."""
    from hf_dpfilter.optimizers.base import build_base_optimizer

    optimizer = build_base_optimizer(params, base, **base_kwargs)
    cls = method_spec(plan.method).optimizer_class
    if audit is not None:
        cls = audit.optimizer_class(cls)
    return cls(
        optimizer, plan, accountant=accountant, collectives=collectives, target_epsilon=target_epsilon,
        target_delta=target_delta,
    )


def make_sampler(
    plan: PrivacyPlan,
    rank: int = 0,
    world_size: int = 1,
    *,
    users: UserIndex | None = None,
    max_examples_per_user: int | None = None,
) -> torch.utils.data.Sampler:
    """The batch sampler of the run: Poisson (secure or seeded), or shuffled fixed-size batches.

    With ``users`` (``privacy_unit='user'``; the plan's N and q are then over users): Poisson over users, and
    up to ``max_examples_per_user`` examples of each sampled user, drawn afresh each step
    (:mod:`hf_dpfilter.data.units`).
    """
    from hf_dpfilter.randomness.sampling import PoissonBatchSampler, ShuffledBatchSampler

    if plan.num_examples is None or plan.sample_rate is None or plan.steps_per_epoch is None:
        raise ValueError("This plan has no data set (N); build it with PrivacyPlan.create(num_examples=...).")
    if users is not None:
        from hf_dpfilter.data.units import UserPoissonBatchSampler

        if max_examples_per_user is None or not plan.poisson_sampling:
            raise ValueError("A user-level sampler needs max_examples_per_user and Poisson sampling.")
        return UserPoissonBatchSampler(
            users, plan.sample_rate, max_examples_per_user, plan.steps_per_epoch, seed=plan.seed, rank=rank,
            world_size=world_size, secure=plan.secure_rng,
        )
    if plan.is_private and plan.poisson_sampling:
        return PoissonBatchSampler(
            plan.num_examples, plan.sample_rate, plan.steps_per_epoch, seed=plan.seed, rank=rank,
            world_size=world_size, secure=plan.secure_rng,
        )
    return ShuffledBatchSampler(
        plan.num_examples, int(round(plan.expected_batch_size)), plan.steps_per_epoch, plan.seed, rank,
        world_size
    )


def make_private(
    plan: PrivacyPlan,
    model: nn.Module,
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.SGD,
    *,
    collectives: Collectives | None = None,
    accountant: PrivacyAccountant | None = None,
    verify_first_backward: bool = True,
    stack_layers: bool | None = None,
    batchnorm_eval: bool = False,
    rank: int = 0,
    world_size: int = 1,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    **optimizer_kwargs: Any,
) -> PrivateTraining:
    """A consistent engine, DP optimizer and sampler for ``model``'s trainable parameters under ``plan``.

    ``base`` is the base optimizer: a class (built on the trainable parameters with ``optimizer_kwargs``, e.g.
    ``lr``) or an instance. The sampler is None for a plan without a data set (``for_optimizer``).
    """
    engine = make_engine(
        plan, model, verify_first_backward=verify_first_backward, stack_layers=stack_layers,
        batchnorm_eval=batchnorm_eval,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    dp_optimizer = make_optimizer(
        plan, params, base, accountant=accountant, collectives=collectives, target_epsilon=target_epsilon,
        target_delta=target_delta, **optimizer_kwargs,
    )
    sampler = make_sampler(plan, rank, world_size) if plan.num_examples is not None else None
    return PrivateTraining(engine, dp_optimizer, sampler)


#: the DP settings :func:`make_dp_optimizer` takes (everything else goes to the base optimizer)
DP_SETTINGS = (
    "noise_multiplier", "per_sample_max_grad_norm", "expected_batch_size", "sample_rate", "clipping_fn",
    "seed", "secure_rng", "accountant", "target_epsilon", "target_delta",
)


def make_dp_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None,
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.SGD,
    method: str = "dpsgd",
    method_args: MethodConfig | Mapping[str, Any] | None = None,
    **hyperparameters: Any,
) -> DPOptimizer:
    """Build a DP optimizer (a shortcut for ``make_optimizer(PrivacyPlan.for_optimizer(...), params, base)``).

    Args:
        params: the parameters (or param groups) to optimize; ignored (may be None) when ``base`` is an
            instance.
        base: a ``torch.optim.Optimizer`` class (constructed here) or instance (SGD, Adam, AdamW, ...).
        method: ``"dpsgd"`` (DP-SGD/DP-Adam with the base) or a noise-reducing method
            (``available_methods()``).
        method_args: the method's settings: its config (e.g. ``DiSKConfig(kappa=0.7)``) or a mapping of its
            field names (``{"kappa": 0.7}``).
        **hyperparameters: the DP settings (``noise_multiplier``, ``per_sample_max_grad_norm`` (C; the
            retired ``max_grad_norm`` is refused with this name), ``expected_batch_size``,
            ``sample_rate``, ``clipping_fn``, ``seed``, ``secure_rng``, ``accountant``, and the optional
            budget guard ``target_epsilon``/``target_delta``), and everything else for the base optimizer
            (``lr``, ...).

    Example::

        opt = make_dp_optimizer(model.parameters(), base=torch.optim.AdamW, method="disk", lr=1e-3,
                                noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                expected_batch_size=256, sample_rate=256 / 50_000,
                                method_args={"kappa": 0.7})
    """
    from hf_dpfilter.retired_names import check_no_retired_names

    check_no_retired_names(hyperparameters, "make_dp_optimizer")
    dp_kwargs = {k: v for k, v in hyperparameters.items() if k in DP_SETTINGS}
    base_kwargs = {k: v for k, v in hyperparameters.items() if k not in DP_SETTINGS}
    accountant = dp_kwargs.pop("accountant", None)
    guard = {k: dp_kwargs.pop(k) for k in ("target_epsilon", "target_delta") if k in dp_kwargs}
    missing = [k for k in ("noise_multiplier", "per_sample_max_grad_norm", "expected_batch_size")
               if k not in dp_kwargs]
    if missing and method != "none":
        raise TypeError(f"make_dp_optimizer(method={method!r}) needs {', '.join(missing)}.")
    instance = accountant if accountant is not None and not isinstance(accountant, str) else None
    plan = PrivacyPlan.for_optimizer(
        method=method,
        method_args=method_args,
        accountant=instance.accountant if instance is not None else (accountant or "prv"),
        **dp_kwargs,
    )
    return make_optimizer(plan, params, base, accountant=instance, **guard, **base_kwargs)
