"""Opacus' Renyi-DP analysis of the subsampled Gaussian mechanism, loaded without importing Opacus' training
stack.

:mod:`hf_dpfilter.accounting.accountant` uses it for the "rdp" accountant and for the RDP cap of the PRV and
PLD results; the values are Opacus' own (the same file runs), only the import is cheaper.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType

logger = logging.getLogger(__name__)

__all__ = ["opacus_rdp"]

_OPACUS_RDP = "opacus.accountants.analysis.rdp"


@functools.lru_cache(maxsize=1)
def opacus_rdp() -> ModuleType:
    """Opacus' RDP analysis module (``opacus/accountants/analysis/rdp.py``), without importing ``opacus``.

    Importing it as ``opacus.accountants.analysis.rdp`` first runs ``opacus/__init__.py``, which imports
    Opacus' whole training stack (grad samplers, the privacy engine): several seconds of a fresh process, for
    a module that needs only numpy and ``scipy.special``. So the same file is executed as a module of its own
    (the same code, hence the same values). If Opacus is already imported, or its file cannot be run alone (a
    future version with package-relative imports), the ordinary import is used.
    """
    if _OPACUS_RDP in sys.modules:
        return sys.modules[_OPACUS_RDP]
    try:
        spec = importlib.util.find_spec("opacus")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = os.path.join(locations[0], "accountants", "analysis", "rdp.py")
        standalone = importlib.util.spec_from_file_location("hf_dpfilter._opacus_rdp", path)
        assert standalone is not None and standalone.loader is not None
        module = importlib.util.module_from_spec(standalone)
        standalone.loader.exec_module(module)
        if callable(getattr(module, "compute_rdp", None)) and callable(getattr(module, "get_privacy_spent",
                                                                               None)):
            return module
    except Exception as err:  # noqa: BLE001 - any failure: the ordinary import below
        logger.debug("opacus' rdp.py not loadable alone (%s); importing opacus", err)
    return importlib.import_module(_OPACUS_RDP)
