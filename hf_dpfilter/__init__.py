"""hf_dpfilter: differentially private fine-tuning in the Hugging Face stack, with noise-reducing DP optimizers."""

from hf_dpfilter.accounting import PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from hf_dpfilter.arguments import DPTrainingArguments
from hf_dpfilter.engine import GhostClippingEngine, PerExampleGradients, UnsupportedLayerError
from hf_dpfilter.grad_rules import register_grad_rule
from hf_dpfilter.losses import per_example_loss
from hf_dpfilter.optimizers import DPOptimizer, available_methods, make_dp_optimizer
from hf_dpfilter.sampling import PoissonBatchSampler
from hf_dpfilter.trainer import DPTrainer

__version__ = "0.1.0"

__all__ = [
    "DPOptimizer",
    "DPTrainer",
    "DPTrainingArguments",
    "GhostClippingEngine",
    "PerExampleGradients",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "UnsupportedLayerError",
    "available_methods",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "make_dp_optimizer",
    "per_example_loss",
    "register_grad_rule",
]
