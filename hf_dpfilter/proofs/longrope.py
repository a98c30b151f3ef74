"""LongRoPE (Phi-3.5, Phi-4-mini): accepted while every micro-batch stays within the original length.

transformers' ``dynamic_rope_update`` (``modeling_rope_utils``) runs before each LongRoPE rotary forward: with
``seq_len = max(position_ids) + 1`` over the **whole** batch, it copies the long-factor frequencies into the
``inv_freq`` buffer when ``seq_len > original_max_position_embeddings``, the short-factor ones
(``original_inv_freq``, computed from the config at init) otherwise. One long example would switch every
example of its micro-batch to the long factor (and write the buffer from private data); while every position
of the micro-batch is within the original length, the short factor is used, as for each example alone, and the
copy writes ``inv_freq`` with the values it already holds.

So the engine (:class:`hf_dpfilter.engine.GhostClippingEngine`) accepts a LongRoPE module it recognises as
transformers' (:func:`longrope_buffers`), checks before each recorded forward of it that the micro-batch's
largest position is within the original length (:func:`check_positions`, one reduction of ``position_ids``;
refused otherwise, with truncation as the fix), and compares its ``inv_freq`` after each step with the
short-factor frequencies instead of with its version counter. A rotary embedding with dynamic scaling, or a
LongRoPE implementation not recognised, stays refused at attach (:mod:`hf_dpfilter.proofs.validators`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["LongRopeLengthError", "check_positions", "longrope_buffers", "original_length"]


class LongRopeLengthError(ValueError):
    """A micro-batch reaches a position beyond a LongRoPE model's original context length."""


@functools.lru_cache(maxsize=1)
def _update_code() -> Any:
    """The code object of the wrapper ``dynamic_rope_update`` puts around a rotary forward (every wrapped
    forward shares it: closures of one function share their code), or None without transformers."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:  # pragma: no cover -- the engine runs without transformers
        return None
    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _wrapped_by_rope_update(forward: Any) -> bool:
    """Whether ``forward`` (through its ``__wrapped__`` chain: ``torch.no_grad`` wraps it too) is
    transformers' ``dynamic_rope_update`` wrapper, the code whose behaviour is described above."""
    code, seen = _update_code(), 0
    while forward is not None and code is not None and seen < 8:
        if getattr(forward, "__code__", None) is code:
            return True
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
    return False


def _longrope_types(module: nn.Module) -> list[str | None] | None:
    """The layer types (None: the module's single type) whose ``rope_type`` is LongRoPE, or None when some
    other type of the module depends on the data (dynamic) or none is LongRoPE."""
    rope_type = getattr(module, "rope_type", None)
    kinds = dict(rope_type) if isinstance(rope_type, dict) else {None: rope_type}
    if any(isinstance(k, str) and "dynamic" in k for k in kinds.values()):
        return None
    found = [layer for layer, kind in kinds.items() if kind == "longrope"]
    return found or None


def _original_max(module: nn.Module, layer_type: str | None) -> int | None:
    """The module config's ``original_max_position_embeddings`` for ``layer_type``, as the update reads it."""
    parameters = getattr(getattr(module, "config", None), "rope_parameters", None)
    if isinstance(parameters, dict) and layer_type is not None:
        parameters = parameters.get(layer_type)
    value = parameters.get("original_max_position_embeddings") if isinstance(parameters, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def longrope_buffers(module: nn.Module) -> list[tuple[str, str]] | None:
    """For a LongRoPE rotary embedding recognised as transformers' (its forward wrapped by
    ``dynamic_rope_update``, its buffers and original length where the update reads them): the pairs (the
    ``inv_freq`` buffer the update rewrites, the short-factor buffer it copies there within the original
    length), one per LongRoPE layer type. None for any other module."""
    layer_types = _longrope_types(module)
    if layer_types is None or not _wrapped_by_rope_update(getattr(type(module), "forward", None)):
        return None
    buffers = dict(module.named_buffers(recurse=False))
    pairs = []
    for layer_type in layer_types:
        prefix = "" if layer_type is None else f"{layer_type}_"
        pair = (f"{prefix}inv_freq", f"{prefix}original_inv_freq")
        if not all(name in buffers for name in pair) or _original_max(module, layer_type) is None:
            return None
        pairs.append(pair)
    return pairs


def original_length(module: nn.Module) -> int:
    """The longest a micro-batch's positions may reach on ``module`` (a :func:`longrope_buffers` module): the
    smallest original length of its LongRoPE layer types (the one the update compares with)."""
    return min(_original_max(module, layer_type) for layer_type in _longrope_types(module) or [None])


def check_positions(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a recorded forward of a LongRoPE ``module``: refuse positions beyond its original length, for
    which the update would switch every example of the micro-batch to the long factor."""
    position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return  # the rotary forward itself fails on no positions: nothing computed to refuse
    limit = original_length(module)
    with torch._C.DisableTorchFunction():  # a read for the refusal only: not one the batch-axis trace counts
        longest = int(position_ids.max()) + 1
    if longest > limit:
        raise LongRopeLengthError(
            f"A micro-batch reaches position {longest} on the LongRoPE rotary embedding '{name}', beyond "
            f"its original_max_position_embeddings ({limit}): transformers would then switch the whole "
            "micro-batch to the long factor (one long example changing the others' frequencies, and writing "
            f"inv_freq from private data). Fix: truncate every training sequence to {limit} tokens "
            f"(tokenizer truncation with max_length={limit}, or max_length / max_seq_length in the recipe). "
            "Nothing was released."
        )
