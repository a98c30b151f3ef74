"""A method's extra state: copied into in place (DTensor-aware), and in a checkpoint with parameter keys
replaced by their position, and back.

Loaded state keyed by a parameter is placed on that parameter's device (its dtype kept: the methods choose
it):
the Trainer loads ``optimizer.pt`` on the CPU when one GPU trains (``map_location="cpu"``) and torch's
optimizers move their own state to the parameters, so a method's buffers must follow too (DiSK's in-place
look-ahead, DP-PMLF's snapshots as parameter values and the filters' state are combined with tensors on the
parameters' device)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_dpfilter.distributed.collectives import is_sharded

__all__ = ["copy_all_", "index_to_params", "params_to_index"]


def params_to_index(obj: Any, index: dict[nn.Parameter, int]) -> Any:
    """Replace parameter keys by their position so method state survives pickling and reloading."""
    if isinstance(obj, dict):
        if obj and all(isinstance(k, nn.Parameter) for k in obj):
            return {"__param_keyed__": {index[k]: params_to_index(v, index) for k, v in obj.items()}}
        return {k: params_to_index(v, index) for k, v in obj.items()}
    if isinstance(obj, list):
        return [params_to_index(v, index) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def index_to_params(obj: Any, params: list[nn.Parameter], device: torch.device | None = None) -> Any:
    """The inverse of :func:`params_to_index`: fresh tensors, those keyed by a parameter on its device."""
    if isinstance(obj, dict):
        if "__param_keyed__" in obj:
            return {params[int(i)]: index_to_params(v, params, params[int(i)].device)
                    for i, v in obj["__param_keyed__"].items()}
        return {k: index_to_params(v, params, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [index_to_params(v, params, device) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.clone() if device is None or obj.device == device else obj.to(device, copy=True)
    return obj


def copy_all_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair: one fused call, or one call each for FSDP2's DTensors (no fused copy)."""
    if any(is_sharded(d) for d in destinations):
        for d, s in zip(destinations, sources):
            d.copy_(s)
    else:
        torch._foreach_copy_(destinations, sources)
