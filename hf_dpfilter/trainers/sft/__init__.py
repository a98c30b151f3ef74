"""DP supervised fine-tuning through TRL: :class:`DPSFTTrainer` and :class:`DPSFTConfig` (needs
``hf_dpfilter[trl]``).

A user of TRL's ``SFTTrainer``/``SFTConfig`` switches to ``DPSFTTrainer``/``DPSFTConfig`` and keeps the data
set and the options (docs/sft.md). The names are imported lazily: the submodules that need no TRL
(:mod:`hf_dpfilter.trainers.sft.packing`) imports without it, and asking for the trainer
or the config without TRL installed raises an ``ImportError`` that names the extra.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DPSFTConfig", "DPSFTTrainer", "require_trl"]

_EXPORTS = {"DPSFTConfig": "hf_dpfilter.trainers.sft.config",
            "DPSFTTrainer": "hf_dpfilter.trainers.sft.trainer"}

#: the oldest TRL whose SFTTrainer the DP glue was written against (its dataset preparation and collator)
MIN_TRL = "1.16"


def require_trl() -> None:
    """Raise an ``ImportError`` naming the extra when TRL is missing or too old."""
    try:
        import trl
    except ImportError as err:
        raise ImportError(
            "DPSFTTrainer and DPSFTConfig need TRL: pip install 'hf_dpfilter[trl]' (trl>=1.16)."
        ) from err
    from packaging.version import Version

    if Version(trl.__version__) < Version(MIN_TRL):
        raise ImportError(
            f"DPSFTTrainer needs trl>={MIN_TRL}, found {trl.__version__}: pip install 'hf_dpfilter[trl]'."
        )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        require_trl()
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_dpfilter.trainers.sft' has no attribute {name!r}")
