"""Every fix a refusal suggests is a real setting: the library's messages are read from its source, each
``name=value`` they hold must name a field or a parameter of something the user can set (DPTrainingArguments,
make_private, the method configs, a model config, a tokenizer, ...), and each ``DPTrainingArguments`` field a
message sets to a value is accepted when built with it.

A message that drifts from the code (a field renamed, a suggestion never implemented: ``make_private(...,
batchnorm_eval=True)`` once named a field that did not exist) fails here with the file it is in.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from functools import cache
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "hf_dpfilter"
#: ``name=value`` in a message: a setting with a literal value, an ellipsis, a placeholder or a container
SETTING = re.compile(r"(?<![\w.])([a-z][a-z0-9_]*)=(True|False|None|'[^']*'|\"[^\"]*\"|-?[\d.]+(?:e-?\d+)?"
                     r"|\.\.\.|\{\}|\{|\[)")
#: names a message mentions as the wrong thing (a retired name, refused with its replacement)
RETIRED = {"secure_noise", "max_grad_norm", "disk_kappa", "dice_accounting", "dice_save_error_buffer",
           "doppler_base", "pmlf_preset"}
#: names in messages that are not settings: a lambda's or an example's variables, a quantity stated
#: (``epsilon=3``, ``delta=...``), a method's own wording (``claimed=``, ``track=``)
NOT_SETTINGS = {"a", "b", "i", "m", "p", "q", "r", "v", "eps", "eps_lb", "epsilon", "delta", "steps",
                "history", "claimed", "track", "release", "log", "stage", "size", "fdp", "alone", "users",
                "model", "repr"}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes (read by developers; messages are every other string)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


@cache
def _messages() -> list[tuple[str, str]]:
    """(file, text) of every string in the package but the docstrings; an f-string's fields read as ``{}``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            out.append((str(path.relative_to(PACKAGE.parent)), text))
    return out


def _parameters(*functions) -> set[str]:
    return {name for f in functions for name in inspect.signature(f).parameters}


@cache
def _real_settings() -> dict[str, set[str]]:
    """What a user can set, by where: the names a message may suggest."""
    import accelerate
    import transformers
    from transformers import BertConfig, DataCollatorWithFlattening, DataCollatorWithPadding, LlamaConfig

    from hf_dpfilter import DPTrainer, DPTrainingArguments, PrivacyPlan, make_dp_optimizer
    from hf_dpfilter.engine import GhostClippingEngine
    from hf_dpfilter.factory import DP_SETTINGS, make_engine, make_private
    from hf_dpfilter.optimizers.base import DPOptimizer
    from hf_dpfilter.optimizers.registry import method_names, method_spec
    from hf_dpfilter.trainers.seq2seq import DPSeq2SeqTrainingArguments

    arguments = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    arguments |= {f.name for f in dataclasses.fields(DPSeq2SeqTrainingArguments)}
    try:
        from hf_dpfilter.trainers.sft.config import DPSFTConfig

        arguments |= {f.name for f in dataclasses.fields(DPSFTConfig)}
    except ImportError:  # pragma: no cover -- trl is an extra
        pass
    methods = {name for m in method_names() for name in method_spec(m).config_class.field_names()}
    library = (_parameters(make_private, make_engine, make_dp_optimizer, PrivacyPlan.create,
                           PrivacyPlan.for_optimizer, GhostClippingEngine.__init__, DPOptimizer.accumulate,
                           DPTrainer.compute_per_example_loss) | set(DP_SETTINGS))
    stack = _parameters(transformers.Trainer.__init__, accelerate.Accelerator.__init__, torch.optim.AdamW)
    configs = (BertConfig(), LlamaConfig())
    models = ({name for name in _suggested() if any(hasattr(c, name) for c in configs)}
              # from_pretrained's keywords, applied to the config
              | {"attn_implementation", "experts_implementation"})
    data = (_parameters(transformers.PreTrainedTokenizerBase.__call__, DataCollatorWithFlattening.__init__)
            | {f.name for f in dataclasses.fields(DataCollatorWithPadding)}
            | {"remove_columns"})  # datasets.Dataset.map
    try:
        import peft

        lora = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    except ImportError:  # pragma: no cover -- peft is an extra: its names are taken on trust
        lora = {"lora_dropout", "use_dora", "alora_invocation_tokens", "velora_config", "bias"}
    torch_names = _parameters(torch.nn.BatchNorm1d, torch.nn.Embedding, torch.utils.checkpoint.checkpoint,
                              torch.load)
    return {"arguments": arguments, "methods": methods, "library": library, "stack": stack, "models": models,
            "data": data, "lora": lora, "torch": torch_names}


