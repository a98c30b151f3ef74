"""The clipping engine: per-example gradients in compact (ghost) form, from one backward.

The engine computes; it never clips (the DP optimizer clips, adds noise and accounts). Its rooms:

* :mod:`~hf_dpfilter.engine.recorder` -- :class:`GhostClippingEngine`: hooks, ``record``, ``packed``,
  ``call_model``, the backward to the recorded layer outputs, the first-backward check;
* :mod:`~hf_dpfilter.engine.proving` -- the proving step (batch axes, state written, modules never called);
* :mod:`~hf_dpfilter.engine.checkpointing` -- gradient checkpointing: refusals and replay at recorded values;
* :mod:`~hf_dpfilter.engine.rules` -- the per-layer rule registry (:func:`register_grad_rule`);
* :mod:`~hf_dpfilter.engine.layer_inputs` -- the declared input of layers whose rule reads another tensor than
  their first argument (OPT's positional table), checked on the proving step;
* :mod:`~hf_dpfilter.engine.shared_tables` -- DeBERTa's declared relative-position table, read directly (its
  per-example gradients from :mod:`~hf_dpfilter.engine.shared_outputs`);
* :mod:`~hf_dpfilter.engine.shared_outputs` -- per-example gradients of outputs every example shares (SHARED:
  BART's positions, T5's relative bias, declared tables), from a batched backward of the per-example losses;
* :mod:`~hf_dpfilter.engine.moe` -- mixture-of-experts routers and experts (Mixtral, Qwen2-MoE): their rules,
  and the experts' verdict on the merged token axis ``(B·T, d)`` (recorded as MERGED, like OPT's and BLOOM's
  calls);
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
