"""The optimizer factory: any torch optimizer turned into a DP optimizer with one of the library's methods."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer, build_base_optimizer

METHODS: dict[str, type[DPOptimizer]] = {"dpsgd": DPOptimizer}


def register_method(cls: type[DPOptimizer]) -> type[DPOptimizer]:
    """Class decorator: make a DPOptimizer subclass available under ``cls.method_name``."""
    METHODS[cls.method_name] = cls
    return cls


def _load_methods() -> None:
    # Each method lives in its own module; importing it registers it. Missing modules are simply absent.
    import importlib

    for name in ("disk", "doppler", "pmlf", "dicesgd", "diff2"):
        try:
            importlib.import_module(f"hf_dpfilter.optimizers.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"hf_dpfilter.optimizers.{name}":
                raise


def available_methods() -> list[str]:
    _load_methods()
    return sorted(METHODS)


def make_dp_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None,
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer = torch.optim.SGD,
    method: str = "dpsgd",
    **hyperparameters: Any,
) -> DPOptimizer:
    """Build a DP optimizer.

    Args:
        params: the parameters (or param groups) to optimize; ignored (may be None) when ``base`` is an instance.
        base: a ``torch.optim.Optimizer`` class (constructed here) or instance (SGD, Adam, AdamW, ...).
        method: ``"dpsgd"`` (DP-SGD/DP-Adam with the base) or a noise-reducing method
            (``available_methods()``).
        **hyperparameters: the DP settings (``noise_multiplier``, ``max_grad_norm``, ``expected_batch_size``,
            ``sample_rate``, ``clipping_fn``, ``seed``, ``secure_noise``, ``accountant``), the method's own
            hyperparameters (see the method class), and everything else for the base optimizer (``lr``, ...).

    Example::

        opt = make_dp_optimizer(model.parameters(), base=torch.optim.AdamW, method="disk", lr=1e-3,
                                noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=256,
                                sample_rate=256 / 50_000, disk_kappa=0.7)
    """
    _load_methods()
    if method not in METHODS:
        raise ValueError(f"Unknown dp method {method!r}; available: {sorted(METHODS)}.")
    cls = METHODS[method]
    accepted = set()
    for klass in cls.__mro__:
        if klass is torch.optim.Optimizer or not issubclass(klass, DPOptimizer):
            continue
        accepted |= {
            name
            for name, p in inspect.signature(klass.__init__).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name not in ("self", "optimizer")
        }
    dp_kwargs = {k: v for k, v in hyperparameters.items() if k in accepted}
    base_kwargs = {k: v for k, v in hyperparameters.items() if k not in accepted}
    optimizer = build_base_optimizer(params, base, **base_kwargs)
    return cls(optimizer, **dp_kwargs)


__all__ = ["METHODS", "DPOptimizer", "available_methods", "make_dp_optimizer", "register_method"]
