"""Padding kept from coupling examples: every micro-batch, from the attention mask, with no extra forward.

A padding collator makes each example's row depend on the longest example of its batch. Two things then reach
an example's gradient unless they are handled, and both are handled here for every micro-batch, by
construction (the first-step and re-checks are a second line, not the guarantee):

* **Padding without an attention mask.** The model attends to the pads, whose number is set by the other
  examples:
  one long example changes every other example's gradient. Whether a row is padded is not guessed from
  pad-token values: when the probed collator structure has no ``attention_mask``, the training collator also
  collates each example alone (:func:`needs_alone_widths`), and :func:`check_padded_rows_have_a_mask` refuses
  the batch if any example's row is wider than the example alone. Runs with a mask pay nothing.
* **Leading padding** (``padding_side="left"``). A model that numbers positions from the first column gives
  each example positions shifted by its number of pads, which the longest example of the batch sets. The
  model's position scheme is declared in :data:`POSITION_SCHEMES` (read from the transformers sources, keyed
  by ``config.model_type``), and :func:`with_positions` acts on it:

  - ``"absolute"`` (positions ``0..T-1`` from the first column, ``position_ids`` accepted): every micro-batch
    with a per-example attention mask gets ``position_ids`` derived from that mask, ``arange(T) - leading
    pads`` per row, the positions the example has collated alone (on every micro-batch, padded on the left or
    not, so the engine's batch-axis verdict for the position table is the same at every step). Rotary models
    are in this group: their attention is shift-invariant only up to rounding, and derived positions make them
    exact;
  - ``"padding_idx"`` (RoBERTa family: positions counted over ``input_ids != pad_token_id``): already
    pad-aware, exactly as long as the leading pads hold ``config.pad_token_id``, which is checked on every
    such micro-batch; injecting ``arange`` positions there would be wrong;
  - ``"mask"`` (OPT's positions, BLOOM's ALiBi: built from the attention mask's cumulative sum): pad-aware.

  Leading padding with a model not declared, with collator ``position_ids`` that are not the example's own, or
  with a sequence-level head that reads the first column (BERT's pooler, RoBERTa's ``<s>`` classifier: the
  first column is a pad for every example shorter than the longest) is refused before that step is released,
  with the fix (``tokenizer.padding_side = "right"``).

The functions here are pure: they read the batch, its probed structure and the model's config, and return a
new batch or raise :class:`PaddingError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_dpfilter.losses.tasks import IGNORE_INDEX

__all__ = [
    "POSITION_SCHEMES",
    "PaddingError",
    "PositionScheme",
    "check_collator_padding",
    "check_decoder_labels_not_left_padded",
    "check_padded_rows_have_a_mask",
    "labels_along_tokens",
    "leading_padding",
    "needs_alone_widths",
    "positions_from_mask",
    "with_positions",
    "without_derived_positions",
]

POSITIONS_KEY = "position_ids"
MASK_KEY = "attention_mask"
RIGHT_PADDING_FIX = ('pad on the right (tokenizer.padding_side = "right", or padding_side="right" in the '
                     'collator)')


class PaddingError(ValueError):
    """A padded micro-batch whose padding would make an example's gradient depend on the other examples."""


@dataclass(frozen=True)
class PositionScheme:
    """How a model family numbers positions, read from its transformers source (``modeling_<family>.py``)."""

    #: "absolute": from the first column, ``position_ids`` accepted; "padding_idx": counted over
    #: ``input_ids != config.pad_token_id``; "mask": counted over the attention mask
    kind: str
    #: its sequence-level heads read the first column (a pad for short examples under left padding)
    pools_first_column: bool = False
    #: ``(config field, value)``: the heads read the first column only when the config's pooling field has
    #: that value (ModernBERT: ``classifier_pooling="cls"``; ``"mean"`` averages over the attention mask);
    #: None: always
    first_column_when: tuple[str, str] | None = None

    def reads_first_column(self, config: Any) -> bool:
        """Whether the model's sequence-level head reads the first column, for this config."""
        if not self.pools_first_column or self.first_column_when is None:
            return self.pools_first_column
        field, value = self.first_column_when
        return getattr(config, field, value) == value


