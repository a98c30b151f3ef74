"""Retired public names, refused with the name that replaced them: the one place that knows them.

* ``secure_noise`` is ``secure_rng``: one name for the one setting that draws the noise AND the sampling from
  the OS CSPRNG, in the arguments, the plan, the optimizer and the docs.
* ``max_grad_norm`` (of ``PrivacyPlan.create``/``for_optimizer`` and ``make_dp_optimizer``) is
  ``per_sample_max_grad_norm``: the per-example clipping norm C under ``DPTrainingArguments``' name (there,
  ``max_grad_norm`` is the Trainer's batch-level clipping, refused by
  :mod:`hf_dpfilter.run.training_fields` with the same pointer).
* The flat method settings of earlier versions (``disk_kappa``, ``dice_accounting``, ``diff2_restart_every``,
  ...: a method config's ``legacy_prefix`` + one of its fields) are the fields of the method's config, given
  as ``dp_method_args`` (``DPTrainingArguments``) or ``method_args`` (``make_dp_optimizer``).

Nothing maps an old name onto a new one (the project is young): a clear error names the new field.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["RENAMED", "check_no_retired_names", "refuse_retired_names", "retired_name_message"]

#: ``{old name: new name}`` of renamed settings
RENAMED = {"secure_noise": "secure_rng", "max_grad_norm": "per_sample_max_grad_norm"}
#: why each was renamed, said with the refusal
_REASONS = {
    "secure_noise": "it governs the noise and the sampling",
    "max_grad_norm": "the per-example clipping norm C has one name everywhere, DPTrainingArguments' own",
}

_T = TypeVar("_T")


def retired_name_message(name: str, where: str) -> str | None:
    """The error for the retired name ``name`` given to ``where`` (None: ``name`` is not a retired name)."""
    if name in RENAMED:
        return (f"{where}: {name!r} was renamed {RENAMED[name]!r} ({_REASONS[name]}); "
                f"use {RENAMED[name]}=...")
    from hf_dpfilter.optimizers.registry import method_names, method_spec

    for method in method_names():
        config_class = method_spec(method).config_class
        prefix = getattr(config_class, "legacy_prefix", "")
        if prefix and name.startswith(prefix) and name[len(prefix):] in config_class.field_names():
            field = name[len(prefix):]
            return (
                f"{where}: {name!r} is no longer accepted. The settings of dp_method={method!r} are the "
                f"fields of {config_class.__name__}: pass dp_method_args={{'{field}': ...}} "
                f"(DPTrainingArguments, --dp_method_args '{{\"{field}\": ...}}') or make_dp_optimizer(..., "
                f"method_args={{'{field}': ...}})."
            )
    return None


def check_no_retired_names(names: Iterable[str], where: str) -> None:
    """Raise a ValueError naming the replacement if one of ``names`` is retired."""
    for name in names:
        message = retired_name_message(name, where)
        if message is not None:
            raise ValueError(message)


def refuse_retired_names(cls: type[_T]) -> type[_T]:
    """Class decorator (after ``@dataclass``): the generated ``__init__`` refuses a retired keyword with the
    name that replaced it, instead of Python's bare "unexpected keyword argument". Wrapping the generated
    ``__init__`` is the one way a dataclass can see names that are not its fields.

    Only the keywords that are not fields of ``cls`` are checked: a field is accepted by the generated
    ``__init__`` whatever its name, so it cannot be a retired name, and every other keyword fails there
    anyway. This keeps the common case (``HfArgumentParser`` passes every field as a keyword) from importing
    the DP methods' config modules, which :func:`retired_name_message` needs to know their retired names."""
    generated = cls.__init__
    field_names = frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        check_no_retired_names((name for name in kwargs if name not in field_names), cls.__name__)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls
