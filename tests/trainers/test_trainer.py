"""The DP fields and the DP glue are declared once and mix into another TrainingArguments / Trainer subclass.

``DPArgumentsMixin`` + any ``TrainingArguments`` subclass (as ``DPSFTConfig(DPArgumentsMixin, SFTConfig)``
will):
the fields of both, in dataclass order, once each; both ``__post_init__`` run (the DP checks and rewrites,
then the other class's); the secret seed stays out of repr/to_dict/pickle; the command-line parser sees the DP
fields; retired names are refused. ``DPTrainerMixin`` + any ``Trainer`` subclass trains privately with the
same glue.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.retired_names import refuse_retired_names
from hf_dpfilter.trainers.arguments import DPArgumentsMixin
from hf_dpfilter.trainers.trainer import DPTrainerMixin, read_privacy_ledger

DP_FIELDS = [f.name for f in dataclasses.fields(DPArgumentsMixin)]


@dataclass
class OtherArguments(TrainingArguments):
    """Stands for another TrainingArguments subclass (trl's SFTConfig), with a field and a __post_init__ of
    its own."""

    other_length: int = field(default=7, metadata={"help": "a setting of the other class"})

    def __post_init__(self) -> None:
        self.other_post_init_ran = True
        super().__post_init__()


@refuse_retired_names
@dataclass(repr=False)
class DPOtherArguments(DPArgumentsMixin, OtherArguments):
    pass


class OtherTrainer(Trainer):
    """Stands for another Trainer subclass (trl's SFTTrainer)."""

    other_trainer = True


class DPOtherTrainer(DPTrainerMixin, OtherTrainer):
    pass


def _kwargs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False,
                per_device_train_batch_size=4, logical_batch_size=8, max_steps=2, learning_rate=0.1,
                noise_multiplier=1.0)
    base.update(kw)
    return base


def test_the_dp_fields_are_declared_once_and_shared():
    names = [f.name for f in dataclasses.fields(DPOtherArguments)]
    assert len(names) == len(set(names))
    base = [f.name for f in dataclasses.fields(OtherArguments)]
    # the other class's fields first, then the DP fields, in declaration order
    assert names == base + DP_FIELDS
    assert [f.name for f in dataclasses.fields(DPTrainingArguments)] == [
        f.name for f in dataclasses.fields(TrainingArguments)] + DP_FIELDS
    assert "secure_rng" in DP_FIELDS and "dp_seed" in DP_FIELDS


def test_post_init_chains_through_both_classes(tmp_path):
    args = DPOtherArguments(**_kwargs(tmp_path, other_length=3, gradient_accumulation_steps=2,
                                      logical_batch_size=None))
    assert args.other_post_init_ran and args.other_length == 3
    assert args.max_grad_norm == 0.0  # the DP rewrite ran
    # and the translation after it
    assert args.logical_batch_size == 8 and args.gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match="exactly one of target_epsilon and noise_multiplier"):
        DPOtherArguments(**_kwargs(tmp_path, target_epsilon=1.0))
    with pytest.raises(ValueError, match="'secure_noise' was renamed 'secure_rng'"):
        DPOtherArguments(**_kwargs(tmp_path, secure_noise=True))


def test_the_seed_stays_secret_in_the_mixed_class(tmp_path):
    args = DPOtherArguments(**_kwargs(tmp_path, dp_seed=123456789))
    assert "123456789" not in repr(args) and "123456789" not in str(args)
    assert "dp_seed" not in args.to_dict() and "123456789" not in args.to_json_string()
    assert pickle.loads(pickle.dumps(args)).dp_seed is None
    assert args.dp_seed == 123456789


def test_the_command_line_parser_sees_both(tmp_path):
    (args,) = HfArgumentParser(DPOtherArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--dp_method", "disk", "--noise_multiplier", "1.0", "--other_length",
         "5",
         "--secure_rng", "true", "--use_cpu", "true", "--report_to", "none"]
    )
    assert args.dp_method == "disk" and args.other_length == 5 and args.secure_rng


def test_the_glue_trains_another_trainer_privately(tmp_path):
    trainer = DPOtherTrainer(model=tiny_bert(),
                             args=DPOtherArguments(**_kwargs(tmp_path, save_strategy="no")),
                             train_dataset=ListDataset(make_examples(16, VOCAB, causal=False)),
                             data_collator=PadCollator(0))
    assert trainer.other_trainer and isinstance(trainer, OtherTrainer) and not isinstance(trainer, DPTrainer)
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == 2 == trainer.dp_optimizer.dp_steps
    assert read_privacy_ledger(str(tmp_path))["steps"] == 2
    with pytest.raises(TypeError, match="DPOtherTrainer needs DPTrainingArguments"):
        DPOtherTrainer(model=tiny_bert(), args=OtherArguments(output_dir=str(tmp_path), use_cpu=True),
                       train_dataset=ListDataset(make_examples(16, VOCAB, causal=False)),
                       data_collator=PadCollator(0))
