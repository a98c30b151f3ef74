"""Every TrainingArguments field has a declared DP status (hf_dpfilter/run/training_fields.py), and the
refusals it declares happen when the arguments are created, with the fix in the message."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from transformers import TrainingArguments

from hf_dpfilter import DPTrainingArguments
from hf_dpfilter.run.training_fields import (
    FIELD_POLICIES,
    STATUSES,
    TrainingFieldError,
    render_markdown,
)

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "configuration.md")


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                noise_multiplier=1.0)
    base.update(kw)
    return DPTrainingArguments(**base)


def test_every_field_of_the_installed_training_arguments_is_classified():
    # A field that a new transformers release adds fails here until it has a row in FIELD_POLICIES.
    names = [f.name for f in dataclasses.fields(TrainingArguments)]
    missing = [n for n in names if n not in FIELD_POLICIES]
    assert not missing, f"TrainingArguments fields without a DP status in hf_dpfilter/run/training_fields.py: {missing}"


def test_every_dp_field_is_classified_and_no_row_is_stale():
    names = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    assert not names - set(FIELD_POLICIES), names - set(FIELD_POLICIES)
    assert not set(FIELD_POLICIES) - names, set(FIELD_POLICIES) - names
    for name, policy in FIELD_POLICIES.items():
        assert policy.status in STATUSES, (name, policy.status)
        assert policy.note, name


def test_the_docs_hold_the_table():
    with open(DOCS) as f:
        text = f.read()
    match = re.search(r"<!-- training-fields:start -->\n(.*?)<!-- training-fields:end -->", text, re.S)
    assert match, "docs/configuration.md lacks the training-fields table markers"
    assert match.group(1) == render_markdown(), (
        "docs/configuration.md is out of sync with FIELD_POLICIES: paste "
        "hf_dpfilter.run.training_fields.render_markdown()"
    )


REFUSED = [
    # HF's batch clipping given explicitly is not silently dropped
    (dict(max_grad_norm=0.1), r"max_grad_norm=0\.1 .*per_sample_max_grad_norm=0\.1"),
    (dict(max_grad_norm=5.0), r"per_sample_max_grad_norm"),
    # item 13
    (dict(auto_find_batch_size=True), r"auto_find_batch_size=True is not "
                                      r"supported.*per_device_train_batch_size"),
    # item 17
    (dict(debug="underflow_overflow"), r"debug='underflow_overflow'.*Remove it"),
    (dict(debug="underflow_overflow tpu_metrics_debug"), r"debug='underflow_overflow'"),
    # item 18
    (dict(optim="lomo"), r"optim='lomo'.*optim='adamw_torch'"),
    (dict(optim="adalomo"), r"optim='adalomo'"),
    # a forward that adds noise scaled by the batch's longest example
    (dict(neftune_noise_alpha=5.0), r"neftune_noise_alpha=5\.0.*longest example.*Remove"),
    # item 1, at the arguments: the accelerator's accumulation
    (dict(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}}),
     r"gradient_accumulation_kwargs=\{'num_steps': 2\}.*logical_batch_size"),
    # item 14, at the arguments: evaluation-driven settings without the declaration
    (dict(eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True),
     r"load_best_model_at_end=True.*dp_eval_disjoint_from_train=True"),
    (dict(eval_strategy="steps", metric_for_best_model="loss"), r"metric_for_best_model='loss'"),
    (dict(eval_strategy="steps", save_strategy="best", metric_for_best_model="loss"),
     r"save_strategy='best'"),
    (dict(eval_strategy="steps", lr_scheduler_type="reduce_lr_on_plateau"), r"reduce_lr_on_plateau"),
    # other fields that would be silently ignored or break the per-example bound
    (dict(use_liger_kernel=True), r"use_liger_kernel=True"),
    (dict(torch_compile=True), r"torch_compile"),
    (dict(torch_compile_mode="default"), r"torch_compile"),
    (dict(train_sampling_strategy="group_by_length", dp_group_by_length=False),
     r"train_sampling_strategy='group_by_length' with dp_group_by_length=False.*Poisson"),
    (dict(train_sampling_strategy="sequential"), r"train_sampling_strategy='sequential'.*Poisson"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED, ids=[str(k) for k, _ in REFUSED])
def test_refused_values_fail_at_the_arguments_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(TrainingFieldError, match=message):
        _args(tmp_path, **kwargs)


@pytest.mark.parametrize("value", [1.0, 0.0, None])
def test_max_grad_norm_default_and_zero_are_not_refused(tmp_path, value):
    kwargs = {} if value == 1.0 else {"max_grad_norm": value}
    args = _args(tmp_path, **kwargs)
    assert args.max_grad_norm == 0.0
    again = dataclasses.replace(args)  # the 0.0 that __post_init__ wrote comes back through replace/to_dict
    assert again.max_grad_norm == 0.0


def test_honoured_values_are_accepted(tmp_path):
    args = _args(tmp_path, debug="tpu_metrics_debug", optim="sgd", lr_scheduler_type="cosine",
                 eval_strategy="steps",
                 gradient_accumulation_steps=2)
    assert (args.logical_batch_size == 2 * args.per_device_train_batch_size
            and args.gradient_accumulation_steps == 1)
    # with the declaration, evaluation-driven model selection is allowed at the arguments
    _args(tmp_path, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True,
          dp_eval_disjoint_from_train=True)


def test_all_refusals_are_listed_together(tmp_path):
    with pytest.raises(TrainingFieldError) as info:
        _args(tmp_path, auto_find_batch_size=True, neftune_noise_alpha=1.0)
    assert "auto_find_batch_size" in str(info.value) and "neftune_noise_alpha" in str(info.value)


#: for every field whose status is "refused": a value that must be refused, and what the message says
REFUSED_EXAMPLE = {
    "accelerator_config": (dict(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}}),
                           "num_steps"),
    "auto_find_batch_size": (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    "train_sampling_strategy": (dict(train_sampling_strategy="sequential"), "train_sampling_strategy"),
    "lr_scheduler_type": (dict(eval_strategy="steps", lr_scheduler_type="reduce_lr_on_plateau"), "reduce_lr"),
    "optim": (dict(optim="adalomo"), "adalomo"),
    "max_grad_norm": (dict(max_grad_norm=2.0), "per_sample_max_grad_norm"),
    "neftune_noise_alpha": (dict(neftune_noise_alpha=1.0), "NEFTune"),
    "use_liger_kernel": (dict(use_liger_kernel=True), "Liger"),
    "activation_checkpointing_kwargs": (
        dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}),
        "use_reentrant"),
    "gradient_checkpointing_kwargs": (
        dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
        "use_reentrant"),
    "torch_compile": (dict(torch_compile=True), "torch_compile"),
    "torch_compile_backend": (dict(torch_compile_backend="inductor"), "torch_compile"),
    "torch_compile_mode": (dict(torch_compile_mode="max-autotune"), "torch_compile"),
    "debug": (dict(debug="underflow_overflow"), "underflow_overflow"),
    "load_best_model_at_end": (
        dict(eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True), "dp_eval_disjoint"),
    "metric_for_best_model": (dict(eval_strategy="steps", metric_for_best_model="accuracy"),
                              "dp_eval_disjoint"),
    "save_strategy": (dict(eval_strategy="steps", save_strategy="best", metric_for_best_model="loss"),
                      "'best'"),
    "parallelism_config": (dict(parallelism_config=object()), "parallelism_config"),
}
#: refused at DPTrainer creation, where the accelerator says what runs (tests/distributed/test_ddp.py)
REFUSED_AT_THE_TRAINER = {"fsdp", "fsdp_config", "deepspeed"}


def test_every_refused_row_refuses_a_value():
    refused = {name for name, policy in FIELD_POLICIES.items() if policy.status == "refused"}
    assert refused == set(REFUSED_EXAMPLE) | REFUSED_AT_THE_TRAINER, refused ^ (set(REFUSED_EXAMPLE) | REFUSED_AT_THE_TRAINER)


@pytest.mark.parametrize("name", sorted(REFUSED_EXAMPLE))
def test_refused_row_example(tmp_path, name):
    kwargs, message = REFUSED_EXAMPLE[name]
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **kwargs)
