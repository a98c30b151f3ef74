"""Layers whose rule reads another tensor than their first positional argument: the tensor declared per type.

The engine's forward hook hands a layer's rule the layer's first positional input (a Linear's hidden states,
an Embedding's ids). A few layers are called on something else and compute their real input inside their
forward:
OPT's ``OPTLearnedPositionalEmbedding`` is called as ``embed_positions(attention_mask, past,
position_ids=...)`` and looks up ``position_ids + offset``. Its rule must see those ids; given the mask it
would be wrong.

Such an input is *declared* here per exact layer type (read from the transformers source, never guessed from
shapes) by a function of the call's arguments; the engine then hooks that type with its keyword arguments. The
declaration is also checked on every proving step: the layer's output must equal what its rule assumes it
computed from the declared input (:attr:`LayerInput.reproduces`, e.g. ``F.embedding(ids, weight)``), so a
forward that changed in another transformers version is refused by name instead of trained with a wrong rule.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerInput", "find_layer_input", "register_layer_input"]


@dataclass(frozen=True)
class LayerInput:
    """The input a layer type's rule reads, and how its output follows from it."""

    #: ``(module, args, kwargs) -> tensor``: the input the rule reads, from the call's arguments
    select: Callable[[nn.Module, tuple, dict], torch.Tensor]
    #: ``(module, input) -> tensor``: the output the rule assumes the layer computed (compared on the proving
    #: step)
    reproduces: Callable[[nn.Module, torch.Tensor], torch.Tensor]


_DECLARED: dict[type, LayerInput] = {}


def register_layer_input(layer_type: type, declared: LayerInput) -> None:
    """Declare the input of ``layer_type``'s rule (exact type: a subclass may compute another input)."""
    _DECLARED[layer_type] = declared


def find_layer_input(module: nn.Module) -> LayerInput | None:
    """The declared input of ``module``'s exact type, or None (the rule reads the first positional input)."""
    return _DECLARED.get(type(module))


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: object = None) -> object:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _opt_positions(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """``OPTLearnedPositionalEmbedding.forward(attention_mask, past_key_values_length=0, position_ids=None)``
    looks up ``position_ids + offset``, with ``position_ids`` counted over the mask when not given
    (modeling_opt.py)."""
    position_ids = _argument(args, kwargs, 2, "position_ids")
    if position_ids is None:
        mask = _argument(args, kwargs, 0, "attention_mask")
        past = _argument(args, kwargs, 1, "past_key_values_length", 0)
        position_ids = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, past:]
    return position_ids + module.offset


def _embedding_lookup(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, module.weight, module.padding_idx)


try:
    _opt = importlib.import_module("transformers.models.opt.modeling_opt")
    register_layer_input(_opt.OPTLearnedPositionalEmbedding, LayerInput(_opt_positions, _embedding_lookup))
except (ImportError, AttributeError):  # pragma: no cover -- a transformers without OPT
    pass
