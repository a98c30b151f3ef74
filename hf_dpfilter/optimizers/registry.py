"""The method registry: the one place that lists the DP methods.

``dp_method`` names map to ``(module, config class, optimizer class)``, in the spirit of the
``OptimizerNames`` -> optimizer table of ``transformers.Trainer``. Modules are imported on first use, so
listing the methods (``DPTrainingArguments`` choices, recipe flags) costs nothing.

Adding a method: write ``hf_dpfilter/optimizers/<method>.py`` (a :class:`MethodConfig` subclass and a
:class:`DPOptimizer` subclass, the paper and the update equations in its docstring), add one line below, and
document it in docs/configuration.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_dpfilter.optimizers.base import DPOptimizer
    from hf_dpfilter.optimizers.method_config import MethodConfig

__all__ = [
    "METHOD_NAMES",
    "MethodSpec",
    "legacy_setting_owners",
    "method_names",
    "method_spec",
    "register_method",
]

_REGISTRY: dict[str, tuple[str, str, str]] = {
    "none": ("hf_dpfilter.optimizers.nonprivate", "NonPrivateConfig", "NonPrivateOptimizer"),
    "dpsgd": ("hf_dpfilter.optimizers.base", "DPSGDConfig", "DPOptimizer"),
    "disk": ("hf_dpfilter.optimizers.disk", "DiSKConfig", "DiSKOptimizer"),
    "doppler": ("hf_dpfilter.optimizers.doppler", "DopplerConfig", "DopplerOptimizer"),
    "pmlf": ("hf_dpfilter.optimizers.pmlf", "PMLFConfig", "PMLFOptimizer"),
    "dicesgd": ("hf_dpfilter.optimizers.dicesgd", "DiceSGDConfig", "DiceSGD"),
    "diff2": ("hf_dpfilter.optimizers.diff2", "Diff2Config", "Diff2"),
}

#: the built-in method names, in documentation order ("none" trains non-privately through the same path)
METHOD_NAMES: tuple[str, ...] = tuple(_REGISTRY)

_custom: dict[str, tuple[type, type]] = {}


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_class: type[MethodConfig]
    optimizer_class: type[DPOptimizer]


def method_names() -> list[str]:
    """Every available method: the built-in ones, then those added with :func:`register_method`."""
    return [*METHOD_NAMES, *(n for n in _custom if n not in _REGISTRY)]


def method_spec(name: str) -> MethodSpec:
    """The config and optimizer classes of method ``name``."""
    if name in _custom:
        config_class, optimizer_class = _custom[name]
        return MethodSpec(name, config_class, optimizer_class)
    if name not in _REGISTRY:
        raise ValueError(f"Unknown dp_method {name!r}; available: {method_names()}.")
    module_name, config_name, optimizer_name = _REGISTRY[name]
    module = importlib.import_module(module_name)
    return MethodSpec(name, getattr(module, config_name), getattr(module, optimizer_name))


def legacy_setting_owners() -> dict[str, str]:
    """``{earlier flat name: method}`` for every method's settings (``"disk_kappa": "disk"``, ...)."""
    return {legacy: name for name in method_names() for legacy in method_spec(name).config_class.legacy_names()}


def register_method(name: str, config_class: type[MethodConfig], optimizer_class: type[DPOptimizer]) -> None:
    """Make a user-defined method available under ``name`` (for the built-in ones, edit the table above)."""
    if name in _REGISTRY:
        raise ValueError(f"{name!r} is a built-in method; choose another name.")
    if config_class.name != name or optimizer_class.method_name != name:
        raise ValueError(
            f"register_method({name!r}, ...): set {config_class.__name__}.name and "
            f"{optimizer_class.__name__}.method_name to {name!r}."
        )
    _custom[name] = (config_class, optimizer_class)
