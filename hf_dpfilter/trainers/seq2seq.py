"""``DPSeq2SeqTrainer`` / ``DPSeq2SeqTrainingArguments``: transformers' ``Seq2SeqTrainer`` with the DP glue.

A script written for ``Seq2SeqTrainer``/``Seq2SeqTrainingArguments`` (transformers' run_summarization,
run_translation) becomes private by swapping the two classes: the DP fields come from
:class:`hf_dpfilter.trainers.arguments.DPArgumentsMixin`, the training step, the Poisson sampler, the
optimizer and the accounting from :class:`hf_dpfilter.trainers.trainer.DPTrainerMixin`. Training is the same
as DPTrainer's: an encoder-decoder's per-example loss is the mean cross-entropy over the example's own label
tokens (the logits are already aligned with the labels, the model shifts them into ``decoder_input_ids``, so
no shift is done here).

What the Seq2Seq arguments add acts on evaluation only, and :data:`SEQ2SEQ_FIELD_POLICIES` says so for each
field (a field a new transformers release adds has no row, and ``tests/trainers/test_seq2seq.py`` fails until
it is classified):
``predict_with_generate`` makes ``evaluate()``/``predict()`` generate, under the same evaluation-set checks as
any evaluation (a set sharing rows with the training set is refused); ``generation_*`` set how. The
``sortish_sampler`` flag is read by no code of the installed transformers, and DPTrainerMixin's training
loader draws each step's batch with the Poisson sampler whatever the flag: it cannot replace the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_dpfilter.retired_names import refuse_retired_names
from hf_dpfilter.run.training_fields import FieldPolicy, check_training_fields
from hf_dpfilter.run.training_fields import render_markdown as render_training_fields
from hf_dpfilter.trainers.arguments import DPArgumentsMixin
from hf_dpfilter.trainers.trainer import DPTrainerMixin

__all__ = ["SEQ2SEQ_FIELD_POLICIES", "DPSeq2SeqTrainer", "DPSeq2SeqTrainingArguments", "render_markdown"]

_GENERATION = "evaluation only: how evaluate()/predict() generate (held-out sets; see eval_strategy)"

#: The DP status of every field ``Seq2SeqTrainingArguments`` adds to ``TrainingArguments``.
SEQ2SEQ_FIELD_POLICIES: dict[str, FieldPolicy] = {
    "sortish_sampler": FieldPolicy(
        "honoured", "no effect: no code of the installed transformers reads it, and DPSeq2SeqTrainer's "
                    "training "
        "loader draws every batch with the Poisson sampler (the accounting's) whatever its value"),
    "predict_with_generate": FieldPolicy(
        "honoured", "evaluation only: evaluate()/predict() generate, on sets that share no row with the "
                    "training set "
        "(refused otherwise, as any evaluation)"),
    "generation_max_length": FieldPolicy("honoured", _GENERATION),
    "generation_num_beams": FieldPolicy("honoured", _GENERATION),
    "generation_config": FieldPolicy("honoured", _GENERATION),
}


def check_seq2seq_fields(args: Any, stage: str) -> None:
    """Raise :class:`~hf_dpfilter.run.training_fields.TrainingFieldError` for every refused Seq2Seq value
    (none today:
    the table's checks run here, so that a refusal added to a row takes effect)."""
    check_training_fields(args, stage, SEQ2SEQ_FIELD_POLICIES)


@refuse_retired_names
@dataclass(repr=False)
class DPSeq2SeqTrainingArguments(DPArgumentsMixin, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` + the DP settings of :class:`hf_dpfilter.DPTrainingArguments`, for
    :class:`DPSeq2SeqTrainer`. Its MRO is ``DPArgumentsMixin -> Seq2SeqTrainingArguments ->
    TrainingArguments``:
    ``__post_init__`` runs the Seq2Seq table's checks, the DP checks, then transformers'."""

    def __post_init__(self) -> None:
        check_seq2seq_fields(self, "arguments")
        super().__post_init__()


class DPSeq2SeqTrainer(DPTrainerMixin, Seq2SeqTrainer):
    """A ``transformers.Seq2SeqTrainer`` that trains with (epsilon, delta)-differential privacy.

    Same constructor as ``Seq2SeqTrainer``; ``args`` must be :class:`DPSeq2SeqTrainingArguments` (or any
    arguments with the DP fields). Training is :class:`~hf_dpfilter.trainers.trainer.DPTrainerMixin`'s;
    evaluation and prediction are ``Seq2SeqTrainer``'s (``predict_with_generate``), behind the mixin's
    evaluation-set checks.
    """


def render_markdown() -> str:
    """The Seq2Seq fields' table as Markdown (docs/configuration.md; a test keeps it in sync)."""
    return render_training_fields(SEQ2SEQ_FIELD_POLICIES)
