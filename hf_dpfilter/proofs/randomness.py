"""The per-example checks' forwards: training mode, dropout off, the same random draws, or a refusal.

An example's loss in its micro-batch and its loss re-collated alone must be the *same function* for the
comparison to prove anything, and it must be the function training computes: a module may couple examples in
training mode only (batch statistics, ``x - x.mean(0)`` under ``self.training``), which eval mode would hide.
So the checks run in training mode with two changes, both exact for what they compare:

* dropout is off: the ``nn.Dropout`` modules, and the dropout probabilities attention kernels read at call
  time (transformers' BERT passes ``self.dropout.p`` and GPT-2 ``self.attn_dropout.p`` to SDPA, Llama its
  float ``self.attention_dropout``, BLOOM its float ``self.hidden_dropout`` to ``dropout_add``, BART its
  ``self.activation_dropout``: any float attribute named as a dropout probability), and the dropout
  probabilities of the model's configs, which some families read at call time (Falcon's decoder layer passes
  ``self.config.attention_dropout`` and ``self.config.hidden_dropout`` to ``dropout_add``). Dropout draws a
  mask element by element: it cannot carry one example's data into another's outputs, so turning it off in
  both forwards hides no coupling;
* every forward runs on a forked global RNG seeded with the same seed, so that whatever randomness remains
  draws the same numbers in the batch and alone, and the run's own random stream is left untouched.

Whatever is still random after that (two seeds give different in-batch losses: a mixup hook with a random
lambda, router jitter, stochastic depth) cannot be compared and may mix examples: the run is refused by
:func:`check_deterministic` with the reason and the fix. There is no fallback to eval mode.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

__all__ = ["TrainingRandomnessError", "check_deterministic", "checking_forward", "dropout_free", "same_draws"]

#: float attributes that attention implementations read as their dropout probability at call time (and any
#: float attribute whose name ends as in :data:`CONFIG_DROPOUT_ENDINGS`: BART's ``activation_dropout``,
#: ``resid_pdrop``)
KERNEL_DROPOUT_ATTRIBUTES = (
    "attention_dropout", "attn_dropout", "attn_drop", "dropout", "dropout_p", "dropout_prob",
    "attention_dropout_p",
    "hidden_dropout",
)
#: endings of a config field that holds a dropout probability (``attention_dropout``, ``hidden_dropout_prob``,
#: ``resid_pdrop``, ``dropout_rate``); a stochastic-depth rate (``layerdrop``, ``drop_path_rate``) is not one
#: of them: it drops whole layers for the whole micro-batch and stays random, so the two-seed check refuses it
CONFIG_DROPOUT_ENDINGS = ("dropout", "dropout_prob", "dropout_rate", "dropout_p", "pdrop")
#: parts of a config field's name that set randomness other than dropout, named in the refusal when non-zero
#: (Mixtral's ``router_jitter_noise``, LayerDrop, stochastic depth)
CONFIG_RANDOMNESS_NAMES = ("jitter", "layerdrop", "drop_path", "stochastic_depth")


#: True inside a checking forward of a model whose dropout it turned off: a proof the engine concludes there
#: saw none of the training forward's dropout calls, so it proves again on the next recorded forward
#: (hf_dpfilter.randomness.example_keys keys each dropout by the proof's verdict)
DROPOUT_TURNED_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("dropout_turned_off", default=False)


class TrainingRandomnessError(RuntimeError):
    """The training forward is random with dropout off: the per-example checks cannot compare it."""


@contextlib.contextmanager
def checking_forward(model: nn.Module) -> Iterator[None]:
    """Dropout off (modules, kernel probabilities and the configs' dropout probabilities), every other module
    left in its training mode; restored."""
    modes: list[tuple[nn.Module, bool]] = []
    probabilities: list[tuple[object, str, float]] = []
    token = DROPOUT_TURNED_OFF.set(DROPOUT_TURNED_OFF.get() or not dropout_free(model))
    try:
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                modes.append((module, module.training))
                probabilities.append((module, "p", module.p))
                module.training, module.p = False, 0.0
            names = {k for k in vars(module)
                     if k.endswith(CONFIG_DROPOUT_ENDINGS)} | set(KERNEL_DROPOUT_ATTRIBUTES)
            _zero(module, sorted(names), probabilities)
        for config in _configs(model):
            _zero(config, [k for k in vars(config) if k.endswith(CONFIG_DROPOUT_ENDINGS)], probabilities)
        yield
    finally:
        DROPOUT_TURNED_OFF.reset(token)
        for owner, name, value in reversed(probabilities):
            setattr(owner, name, value)
        for module, mode in modes:
            module.training = mode


def _configs(model: nn.Module) -> list[object]:
    """The configs the model's modules hold (``module.config`` and its sub-configs, such as ``text_config``),
    once."""
    found: dict[int, object] = {}
    pending = [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue
        found[id(config)] = config
        pending.extend(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return list(found.values())


def _random_config_fields(model: nn.Module) -> list[str]:
    """``name=value`` for each non-zero float field of the model's configs that sets randomness other than
    dropout."""
    return sorted({
        f"{name}={value}" for config in _configs(model) for name, value in vars(config).items()
        if any(part in name for part in CONFIG_RANDOMNESS_NAMES) and isinstance(value, float) and value != 0.0
    })


def _zero(owner: object, names: Iterable[str], probabilities: list[tuple[object, str, float]]) -> None:
    """Set each float attribute of ``owner`` named in ``names`` to 0, recording its value in
    ``probabilities``."""
    for name in names:
        value = vars(owner).get(name)  # plain attributes only (a submodule lives in _modules)
        if isinstance(value, float) and not isinstance(value, bool) and value != 0.0:
            probabilities.append((owner, name, value))
            setattr(owner, name, 0.0)


def _nonzero(owner: object, names: Iterable[str]) -> bool:
    """Whether a float attribute of ``owner`` named in ``names`` is non-zero (what :func:`_zero` would
    change)."""
    for name in names:
        value = vars(owner).get(name)
        if isinstance(value, float) and not isinstance(value, bool) and value != 0.0:
            return True
    return False


def dropout_free(model: nn.Module) -> bool:
    """Whether the training forward draws no dropout: no dropout module in training mode with ``p > 0`` and no
    non-zero dropout probability among the modules' attributes (the names :func:`checking_forward` zeroes).
    Then the training forward is the checking forward, and its losses can stand for the re-check's in-batch
    forward.

    The configs' fields are not read here (a config keeps fields no module of the model uses, e.g. GPT-2's
    ``summary_first_dropout``). A dropout read from a config at call time and missed here costs no privacy:
    the training losses then differ from the example alone, the two-seed check of the mismatch finds the
    checking forward deterministic, and the step is refused (a false refusal, with its message), never
    released."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p != 0.0:
            return False
        names = {k for k in vars(module)
                 if k.endswith(CONFIG_DROPOUT_ENDINGS)} | set(KERNEL_DROPOUT_ATTRIBUTES)
        if _nonzero(module, names):
            return False
    return True


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def same_draws(model: nn.Module, seed: int) -> Iterator[None]:
    """Run the block on a forked global RNG (CPU and the model's CUDA devices) seeded with ``seed``; the run's
    own stream is restored afterwards, so seeded runs draw the same dropout masks with or without the
    checks."""
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
        fields = _random_config_fields(model)
        named = (f" The model's config sets {', '.join(fields)}: set it to 0 for private training." if fields
                 else "")
        raise TrainingRandomnessError(
            f"The training forward of {where} is random even with dropout off: two random seeds give "
            "different per-example losses for the same micro-batch (a forward hook or module drawing random "
            "numbers, such as mixup with a random lambda that mixes the examples of a micro-batch, router "
            "jitter, stochastic depth). Randomness shared by the examples of a micro-batch can mix them, and "
            "an example's loss in the batch cannot be compared with its loss alone, so the run is refused "
            "before any step is released. Fix: remove the random module or hook from training, make its "
            "randomness element-wise and independent of the other examples (nn.Dropout is fine: it is turned "
            "off while checking), or mix examples only within each example's own data. A dropout whose "
            "probability is read from elsewhere than an nn.Dropout, a float attribute of its module or a "
            "field of the model's config named as a dropout probability (ending in 'dropout', 'dropout_p', "
            "'dropout_prob', 'dropout_rate' or 'pdrop', or listed in "
            "hf_dpfilter.proofs.randomness.KERNEL_DROPOUT_ATTRIBUTES) is random too: set that dropout to 0."
            + named
        )
    return first