_ABSOLUTE = PositionScheme("absolute")
_ENCODER_ABSOLUTE = PositionScheme("absolute", pools_first_column=True)
_PADDING_IDX = PositionScheme("padding_idx", pools_first_column=True)
_MASK = PositionScheme("mask")

#: Declared position schemes, keyed by ``config.model_type``. Anything not listed is refused when a
#: micro-batch has leading padding. GPT-2/GPT-Neo (``wpe(arange)``), GPT-J, GPT-NeoX, Phi, StableLM, the
#: Llama-like families, Mixtral, Qwen2-MoE, StarCoder2, OLMo2, Granite and Gemma3's text model (rotary on
#: ``arange``; sliding windows are distances between columns, which leading pads do not change), Falcon
#: (rotary on ``arange``; with ``alibi=True`` its ALiBi is built from the mask and the injected positions are
#: unused) and BERT, ALBERT, ELECTRA, DistilBERT (a ``position_ids`` buffer) and ModernBERT (rotary on
#: ``arange``; its sliding window is a distance between columns, which leading pads do not change) number from
#: the first column and take ``position_ids``; RoBERTa-like models call
#: ``create_position_ids_from_input_ids``; OPT (``cumsum(attention_mask)``) and BLOOM (``build_alibi_tensor``
#: on the mask) count real tokens. Sequence heads: GPT-2, OPT and the Llama-like families pool the last
#: non-pad token (the last column under left padding); BERT, ALBERT, ELECTRA, DistilBERT and ModernBERT
#: (``classifier_pooling="cls"``, the default; ``"mean"`` averages over the mask) pool the first column,
#: RoBERTa ``features[:, 0, :]``.
POSITION_SCHEMES: dict[str, PositionScheme] = {
    "gpt2": _ABSOLUTE,
    "gpt_neo": _ABSOLUTE,
    "gptj": _ABSOLUTE,
    "llama": _ABSOLUTE,
    "mistral": _ABSOLUTE,
    "mixtral": _ABSOLUTE,
    "qwen2_moe": _ABSOLUTE,
    "starcoder2": _ABSOLUTE,
    "olmo2": _ABSOLUTE,
    "granite": _ABSOLUTE,
    "gemma3_text": _ABSOLUTE,
    "qwen2": _ABSOLUTE,
    "qwen3": _ABSOLUTE,
    "gemma": _ABSOLUTE,
    "gemma2": _ABSOLUTE,
    "phi3": _ABSOLUTE,
    "phi": _ABSOLUTE,
    "gpt_neox": _ABSOLUTE,
    "stablelm": _ABSOLUTE,
    "falcon": _ABSOLUTE,
    "bert": _ENCODER_ABSOLUTE,
    "albert": _ENCODER_ABSOLUTE,
    "electra": _ENCODER_ABSOLUTE,
    "distilbert": _ENCODER_ABSOLUTE,
    "modernbert": PositionScheme("absolute", pools_first_column=True,
                                 first_column_when=("classifier_pooling", "cls")),
    "roberta": _PADDING_IDX,
    "xlm-roberta": _PADDING_IDX,
    "xlm-roberta-xl": _PADDING_IDX,
    "camembert": _PADDING_IDX,
    "opt": _MASK,
    "bloom": _MASK,
}


