"""Shared relative-position tables: per-example gradients through batch-free values the model reshapes itself.

DeBERTa-v2 (and v3) reads its relative-position table directly, ``encoder.rel_embeddings.weight`` (the
``nn.Embedding`` is never called), normalises it with ``encoder.LayerNorm`` (an input of shape ``(2·span,
d)``, no batch axis), and every attention layer projects the same rows, ``query_proj``/``key_proj`` (or
``pos_key_proj``/``pos_query_proj``) on ``(1, 2·span, d)``, then ``transpose_for_scores`` reshapes the result
*by its own shape* and ``.repeat(B, 1, 1)`` copies it to the batch. Every example uses the same rows; each
example's gradient through them is its own, but the gradient that reaches a batch-free value is the sum over
the batch. The engine's usual answer for a broadcast ``(1, ...)`` output (expanding it to ``(B, ...)`` in the
forward hook) breaks here: the model's reshape then makes ``B·B`` copies and torch fails with a shape error.

What holds instead, for a model that contains a declared encoder (:data:`SHARED_TABLE_OWNERS`):

* a layer call whose output does not derive from the batch (proven by the tracer of
  :mod:`hf_dpfilter.proofs.batch_axis`), the ``(1, ...)`` broadcast included, is recorded unchanged as
  ``SHARED``, its per-example gradient taken by :mod:`hf_dpfilter.engine.shared_outputs` (the one mechanism
  for outputs every example shares: BART's positions and T5's relative bias use it too);
* the declared tables read directly by the forward (``rel_embeddings.weight``) are shared values themselves:
  their per-example gradients ``d loss_i / d W`` come from the same batched (vmapped) backward of the
  per-example losses.

Why this is exact and private: a shared value is a function of the parameters only, so ``d loss_i / d Z`` is
the gradient of example i's own loss, from its own backward (what the per-example loss means is the
engine's contract, checked by :mod:`hf_dpfilter.proofs.first_step_check`); no structure of the consumer is
assumed. The price is the batched backward: about B times one backward of the model, where B is the
micro-batch size (freezing the relative-position path, ``rel_embeddings``, ``encoder.LayerNorm`` and the
``pos_*_proj`` layers, removes it only where no trainable layer is called on the table; with ``share_att_key``
the content projections are, so the path stays).
"""

from __future__ import annotations

from torch import nn

__all__ = ["SHARED_TABLE_OWNERS", "declared_tables"]

#: encoder types (module.qualname) whose forward reads a child module's ``weight`` directly as a batch-free
#: table, declared with the child's name
SHARED_TABLE_OWNERS: dict[str, tuple[str, ...]] = {
    "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder": ("rel_embeddings",),
}


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def declared_tables(model: nn.Module) -> tuple[bool, dict[nn.Parameter, str]]:
    """(whether ``model`` contains a declared encoder with its table, its trainable tables read directly ->
    their names). Without a table (DeBERTa-v2 without relative attention) nothing is shared: absolute position
    ids are broadcast ``(1, T)`` and expanded as in BERT."""
    found = False
    tables: dict[nn.Parameter, str] = {}
    for name, module in model.named_modules():
        children = SHARED_TABLE_OWNERS.get(_qualname(module))
        if children is None:
            continue
        for child_name in children:
            weight = getattr(getattr(module, child_name, None), "weight", None)
            found |= isinstance(weight, nn.Parameter)  # DeBERTa without relative attention has no table
            if isinstance(weight, nn.Parameter) and weight.requires_grad:
                tables[weight] = f"{name}.{child_name}.weight" if name else f"{child_name}.weight"
    return found, tables