def _suggested() -> dict[str, list[str]]:
    """Each name a message sets, with the files it is in."""
    names: dict[str, list[str]] = {}
    for path, text in _messages():
        for match in SETTING.finditer(text):
            names.setdefault(match.group(1), []).append(path)
    return names


def test_every_setting_a_message_names_exists():
    # the scan sees the suggestions it guards (the BatchNorm refusals' two fixes among them)
    assert {"dp_batchnorm_eval", "batchnorm_eval", "dp_row_is_unit", "per_sample_max_grad_norm"} <= set(_suggested())
    real = set().union(*_real_settings().values())
    unknown = {name: sorted(set(paths)) for name, paths in _suggested().items()
               if name not in real | RETIRED | NOT_SETTINGS}
    assert not unknown, f"messages name settings that do not exist: {unknown}"


def test_the_retired_names_are_refused_and_not_settings():
    """A name the messages treat as retired must really be gone from the arguments."""
    from hf_dpfilter import DPTrainingArguments

    fields = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    assert RETIRED & fields == {"max_grad_norm"}  # the Trainer's batch clipping, refused unless 0 or 1
    assert "max_grad_norm" not in _real_settings()["library"]


#: the DPTrainingArguments suggestions that need a companion setting to be built (the message says so)
COMPANIONS = {
    ("privacy_unit", "user"): {"user_id_column": "user_id", "max_examples_per_user": 1},
    "user_id_column": {"privacy_unit": "user", "max_examples_per_user": 1},
    "dp_micro_batch_tokens": {"dp_group_by_length": True},
}


#: a setting the message suggests (not the refused value it starts from): a verb of advice before it in its
#: clause
ADVICE = re.compile(r"\b(set|pass|use|leave|declare|declared|add|give|keep|with|or|e\.g\.|instead of)\b"
                    r"[^.;:]*$|DPTrainingArguments\([^()]*$", re.IGNORECASE)


def _literal_suggestions() -> dict[str, set[object]]:
    """``DPTrainingArguments`` fields the messages advise setting to a literal value (True, 'user', ...)."""
    from hf_dpfilter import DPTrainingArguments

    fields = {f.name for f in dataclasses.fields(DPTrainingArguments)} - RETIRED
    out: dict[str, set[object]] = {}
    for _, text in _messages():
        for match in SETTING.finditer(text):
            name, value = match.groups()
            advised = ADVICE.search(text[max(0, match.start() - 80):match.start()])
            if advised and name in fields and value not in ("...", "{", "[", "{}"):
                try:
                    out.setdefault(name, set()).add(ast.literal_eval(value))
                except (ValueError, SyntaxError):
                    continue
    return out


@pytest.mark.parametrize(("name", "value"), sorted(((n, v) for n, vs in _literal_suggestions().items() for v in vs),
                                                   key=repr))
def test_each_suggested_argument_value_is_accepted(tmp_path, name, value):
    from hf_dpfilter import DPTrainingArguments

    base = dict(output_dir=str(tmp_path), noise_multiplier=1.0, report_to=[], use_cpu=True)
    companions = COMPANIONS.get((name, value), COMPANIONS.get(name, {}))
    try:
        args = DPTrainingArguments(**{**base, **companions, name: value})
    except ValueError as err:
        pytest.fail(f"a message suggests {name}={value!r}, which DPTrainingArguments refuses: {err}")
    if isinstance(value, bool):
        assert getattr(args, name) is value


def test_the_suggested_call_keywords_are_parameters():
    """``make_private(..., batchnorm_eval=True)``, ``DPTrainingArguments(dp_batchnorm_eval=True)``,
    ``make_dp_optimizer(..., method_args=...)``: the keyword belongs to the call the message names."""
    from hf_dpfilter import DPTrainingArguments, PrivacyPlan, make_dp_optimizer
    from hf_dpfilter.factory import DP_SETTINGS, make_private

    calls = {
        "DPTrainingArguments": {f.name for f in dataclasses.fields(DPTrainingArguments)},
        "make_private": _parameters(make_private),
        "make_dp_optimizer": _parameters(make_dp_optimizer) | set(DP_SETTINGS),
        "PrivacyPlan.create": _parameters(PrivacyPlan.create),
    }
    wrong, seen = [], set()
    for path, text in _messages():
        for call, names in calls.items():
            for match in re.finditer(re.escape(call) + r"\(([^()]*)\)", text):
                for name in re.findall(r"(?<![\w.])([a-z][a-z0-9_]*)=", match.group(1)):
                    seen.add(f"{call}({name}=")
                    if name not in names - RETIRED:
                        wrong.append(f"{path}: {call}({name}=...)")
    assert not wrong, wrong
    assert {"make_private(batchnorm_eval=", "DPTrainingArguments(dp_batchnorm_eval="} <= seen, seen
