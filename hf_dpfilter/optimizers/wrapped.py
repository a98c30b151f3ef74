"""The ``torch.optim.Optimizer`` surface of an optimizer that wraps another: the base optimizer owns
``param_groups``, ``state`` and ``defaults``, so schedulers, Accelerate and the Trainer see one optimizer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["WrappedOptimizer", "build_base_optimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters and state are those of ``original_optimizer`` (set by :meth:`wrap`)."""

    original_optimizer: torch.optim.Optimizer

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Wrap ``optimizer``; what ``torch.optim.Optimizer.__init__`` would set (its hooks), without its
        state."""
        self.original_optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

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

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)


def build_base_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
    base: type[torch.optim.Optimizer] | torch.optim.Optimizer,
    **base_kwargs: Any,
) -> torch.optim.Optimizer:
    """An optimizer instance from a class (constructed on ``params``) or an existing instance."""
    if isinstance(base, torch.optim.Optimizer):
        if base_kwargs:
            raise ValueError("base is an optimizer instance; pass its settings to it, not here: "
                             f"{sorted(base_kwargs)}")
        return base
    if isinstance(base, type) and issubclass(base, torch.optim.Optimizer):
        return base(params, **base_kwargs)
    raise TypeError(f"base must be a torch.optim.Optimizer class or instance, got {base!r}.")
