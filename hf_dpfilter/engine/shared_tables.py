"""Shared relative-position tables: per-example gradients through batch-free values the model reshapes itself.

DeBERTa-v2 (and v3) reads its relative-position table directly, ``encoder.rel_embeddings.weight`` (the
``nn.Embedding`` is never called), normalises it with ``encoder.LayerNorm`` (an input of shape ``(2·span, d)``,
no batch axis), and every attention layer projects the same rows, ``query_proj``/``key_proj`` (or
``pos_key_proj``/``pos_query_proj``) on ``(1, 2·span, d)``, then ``transpose_for_scores`` reshapes the result
*by its own shape* and ``.repeat(B, 1, 1)`` copies it to the batch. Every example uses the same rows; each
example's gradient through them is its own, but the gradient that reaches a batch-free value is the sum over
the batch. The engine's usual answer for a broadcast ``(1, ...)`` output (expanding it to ``(B, ...)`` in the
forward hook) breaks here: the model's reshape then makes ``B·B`` copies and torch fails with a shape error.

What holds instead, for a model that contains a declared encoder (:data:`SHARED_TABLE_OWNERS`):

* a layer call whose input does not derive from the batch (proven by the tracer of
  :mod:`hf_dpfilter.proofs.batch_axis`: a broadcast or a batch-free call) is recorded unchanged, *shared*;
* the declared tables read directly by the forward (``rel_embeddings.weight``) are shared parameters;
* their per-example output gradients are ``d loss_i / d Z`` for every example i, computed exactly by one batched
  (vmapped) backward of the per-example losses (:func:`per_example_output_grads`); the layer's rule then turns
  them, with its input copied once per example (a view), into per-example terms as for any other call, and a
  table gets its per-example gradient materialised.

Why this is exact and private: a shared value is a function of the parameters only, so ``d loss_i / d Z`` is
the gradient of example i's own loss, from its own backward (what the per-example loss means is the
engine's contract, checked by :mod:`hf_dpfilter.proofs.first_step_check`); no structure of the consumer is
assumed. The price is the batched backward: about B times one backward of the model, where B is the
micro-batch size (freezing the relative-position path, ``rel_embeddings``, ``encoder.LayerNorm`` and the
``pos_*_proj`` layers, removes it only where no trainable layer is called on the table; with ``share_att_key``
the content projections are, so the path stays).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from hf_dpfilter.engine.rules import DenseTerm, Term, find_grad_rule

__all__ = ["SHARED_TABLE_OWNERS", "declared_tables", "per_example_output_grads", "shared_terms"]

#: encoder types (module.qualname) whose forward reads a child module's ``weight`` directly as a batch-free
#: table, declared with the child's name
SHARED_TABLE_OWNERS: dict[str, tuple[str, ...]] = {
    "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder": ("rel_embeddings",),
}


#: examples whose backwards one vmapped backward runs together: its memory holds this many copies of the gradients
LANES = 8


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def declared_tables(model: nn.Module) -> tuple[bool, dict[nn.Parameter, str]]:
    """(whether ``model`` contains a declared encoder with its table, its trainable tables read directly -> their
    names). Without a table (DeBERTa-v2 without relative attention) nothing is shared: absolute position ids are
    broadcast ``(1, T)`` and expanded as in BERT."""
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


def per_example_output_grads(
    per_example_loss: torch.Tensor, shared: list, tables: dict[nn.Parameter, str]
) -> list[torch.Tensor | None]:
    """``d loss_i / d target`` for every example i and every shared call's output (``shared``, the engine's
    records) then every table, each shaped ``(B, *target.shape)`` (None: no gradient); ``[]`` when there are none.

    Backwards of the per-example losses with one-hot output gradients, batched by vmap (``is_grads_batched``)
    :data:`LANES` examples at a time; the graph is kept for the engine's own backward that follows.
    """
    if not shared and not tables:
        return []
    batch = per_example_loss.shape[0]
    eye = torch.eye(batch, dtype=per_example_loss.dtype, device=per_example_loss.device)
    targets = [record.output_edge for record in shared] + list(tables)
    parts = [
        torch.autograd.grad(per_example_loss, targets, grad_outputs=eye[start:start + LANES], is_grads_batched=True,
                            retain_graph=True, allow_unused=True)
        for start in range(0, batch, LANES)
    ]
    # a target the losses do not reach gets None in every part
    return [None if grads[0] is None else torch.cat(grads) for grads in zip(*parts)]


def shared_terms(
    shared: list,
    per_example: list[torch.Tensor | None],
    tables: dict[nn.Parameter, str],
    module_params: dict[nn.Module, dict[str, nn.Parameter]],
    module_name: Callable[[nn.Module], str],
) -> Iterator[tuple[nn.Parameter, Term]]:
    """The per-example terms of the shared calls (each layer's rule applied to its input copied once per example,
    a view, and its per-example output gradients) and of the tables (materialised), keyed by parameter."""
    for record, grads in zip(shared, per_example):
        if grads is None:
            continue
        module, activations = record.module, record.activations
        if activations is None:
            raise RuntimeError(
                f"Module '{module_name(module)}' ({type(module).__name__}) was called on no tensor input with a "
                "batch-free output that gets gradient: its per-example gradient has no rule. Fix: freeze it "
                "(requires_grad_(False)). Nothing was released."
            )
        rule = find_grad_rule(module)
        for name, term in rule(module, activations.expand(grads.shape[0], *activations.shape), grads).items():
            yield module_params[module][name], term
    for param, grads in zip(tables, per_example[len(shared):]):
        if grads is not None:
            yield param, DenseTerm(grads)
