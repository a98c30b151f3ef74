"""The Trainer glue: ``DPTrainer`` and the mixin it is made of.

* :mod:`~hf_dpfilter.trainer.glue` -- :class:`DPTrainerMixin` (the DP hooks over a ``transformers.Trainer`` loop)
  and ``DPTrainer(DPTrainerMixin, Trainer)``;
* :mod:`~hf_dpfilter.trainer.session` -- the privacy ledger, resumes, and runs on one model;
* :mod:`~hf_dpfilter.trainer.micro_batches` -- a logical batch cut into micro-batches, and the first-step checks.
"""

from hf_dpfilter.trainer.glue import DPTrainer, DPTrainerMixin
from hf_dpfilter.trainer.micro_batches import NUM_EXAMPLES_KEY
from hf_dpfilter.trainer.session import read_privacy_ledger

__all__ = ["NUM_EXAMPLES_KEY", "DPTrainer", "DPTrainerMixin", "read_privacy_ledger"]
