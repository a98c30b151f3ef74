"""The privacy unit, declared: one example (default) or one user (all of a user's examples).

``privacy_unit="user"`` with ``user_id_column`` (the data set column naming each example's user) and
``max_examples_per_user`` (k) protects a *user*: the neighbouring data sets differ by one user and all of
their examples. Three parts change, each in this module:

* **Sampling** (:class:`UserPoissonBatchSampler`): each step includes every user independently with
  probability q = expected users per step / number of users (``logical_batch_size`` counts users), and for
  each sampled user up to k of their examples drawn uniformly without replacement, afresh each step, from the
  same secret randomness as the rest of the sampling (the seeded sampler stream, or the OS CSPRNG with
  ``secure_rng``). Whole users are assigned to processes (user u to process u mod world size), so all of a
  sampled user's examples are on one process; the micro-batches are cut at user boundaries
  (:func:`unit_micro_batches`), so they are all in one micro-batch.
* **Clipping** (:class:`UnitLayout`): a user's contribution to a step is the sum of the per-example gradients
  of their selected examples, clipped as ONE vector to C. The layout maps the tokens of the user's examples --
  several rows, several segments of packed rows -- to one unit, and the engine regroups every layer's recorded
  activations and output gradients per unit before its rule (as :mod:`hf_dpfilter.data.packing` does per
  example):
  the ghost identity then runs over all of the user's tokens, cross terms between their examples included, so
  the norm is the norm of the sum, exactly. The unit's loss is the SUM of its examples' losses (each the
  example's own mean token loss): its gradient is then the sum of the examples' gradients, what C bounds.
* **Accounting**: the plan is computed over users (N = number of users, q over users). The number of users is
  computed from the column and is public, like the data set size (docs/threat_model.md).

Which example belongs to which user is read from the declared column by index, never inferred from a batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from hf_dpfilter.data.packing import PackedLayout, PackingError
from hf_dpfilter.data.user_ids import PrivacyUnitError, checked_user_ids, read_user_ids
from hf_dpfilter.randomness.sampling import PoissonBatchSampler
from hf_dpfilter.randomness.secure_rng import derive_seed, secure_uniform

#: The tokenizer's column mapping each row to its example when it splits long inputs
#: (return_overflowing_tokens).
OVERFLOW_COLUMN = "overflow_to_sample_mapping"

__all__ = [
    "PRIVACY_UNITS",
    "UNITS_KEY",
    "PrivacyUnitError",
    "UnitCollator",
    "UnitLayout",
    "UnitTaggedDataset",
    "UserIndex",
    "UserPoissonBatchSampler",
    "as_examples",
    "card_section",
    "describe_users",
    "check_unit_arguments",
    "examples_layout",
    "per_unit_loss",
    "planned_dataset_size",
    "unit_micro_batches",
    "user_index_for",
    "user_loading",
    "with_unit",
    "without_column",
]

PRIVACY_UNITS = ("example", "user")
#: Key under which the training collator reports each collated example's unit (popped before the forward).
UNITS_KEY = "_dp_units"


# ------------------------------------------------------------------------------------------ the declaration
def check_unit_arguments(args: Any) -> None:
    """Refuse, before training, a privacy unit whose declaration is incomplete or contradicted by other
    fields."""
    unit = getattr(args, "privacy_unit", "example")
    column = getattr(args, "user_id_column", None)
    k = getattr(args, "max_examples_per_user", None)
    if unit not in PRIVACY_UNITS:
        raise PrivacyUnitError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {unit!r}.")
    if unit == "example":
        if column is not None or k is not None:
            given = ", ".join(f"{n}={v!r}" for n,
                              v in (("user_id_column", column), ("max_examples_per_user", k))
                              if v is not None)
            raise PrivacyUnitError(
                f"{given} with privacy_unit='example': these declare users, which example-level DP ignores "
                "(each example would be protected, not each user). Set privacy_unit='user' to protect users, "
                "or remove them."
            )
        return
    if not isinstance(column, str) or not column:
        raise PrivacyUnitError(
            "privacy_unit='user' needs user_id_column: the name of the data set column that names each "
            "example's user (e.g. user_id_column='author'). Without it the users cannot be told apart."
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PrivacyUnitError(
            f"privacy_unit='user' needs max_examples_per_user (k) >= 1, got {k!r}: at most k of a sampled "
            "user's examples enter a step (drawn at random each step); k bounds the work per user, C bounds "
            "their influence."
        )
    if not getattr(args, "poisson_sampling", True):
        raise PrivacyUnitError(
            "privacy_unit='user' with poisson_sampling=False: user-level sampling is Poisson over users "
            "(what the accountant assumes); shuffled fixed-size batches of users are not implemented. Keep "
            "poisson_sampling=True."
        )


@dataclass(frozen=True)
class UserIndex:
    """Which examples belong to which user, read from the declared column: ``examples[u]`` are user u's
    indices.

    Users are numbered in the order they first appear in the data set. ``num_users`` (public, like the data
    set size) is the number of distinct values in the column.
    """

    examples: tuple[tuple[int, ...], ...]
    unit_of: tuple[int, ...]
    column: str

    @property
    def num_users(self) -> int:
        return len(self.examples)

    @property
    def largest(self) -> int:
        return max((len(e) for e in self.examples), default=0)

    @classmethod
    def from_dataset(cls, dataset: Any, column: str) -> UserIndex:
        """The users of ``dataset``; refuses missing, mixed-type or ambiguous ids
        (:mod:`hf_dpfilter.data.user_ids`)."""
        ids = checked_user_ids(read_user_ids(dataset, column), column)
        numbers: dict[Any, int] = {}
        unit_of = [numbers.setdefault(value, len(numbers)) for value in ids]
        examples: list[list[int]] = [[] for _ in numbers]
        for i, unit in enumerate(unit_of):
            examples[unit].append(i)
        return cls(tuple(tuple(e) for e in examples), tuple(unit_of), column)


# ----------------------------------------------------------------------------------------------- sampling
class UserPoissonBatchSampler(PoissonBatchSampler):
    """Poisson over users at rate q, then up to k of each sampled user's examples at random; yields the
    indices of a step grouped by user (all of a user's examples consecutive), for this process's users only.

    The Poisson draw over users is :class:`~hf_dpfilter.randomness.sampling.PoissonBatchSampler`'s, with the
    users as its samples. Process r holds the users u with u % world_size == r. Seeded: every process draws
    the whole user mask and every sampled user's choice from the same generators and keeps its own users, so
    the shards of a step are disjoint parts of one draw. Secure: each process flips its own users' coins and
    draws their examples from the OS CSPRNG.
    """

    stream = "user-poisson-sampler"

    def __init__(
        self,
        users: UserIndex,
        sample_rate: float,
        max_examples_per_user: int,
        steps_per_epoch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        secure: bool = False,
    ) -> None:
        super().__init__(users.num_users, sample_rate, steps_per_epoch, seed, rank, world_size, secure)
        if max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be >= 1, got {max_examples_per_user}.")
        self.users = users
        self.k = int(max_examples_per_user)

    def _choose(self, user: int, generator: torch.Generator | None) -> list[int]:
        examples = self.users.examples[user]
        if len(examples) <= self.k:
            return list(examples)
        if generator is None:
            order = torch.argsort(secure_uniform(len(examples)))
        else:
            order = torch.randperm(len(examples), generator=generator)
        return [examples[i] for i in sorted(order[: self.k].tolist())]

    def __iter__(self) -> Iterator[list[int]]:
        # this process's users' coins (the parent's draw), then their examples, from the CSPRNG
        if self.secure:
            for sampled in super().__iter__():
                yield [i for user in sampled for i in self._choose(user, None)]
            return
        count = self.users.num_users
        shard = torch.arange(self.rank, count, self.world_size)
        coins = self.generator()
        choice = torch.Generator().manual_seed(derive_seed(self.seed, "user-example-choice", self.epoch))
        mine = torch.zeros(count, dtype=torch.bool)
        mine[shard] = True
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(count, generator=coins) < self.sample_rate
            batch = []
            for user in mask.nonzero().flatten().tolist():
                chosen = self._choose(user, choice)  # drawn for every sampled user: the streams stay in step
                if mine[user]:
                    batch.extend(chosen)
            yield batch


class UnitTaggedDataset(Dataset):
    """The training set with each item tagged by its unit (read from the declared column by index)."""

    def __init__(self, dataset: Any, unit_of: Sequence[int]) -> None:
        self.dataset, self.unit_of = dataset, unit_of

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> _Tagged:
        return _Tagged(self.dataset[index], self.unit_of[index])


@dataclass(frozen=True)
class _Tagged:
    item: Any
    unit: int


class UnitCollator:
    """Collates the items with the user's collator and adds ``UNITS_KEY``: each collated example's unit."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, examples: list) -> dict[str, Any]:
        if not examples or not all(isinstance(e, _Tagged) for e in examples):
            return self.collate_fn(examples)  # a probe or a template on untagged items: no unit to report
        batch = dict(self.collate_fn([e.item for e in examples]))
        batch[UNITS_KEY] = torch.tensor([e.unit for e in examples], dtype=torch.long)
        return batch


# ----------------------------------------------------------------------------------------------- clipping
@dataclass(frozen=True)
class UnitLayout(PackedLayout):
    """Which tokens belong to which unit: ``units[u]`` are the indices of ``spans`` (the examples) of unit u.

    ``spans`` are the examples, as in :class:`PackedLayout` (one per row for padded rows, segments of rows for
    packed rows). The engine sees ``num_examples`` = the number of units and regroups every recorded tensor to
    ``(units, tokens of the unit, ...)``: the unit's spans concatenated, so its ghost norm runs over all of
    its tokens (cross terms between its examples included) and it is clipped as one vector.
    """

    units: tuple[tuple[int, ...], ...] = ()
    #: the examples are segments of packed rows (False: one example per row, padded)
    packed_rows: bool = True

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:  # what the engine clips: the units
        return self.units

    @property
    def num_member_examples(self) -> int:
        return len(self.spans)

    @property
    def examples_layout(self) -> PackedLayout | None:
        """The per-example layout (for the per-example losses); None for padded rows (one example per row)."""
        return PackedLayout(self.spans, self.rows, self.length) if self.packed_rows else None

    def over_rows(self, width: int) -> UnitLayout | None:
        """Padded rows (one example per row): each example's whole row r, ``width`` entries wide, so a unit's
        vector concatenates its rows' entries whatever axes the model merged into them (OPT's ``(B*T, d)``
        viewed ``(B, T, d)``, proven row r // T by the tracer); None for packed rows (examples share a
        row)."""
        if self.packed_rows:
            return None
        return dataclasses.replace(self, spans=tuple((r, 0, width) for r, _, _ in self.spans), length=width,
                                   _index_cache={})

    def unit_of_example(self, device: torch.device | None = None) -> torch.Tensor:
        index = torch.empty(len(self.spans), dtype=torch.long)
        for unit, members in enumerate(self.units):
            index[list(members)] = unit
        return index.to(device) if device is not None else index

    @classmethod
    def of(cls, example_units: Sequence[int], examples: PackedLayout | None, rows: int,
           length: int) -> UnitLayout:
        """The unit layout of a micro-batch: each example's unit (consecutive runs), and the examples' layout
        (None: padded rows, example i is row i)."""
        spans = examples.spans if examples is not None else tuple((r, 0, length) for r in range(rows))
        if len(spans) != len(example_units):
            raise PrivacyUnitError(f"{len(example_units)} unit ids for {len(spans)} examples in a "
                                   "micro-batch.")
        groups: list[list[int]] = []
        seen: set[int] = set()
        for e, unit in enumerate(example_units):
            if groups and example_units[e - 1] == unit:
                groups[-1].append(e)
                continue
            if unit in seen:
                raise PrivacyUnitError(
                    "A unit's examples are not consecutive in the batch: the sampler must yield each unit's "
                    "examples together (UserPoissonBatchSampler does)."
                )
            seen.add(unit)
            groups.append([e])
        return cls(tuple(spans), rows, length, units=tuple(tuple(g) for g in groups),
                   packed_rows=examples is not None)


def per_unit_loss(loss_fn: Callable[..., torch.Tensor], layout: UnitLayout) -> Callable[..., torch.Tensor]:
    """``loss_fn`` (per-example losses, one per span) -> the SUM of each unit's examples' losses, one per
    unit.

    Sum, not mean: the unit's gradient is then the sum of its examples' gradients, which the clip bounds by C
    whatever the number of examples the unit has in the step.
    """

    def unit_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        losses = loss_fn(*args, **kwargs)
        if losses.dim() != 1 or losses.shape[0] != layout.num_member_examples:
            raise PrivacyUnitError(
                f"The per-example loss has shape {tuple(losses.shape)} for {layout.num_member_examples} "
                "examples."
            )
        index = layout.unit_of_example(losses.device)
        # The declared grouping, not a coupling the model made: hidden from the engine's batch-axis tracer,
        # which would otherwise take this sum over rows for a forward that mixes examples. The engine clips
        # per unit from the regrouped layer records (UnitLayout), whatever this tensor is.
        with torch._C.DisableTorchFunction():
            return losses.new_zeros(layout.num_examples).index_add(0, index, losses)

    return unit_loss


def _unit_groups(units: list[int], size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` example ranges of the micro-batches: whole units, up to ``size`` examples each (a
    unit with more examples than ``size`` gets a micro-batch of its own)."""
    runs: list[tuple[int, int]] = []
    for e, unit in enumerate(units):
        if runs and units[runs[-1][0]] == unit:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    groups: list[tuple[int, int]] = []
    for start, stop in runs:
        if groups and stop - groups[-1][0] <= size:
            groups[-1] = (groups[-1][0], stop)
        else:
            groups.append((start, stop))
    return groups


def unit_micro_batches(
    structure: Any,
    micro_batches: Callable[..., Any],
    inputs: dict[str, Any],
    labels: torch.Tensor,
    units: torch.Tensor,
    size: int,
    labels_along_tokens: bool | None = True,
) -> list[tuple[dict[str, Any], torch.Tensor, UnitLayout]]:
    """Micro-batches cut at unit boundaries (every example of a unit in ONE micro-batch), each with its
    :class:`UnitLayout`. ``micro_batches(inputs, labels, num_examples, size=...)`` is the trainer's
    example-level cutter, applied to the examples of one group at a time (so padding trimming and re-packing
    stay its own).

    Padded rows span the inputs' columns: the labels' width when they run along the tokens, the attention
    mask's (or the input ids') when the head declares one label row per example
    (``labels_along_tokens=False``: extractive QA's (start, end) pair, whose head is token-wise: every layer's
    output is then regrouped per unit, and a layer that is not token-wise, a pooler, is refused by the
    engine)."""
    from hf_dpfilter.proofs.batch_structure import flash_boundaries

    unit_list = [int(u) for u in units.tolist()]
    n = len(unit_list)
    structure.check({**inputs, "labels": labels})
    packed_layout = PackedLayout.from_position_ids(inputs["position_ids"]) if structure.packed else None
    count = packed_layout.num_examples if packed_layout is not None else labels.shape[0]
    if count != n:
        raise PrivacyUnitError(f"The batch holds {count} examples but {n} unit ids were collated with it.")
    out = []
    for start, stop in _unit_groups(unit_list, size):
        if packed_layout is None:
            sub = {k: v[start:stop] if k in structure.per_example else v for k, v in inputs.items()}
            sub_labels = labels[start:stop]
        else:
            spans = packed_layout.spans[start:stop]
            sub = {}
            for key, value in inputs.items():
                if key in structure.per_token:
                    sub[key] = torch.cat([value[r : r + 1, a:b] for r, a, b in spans], dim=1)
                elif key in structure.shared:
                    sub[key] = value
            sub_labels = torch.cat([labels[r : r + 1, a:b] for r, a, b in spans], dim=1)
            sub.update(flash_boundaries(inputs, structure.boundaries, [b - a for _, a, b in spans],
                                        labels.device))
        pieces = list(micro_batches(sub, sub_labels, stop - start, size=stop - start))
        if len(pieces) != 1:
            raise PackingError("Cutting a micro-batch at unit boundaries split a unit.")
        micro, micro_labels, examples = pieces[0]
        if examples is None and micro_labels.dim() < 2:
            raise PrivacyUnitError(
                "privacy_unit='user' needs one label per token (a language-modelling loss): the unit's "
                "examples are clipped together by regrouping every layer's tokens, which a sequence-level "
                "head (one output per row) does not have. Use privacy_unit='example' for this model."
            )
        rows, length = (examples.rows,
                        examples.length) if examples is not None else tuple(micro_labels.shape[:2])
        width = micro.get("attention_mask", micro.get("input_ids"))
        if examples is None and labels_along_tokens is False and isinstance(width,
                torch.Tensor) and width.dim() == 2:
            rows, length = tuple(width.shape)
        out.append((micro, micro_labels, UnitLayout.of(unit_list[start:stop], examples, rows, length)))
    return out


# ------------------------------------------------------------------------------------- trainer glue
def user_index_for(args: Any, dataset: Any) -> UserIndex | None:
    """The users of the training set when ``privacy_unit='user'`` (None at example level).

    At example level, a training set with an ``overflow_to_sample_mapping`` column (the tokenizer's
    ``return_overflowing_tokens=True``) is refused: it declares several rows (features) per example, and each
    row would be protected, not the example; the fix names the user-level run with the example's id as the
    unit."""
    if getattr(args, "privacy_unit", "example") != "user":
        names = getattr(dataset, "column_names", None)
        if isinstance(names, list) and OVERFLOW_COLUMN in names:
            raise PrivacyUnitError(
                f"The training set has a '{OVERFLOW_COLUMN}' column: the tokenizer split an example into "
                "several rows (return_overflowing_tokens=True, e.g. run_qa's doc_stride), and with "
                "privacy_unit='example' each row would be protected, not the example. Keep each row's "
                "example id (as run_qa does for its validation features: example_id = "
                "examples['id'][overflow_to_sample_mapping[i]]; the mapping itself counts from 0 in every "
                "batch of a batched map) and train with privacy_unit='user', user_id_column='example_id', "
                "max_examples_per_user=k (each example's features clipped as one vector; docs/tasks.md), or "
                "keep one row per example."
            )
        return None
    users = UserIndex.from_dataset(dataset, args.user_id_column)
    batch = args.logical_batch_size or args.per_device_train_batch_size * max(1, args.world_size)
    if batch > users.num_users:
        raise PrivacyUnitError(
            f"logical_batch_size={batch} users per step, but the training set has {users.num_users} users "
            f"(column '{users.column}', {len(users.unit_of)} examples): with privacy_unit='user' the logical "
            "batch counts users, and q = logical_batch_size / number of users must be <= 1. Lower "
            "logical_batch_size."
        )
    return users


def without_column(dataset: Any, column: str) -> Any:
    """The training set without the user column (the model never gets it; a collator may not accept
    strings)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and column in names:
        return dataset.remove_columns(column)
    if isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__"):
        return _DroppedKey(dataset, column)
    return dataset


class _DroppedKey(Dataset):
    def __init__(self, dataset: Any, key: str) -> None:
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        return {k: v for k, v in item.items() if k != self.key} if isinstance(item, dict) else item


def planned_dataset_size(trainer: Any) -> int | None:
    """The training-set size the trainer's plan was built from; at user level, also refuse a training set
    whose users differ from those the plan counted (the number of users and each example's user)."""
    users = getattr(trainer, "_user_index", None)
    if users is None:
        return trainer.privacy_plan.num_examples
    dataset = trainer.train_dataset
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == len(users.unit_of):
        if UserIndex.from_dataset(dataset, users.column) != users:
            raise PrivacyUnitError(
                "trainer.train_dataset's users changed after the DPTrainer was created: the privacy plan "
                "(number of users, sample rate, noise) was computed for the users at creation. Create a new "
                "DPTrainer."
            )
    return len(users.unit_of)


def describe_users(users: UserIndex, k: int) -> str:
    """The plan's line about the unit: its N, logical batch and q count users.

    Only the plan's public quantities: N (users, as N examples at example level) and k. Not the number of
    examples nor the largest user's count: adding or removing one user changes them by that user's own count,
    released without noise wherever the log goes."""
    return (f"  privacy unit: user (column '{users.column}'): N = {users.num_users} users, the logical batch "
            f"and q count users, at most k = {k} examples of a sampled user per step, each user's examples "
            "clipped as one vector")


def user_loading(users: UserIndex, dataset: Any, collate_fn: Callable) -> tuple[UnitTaggedDataset,
                                                                                UnitCollator]:
    """The (tagged) data set and the collator of a user-level run (the sampler is the factory's:
    ``hf_dpfilter.factory.make_sampler(plan, ..., users=...)``)."""
    if len(dataset) != len(users.unit_of):
        raise PrivacyUnitError(
            f"The training set has {len(dataset)} examples after the trainer's column removal but the user "
            f"column was read on {len(users.unit_of)}: do not filter the training set after creating the "
            "trainer."
        )
    # the structure of one example's collation, nothing private
    labels = collate_fn([dataset[0]]).get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() < 2:
        raise PrivacyUnitError(
            "privacy_unit='user' needs one label per token (a language-modelling loss): a user's examples "
            "are clipped together by regrouping every layer's tokens per user, which a sequence-level head "
            "(one label per example) does not allow. Use privacy_unit='example' for this model."
        )
    return UnitTaggedDataset(dataset, users.unit_of), UnitCollator(collate_fn)


def examples_layout(layout: PackedLayout | None) -> PackedLayout | None:
    """What the per-example loss sees: a unit layout's examples, or the layout itself."""
    return layout.examples_layout if isinstance(layout, UnitLayout) else layout


def as_examples(micro_batch: tuple) -> tuple:
    """A micro-batch with its unit layout replaced by its examples' layout (the first-step check compares each
    example with itself alone: the model must not couple examples, whatever the unit)."""
    micro, labels, layout = micro_batch
    return micro, labels, examples_layout(layout)


def card_section(report: dict[str, Any]) -> str:
    """The model card's privacy paragraph: the unit-level (epsilon, delta) of the run.

    Args:
        report: :meth:`DPTrainerMixin.privacy_report`'s dictionary.
    """
    unit = report.get("privacy_unit", "example")
    row = bool(report.get("row_is_unit"))
    # dp_row_is_unit: the guarantee is about rows, which the card must not call examples
    level = "row" if row and unit == "example" else unit
    lines = [
        "## Differential privacy",
        "",
        f"Trained with hf_dpfilter ({report.get('method')}): {level}-level (ε, δ) = "
        f"({report.get('epsilon'):.4g}, {report.get('delta'):.3g}) differential privacy, "
        f"neighbouring relation: {report.get('neighbouring_relation')}.",
        f"Privacy unit: {level}; number of units: {report.get('num_units')} (public); sample rate q over "
        f"{level}s: {report.get('unit_sample_rate'):.4g}; steps: {report.get('steps')}; clipping norm C per "
        f"{level}: {report.get('per_sample_max_grad_norm')}.",
        f"Noise multiplier σ: {report.get('noise_multiplier'):.4g}; accountant: {report.get('accountant')}; "
        f"expected logical (Poisson) batch: {report.get('logical_batch_size'):g} {level}s "
        "(`train_batch_size` in the hyperparameters is the micro-batch each step is computed in).",
    ]
    if unit == "user":
        lines.append(f"At most {report.get('max_examples_per_user')} examples of a sampled user per step.")
    if row:
        lines.append("A training row may hold several examples (declared with dp_row_is_unit=True): the "
                     "guarantee protects whole rows, not each example inside a row.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- reporting
def with_unit(report: dict[str, Any], unit: str, num_units: int | None, sample_rate: float | None,
              k: int | None, row_is_unit: bool = False) -> dict[str, Any]:
    """The privacy report with the entries that name the unit: the unit, the number of units, q over them, k,
    and the neighbouring relation in terms of the unit (the method's own relation, add/remove or replace).

    Args:
        report: the report's other entries (``neighbouring_relation`` in terms of one example).
        unit: ``privacy_unit``.
        num_units: N, the number of units (rows, or users).
        sample_rate: q over the units.
        k: ``max_examples_per_user`` (user level).
        row_is_unit: ``dp_row_is_unit``: the run declares each row the unit, whatever it holds
            (``row_is_unit`` is then in the report, and the relation says a row may hold several examples).
    """
    report = dict(report)
    report.update({"privacy_unit": unit, "num_units": num_units, "unit_sample_rate": sample_rate})
    relation = str(report.get("neighbouring_relation", "add/remove one example"))
    if unit == "user":
        report["max_examples_per_user"] = k
        whole = "one user (all of their rows; a row may hold several examples)" if row_is_unit else (
            "one user (all of their examples)")
        relation = relation.replace("one example", whole)
    elif row_is_unit:
        relation = relation.replace("one example", "one row (a row may hold several examples)")
    report["neighbouring_relation"] = relation
    if row_is_unit:
        report["row_is_unit"] = True
    return report
