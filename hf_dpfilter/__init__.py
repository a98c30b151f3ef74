"""hf_dpfilter: differentially private fine-tuning in the Hugging Face stack, with noise-reducing DP
optimizers.

The public names are imported lazily, so that light submodules (``hf_dpfilter.accounting.accountant``,
``hf_dpfilter.randomness.sampling``, ...) do not pay for importing transformers and peft.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DPArgumentsMixin": "hf_dpfilter.trainers.arguments",
    "DPOptimizer": "hf_dpfilter.optimizers.base",
    "DPSFTConfig": "hf_dpfilter.trainers.sft",
    "DPSFTTrainer": "hf_dpfilter.trainers.sft",
    "DPSeq2SeqTrainer": "hf_dpfilter.trainers.seq2seq",
    "DPSeq2SeqTrainingArguments": "hf_dpfilter.trainers.seq2seq",
    "DPTrainer": "hf_dpfilter.trainers.trainer",
    "DPTrainerMixin": "hf_dpfilter.trainers.trainer",
    "DPTrainingArguments": "hf_dpfilter.trainers.arguments",
    "GhostClippingEngine": "hf_dpfilter.engine",
    "ModuleProblem": "hf_dpfilter.proofs.validators",
    "ModuleValidationError": "hf_dpfilter.proofs.validators",
    "PerExampleGradients": "hf_dpfilter.engine",
    "PoissonBatchSampler": "hf_dpfilter.randomness.sampling",
    "PrivacyAccountant": "hf_dpfilter.accounting.accountant",
    "PrivacyPlan": "hf_dpfilter.plan",
    "StateWrittenError": "hf_dpfilter.proofs.validators",
    "UnprivatizedGradientError": "hf_dpfilter.optimizers.base",
    "UnsupportedLayerError": "hf_dpfilter.engine",
    "available_methods": "hf_dpfilter.optimizers.registry",
    "calibrate_noise_multiplier": "hf_dpfilter.accounting.calibration",
    "compute_epsilon": "hf_dpfilter.accounting.accountant",
    "make_dp_optimizer": "hf_dpfilter.factory",
    "make_private": "hf_dpfilter.factory",
    "per_example_loss": "hf_dpfilter.losses.tasks",
    "register_grad_rule": "hf_dpfilter.engine",
    "register_module_validator": "hf_dpfilter.proofs.validators",
    "register_method": "hf_dpfilter.optimizers.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_dpfilter' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
