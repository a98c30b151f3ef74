"""``DPSFTConfig``: TRL's ``SFTConfig`` with the DP fields of :class:`hf_dpfilter.DPTrainingArguments`.

The DP fields are declared once, in :class:`hf_dpfilter.trainers.arguments.DPArgumentsMixin` (shared with
``DPTrainingArguments``); this class only combines the two dataclasses. Its MRO is ``DPSFTConfig ->
DPArgumentsMixin -> SFTConfig -> _BaseConfig -> TrainingArguments``, so ``__post_init__`` runs the SFT
refusals, then the DP checks, then TRL's (which resolves ``bf16=None``), then the Trainer's.

Every field SFTConfig adds to ``TrainingArguments`` has a DP status in :data:`SFT_FIELD_POLICIES` (the same
four statuses as :mod:`hf_dpfilter.run.training_fields`); a field a new TRL release adds has no row, and
``tests/trainers/test_sft.py`` fails until it is classified here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl import SFTConfig

from hf_dpfilter.retired_names import refuse_retired_names
from hf_dpfilter.run.training_fields import FieldPolicy, check_training_fields
from hf_dpfilter.run.training_fields import render_markdown as render_training_fields
from hf_dpfilter.trainers.arguments import DPArgumentsMixin

__all__ = ["SFT_FIELD_POLICIES", "DPSFTConfig", "check_sft_fields", "render_markdown"]


# ------------------------------------------------------------------------------------------------ checks
def _packing_strategy(args: Any, stage: str) -> str | None:
    if not args.packing or args.packing_strategy == "bfd":
        return None
    if args.packing_strategy == "wrapped":
        return (
            "packing_strategy='wrapped' concatenates the examples and cuts the stream into rows of "
            "max_length: an example is split across rows and attention and loss cross example boundaries, so "
            "no example's contribution can be clipped on its own. Use packing_strategy='bfd' (the default): "
            "under DP the library samples the examples first and packs each step's sample best-fit, one "
            "example per segment."
        )
    return (
        f"packing_strategy={args.packing_strategy!r} splits an example longer than max_length into several "
        "segments, which would then be sampled, clipped and counted as separate examples. Use "
        "packing_strategy='bfd' (examples longer than max_length are truncated, each stays one example)."
    )


def _loss_type(args: Any, stage: str) -> str | None:
    if args.loss_type in ("nll", "chunked_nll"):
        return None
    return (
        f"loss_type={args.loss_type!r} is not computed per example by DPSFTTrainer (TRL computes it as one "
        "token mean over the whole batch, which couples the examples). Use loss_type='nll': each example's "
        "loss is then its own mean token NLL over its unmasked tokens."
    )


def _activation_offloading(args: Any, stage: str) -> str | None:
    if not args.activation_offloading:
        return None
    return (
        "activation_offloading=True moves saved activations to the CPU inside TRL's training step, which the "
        "DP training step replaces: the option would be ignored silently. Leave activation_offloading=False "
        "(use gradient_checkpointing to save memory)."
    )


def _pad_to_multiple_of(args: Any, stage: str) -> str | None:
    value = args.pad_to_multiple_of
    if value in (None, "auto") or not (args.padding_free or args.packing):
        return None
    return (
        f"pad_to_multiple_of={value} with padding-free or packed rows pads the packed row with tokens whose "
        "positions restart at 0, which would read as extra examples. Leave pad_to_multiple_of=None."
    )


SFT_FIELD_POLICIES: dict[str, FieldPolicy] = {
    "model_init_kwargs": FieldPolicy("honoured", "how a model given by name is loaded (public)."),
    "trust_remote_code": FieldPolicy("honoured", "loading code only."),
    "router_aux_loss_coef": FieldPolicy("honoured", "the MoE load-balancing loss, computed per example over "
                                                    "its own "
                                        "tokens (hf_dpfilter/losses/router.py)."),
    "chat_template_path": FieldPolicy("honoured", "the chat template applied to each example alone."),
    "dataset_text_field": FieldPolicy("honoured", "which column holds the text."),
    "dataset_kwargs": FieldPolicy("honoured", "skip_prepare_dataset: a row is what is sampled and clipped, "
                                              "one "
                                  "tokenized example (a `seq_lengths` column is refused when the trainer is "
                                  "created, a row packed with its own `position_ids` or holding several "
                                  "conversations (the chat template's start more than once) at the batch "
                                  "that samples it, unless dp_row_is_unit=True declares the row the unit)."),
    "dataset_num_proc": FieldPolicy("honoured", "preprocessing workers."),
    "eos_token": FieldPolicy("honoured", "tokenizer setting."),
    "max_length": FieldPolicy("honoured", "each example is truncated to it alone; with packing, the capacity "
                                          "of "
                              "a packed row of a step's sample."),
    "truncation_mode": FieldPolicy("honoured", "per example."),
    "shuffle_dataset": FieldPolicy("honoured", "a fixed permutation of the rows; Poisson sampling ignores "
                                               "order."),
    "packing": FieldPolicy("honoured", "packing after sampling: the data set is not packed; each step's "
                                       "Poisson "
                           "sample is packed best-fit decreasing, each example one segment (docs/sft.md)."),
    "packing_strategy": FieldPolicy("refused", "'bfd' honoured; 'wrapped' and 'bfd_split' (which cut "
                                               "examples "
                                    "into several segments) refused.", _packing_strategy),
    "padding_free": FieldPolicy("honoured", "one packed row per micro-batch, examples kept apart by "
                                            "position_ids."),
    "pad_to_multiple_of": FieldPolicy("refused", "refused with padding-free or packed rows (the padding "
                                                 "would "
                                      "read as examples).", _pad_to_multiple_of),
    "eval_packing": FieldPolicy("honoured", "evaluation only (TRL packs the eval set)."),
    "completion_only_loss": FieldPolicy("honoured", "labels of each example alone."),
    "assistant_only_loss": FieldPolicy("honoured", "labels of each example alone."),
    "loss_type": FieldPolicy("refused", "'nll' honoured (each example's mean token NLL); 'dft' refused.",
                             _loss_type),
    "activation_offloading": FieldPolicy("refused", "True refused (TRL's offloading wraps the training step "
                                                    "the DP "
                                         "step replaces).", _activation_offloading),
    "pad_token": FieldPolicy("honoured", "tokenizer setting (deprecated in TRL)."),
}


def check_sft_fields(args: Any, stage: str) -> None:
    """Raise :class:`TrainingFieldError` listing every refused SFT value of ``args``, each with its fix."""
    check_training_fields(args, stage, SFT_FIELD_POLICIES)


def _sft_default(name: str) -> Any:
    """A field with SFTConfig's default for one that SFTConfig re-declares with another default than
    TrainingArguments': DPTrainingArguments' copy of the field would otherwise win in the combined dataclass,
    and a user switching SFTConfig -> DPSFTConfig would get other defaults."""
    source = {f.name: f for f in dataclasses.fields(SFTConfig)}[name]
    if source.default_factory is not dataclasses.MISSING:
        return field(default_factory=source.default_factory, metadata=source.metadata)
    return field(default=source.default, metadata=source.metadata)


@refuse_retired_names
@dataclass(repr=False)
class DPSFTConfig(DPArgumentsMixin, SFTConfig):
    """``SFTConfig`` + the DP settings of :class:`hf_dpfilter.DPTrainingArguments`, for :class:`DPSFTTrainer`.

    SFTConfig's defaults are kept (learning_rate 2e-5, gradient_checkpointing True, bf16 unless fp16,
    logging_steps 10). ``packing=True`` packs each step's Poisson sample, never the data set (docs/sft.md).
    """

    learning_rate: float = _sft_default("learning_rate")
    bf16: bool | None = _sft_default("bf16")
    gradient_checkpointing: bool = _sft_default("gradient_checkpointing")
    logging_steps: float = _sft_default("logging_steps")

    def __post_init__(self) -> None:
        # SFT's own refusals first: they name TRL options, before the DP and Trainer checks rewrite anything
        check_sft_fields(self, "arguments")
        super().__post_init__()


def render_markdown() -> str:
    """The SFT options' table as Markdown (docs/sft.md, "Every SFTConfig option"; a test keeps it in sync)."""
    return render_training_fields(SFT_FIELD_POLICIES, column="option")
