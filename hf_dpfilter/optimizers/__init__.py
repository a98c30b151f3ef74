"""The optimizer factory: any torch optimizer turned into a DP optimizer with one of the library's methods.

The methods are listed once, in :mod:`hf_dpfilter.optimizers.registry`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer, UnprivatizedGradientError, build_base_optimizer
from hf_dpfilter.optimizers.method_config import MethodConfig
from hf_dpfilter.optimizers.registry import method_names, method_spec, register_method

#: the DP settings :func:`make_dp_optimizer` takes (everything else goes to the base optimizer)
DP_SETTINGS = (
    "noise_multiplier", "max_grad_norm", "expected_batch_size", "sample_rate", "clipping_fn", "seed",
    "secure_noise", "accountant", "target_epsilon", "target_delta",
)


def available_methods() -> list[str]:
    """The DP methods (``"none"`` excluded): the names ``make_dp_optimizer`` and ``dp_method`` accept."""
    return sorted(name for name in method_names() if name != "none")


def make_dp_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None,
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.SGD,
    method: str = "dpsgd",
    method_args: MethodConfig | Mapping[str, Any] | None = None,
    **hyperparameters: Any,
) -> DPOptimizer:
    """Build a DP optimizer (a shortcut for ``PrivacyPlan.for_optimizer(...).make_optimizer(...)``).

    Args:
        params: the parameters (or param groups) to optimize; ignored (may be None) when ``base`` is an instance.
        base: a ``torch.optim.Optimizer`` class (constructed here) or instance (SGD, Adam, AdamW, ...).
        method: ``"dpsgd"`` (DP-SGD/DP-Adam with the base) or a noise-reducing method (``available_methods()``).
        method_args: the method's settings: its config (e.g. ``DiSKConfig(kappa=0.7)``) or a mapping of its
            field names (``{"kappa": 0.7}``).
        **hyperparameters: the DP settings (``noise_multiplier``, ``max_grad_norm``, ``expected_batch_size``,
            ``sample_rate``, ``clipping_fn``, ``seed``, ``secure_noise``, ``accountant``, and the optional budget
            guard ``target_epsilon``/``target_delta``), and everything else for the base optimizer (``lr``,
            ...). The method settings' earlier flat names (``disk_kappa``, ...) still work, with a warning.

    Example::

        opt = make_dp_optimizer(model.parameters(), base=torch.optim.AdamW, method="disk", lr=1e-3,
                                noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=256,
                                sample_rate=256 / 50_000, method_args={"kappa": 0.7})
    """
    from hf_dpfilter.plan import PrivacyPlan, split_legacy_method_args

    spec = method_spec(method)
    legacy, rest = split_legacy_method_args(spec.config_class, hyperparameters)
    dp_kwargs = {k: v for k, v in rest.items() if k in DP_SETTINGS}
    base_kwargs = {k: v for k, v in rest.items() if k not in DP_SETTINGS}
    if legacy:
        if isinstance(method_args, MethodConfig):
            raise ValueError("Give the method settings either as method_args or as flat names, not both.")
        method_args = {**legacy, **dict(method_args or {})}
    accountant = dp_kwargs.pop("accountant", None)
    guard = {k: dp_kwargs.pop(k) for k in ("target_epsilon", "target_delta") if k in dp_kwargs}
    missing = [k for k in ("noise_multiplier", "max_grad_norm", "expected_batch_size") if k not in dp_kwargs]
    if missing and method != "none":
        raise TypeError(f"make_dp_optimizer(method={method!r}) needs {', '.join(missing)}.")
    plan = PrivacyPlan.for_optimizer(
        method=method,
        method_args=method_args,
        accountant=accountant.accountant if accountant is not None and not isinstance(accountant, str)
        else (accountant or "prv"),
        **dp_kwargs,
    )
    return plan.make_optimizer(
        params, base=base, accountant=accountant if accountant is not None and not isinstance(accountant, str) else None,
        **guard, **base_kwargs,
    )


__all__ = [
    "DPOptimizer",
    "UnprivatizedGradientError",
    "available_methods",
    "build_base_optimizer",
    "make_dp_optimizer",
    "method_names",
    "method_spec",
    "register_method",
]
