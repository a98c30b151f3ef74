"""The parameter values of a method's extra gradient points: stored tensors, differentiable in x, never
copied.

DiSK's look-ahead point and DP-PMLF's snapshots are handed to the engine as parameter values
(:meth:`~hf_dpfilter.optimizers.base.DPOptimizer.gradient_points`). Two things hold for them:

* **Differentiable in x with Jacobian I.** A point's values carry the gradient back to the current parameters
  unchanged, so an ordinary backward of the combined loss (the engine's first-backward check) is the
  per-example combination that the engine clips. :func:`with_identity_gradient` gives a stored tensor that
  property without copying it (a custom autograd function whose backward passes the gradient through); the
  older form ``value + (p - p.detach())`` wrote two parameter-sized tensors per point.
* **Never copied per micro-batch.** DP-PMLF's points are its stored snapshots themselves; DiSK's look-ahead
  point is formed in place once per logical step (:mod:`hf_dpfilter.optimizers.disk`). A step of many
  micro-batches adds no parameter-sized work per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hf_dpfilter.distributed.collectives import is_sharded

__all__ = ["Points", "with_identity_gradient"]

#: a method's gradient points: (weight, parameter values or None for the current ones)
Points = list[tuple[float, "dict[nn.Parameter, torch.Tensor] | None"]]


class _IdentityGradient(torch.autograd.Function):
    """Forward: ``value`` (the same storage, no copy). Backward: the output's gradient goes to ``param``."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def with_identity_gradient(params: Sequence[nn.Parameter],
                           values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors equal to ``values`` (exactly, sharing their storage), differentiable in ``params`` with
    Jacobian I.

    FSDP2's sharded parameters (DTensors) keep the arithmetic form ``value + (p - p.detach())``: the engine
    writes their points into the shards (:mod:`hf_dpfilter.engine.points`) and reads only the values.
    """
    if any(is_sharded(p) for p in params):
        zeros = torch._foreach_sub(list(params), [p.detach() for p in params])
        return list(torch._foreach_add(list(values), zeros))
    return [_IdentityGradient.apply(p, v.detach()) for p, v in zip(params, values)]
