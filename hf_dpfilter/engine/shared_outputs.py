"""Per-example gradients of layer calls whose output is shared by every example of the batch.

A learned positional table that reads only the shape of its input (BART's ``BartLearnedPositionalEmbedding``)
and T5's relative attention bias (an ``nn.Embedding`` on a ``(q, k)`` bucket tensor) return one tensor ``O``
that the model broadcasts to every example. The batch-axis trace proves it
(:data:`~hf_dpfilter.proofs.batch_axis.SHARED`: the output derives from no batch tensor). ``O`` has no batch
axis, so the ordinary backward gives only ``sum_i dL_i/dO``; but each example's own gradient ``dL_i/dO`` is
well defined whatever the model does with ``O``, and with it the example's gradient of the module's own
parameters through this call: the vector-Jacobian product of the module's forward, ``(dO/dW)^T dL_i/dO``. Both
are computed here with autograd, per example, batched over the examples with ``is_grads_batched`` (one example
at a time where an operation has no batching rule): no shape is read to split anything, and the number of
examples is the length of the per-example loss, the proven batch. Cost: one extra backward from the losses to
the shared outputs, batched over the examples (``B`` times the work of that part of the backward), and the
per-example gradients materialized as :class:`~hf_dpfilter.engine.rules.DenseTerm` (``B`` times the parameter,
and ``B`` times the output for the output's gradients): cheap for T5's ``(buckets, heads)`` table, ``B^2 T d``
for BART's positional output. The batched backwards run :data:`LANES` examples at a time, so their memory
holds that many copies, not ``B``.

The same computation serves the declared tables of :mod:`hf_dpfilter.engine.shared_tables` (DeBERTa's
``rel_embeddings.weight``, read directly by its encoder): a table is its own shared output, its per-example
gradient ``dL_i/dW`` taken in the same batched backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hf_dpfilter.engine.rules import DenseTerm

__all__ = ["LANES", "per_example_grads", "shared_output_terms"]

#: examples whose backwards one batched (vmapped) backward runs together: its memory holds this many copies
LANES = 8


def _batched_grad(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """``autograd.grad`` with a leading batch of ``grad_outputs`` (one per example), graph kept; :data:`LANES`
    examples at a time."""
    batch = grad_outputs[0].shape[0]
    parts = [_batched_lane(outputs, inputs, [g[start:start + LANES] for g in grad_outputs])
             for start in range(0, batch, LANES)]
    # an input the outputs do not reach gets None in every part
    return tuple(None if grads[0] is None else torch.cat(grads) for grads in zip(*parts))


def _batched_lane(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    try:
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True,
                                   is_grads_batched=True)
    except (RuntimeError, NotImplementedError):  # an operation without a batching rule: one example at a time
        batch = grad_outputs[0].shape[0]
        per_example = [torch.autograd.grad(outputs, inputs, [g[i] for g in grad_outputs], retain_graph=True,
                                           allow_unused=True) for i in range(batch)]
        return tuple(None if per_example[0][k] is None else torch.stack([grads[k] for grads in per_example])
                     for k in range(len(inputs)))


def per_example_grads(per_example_loss: torch.Tensor,
                      targets: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``dL_i/d target`` for every example ``i`` and target, each shaped ``(B, *target.shape)`` (None: the
    losses do not reach it); the graph is kept for the engine's own backward that follows."""
    if not targets:
        return []
    batch = per_example_loss.shape[0]
    one_hot = torch.eye(batch, dtype=per_example_loss.dtype, device=per_example_loss.device)
    return list(_batched_grad([per_example_loss], list(targets), [one_hot]))


def shared_output_terms(
    per_example_loss: torch.Tensor,
    calls: Sequence[tuple[dict[str, nn.Parameter], dict[str, torch.Tensor], torch.Tensor]],
    tables: Sequence[nn.Parameter] = (),
) -> dict[nn.Parameter, list[DenseTerm]]:
    """The per-example gradient terms of the module calls ``(params, used, shared output)`` (see the module
    docstring): ``params`` the module's trainable parameters by name, ``used`` the tensors its forward used
    for them (the same ones, or the values of ``call_model``'s functional call, or FSDP2's gathered tensors),
    so the gradient is taken at the point the forward ran and credited to the parameter; and of the ``tables``
    read directly by the forward (:mod:`hf_dpfilter.engine.shared_tables`), their own per-example gradients.

    Call before the backward that frees the graph. A call or table that gets no gradient contributes nothing.
    """
    grads = per_example_grads(per_example_loss, [out for _, _, out in calls] + list(tables))
    terms: dict[nn.Parameter, list[DenseTerm]] = {}
    for (params, used, output), grad in zip(calls, grads):
        if grad is None:
            continue
        param_grads = _batched_grad([output], [used[name] for name in params], [grad.to(output.dtype)])
        for param, param_grad in zip(params.values(), param_grads):
            if param_grad is not None:
                terms.setdefault(param, []).append(DenseTerm(param_grad))
    for table, grad in zip(tables, grads[len(calls):]):
        if grad is not None:
            terms.setdefault(table, []).append(DenseTerm(grad))
    return terms
