"""An encoder-decoder's ``decoder_input_ids`` built from each example's labels, as the model builds them.

Given ``labels`` and no decoder inputs, an encoder-decoder's forward shifts the labels right into
``decoder_input_ids``. The DP trainer keeps ``labels`` out of the forward (the loss is computed per
example), so when the collator gave no decoder inputs (``DataCollatorForSeq2Seq`` without ``model=``) they
are built here, by the model's own rule and row by row (one example's decoder inputs come from its own
labels only):

* ``prepare_decoder_input_ids_from_labels`` where the model has it (T5, BART, Marian, ...);
* else the ``shift_tokens_right`` of the model's own module, called exactly as its forward calls it, with the
  config's pad and decoder start ids (M2M100/NLLB-200, Blenderbot, BlenderbotSmall, NLLB-MoE, SeamlessM4T's
  text-to-text): recognised from the forward's source, never assumed;
* else the step is refused (:class:`DecoderInputsError`): building them by another rule than the model's would
  train on inputs it never sees alone.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DecoderInputsError", "decoder_inputs_rule", "with_decoder_inputs"]


class DecoderInputsError(ValueError):
    """An encoder-decoder given no decoder inputs, whose rule for building them from labels is not known."""


#: The calls of a module's ``shift_tokens_right`` in a forward that are recognised (whitespace removed),
#: each with the parameters the function must take and the config attributes passed, in order:
#: transformers' Bart-derived forwards shift ``labels`` with the config's pad and decoder start ids
#: (MBart's variant takes the pad only).
_SHIFT_CALLS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("shift_tokens_right(labels,self.config.pad_token_id,self.config.decoder_start_token_id)",
     ("input_ids", "pad_token_id", "decoder_start_token_id"), ("pad_token_id", "decoder_start_token_id")),
    ("shift_tokens_right(labels,self.config.pad_token_id)", ("input_ids", "pad_token_id"), ("pad_token_id",)),
)


def _base(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (its forward and config build the decoder inputs)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.lru_cache(maxsize=64)
def _shift_rule(cls: type) -> tuple[Callable[..., torch.Tensor], tuple[str, ...]] | None:
    """The module ``shift_tokens_right`` that ``cls.forward`` calls on its labels and the config attributes
    it passes, or None when the forward's source shows no recognised call (cached: read once per class)."""
    forward = getattr(cls, "forward", None)
    module = sys.modules.get(getattr(cls, "__module__", ""))
    shift = getattr(module, "shift_tokens_right", None)
    if forward is None or not callable(shift):
        return None
    try:
        source = re.sub(r"\s+", "", inspect.getsource(forward))
        params = tuple(inspect.signature(shift).parameters)
    except (OSError, TypeError, ValueError):  # no source (compiled, defined at a prompt): nothing known
        return None
    for call, expected, attributes in _SHIFT_CALLS:
        if call in source and params == expected:
            return shift, attributes
    return None


def decoder_inputs_rule(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How ``model`` builds ``decoder_input_ids`` from a batch of labels given none; None if not known."""
    base = _base(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return lambda labels: prepare(labels=labels)
    rule = _shift_rule(type(base))
    if rule is None:
        return None
    shift, attributes = rule
    config = base.config
    values = [getattr(config, name, None) for name in attributes]
    return lambda labels: shift(labels, *values)


def with_decoder_inputs(model: Any, micro: dict[str, Any], labels: torch.Tensor) -> dict[str, Any]:
    """``micro`` with the ``decoder_input_ids`` an encoder-decoder builds from ``labels`` when the collator
    gave no decoder inputs; unchanged when it did, or when the model is no encoder-decoder or the labels are
    not one row of token ids per example. Each row is built from its own labels alone (as the example alone
    gets them, whatever the rule does across rows)."""
    if not bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)):
        return micro
    if "decoder_input_ids" in micro or "decoder_inputs_embeds" in micro or labels.dim() != 2:
        return micro
    rule = decoder_inputs_rule(model)
    if rule is None:
        raise DecoderInputsError(
            f"{type(_base(model)).__name__} is an encoder-decoder given no decoder_input_ids, and its rule "
            "for building them from the labels is not known (no prepare_decoder_input_ids_from_labels, and "
            "its forward calls no recognised shift_tokens_right): the trainer keeps the labels out of the "
            "forward (the loss is per example), so it would build them by a guess. Pass decoder_input_ids "
            "from the collator: DataCollatorForSeq2Seq(tokenizer, model=model) adds them."
        )
    return {**micro, "decoder_input_ids": torch.cat([rule(labels[i:i + 1]) for i in range(labels.shape[0])])}
