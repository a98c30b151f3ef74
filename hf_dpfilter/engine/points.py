"""Multi-point gradient passes: the per-example combination ``sum_k w_k g_i(x_k)`` of several parameter
points.

A method declares its points (``DPOptimizer.gradient_points()``: DiSK's second point, DP-PMLF's k snapshots,
DIFF2's difference); :func:`per_example_combination` runs the forwards at every point and the backward, and
returns the per-example gradients of the *combination*, which the optimizer clips as ONE vector per example
(the invariant: clip the combination, never sum separately clipped pieces).

* Every point sees the same dropout masks: the RNG states of the first forward are replayed before each.
* A combination with a negative weight has cancellation: it is computed in precise mode (float64 terms and
  proven norm bounds, :class:`~hf_dpfilter.engine.per_example.PerExampleGradients`).
* Under FSDP2 a functional call at other values would be overwritten by the gathered current shards, so each
  point's values are written into the shards for its own forward and backward, and restored exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from hf_dpfilter.engine.per_example import PerExampleGradients

__all__ = ["CurrentPoint", "Float64Point", "LossFn", "Point", "per_example_combination"]


class RecordingEngine(Protocol):
    """What a gradient point uses of :class:`~hf_dpfilter.engine.recorder.GhostClippingEngine` (the engine
    is built above the points)."""

    model: nn.Module

    def record(self, *args: Any, **kwargs: Any) -> Any: ...

    def backward_recorded(self, *args: Any, **kwargs: Any) -> Any: ...

    def per_example(self, *args: Any, **kwargs: Any) -> Any: ...

    def per_example_gradients(self, *args: Any, **kwargs: Any) -> Any: ...

    def recorded_gradients(self, *args: Any, **kwargs: Any) -> Any: ...

#: ``loss_fn(param_values)``: the per-example losses (B,) of a forward at those values (None: the current
#: ones)
LossFn = Callable[[dict[nn.Parameter, torch.Tensor] | None], torch.Tensor]
#: (weight, parameter values or None for the current ones) of one point of the combination
Point = tuple[float, "dict[nn.Parameter, torch.Tensor] | None"]


class CurrentPoint(dict):
    """Values of a gradient point that IS the current point, given explicitly (DIFF2 gives it in float64): its
    losses are the ones the step reports, as for a point given as ``None``."""


class Float64Point(dict):
    """Values of a gradient point at which the WHOLE model runs in float64 (frozen parameters and floating
    buffers too, :meth:`GhostClippingEngine.call_model`), also when the trainable parameters are float64
    already: float64 adapters on a float32 base would otherwise compute the base in float32 (DIFF2's float64
    route)."""


class CurrentFloat64Point(CurrentPoint, Float64Point):
    """The current point, given in float64 for the whole model."""


def per_example_combination(
    engine: RecordingEngine,
    loss_fn: LossFn,
    points: Sequence[Point],
    batch_size: int,
    params: Sequence[nn.Parameter],
    sharded: bool = False,
) -> tuple[PerExampleGradients, torch.Tensor, torch.Tensor | None]:
    """Forward(s) at the gradient points and the backward: (per-example gradients of the combination, combined
    losses, losses at the current point or None when no point is the current one).

    ``params`` are the trainable parameters (their CUDA devices' RNG states are replayed; under FSDP2, with
    ``sharded``, their shards are written and restored).
    """
    precise = any(weight < 0 for weight, _ in points)
    if sharded and any(values is not None for _, values in points):
        return _gradients_at_points_in_shards(engine, loss_fn, points, batch_size, precise, params)
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
            devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
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


def _gradients_at_points_in_shards(
    engine: RecordingEngine,
    loss_fn: LossFn,
    points: Sequence[Point],
    batch_size: int,
    precise: bool,
    params: Sequence[nn.Parameter],
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
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    current = {p: p.detach().clone() for p in params}  # x_t, this process's shards
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
                combined = (losses.detach() * weight if combined is None
                            else combined + losses.detach() * weight)
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