# ------------------------------------------------------------------------------------ from the mask
def leading_padding(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D attention mask, the number of columns before its first real token (all of them if
    none)."""
    return mask.ne(0).long().cumsum(dim=1).eq(0).sum(dim=1)  # columns with no real token at or before them


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """``position_ids`` of shape ``(B, T)``: ``arange(T)`` shifted left by each row's leading padding, clamped
    at 0.

    A row's tokens then have the positions the example gets collated alone (unpadded or padded on the right),
    whatever the number of pads the batch's longest example put before them; leading pads get 0 (a valid
    index, masked out). Zeros of the mask after the first real token (an example's own masked tokens) keep
    their column's position, as they do alone."""
    columns = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    return (columns - leading_padding(mask).unsqueeze(1)).clamp(min=0)


def _model_scheme(model: Any) -> tuple[str, PositionScheme | None, Any]:
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    return model_type, POSITION_SCHEMES.get(model_type), config


def _mask_of(micro: dict[str, Any], structure: Any) -> torch.Tensor | None:
    mask = micro.get(MASK_KEY) if MASK_KEY in structure.per_example else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask
    return None


_TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForTokenClassification")
_EXAMPLE_HEADS = ("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice")


def _is_question_answering(model: Any) -> bool:
    """Whether the model's head is extractive QA's (start/end logits over the columns), by its class."""
    from transformers.models.auto import modeling_auto as auto

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return (name.endswith("ForQuestionAnswering")
            or name in auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES.values())


def labels_along_tokens(model: Any, label_names: Any) -> bool | None:
    """Whether the labels run along the tokens (one per column, cut with the inputs' padding columns), as the
    model's head declares it: True for a language-modelling or token-classification head, False for a head
    with one label row per example (sequence classification, multi-label or regression targets of
    ``num_labels`` columns; extractive QA's (start, end) pair, also declared by its ``label_names``; multiple
    choice), None for a head of neither kind. Never decided by the labels' width: a multi-label target of 8
    classes in a batch padded to 8 tokens (``pad_to_multiple_of=8``), or QA's pair in a micro-batch 2 tokens
    wide, is as wide as the row by chance, and cutting it would drop label columns of the example."""
    from transformers.models.auto import modeling_auto as auto

    from hf_dpfilter.losses.question_answering import SPAN_LABEL_NAMES

    if label_names is not None and sorted(label_names) == sorted(SPAN_LABEL_NAMES):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    token_maps = (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                  auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)
    example_maps = (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                    auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
                    auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES)
    if name.endswith(_EXAMPLE_HEADS) or any(name in m.values() for m in example_maps):
        return False
    if name.endswith(_TOKEN_HEADS) or any(name in m.values() for m in token_maps):
        return True
    return None


def check_decoder_labels_not_left_padded(collator: Any) -> None:
    """An encoder-decoder trained through a collator that declares left padding of its labels is refused
    (checked on every micro-batch, before any release).

    The decoder's inputs are the labels shifted right, and the decoder attends causally to every column before
    a target, pads included (``DataCollatorForSeq2Seq`` gives no decoder attention mask): a target padded on
    the left follows as many pads as the longest target of its batch asks, so an example's loss depends on the
    others. ``DataCollatorForSeq2Seq`` pads the labels on its tokenizer's ``padding_side``: that declaration
    is read (not the labels, whose leading -100 may be the example's own)."""
    from transformers import DataCollatorForSeq2Seq

    if not isinstance(collator, DataCollatorForSeq2Seq):
        return
    side = getattr(collator, "padding_side", None) or getattr(collator.tokenizer, "padding_side", None)
    if side == "left":
        raise PaddingError(
            f"An encoder-decoder trained with {type(collator).__name__} padding on the left: the labels are "
            "padded on the left too, and the decoder attends to those pads, as many as the longest target of "
            "the batch asks, so an example's loss depends on the others. Fix: pad on the right "
            "(tokenizer.padding_side = "
            '"right" before building the collator). Nothing of this step was released.'
        )


# ------------------------------------------------------------------------------------ per micro-batch
def with_positions(model: Any, micro: dict[str, Any], labels: torch.Tensor, structure: Any) -> dict[str, Any]:
    """The micro-batch as the model must get it so that no example's positions depend on the others' lengths.

    ``micro`` is one micro-batch of one example per row (not packed). With a declared ``"absolute"`` scheme
    and a per-example attention mask, ``position_ids`` derived from the mask are added (every micro-batch);
    with leading padding, anything that cannot be made exact raises :class:`PaddingError` (see the module
    docstring)."""
    mask = _mask_of(micro, structure)
    if mask is None:
        return micro
    model_type, scheme, config = _model_scheme(model)
    own = POSITIONS_KEY in structure.per_example
    if scheme is not None and scheme.kind == "absolute" and not own:
        micro = {**micro, POSITIONS_KEY: positions_from_mask(mask)}
    leading = leading_padding(mask)
    padded = (leading > 0) & (leading < mask.shape[1])  # an all-padding row has no position to shift
    if not bool(padded.any()):
        return micro
    name = type(model).__name__
    if _is_question_answering(model):
        raise PaddingError(
            f"A micro-batch is padded on the left with {name} (extractive QA): the start/end positions index "
            "the collated row, and an example's leading pads depend on the longest example of its batch, so "
            "its positions point at other tokens than alone (a tokenizer's positions count from the "
            f"example's first token). Fix: {RIGHT_PADDING_FIX}; the QA head reads every column, so right "
            "padding is exact. Nothing of this step was released."
        )
    if scheme is None:
        raise PaddingError(
            "A micro-batch is padded on the left (attention_mask starts with zeros) and the position scheme "
            f"of {name} (model_type={model_type!r}) is not declared in "
            "hf_dpfilter.proofs.padding.POSITION_SCHEMES: if it numbers positions from the first column, "
            "every example's positions would shift with the longest example of its batch. Fix: "
            f"{RIGHT_PADDING_FIX}. Nothing of this step was released."
        )
    # a head declared token-level (one label per column); a class, a multi-label target (integer or float, as
    # wide as the row or not) or a head of undeclared kind is pooled
    token_level = labels_along_tokens(model,
                                      None) is True and labels.dim() == 2 and labels.shape[1] == mask.shape[1]
    if scheme.reads_first_column(config) and not token_level:
        raise PaddingError(
            f"A micro-batch is padded on the left with {name}, whose sequence-level head reads the first "
            "column: for every example shorter than the longest of its batch that column is a pad, so its "
            f"prediction depends on the other examples. Fix: {RIGHT_PADDING_FIX}. Nothing of this step was "
            "released."
        )
    if own:
        given = micro[POSITIONS_KEY]
        real = mask.ne(0)
        if not isinstance(given, torch.Tensor) or given.shape != mask.shape or not bool(
                given[real].eq(positions_from_mask(mask)[real]).all()) or scheme.kind != "absolute":
            raise PaddingError(
                "A micro-batch is padded on the left and the collator's own `position_ids` are not each "
                "example's positions alone (counted from its first real token), or the model builds its "
                "positions from the padding itself: they would shift with the longest example of the batch. "
                f"Fix: {RIGHT_PADDING_FIX}, "
                "or let DPTrainer derive `position_ids` from the attention mask (leave them out of the "
                "collator)."
            )
    if scheme.kind == "padding_idx":
        ids = micro.get("input_ids")
        pad = getattr(config, "pad_token_id", None)
        before = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) < leading.unsqueeze(1)
        if not isinstance(ids, torch.Tensor) or pad is None or not bool(ids[before].eq(pad).all()):
            raise PaddingError(
                f"A micro-batch is padded on the left with {name}, which counts positions over the tokens "
                f"that are not config.pad_token_id ({pad}), but its leading pads hold other tokens: every "
                "example's positions would shift with the longest example of its batch. Fix: pad with "
                f"config.pad_token_id, or {RIGHT_PADDING_FIX}."
            )
    return micro


