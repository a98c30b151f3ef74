"""The DP methods: one file each (its :class:`MethodConfig` and its :class:`DPOptimizer`), listed once in
:mod:`hf_dpfilter.optimizers.registry`.

The names below are imported lazily, so that importing one declaration (``method_config``, ``registry``: what
the privacy plan needs) does not import the optimizers and the engine. Building an optimizer is the factory's
job (:mod:`hf_dpfilter.factory`); ``make_dp_optimizer`` is re-exported from there.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DPOptimizer": "hf_dpfilter.optimizers.base",
    "MethodConfig": "hf_dpfilter.optimizers.method_config",
    "UnprivatizedGradientError": "hf_dpfilter.optimizers.base",
    "build_base_optimizer": "hf_dpfilter.optimizers.base",
    "make_dp_optimizer": "hf_dpfilter.factory",
    "available_methods": "hf_dpfilter.optimizers.registry",
    "method_names": "hf_dpfilter.optimizers.registry",
    "method_spec": "hf_dpfilter.optimizers.registry",
    "register_method": "hf_dpfilter.optimizers.registry",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_dpfilter.optimizers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
