"""Module validators: the registry of modules per-example clipping must refuse, each with its fix.

The per-layer rule registry (:mod:`hf_dpfilter.engine.rules`) says how a layer's per-example gradient is
computed. This registry says which modules cannot be trained privately at all, whatever their gradient rule:
modules that mix examples (batch statistics), and modules that change state from the data outside the DP
optimizer's step (running buffers, in-place renormalisation, adapters that write activation statistics).
:class:`hf_dpfilter.engine.GhostClippingEngine` runs every registered validator over **every** module of the
model when it attaches (frozen modules too: a frozen BatchNorm in train mode still normalises with the
batch's statistics and writes its running buffers) and raises one :class:`ModuleValidationError` listing each
module, its problem and the fix.

A validator gets the module's qualified name, the module and the engine's :class:`ValidationOptions`, and
returns the problems it found (an empty list when the module is fine). Validators apply to the registered
type and its subclasses, like Opacus' module validators::

    @register_module_validator(MyStatefulLayer)
    def _my_layer(name, module, options) -> list[ModuleProblem]:
        return [ModuleProblem(name, "writes a running average of its inputs", "set track=False")]

What the validators cannot see statically (a buffer written by some other module's forward) is caught at run
time by the engine's first recorded step, which compares every parameter's and buffer's version before and
after the forward (see ``GhostClippingEngine``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from hf_dpfilter.proofs import longrope

__all__ = [
    "ModuleProblem",
    "ModuleValidationError",
    "StateWrittenError",
    "ValidationOptions",
    "find_module_problems",
    "hold_eval_modes",
    "register_module_validator",
    "registered_validator_types",
]


@dataclass(frozen=True)
class ModuleProblem:
    """One refusal: the module's qualified name, what is wrong with it for DP training, and the fix."""

    module_name: str
    problem: str
    fix: str

    def describe(self) -> str:
        return f"- '{self.module_name or '<root>'}': {self.problem} Fix: {self.fix}"


@dataclass(frozen=True)
class ValidationOptions:
    """The engine options the validators take into account."""

    #: frozen BatchNorms are accepted and held in eval mode in every step (see :func:`hold_eval_modes`)
    batchnorm_eval: bool = False