def causal_labels(micro: dict[str, Any], labels: torch.Tensor, structure: Any) -> torch.Tensor:
    """A causal LM's token labels with no target predicted from a leading pad.

    The causal loss predicts the label of column ``j`` from the logits of column ``j - 1``. A row padded on
    the left has its first real token at column ``leading > 0``: its label would be predicted from a pad,
    whose output depends on how many pads the batch's longest example put there. Collated alone (no leading
    padding) the example's first token is never a target (no column before it). That label is ignored
    (``-100``), so the row's loss is the example's own loss alone (``DataCollatorForSeq2Seq`` used for a
    causal LM with ``padding_side="left"`` labels it); rows without leading padding are unchanged."""
    mask = _mask_of(micro, structure)
    if mask is None or labels.dim() != 2 or labels.shape != mask.shape or labels.is_floating_point():
        return labels
    leading = leading_padding(mask)
    rows = torch.nonzero((leading > 0) & (leading < mask.shape[1])).flatten()
    if rows.numel() == 0:
        return labels
    labels = labels.clone()
    labels[rows, leading[rows]] = IGNORE_INDEX
    return labels


def without_derived_positions(inputs: dict[str, Any], structure: Any) -> dict[str, Any]:
    """``inputs`` without the ``position_ids`` that :func:`with_positions` added (to cut them again, e.g. one
    example at a time): removed only when the collator has no ``position_ids`` of its own and they are exactly
    the ones the mask gives; anything else is left for the batch structure's check to refuse as an undeclared
    key."""
    given = inputs.get(POSITIONS_KEY)
    mask = _mask_of(inputs, structure)
    if POSITIONS_KEY in structure.keys or not isinstance(given, torch.Tensor) or mask is None:
        return inputs
    if given.shape == mask.shape and bool(given.eq(positions_from_mask(mask)).all()):
        return {k: v for k, v in inputs.items() if k != POSITIONS_KEY}
    return inputs


