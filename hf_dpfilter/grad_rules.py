"""Per-layer rules for per-example gradients: the registry every layer type goes through.

A *rule* turns what a forward hook saw (the layer input ``A``) and what the backward produced (the gradient
``B`` of the layer output) into one :class:`Term` per parameter. A term is a compact description of the
per-example gradient of that parameter, from which the engine computes per-example norms (by the ghost
identity or by materializing, whichever is cheaper for this batch) and the weighted sum
``sum_i c_i * grad_i`` (book-keeping, so no second backward is needed).

Three kinds of term cover the layers real language models use:

* :class:`OuterTerm` -- ``G_i = sum_t left[i, t] (outer) right[i, t]``: ``nn.Linear`` (left = output
  gradient, right = input), GPT-2 ``Conv1D`` (the transpose: left = input, right = output gradient).
* :class:`IndexTerm` -- ``G_i = sum_t onehot(ids[i, t]) (outer) right[i, t]``: ``nn.Embedding``; rows equal
  to ``padding_idx`` are zeroed as PyTorch does.
* :class:`DenseTerm` -- the materialized per-example gradient ``(B, *param.shape)``: biases, LayerNorm.

Tied weights (GPT-2's ``wte``/``lm_head``) are one parameter with an ``IndexTerm`` and an ``OuterTerm``;
the engine computes the cross term between them exactly.

Add a layer type with :func:`register_grad_rule`::

    @register_grad_rule(MyLayer)
    def _my_layer(module, activations, grad_output) -> dict[str, Term]:
        ...  # keys are the names of module's own (non-recursive) parameters
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DenseTerm",
    "IndexTerm",
    "OuterTerm",
    "Term",
    "find_grad_rule",
    "register_grad_rule",
    "registered_layer_types",
]


@dataclass
class OuterTerm:
    """Per-example gradient ``G_i = sum_t left[i,t] ⊗ right[i,t]``; left (B,T,P), right (B,T,Q)."""

    left: torch.Tensor
    right: torch.Tensor


@dataclass
class IndexTerm:
    """Per-example gradient ``G_i = sum_t e_{ids[i,t]} ⊗ right[i,t]``; ids (B,T) long, right (B,T,Q).

    ``num_rows`` is the number of rows of the parameter (the vocabulary size).
    """

    ids: torch.Tensor
    right: torch.Tensor
    num_rows: int


@dataclass
class DenseTerm:
    """Materialized per-example gradient of shape ``(B, *param.shape)``."""

    grad: torch.Tensor


Term = OuterTerm | IndexTerm | DenseTerm
GradRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, Term]]

_GRAD_RULES: dict[type, GradRule] = {}


def register_grad_rule(*layer_types: type) -> Callable[[GradRule], GradRule]:
    """Register a per-example gradient rule for one or more module types (decorator)."""

    def decorator(rule: GradRule) -> GradRule:
        for layer_type in layer_types:
            _GRAD_RULES[layer_type] = rule
        return rule

    return decorator


def find_grad_rule(module: nn.Module) -> GradRule | None:
    """The rule for ``module``'s exact type, else for the nearest registered base class, else None."""
    for cls in type(module).__mro__:
        if cls in _GRAD_RULES:
            return _GRAD_RULES[cls]
    return None


def registered_layer_types() -> list[type]:
    return list(_GRAD_RULES)


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """View (B, d) as (B, 1, d) and (B, d1, ..., dk, d) as (B, T, d): every position counts as a token."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() > 3:
        return x.reshape(x.shape[0], -1, x.shape[-1])
    return x


@register_grad_rule(nn.Linear)
def _linear(module: nn.Linear, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    a = _as_tokens(activations)
    b = _as_tokens(grad_output)
    terms: dict[str, Term] = {}
    if module.weight.requires_grad:
        terms["weight"] = OuterTerm(left=b, right=a)
    if module.bias is not None and module.bias.requires_grad:
        terms["bias"] = DenseTerm(b.sum(dim=1))
    return terms


def _conv1d(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # transformers' Conv1D computes x @ W + b with W of shape (in, out): the transpose of nn.Linear.
    a = _as_tokens(activations)
    b = _as_tokens(grad_output)
    terms: dict[str, Term] = {}
    if module.weight.requires_grad:
        terms["weight"] = OuterTerm(left=a, right=b)
    if module.bias is not None and module.bias.requires_grad:
        terms["bias"] = DenseTerm(b.sum(dim=1))
    return terms


try:  # transformers is a dependency, but keep the registry importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D

    register_grad_rule(_HFConv1D)(_conv1d)
except ImportError:  # pragma: no cover
    pass


@register_grad_rule(nn.Embedding)
def _embedding(module: nn.Embedding, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    if not module.weight.requires_grad:
        return {}
    ids = activations.reshape(activations.shape[0], -1)
    right = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1])
    if module.padding_idx is not None:
        # PyTorch never updates the padding row; neither do we.
        right = right * (ids != module.padding_idx).unsqueeze(-1).to(right.dtype)
    return {"weight": IndexTerm(ids=ids, right=right, num_rows=module.num_embeddings)}


@register_grad_rule(nn.LayerNorm)
def _layer_norm(module: nn.LayerNorm, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    terms: dict[str, Term] = {}
    batch = activations.shape[0]
    reduce_dims = tuple(range(1, activations.dim() - len(module.normalized_shape)))
    if module.weight is not None and module.weight.requires_grad:
        normalized = F.layer_norm(activations, module.normalized_shape, eps=module.eps)
        grad = (grad_output * normalized).sum(dim=reduce_dims) if reduce_dims else grad_output * normalized
        terms["weight"] = DenseTerm(grad.reshape(batch, *module.weight.shape))
    if module.bias is not None and module.bias.requires_grad:
        grad = grad_output.sum(dim=reduce_dims) if reduce_dims else grad_output
        terms["bias"] = DenseTerm(grad.reshape(batch, *module.bias.shape))
    return terms
