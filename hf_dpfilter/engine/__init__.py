"""The clipping engine: per-example gradients in compact (ghost) form, from one backward.

The engine computes; it never clips (the DP optimizer clips, adds noise and accounts). Its rooms:

* :mod:`~hf_dpfilter.engine.recorder` -- :class:`GhostClippingEngine`: hooks, ``record``, ``packed``,
  ``call_model``, the backward to the recorded layer outputs, the first-backward check;
* :mod:`~hf_dpfilter.engine.proving` -- the proving step (batch axes, state written, modules never called);
* :mod:`~hf_dpfilter.engine.checkpointing` -- gradient checkpointing: refusals and replay at recorded values;
* :mod:`~hf_dpfilter.engine.rules` -- the per-layer rule registry (:func:`register_grad_rule`);
* :mod:`~hf_dpfilter.engine.moe` -- mixture-of-experts routers and experts (Mixtral, Qwen2-MoE), and the calls on a
  merged token axis ``(B·T, d)`` whose batch part the tracer proved;
* :mod:`~hf_dpfilter.engine.per_example` -- :class:`PerExampleGradients`: norms, proven bounds, weighted sums;
* :mod:`~hf_dpfilter.engine.blocks` -- fusion, stacking and Gram algebra of the terms;
* :mod:`~hf_dpfilter.engine.precision` -- term and accumulation dtypes, bf16 splits, rounding-error bounds;
* :mod:`~hf_dpfilter.engine.points` -- the per-example combination of several parameter points (DiSK,
  DP-PMLF, DIFF2), run for a method that declares its points.
"""

from hf_dpfilter.engine.checkpointing import CheckpointingError, checkpoint_function_is_reentrant
from hf_dpfilter.engine.per_example import PerExampleGradients
from hf_dpfilter.engine.points import CurrentPoint, LossFn, Point, per_example_combination
from hf_dpfilter.engine.recorder import GhostClippingEngine, UnsupportedLayerError
from hf_dpfilter.engine.rules import (
    DenseTerm,
    IndexTerm,
    OuterTerm,
    Term,
    find_grad_rule,
    register_grad_rule,
    registered_layer_types,
)

__all__ = [
    "CheckpointingError",
    "CurrentPoint",
    "DenseTerm",
    "GhostClippingEngine",
    "IndexTerm",
    "LossFn",
    "OuterTerm",
    "PerExampleGradients",
    "Point",
    "Term",
    "UnsupportedLayerError",
    "checkpoint_function_is_reentrant",
    "find_grad_rule",
    "per_example_combination",
    "register_grad_rule",
    "registered_layer_types",
]