class ModuleValidationError(ValueError):
    """The model holds modules that per-example clipping cannot train safely (listed with their fixes)."""

    def __init__(self, problems: list[ModuleProblem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(p.describe() for p in self.problems)
        super().__init__(
            f"{len(self.problems)} module(s) cannot be trained with differential privacy as they are: each "
            "would let one example influence others or write state from private data outside the DP "
            f"step.\n{lines}"
        )


class StateWrittenError(RuntimeError):
    """A forward pass wrote parameters or buffers (found by the engine's first recorded step, before
    release)."""

    def __init__(self, changes: list[tuple[str, str, str]]) -> None:
        self.changes = list(changes)
        lines = "\n".join(f"- '{tensor}' (module '{module}') {how}" for tensor, module, how in self.changes)
        super().__init__(
            "The forward pass changed model state outside the DP optimizer's step: these tensors would carry "
            "information from private examples, unclipped and without noise, into the saved model.\n"
            f"{lines}\nFix: make the module stateless in training (BatchNorm: convert to GroupNorm/LayerNorm "
            "or freeze it with DPTrainingArguments(dp_batchnorm_eval=True) (make_private(..., "
            "batchnorm_eval=True)); InstanceNorm: track_running_stats=False; Embedding: "
            "max_norm=None; adapters that record activation statistics, such as VeLoRA: use plain LoRA). "
            "Nothing was released."
        )


Validator = Callable[[str, nn.Module, ValidationOptions], list[ModuleProblem]]

_VALIDATORS: dict[type, list[Validator]] = {}


def register_module_validator(*module_types: type) -> Callable[[Validator], Validator]:
    """Register a validator for one or more module types and their subclasses (decorator)."""

    def decorator(validator: Validator) -> Validator:
        for module_type in module_types:
            _VALIDATORS.setdefault(module_type, []).append(validator)
        return validator

    return decorator


def registered_validator_types() -> list[type]:
    return list(_VALIDATORS)


def find_module_problems(model: nn.Module, options: ValidationOptions | None = None) -> list[ModuleProblem]:
    """Every problem every registered validator finds in every module of ``model`` (frozen or not)."""
    options = options or ValidationOptions()
    _register_peft_validators()
    problems: list[ModuleProblem] = []
    for name, module in model.named_modules():
        for module_type, validators in _VALIDATORS.items():
            if isinstance(module, module_type):
                for validator in validators:
                    problems.extend(validator(name, module, options))
    return problems


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _held_in_eval(module: nn.Module, options: ValidationOptions) -> bool:
    """A BatchNorm the engine holds in eval mode (batchnorm_eval=True and nothing of it trainable)."""
    return options.batchnorm_eval and isinstance(module, _BatchNorm) and not _trainable(module)


def hold_eval_modes(model: nn.Module, options: ValidationOptions) -> None:
    """Put back in eval mode the modules the options freeze there (after ``model.train()``, every step).

    ``batchnorm_eval=True``: every frozen BatchNorm normalises with its stored running statistics (no batch
    statistics, no buffer written). The Trainer calls ``model.train()`` at each step; the DPTrainer and the
    engine's ``record()`` call this right after.
    """
    if not options.batchnorm_eval:
        return  # nothing to hold: no walk over the modules in every step
    for module in model.modules():
        if _held_in_eval(module, options) and module.training:
            module.eval()


# ------------------------------------------------------------------------------------------ the validators
_BATCHNORM_FIX = (
    "replace it by GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) converts BatchNorm "
    "to GroupNorm), or freeze it (requires_grad_(False) on its parameters) and pass "
    "GhostClippingEngine(..., batchnorm_eval=True) / DPTrainingArguments(dp_batchnorm_eval=True), which "
    "keeps it in eval mode with its stored statistics in every step."
)


@register_module_validator(_BatchNorm)
def _batch_norm(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    kind = type(module).__name__
    if _trainable(module):
        return [ModuleProblem(
            name,
            f"{kind} is trainable: in train mode it normalises each example with statistics of the whole "
            "batch (one example moves every other example's gradient) and writes running_mean/running_var "
            "from private data; in eval mode its affine parameters have no per-example gradient rule.",
            "replace it by GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) converts "
            "BatchNorm to GroupNorm), or freeze it and set DPTrainingArguments(dp_batchnorm_eval=True) "
            "(make_private(..., batchnorm_eval=True)): it then runs in eval mode.",
        )]
    if _held_in_eval(module, options):
        return []
    return [ModuleProblem(
        name,
        f"{kind} (frozen or affine=False) still normalises with batch statistics in train mode, which "
        "couples the examples of a batch, and updates running_mean/running_var from private data without "
        "noise.",
        _BATCHNORM_FIX,
    )]


@register_module_validator(_InstanceNorm)
def _instance_norm(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    if not module.track_running_stats:
        return []  # normalises each example by its own statistics: per example, nothing written
    return [ModuleProblem(
        name,
        f"{type(module).__name__}(track_running_stats=True) writes running_mean/running_var from private "
        "data in every training forward, outside the DP step, and saves them without noise.",
        "build it with track_running_stats=False (each example is then normalised by its own statistics).",
    )]


@register_module_validator(nn.Embedding)
def _embedding_max_norm(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    if getattr(module, "max_norm", None) is None:
        return []
    return [ModuleProblem(
        name,
        f"{type(module).__name__}(max_norm={module.max_norm}) renormalises the looked-up rows of its weight "
        "in place during the forward: which rows changed reveals which tokens the private batch holds, at "
        "any epsilon.",
        "build it with max_norm=None (renormalise explicitly after the DP step if needed, e.g. in a callback "
        "on the released weights).",
    )]


@register_module_validator(nn.Embedding)
def _embedding_grad_by_freq(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    if not getattr(module, "scale_grad_by_freq", False) or not _trainable(module):
        return []
    return [ModuleProblem(
        name,
        f"{type(module).__name__}(scale_grad_by_freq=True) divides each row's gradient by the token's "
        "frequency in the whole micro-batch: one example's gradient depends on the tokens of the others.",
        "build it with scale_grad_by_freq=False (the per-example gradient is then each example's own).",
    )]


_DATA_DEPENDENT_ROPE = ("dynamic", "longrope")


@register_module_validator(nn.Module)
def _data_dependent_rope(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    """transformers' rotary embeddings with a dynamic or LongRoPE scaling (``rope_type`` attribute, one string
    or one per layer type): their frequencies depend on the longest position of the whole batch. A LongRoPE
    one recognised as transformers' is accepted: the engine refuses each micro-batch reaching beyond its
    original length, within which it computes as for each example alone
    (:mod:`hf_dpfilter.proofs.longrope`)."""
    rope_type = getattr(module, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    found = sorted({k for k in kinds if isinstance(k, str) and any(d in k for d in _DATA_DEPENDENT_ROPE)})
    if not found or longrope.longrope_buffers(module) is not None:
        return []
    return [ModuleProblem(
        name,
        f"rotary embedding with rope_type {', '.join(repr(k) for k in found)} recomputes its frequencies "
        "from the largest position id of the whole micro-batch (writing its inv_freq buffer, only on the "
        "steps where a batch is long enough, so the first-step check may not see it): every example's "
        "gradient then depends on the lengths of the other examples, and the written state carries them into "
        "later steps.",
        "use a static scaling (rope_parameters rope_type 'default', 'linear' or 'yarn'), or keep every "
        "sequence within original_max_position_embeddings and drop the dynamic scaling for training "
        "(transformers' LongRoPE is accepted as it is: each micro-batch within that length is checked).",
    )]


# ------------------------------------------------------------------------------------------------ PEFT
_PEFT_REGISTERED = False


def _register_peft_validators() -> None:
    """Validators for PEFT adapters that compute outside the batch or write state. Registered once peft is
    imported (a model with PEFT layers has imported it), so that the engine does not pay for importing
    peft."""
    global _PEFT_REGISTERED
    if _PEFT_REGISTERED or "peft" not in sys.modules:
        return
    _PEFT_REGISTERED = True
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # pragma: no cover -- peft is optional for the engine
        return
    try:
        from peft.tuners.peanut.layer import PeanutLayer
    except ImportError:  # pragma: no cover -- older peft
        PeanutLayer = None

    @register_module_validator(LoraLayer)
    def _lora_variants(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
        problems = []
        for adapter, variant in getattr(module, "lora_variant", {}).items():
            variant_name = type(variant).__name__ if not isinstance(variant, type) else variant.__name__
            if variant_name == "VeloraLinearVariant":
                problems.append(ModuleProblem(
                    name,
                    f"VeLoRA (LoraConfig(velora_config=...), adapter '{adapter}') writes the mean of each "
                    "training micro-batch's activations into the buffer lora_velora_embed (saved with the "
                    "adapter, never clipped or noised), and computes lora_A through its own autograd "
                    "function, never calling it as a module: its per-example gradient is invisible.",
                    "use plain LoRA (velora_config=None).",
                ))
            elif variant_name == "ALoraLinearVariant":
                problems.append(ModuleProblem(
                    name,
                    f"aLoRA (activated LoRA, LoraConfig(alora_invocation_tokens=...), adapter '{adapter}') "
                    "runs lora_A/lora_B on the selected tokens of all examples flattened together, so the "
                    "layer's input has no batch axis and per-example gradients cannot be separated.",
                    "use plain LoRA (alora_invocation_tokens=None).",
                ))
            elif variant_name.startswith("Dora"):
                magnitude = getattr(module, "lora_magnitude_vector", {})
                layer = magnitude[adapter] if adapter in magnitude else None
                if layer is not None and _trainable(layer):
                    problems.append(ModuleProblem(
                        f"{name}.lora_magnitude_vector.{adapter}" if name
                        else f"lora_magnitude_vector.{adapter}",
                        f"DoRA (use_dora=True, adapter '{adapter}') with a trainable magnitude vector: the "
                        "magnitude scales the layer's output through a weight norm, a form with no "
                        "per-example gradient rule.",
                        "freeze the magnitude (for n, p in model.named_parameters(): if "
                        "'lora_magnitude_vector' in n: p.requires_grad_(False)): DoRA with a frozen "
                        "magnitude is exact; or use plain LoRA.",
                    ))
        return problems

    if PeanutLayer is not None:
        @register_module_validator(PeanutLayer)
        def _peanut(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
            if not _trainable(module):
                return []
            return [ModuleProblem(
                name,
                "PEANuT (PeanutConfig) computes its weight update by calling its trainable Linear layers on "
                "the base weight matrix, not on the batch: rows of the weight would be clipped as if they "
                "were examples.",
                "use LoRA (LoraConfig) for DP fine-tuning, or freeze the PEANuT adapter.",
            )]
