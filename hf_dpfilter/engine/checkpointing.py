"""Gradient checkpointing under the engine: reentrant checkpointing refused, recomputations at recorded
values.

Transformers' non-reentrant ``torch.utils.checkpoint``: a checkpointed layer runs its forward twice, once in
the forward pass and again inside the backward, to rebuild the tensors autograd needs. The hooks fire both
times; only the first counts. A forward hook that fires inside a backward (an autograd graph task) is a
recomputation:
it records nothing, so every layer call is recorded once per gradient point, however many backwards replay it.
Records hold the layer's *gradient edge* (:func:`torch.autograd.graph.get_gradient_edge`), not its output
tensor, so a checkpointed layer's output is freed as checkpointing intends, and the backward still delivers
that output's gradient. A forward at other parameter values (:meth:`GhostClippingEngine.call_model`,
DiSK/DP-PMLF/DIFF2) must be recomputed at the same values: the engine wraps the checkpoint function
transformers keeps on each checkpointed layer (``_gradient_checkpointing_func``) so that its recomputation
runs at the values of its original forward. Reentrant checkpointing (``use_reentrant=True``) runs the first
forward without autograd, so the hooks never see those layers: it is refused, and a recomputation of a layer
that was never recorded raises.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["CheckpointingError", "checkpoint_function_is_reentrant"]


class ReplayingEngine(Protocol):
    """What a checkpoint replay uses of :class:`~hf_dpfilter.engine.recorder.GhostClippingEngine` (the engine
    is built above this room)."""

    model: nn.Module
    recorder: Any
    _active_values: Any
    _replaying_values: Any

    def call_model(self, *args: Any, **kwargs: Any) -> Any: ...


def inside_backward() -> bool:
    """True while autograd runs a backward (where checkpointed layers are recomputed)."""
    return torch._C._current_graph_task_id() != -1


class CheckpointingError(RuntimeError):
    """Gradient checkpointing set up in a way per-example clipping cannot see (reentrant, or unknown)."""


REENTRANT_REFUSED = (
    "Reentrant gradient checkpointing (use_reentrant=True) is not supported with per-example clipping: it "
    "runs the first forward of every checkpointed layer without autograd, so the clipping hooks never see "
    "those layers. Use the non-reentrant kind: gradient_checkpointing_kwargs={'use_reentrant': False} "
    "(transformers' default when no kwargs are given), or "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})."
)


def checkpoint_function_is_reentrant(function: Callable) -> bool | None:
    """Whether transformers' checkpoint function (a ``functools.partial`` of ``torch.utils.checkpoint``)
    is reentrant: True/False when its keywords say, True when unset (torch's default), None when unknown."""
    while isinstance(function, CheckpointAtRecordedValues):
        function = function.checkpoint
    if not isinstance(function, functools.partial):
        return None
    return bool(function.keywords.get("use_reentrant", True))


class CheckpointAtRecordedValues:
    """transformers' per-layer checkpoint function, with the recomputation run at the parameter values of the
    original forward (those given to :meth:`GhostClippingEngine.call_model`, or the current ones)."""

    def __init__(self, checkpoint: Callable, engine: ReplayingEngine) -> None:
        self.checkpoint = checkpoint
        self.engine = engine

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        from hf_dpfilter.randomness.example_keys import active_keyed_mode

        engine = self.engine
        values = engine._active_values  # None: the current values, which are in place at recomputation too
        # the per-example dropout of the original forward, re-entered to recompute
        keyed = active_keyed_mode()

        def at_recorded_values(*inner_args: Any, **inner_kwargs: Any) -> Any:
            if not inside_backward():
                return function(*inner_args, **inner_kwargs)  # the original forward: the values are in place
            from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

            engine._replaying_values += 1
            # the backward runs without the forward's function modes: the same keyed dropout (the checkpoint
            # restores the generator, so each call draws its forward's nonce and mask)
            mode = (keyed if keyed is not None and active_keyed_mode() is not keyed
                    else contextlib.nullcontext())
            try:
                with mode:
                    if values is None:
                        return function(*inner_args, **inner_kwargs)
                    with _reparametrize_module(engine.model, dict(values), tie_weights=True, strict=False):
                        return function(*inner_args, **inner_kwargs)
            finally:
                engine._replaying_values -= 1

        return self.checkpoint(at_recorded_values, *args, **kwargs)


class CheckpointReplay:
    """The engine's side of gradient checkpointing (a mixin of :class:`GhostClippingEngine`)."""

    def _adopt_checkpointing(self) -> None:
        """Check transformers' gradient checkpointing (refuse reentrant) and make its recomputations run at
        the parameter values of their original forward (see the module docstring)."""
        for module in self.model.modules():
            function = module.__dict__.get("_gradient_checkpointing_func")
            if function is None or not getattr(module, "gradient_checkpointing", False):
                continue
            if checkpoint_function_is_reentrant(function):
                raise CheckpointingError(REENTRANT_REFUSED)
            if not isinstance(function, CheckpointAtRecordedValues):
                module._gradient_checkpointing_func = CheckpointAtRecordedValues(function, self)

    def _check_recomputation(self, module: nn.Module) -> None:
        if id(module) not in self._recorded_modules:
            raise CheckpointingError(
                f"Module {type(module).__name__} was recomputed during the backward but its forward was "
                f"never recorded: its first forward ran without autograd, as reentrant checkpointing does. "
                f"{REENTRANT_REFUSED}"
            )
        if self._recorded_at_other_values and not self._replaying_values:
            raise CheckpointingError(
                f"Module {type(module).__name__} was recomputed by a gradient checkpoint that the engine "
                "does not know (not transformers' gradient checkpointing) after a forward at other parameter "
                "values (engine.call_model, used by disk/pmlf/diff2): the recomputation would run at the "
                "current values and give wrong gradients. Use transformers' "
                "model.gradient_checkpointing_enable(...) (or "
                "TrainingArguments(gradient_checkpointing=True)), or a method with one gradient point "
                "(dpsgd)."
            )
