"""The method registry: the one place that lists the DP methods.

``dp_method`` names map to ``(config class, optimizer class)``, in the spirit of the
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
    "available_methods",
    "method_names",
    "method_spec",
    "register_method",
]

#: ``dp_method`` -> (its config class, its optimizer class), as ``"module:Name"``. Each is imported on first
#: use: a plan needs only the config (DP-SGD's lives in method_config, so the default plan imports no engine).
_REGISTRY: dict[str, tuple[str, str]] = {
    "none": ("hf_dpfilter.optimizers.nonprivate:NonPrivateConfig",
             "hf_dpfilter.optimizers.nonprivate:NonPrivateOptimizer"),
    "dpsgd": ("hf_dpfilter.optimizers.method_config:DPSGDConfig", "hf_dpfilter.optimizers.base:DPOptimizer"),
    "disk": ("hf_dpfilter.optimizers.disk:DiSKConfig", "hf_dpfilter.optimizers.disk:DiSKOptimizer"),
    "doppler": ("hf_dpfilter.optimizers.doppler:DopplerConfig",
                "hf_dpfilter.optimizers.doppler:DopplerOptimizer"),
    "pmlf": ("hf_dpfilter.optimizers.pmlf:PMLFConfig", "hf_dpfilter.optimizers.pmlf:PMLFOptimizer"),
    "dicesgd": ("hf_dpfilter.optimizers.dicesgd:DiceSGDConfig", "hf_dpfilter.optimizers.dicesgd:DiceSGD"),
    "diff2": ("hf_dpfilter.optimizers.diff2:Diff2Config", "hf_dpfilter.optimizers.diff2:Diff2"),
}

#: the built-in method names, in documentation order ("none" trains non-privately through the same path)
METHOD_NAMES: tuple[str, ...] = tuple(_REGISTRY)

_custom: dict[str, tuple[type, type]] = {}


def _load(path: str) -> type:
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_class: type[MethodConfig]
    #: the optimizer class, or its ``"module:Name"`` (imported when first asked for)
    optimizer: type[DPOptimizer] | str

    @property
    def optimizer_class(self) -> type[DPOptimizer]:
        return self.optimizer if isinstance(self.optimizer, type) else _load(self.optimizer)


def method_names() -> list[str]:
    """Every available method: the built-in ones, then those added with :func:`register_method`."""
    return [*METHOD_NAMES, *(n for n in _custom if n not in _REGISTRY)]


def available_methods() -> list[str]:
    """The DP methods (``"none"`` excluded): the names ``make_dp_optimizer`` and ``dp_method`` accept."""
    return sorted(name for name in method_names() if name != "none")


def method_spec(name: str) -> MethodSpec:
    """The config and optimizer classes of method ``name``."""
    if name in _custom:
        config_class, optimizer_class = _custom[name]
        return MethodSpec(name, config_class, optimizer_class)
    if name not in _REGISTRY:
        raise ValueError(f"Unknown dp_method {name!r}: dp_method must be one of {method_names()}.")
    config_path, optimizer_path = _REGISTRY[name]
    return MethodSpec(name, _load(config_path), optimizer_path)


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
