"""The per-example checks' forwards: training mode, dropout off, the same random draws, or a refusal.

An example's loss in its micro-batch and its loss re-collated alone must be the *same function* for the
comparison to prove anything, and it must be the function training computes: a module may couple examples in
training mode only (batch statistics, ``x - x.mean(0)`` under ``self.training``), which eval mode would hide. So
the checks run in training mode with two changes, both exact for what they compare:

* dropout is off: the ``nn.Dropout`` modules, and the dropout probabilities attention kernels read at call time
  (transformers' BERT passes ``self.dropout.p`` and GPT-2 ``self.attn_dropout.p`` to SDPA, Llama its float
  ``self.attention_dropout``). Dropout draws a mask element by element: it cannot carry one example's data into
  another's outputs, so turning it off in both forwards hides no coupling;
* every forward runs on a forked global RNG seeded with the same seed, so that whatever randomness remains draws
  the same numbers in the batch and alone, and the run's own random stream is left untouched.

Whatever is still random after that (two seeds give different in-batch losses: a mixup hook with a random
lambda, router jitter, stochastic depth) cannot be compared and may mix examples: the run is refused by
:func:`check_deterministic` with the reason and the fix. There is no fallback to eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["TrainingRandomnessError", "check_deterministic", "checking_forward", "dropout_free", "same_draws"]

#: float attributes that attention implementations read as their dropout probability at call time
KERNEL_DROPOUT_ATTRIBUTES = (
    "attention_dropout", "attn_dropout", "attn_drop", "dropout", "dropout_p", "dropout_prob", "attention_dropout_p",
)


class TrainingRandomnessError(RuntimeError):
    """The training forward is random with dropout off: the per-example checks cannot compare it."""


@contextlib.contextmanager
def checking_forward(model: nn.Module) -> Iterator[None]:
    """Dropout off (modules and kernel probabilities), every other module left in its training mode; restored."""
    modes: list[tuple[nn.Module, bool]] = []
    probabilities: list[tuple[object, str, float]] = []
    try:
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                modes.append((module, module.training))
                probabilities.append((module, "p", module.p))
                module.training, module.p = False, 0.0
            for name in KERNEL_DROPOUT_ATTRIBUTES:
                value = module.__dict__.get(name)  # plain attributes only (a submodule lives in _modules)
                if isinstance(value, float) and not isinstance(value, bool) and value != 0.0:
                    probabilities.append((module, name, value))
                    setattr(module, name, 0.0)
        yield
    finally:
        for owner, name, value in reversed(probabilities):
            setattr(owner, name, value)
        for module, mode in modes:
            module.training = mode


def dropout_free(model: nn.Module) -> bool:
    """Whether :func:`checking_forward` would change nothing: no dropout module in training mode with ``p > 0`` and
    no non-zero kernel dropout probability (read as :func:`checking_forward` reads them, at each call). Then the
    training forward is the checking forward, and its losses can stand for the re-check's in-batch forward."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p != 0.0:
            return False
        for name in KERNEL_DROPOUT_ATTRIBUTES:
            value = module.__dict__.get(name)
            if isinstance(value, float) and not isinstance(value, bool) and value != 0.0:
                return False
    return True


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def same_draws(model: nn.Module, seed: int) -> Iterator[None]:
    """Run the block on a forked global RNG (CPU and the model's CUDA devices) seeded with ``seed``; the run's
    own stream is restored afterwards, so seeded runs draw the same dropout masks with or without the checks."""
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        torch.manual_seed(seed)
        yield


def check_deterministic(
    model: nn.Module,
    losses_under: Callable[[int], torch.Tensor],
    where: str,
) -> torch.Tensor:
    """The in-batch losses under two seeds (inside :func:`checking_forward`); equal, or
    :class:`TrainingRandomnessError`. Returns the losses of the first seed (float64, detached)."""
    first = losses_under(1).detach().double()
    second = losses_under(2).detach().double()
    if first.shape != second.shape or first.numel() == 0 or not bool(torch.isfinite(first).all()):
        return first  # a shape or a non-finite loss: the comparison that follows reports it
    if float((first - second).abs().max()) > 1e-6 * float(first.abs().max()) + 1e-12:
        raise TrainingRandomnessError(
            f"The training forward of {where} is random even with dropout off: two random seeds give different "
            "per-example losses for the same micro-batch (a forward hook or module drawing random numbers, such as "
            "mixup with a random lambda that mixes the examples of a micro-batch, router jitter, stochastic depth). "
            "Randomness shared by the examples of a micro-batch can mix them, and an example's loss in the batch "
            "cannot be compared with its loss alone, so the run is refused before any step is released. Fix: remove "
            "the random module or hook from training, make its randomness element-wise and independent of the other "
            "examples (nn.Dropout is fine: it is turned off while checking), or mix examples only within each "
            "example's own data. An attention kernel whose dropout probability is read from elsewhere than an "
            "nn.Dropout or a float attribute of its module (from the config at call time) is random too: set that "
            "dropout to 0."
        )
    return first