# ------------------------------------------------------------------------------------ without a mask
def needs_alone_widths(structure: Any) -> bool:
    """Whether the training collator must also collate each example alone: one example per row and no
    per-example attention mask, so only each example's own width shows whether its row was padded by the
    others."""
    return structure is not None and not structure.packed and MASK_KEY not in structure.per_example


def check_padded_rows_have_a_mask(batch: dict[str, Any], alone: list[dict[str, Any]], structure: Any) -> None:
    """Refuse a batch collated without an attention mask in which some example's row is wider than the example
    collated alone (``alone[i]``, one per example): the model would attend to pads whose number the other
    examples set. Compared on every per-example key with a sequence axis (shape beyond the batch axis)."""
    for key in sorted(structure.per_example):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        shapes = {tuple(a[key].shape[1:]) for a in alone if isinstance(a.get(key), torch.Tensor)}
        if any(shape != tuple(value.shape[1:]) for shape in shapes):
            widths = sorted({shape[0] for shape in shapes if shape})
            raise PaddingError(
                f"The training collator pads the examples of a batch to {value.shape[1]} columns ('{key}'; "
                f"the examples alone have {widths}) but returns no `attention_mask`: the model attends to "
                "the pads, whose number the longest example of the batch sets, so every example's gradient "
                "depends on the others. Fix: return the attention mask from the collator (tokenizer.pad and "
                "DataCollatorWithPadding do by default). Nothing of this step was released."
            )


# ------------------------------------------------------------------------------------ before training
def check_collator_padding(model: Any, collate_fn: Any, examples: list, structure: Any) -> None:
    """The checks of a step, run once on the first examples of the training set collated together (the
    collator's probe already collates them), so that a collator that pads without a mask, or left-pads for a
    model that cannot take it, is refused when training starts rather than at the first batch that shows it. A
    second line only: the guarantee is that every batch and micro-batch is checked
    (:func:`check_padded_rows_have_a_mask`, :func:`with_positions`); examples of one length show nothing
    here."""
    if structure is None or structure.packed or len(examples) < 2:
        return
    batch = dict(collate_fn(list(examples)))
    if needs_alone_widths(structure):
        check_padded_rows_have_a_mask(batch, [collate_fn([e]) for e in examples], structure)
        return
    labels = batch.pop("labels", None)
    if isinstance(labels, torch.Tensor):
        with_positions(model, batch, labels, structure)
