"""``dp_method="none"``: non-private training through the same code path (the null plan), for comparisons.

Per logical step: ``g_t = (1/B) sum_{i in B_t} grad f(x_t; xi_i)`` (no clipping, no noise, no accounting;
epsilon = inf), handed to the base optimizer. Same batches, micro-batching, cross-process sum and divisor as
the DP methods, so a non-private row differs from a private one only by the privatization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_dpfilter.optimizers.base import DPOptimizer, LossFn
from hf_dpfilter.optimizers.method_config import Mechanism, MethodConfig, NoiseSettings, PlanSettings

if TYPE_CHECKING:
    from hf_dpfilter.engine import GhostClippingEngine


@dataclass(frozen=True)
class NonPrivateConfig(MethodConfig):
    """No settings; releases no mechanism (nothing is accounted, epsilon = inf)."""

    name = "none"

    def mechanisms(self, step: int, noise: NoiseSettings, plan: PlanSettings) -> list[Mechanism]:
        return []


class NonPrivateOptimizer(DPOptimizer):
    """The base optimizer on the plain average gradient of the logical batch (no engine needed)."""

    method_name = "none"

    def accumulate(self, engine: GhostClippingEngine | None, loss_fn: LossFn, batch_size: int,
                   **example_keys: Any) -> torch.Tensor:
        # the non-private baseline: its dropout draws from the run's stream, as the plain Trainer's does
        if batch_size == 0:
            self._accumulated = True
            return torch.zeros(0)
        if self.sharded:
            # FSDP2's shards are not in the autograd graph (the forward uses gathered tensors): take the plain
            # sum from the engine, whole-size, which the step reduce-scatters like a clipped sum.
            if engine is None:
                raise ValueError("Under FSDP2 the non-private path needs the clipping engine: "
                                 "accumulate(engine, ...).")
            with engine.record(batch_size=batch_size):
                losses = loss_fn(None)
            grads = engine.per_example_gradients(losses)
            self.add_to_sums(grads.weighted_sum(torch.ones(batch_size, dtype=grads.dtype), release=True))
            self._accumulated = True
            return losses.detach()
        losses = loss_fn(None)
        params = self.params
        grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        self.add_to_sums({p: g for p, g in zip(params, grads) if g is not None})
        self._accumulated = True
        return losses.detach()

    def sensitivity(self) -> float:
        return 0.0

    def privatize(self, sums: dict[nn.Parameter, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        return {p: s / self.expected_batch_size for p, s in sums.items()}

    def record_privacy_step(self) -> None:
        pass


__all__ = ["NonPrivateConfig", "NonPrivateOptimizer"]
