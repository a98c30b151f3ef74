"""Micro-batches of a logical batch: cut at example boundaries, packed or padded, each with its examples.

The logical batch of one DP step (a Poisson sample, possibly empty) is computed in micro-batches of at most
``per_device_train_batch_size`` examples, cut where the training collator's probed structure says an example
ends (:mod:`hf_dpfilter.proofs.batch_structure`): one row per example, or the segments of packed rows. The
methods here are a mixin of :class:`hf_dpfilter.trainers.trainer.DPTrainerMixin`; they read ``self.args``,
``self.engine`` and the training collator, and change nothing the privacy depends on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from hf_dpfilter.data import length_grouping
from hf_dpfilter.data import units as privacy_units
from hf_dpfilter.data.decoder_inputs import with_decoder_inputs
from hf_dpfilter.data.packing import PackedLayout, PackingError, check_attention_stays_inside_examples
from hf_dpfilter.data.row_checks import check_training_rows
from hf_dpfilter.proofs import collator_draws, padding
from hf_dpfilter.proofs.batch_structure import BatchStructure, probe_batch_structure, random_keys

logger = logging.getLogger(__name__)

__all__ = ["NUM_EXAMPLES_KEY", "RAW_EXAMPLES_KEY", "MicroBatchMixin", "dropout_keys"]

#: Key under which the training collator reports how many examples it collated (popped before the forward):
#: the number of examples a packed batch must hold, declared by the sampler's draw, not inferred from rows.
NUM_EXAMPLES_KEY = "_dp_num_examples"

#: Key under which the training collator passes the raw examples it collated, in order (popped before the
#: forward, in memory only, never logged): the per-example checks re-collate an example alone from its own row
#: (:mod:`hf_dpfilter.proofs.separation`).
RAW_EXAMPLES_KEY = "_dp_raw_examples"


class FreshRowsCollator:
    """Gives the collator its own copy of each row (a dict and its list values copied), so that a collator
    that changes its features in place (``f.pop("label")``, ``f["input_ids"].append(eos)``: harmless to the
    plain Trainer, whose rows are used once) leaves the row as sampled. The checks collate a row more than
    once (the probe collates copies of one row; the padding, packed-row and per-example checks collate each
    row alone after its batch) and re-collate the raw row kept with the batch: each must see the row as the
    data set gave it."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, rows: list) -> Any:
        return self.collate_fn([_fresh(row) for row in rows])


def _fresh(row: Any) -> Any:
    # data-set rows (datasets returns a new dict per access; a list data set does not)
    if isinstance(row, dict):
        return {k: list(v) if isinstance(v, list) else v for k, v in row.items()}
    return row


class EmptySafeCollator:
    """Collates a (possibly empty) list of examples; an empty batch keeps the keys with 0 rows.

    ``structure`` (the probed structure of ``collate_fn``, set by the trainer): without a per-example
    attention mask, each example is also collated alone and a batch padded beyond an example's own width is
    refused (:func:`hf_dpfilter.proofs.padding.check_padded_rows_have_a_mask`); with a mask nothing more is
    collated."""

    def __init__(self, collate_fn: Callable, dataset: Any, structure: BatchStructure | None = None,
                 check_rows: bool = False) -> None:
        self.collate_fn = collate_fn
        self.check_rows = check_rows  # transformers' own collator: rows must be model inputs
        self.dataset = dataset
        self.structure = structure

    def __call__(self, examples: list) -> dict[str, Any]:
        if len(examples) > 0:
            if self.check_rows:
                check_training_rows(examples)
            batch = self.collate_fn(examples)
            if padding.needs_alone_widths(self.structure):
                padding.check_padded_rows_have_a_mask(batch, [self.collate_fn([e]) for e in examples],
                                                      self.structure)
            return {**batch, NUM_EXAMPLES_KEY: len(examples), RAW_EXAMPLES_KEY: list(examples)}
        # Collate one real example for the structure, then keep zero rows of it: nothing private is used.
        template = self.collate_fn([self.dataset[0]])
        empty = {k: v[:0] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in template.items()}
        return {**empty, NUM_EXAMPLES_KEY: 0}


class LogicalBatchLoader(DataLoader):
    """A DataLoader over logical batches that forwards ``set_epoch`` to its Poisson sampler."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)


def check_sequence_length(model: nn.Module, inputs: dict[str, Any], packed: bool = False) -> None:
    """Clear error for sequences longer than the model's position embeddings (instead of an index error).

    ``packed``: a row holds several examples, each with its own positions; the longest example must fit, not
    the row (which holds the whole Poisson batch).
    """
    config = getattr(model, "config", None)
    ids = inputs.get("input_ids")
    if config is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return
    length = ids.shape[1]
    positions = inputs.get("position_ids")
    if packed and isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.numel():
        length = PackedLayout.from_position_ids(positions).max_length
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl"):
        limit -= (getattr(config, "pad_token_id", 1) or 0) + 1  # positions start after the padding index
    if length > limit:
        raise ValueError(
            f"A batch has sequences of length {length}, longer than the model's maximum of {limit} "
            f"positions (config.max_position_embeddings). Truncate in the tokenizer (truncation=True, "
            f"max_length={limit}) or lower max_seq_length."
        )


class MicroBatchMixin:
    """How a logical batch becomes micro-batches (a mixin of
    :class:`hf_dpfilter.trainers.trainer.DPTrainerMixin`)."""

    @property
    def packed_layout(self) -> PackedLayout | None:
        """The example boundaries of the packed micro-batch being computed (None: one example per row)."""
        return self._packed_layout

    @contextlib.contextmanager
    def _packed(self, layout: PackedLayout | None):
        """Declare a micro-batch's packing (or its absence) to the loss and the engine for the block."""
        # privacy_unit='user': the loss sees the examples, the engine the units (clipped as one vector each)
        previous, self._packed_layout = self._packed_layout, privacy_units.examples_layout(layout)
        try:
            with self.engine.packed(layout) if self.engine is not None else contextlib.nullcontext():
                yield
        finally:
            self._packed_layout = previous

    def _training_batch_structure(self) -> BatchStructure:
        """Which keys carry the example axis, probed on the training collator (see
        hf_dpfilter.proofs.batch_structure)."""
        if self._batch_structure is None:
            collator = getattr(self, "_padding_collator", None)
            if collator is not None:
                data = collator.dataset
                self._use_training_structure(
                    probe_batch_structure(collator.collate_fn, data[0], data[1] if len(data) > 1 else None)
                )
            else:
                self.get_train_dataloader()  # builds the training collator and probes it
        return self._batch_structure

    def _use_training_structure(self, structure: BatchStructure) -> None:
        """The probed structure, given to everything that checks the collated batches against it: the
        packed-row guard (every segment one whole sampled row) and the maskless-padding check of the training
        collator. Set wherever the structure is probed, so no collated batch passes unchecked after it."""
        self._batch_structure = structure
        collator = getattr(self, "_padding_collator", None)
        if collator is not None:
            collator.structure = structure
            if hasattr(collator.collate_fn, "structure"):  # proofs.row_segments.RowSegmentsGuard
                collator.collate_fn.structure = structure

    def _micro_batches(
        self, inputs: dict[str, Any], labels: torch.Tensor, num_examples: int | None = None,
        size: int | None = None
    ):
        """Micro-batches of at most ``per_device_train_batch_size`` examples: ``(inputs, labels, layout)``
        each.

        Cut at example boundaries: rows of the keys that carry the example axis (as probed on the collator),
        or the segments of packed rows (re-packed one row per micro-batch; ``layout`` says where each example
        is). Rows padded on the left get their positions from the mask, or are refused, and a causal LM's
        label predicted from a leading pad is ignored (hf_dpfilter.proofs.padding): on every micro-batch, so
        an example cut alone from one gets the same treatment.
        """
        size = size or self.args.per_device_train_batch_size
        structure = self._training_batch_structure()
        # a micro-batch cut again derives them again
        inputs = padding.without_derived_positions(inputs, structure)
        for micro, micro_labels, layout in structure.micro_batches(inputs, labels, size, num_examples):
            if layout is not None:
                yield micro, micro_labels, layout
                continue
            mask = micro.get("attention_mask") if "attention_mask" in structure.per_example else None
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
                # Drop trailing columns that are padding in every example of this micro-batch.
                used = int(mask.any(dim=0).nonzero().max().item()) + 1 if mask.any() else 1
                multiple = getattr(self.data_collator, "pad_to_multiple_of", None)  # declared by the collator
                if isinstance(multiple, int) and multiple > 1:
                    used = -(-used // multiple) * multiple
                decoder_side = _decoder_side(self.model)
                seq = mask.shape[1]
                wide = {k for k,
                        v in micro.items() if k in structure.per_example and isinstance(v, torch.Tensor)
                        and v.dim() >= 2 and v.shape[1] == seq
                        and not (decoder_side and k.startswith("decoder_"))}
                if used < seq and bool(mask[:, used:].eq(0).all()) and wide <= TOKEN_KEYS:
                    # only the keys declared to run along the tokens are cut; another key as wide as the row
                    # (a feature vector of 8 values in a row padded to 8) keeps the whole micro-batch at its
                    # width
                    original = micro
                    micro = {k: v[:, :used] if k in wide else v for k, v in micro.items()}
                    if micro_labels.dim() >= 2 and micro_labels.shape[1] == seq and not decoder_side:
                        # cut the labels with the columns only when the head declares them per token; a head
                        # of undeclared kind keeps the row's width (its padding stays masked, as in the whole
                        # batch)
                        along = padding.labels_along_tokens(self.model, self.label_names)
                        if along is None:
                            micro = original
                        elif along:
                            micro_labels = micro_labels[:, :used]
            if getattr(self, "_causal_lm", False):  # no target predicted from a leading pad (as alone)
                micro_labels = padding.causal_labels(micro, micro_labels, structure)
            if _decoder_side(self.model):  # the decoder attends to a left-padded target's pads
                padding.check_decoder_labels_not_left_padded(self.data_collator)
            # built here, as the model would from the labels kept out of its forward (per row, or refused)
            micro = with_decoder_inputs(self.model, micro, micro_labels)
            yield padding.with_positions(self.model, micro, micro_labels, structure), micro_labels, None

    def _no_cache_when_packed(self, micro_batch: tuple) -> tuple:
        """Packed rows: ``use_cache=False``. transformers keeps attention inside each packed example only when
        no cache is passed (``masking_utils``: packed sequences are detected from ``position_ids`` when there
        are no past key values); a causal LM with ``config.use_cache`` would create an empty cache in its
        forward and let every example attend to those before it in the row."""
        micro, micro_labels, layout = micro_batch
        if layout is not None and hasattr(getattr(self.model, "config", None), "use_cache"):
            micro = {**micro, "use_cache": False}
        return micro, micro_labels, layout

    def _check_packed_attention(self, model: nn.Module) -> None:
        """Before the first packed step: prove on synthetic tokens that attention stays inside each example,
        with the inputs a packed micro-batch gets (``use_cache=False``, see :meth:`_no_cache_when_packed`)."""
        probe = {"position_ids": torch.zeros(1, 1, dtype=torch.long)}
        extra, _, _ = self._no_cache_when_packed((probe, None, PackedLayout(((0, 0, 1),), 1, 1)))
        extra = {k: v for k, v in extra.items() if k != "position_ids"}
        proven = check_attention_stays_inside_examples(model, self._training_batch_structure().position_start,
                                                       extra)
        if not proven and not self.args.dp_verify_first_step:
            raise PackingError(
                f"Packed rows with a model ({type(model).__name__}) on which the synthetic-token probe "
                "cannot run (no vocabulary size in get_input_embeddings() or config.vocab_size, or not one "
                "output per token), and dp_verify_first_step=False: nothing would show that its attention "
                "keeps the examples of a row apart. Keep dp_verify_first_step=True (the per-example check "
                "then compares each example with itself alone), or use a padding collator (one example per "
                "row)."
            )
        self._packing_checked = True

    def _micro_batches_with_members(
        self, inputs: dict[str, Any], labels: torch.Tensor, num_examples: int | None = None
    ) -> list[tuple[tuple, tuple[int, ...]]]:
        """The micro-batches of :meth:`_micro_batches`, each with the indices (into the logical batch's
        examples, the order the collator got them) of the examples it holds, in the micro-batch's own order.

        :meth:`_micro_batches` cuts rows, or packed segments, in order (``BatchStructure.micro_batches``), so
        each micro-batch holds the next ``count`` examples; a subclass that regroups the examples
        (DPSFTTrainer's best-fit packing) overrides this with the groups it made."""
        out, start = [], 0
        for micro_batch in self._micro_batches(inputs, labels, num_examples):
            count = _example_count(micro_batch)
            out.append((micro_batch, tuple(range(start, start + count))))
            start += count
        return out

    def _cut_logical_batch(
        self, inputs: dict[str, Any], labels: torch.Tensor, num_examples: int | None,
        units: torch.Tensor | None,
        raw: list | None,
    ) -> list[tuple[tuple, list | None]]:
        """The logical batch's micro-batches, each with the raw examples it holds in its own order (None
        without ``raw``, the rows the training collator attached): see :meth:`_micro_batches_with_members`;
        with ``privacy_unit='user'`` cut at unit boundaries (``unit_micro_batches``: consecutive groups, in
        order). With ``dp_group_by_length`` the examples are first ordered by length
        (:meth:`_grouped_by_length`), except in a step whose examples are each computed alone
        (:meth:`_each_example_alone`): there no micro-batch of several is computed, so none is collated (it
        was, and then dropped)."""
        alone = raw is not None and units is None and self._examples_alone_wanted()
        cut, grouped_raw = (None, None) if alone else self._grouped_by_length(inputs, labels, num_examples,
                                                                              units, raw)
        # user level: the units moved whole, the logical batch collated in the new order
        if grouped_raw is not None:
            raw = grouped_raw
            inputs, labels, units = self._collated(raw)
        if cut is None and units is None:
            cut = self._micro_batches_with_members(inputs, labels, num_examples)
        elif cut is None:
            cut, start = [], 0
            for micro_batch in privacy_units.unit_micro_batches(
                self._training_batch_structure(), self._micro_batches, inputs, labels, units,
                self.args.per_device_train_batch_size,
                padding.labels_along_tokens(self.model, self.label_names),
            ):
                count = _example_count(micro_batch)
                cut.append((micro_batch, tuple(range(start, start + count))))
                start += count
        if raw is not None and sum(len(members) for _, members in cut) != len(raw):
            raise PackingError(f"The micro-batches hold {sum(len(m) for _, m in cut)} examples; {len(raw)} "
                               "were collated.")
        out = [(self._no_cache_when_packed(micro_batch), None if raw is None else [raw[i] for i in members])
               for micro_batch, members in cut]
        return self._each_example_alone(out, raw is not None and units is None)

    #: ``accumulate``'s keyword for this step's micro-batches: ``{"alone": True}`` when each was collated
    #: alone
    _alone_declaration: dict[str, bool] = {}

    def _each_example_alone(self, cut: list[tuple[tuple, list | None]],
                            possible: bool) -> list[tuple[tuple, list | None]]:
        """When the optimizer asks for it (DIFF2's batch-invariant difference rounds,
        ``wants_examples_alone``), every example of the step as a micro-batch of its own, collated from its
        raw row alone (:meth:`_alone`, keeping the batch's draws of the collator's random keys), and declared
        so to ``accumulate``: its arithmetic then reads no other example. Without raw rows, or with user-level
        units, the micro-batches stay as cut and nothing is declared (the optimizer then falls back to
        float64)."""
        alone = possible and self._examples_alone_wanted()
        self._alone_declaration = {"alone": True} if alone else {}
        if not alone:
            return cut
        return [(self._alone(one, micro_batch, i), [one]) for micro_batch, raws in cut for i,
                one in enumerate(raws)]

    def _examples_alone_wanted(self) -> bool:
        """Whether the optimizer asks for this step's examples each alone
        (``DPOptimizer.wants_examples_alone``)."""
        optimizer = getattr(self, "dp_optimizer", None)
        return optimizer is not None and optimizer.wants_examples_alone()

    def _grouped_by_length(self, inputs: dict[str, Any], labels: torch.Tensor, num_examples: int | None,
                           units: torch.Tensor | None, raw: list | None) -> tuple[list | None, list | None]:
        """``dp_group_by_length``: the logical batch's examples ordered longest first
        (hf_dpfilter/data/length_grouping.py), as ``(cut, raw)``; ``(None, None)`` where the sampled order is
        kept (the option off, no raw rows, packed rows, which have no padding, nothing that declares a length,
        or nothing that moves).

        At example level each micro-batch is collated from its own raw examples by the training collator
        (padded to its own longest, on its own padding side and ``pad_to_multiple_of``), then cut as one
        micro-batch: ``cut`` holds each with the indices of its examples in ``raw``, so the per-micro-batch
        proofs index rows, raw examples and draws by the same positions (``raw`` None: unchanged). With
        ``privacy_unit='user'`` (``cut`` None) the units move whole, and ``raw`` comes back in the new order
        for the caller to collate and cut at unit boundaries (their trailing padding trimmed per micro-batch,
        as in the sampled order); the run's first step keeps the sampled order there (its first micro-batch is
        the first-step check's, see below; "first": until this trainer releases a step, in a resumed run too).

        The micro-batches are the training collator's on the raw rows: the logical batch is still held to the
        probed keys first, and one whose keys differ from its micro-batches' (a ``training_step`` override
        that adds a key) keeps the sampled order; a subclass that edits the collated values in
        ``training_step`` should set ``dp_group_by_length=False``."""
        structure = self._training_batch_structure()
        if not getattr(self.args, "dp_group_by_length", False) or raw is None or len(raw) < 2:
            return None, None
        if structure.packed:
            self._budget_not_applied("the training batches are packed rows (no padding to group; the packing "
                                     "sets the tokens of a micro-batch)")
            return None, None
        structure.check({**inputs, "labels": labels})  # the logical batch's keys, as in the sampled order
        if labels.shape[0] != len(raw) or num_examples not in (None, len(raw)):
            return None, None  # the sampled order's path names the mismatch
        lengths = length_grouping.example_lengths(inputs, raw, structure.per_example)
        if lengths is None or len(lengths) != len(raw):
            self._budget_not_applied("the training batches declare no length (no attention_mask among the "
                                     "per-example keys, no input_ids in the raw rows)")
            return None, None
        # The run's first micro-batch (the one the first-step check verifies) holds the first sampled
        # examples, as in the sampled order: examples of mixed lengths, where a loss coupled through a
        # statistic of the micro-batch (its mean token count) shows; a micro-batch of equal lengths could hide
        # it. The rest is grouped. Decided by the run (until this trainer releases a first step), not by the
        # check's setting: the same micro-batches (and collator draws) with the checks on or off, and in a
        # train() run again after a refusal. A run resumed from a checkpoint is a fresh trainer whose
        # first-step check is still pending: its steps are counted from the restored accountant's, not from 0,
        # so its first micro-batch is sampled too.
        accountant = getattr(self, "accountant", None)
        steps = getattr(accountant, "steps", 0) if accountant is not None else 0
        plan = getattr(self, "privacy_plan", None)
        if plan is not None and not plan.is_private:
            # the null plan (dp_method="none") accounts no step: its released steps are the trainer's (by
            # the accountant's count every step stayed "first", and each step's lead micro-batch was padded
            # to its longest sampled example)
            steps = self.state.global_step
        if getattr(self, "_sampled_lead_until", None) is None:
            self._sampled_lead_until = steps  # the steps released before this trainer's first cut
        checking = steps == self._sampled_lead_until
        budget = getattr(self.args, "dp_micro_batch_tokens", None)
        if budget is not None and _decoder_side(self.model):  # the budget bounds the decoder's tokens too
            lengths = length_grouping.with_target_lengths(lengths, raw)
        order = length_grouping.longest_first(lengths,
                                              None if units is None else [int(u) for u in units.tolist()])
        if units is not None:
            return None, (None if checking or order == sorted(order) else [raw[i] for i in order])
        size = self.args.per_device_train_batch_size
        # the padded widths the budget bounds
        multiple = getattr(self.data_collator, "pad_to_multiple_of", None)
        if budget is not None and isinstance(multiple, int) and multiple > 1:
            lengths = [-(-n // multiple) * multiple for n in lengths]
        lead = length_grouping.micro_batch_groups(range(len(raw)), lengths, size,
                                                  budget)[0] if checking else []
        # the first-step check needs two examples to compare
        if checking and budget is not None and len(lead) < 2:
            lead = [0, 1]  # over the budget if need be, for the run's first micro-batch only
        if budget is None and len(set(lengths)) == 1:
            # one length (fixed-length blocks): nothing moves nor is padded, the sampled cut is the same,
            # collated once (not when only the order holds: a left-padded micro-batch cut from the batch keeps
            # its leading pads)
            return None, None
        groups = [lead] if lead else []
        groups += length_grouping.micro_batch_groups([i for i in order if i >= len(lead)], lengths, size,
                                                     budget)
        cut = []
        for members in groups:
            micro_inputs, micro_labels, _ = self._collated([raw[i] for i in members])
            if set(micro_inputs) != set(inputs):
                return None, None
            pieces = list(self._micro_batches(micro_inputs, micro_labels, len(members), size=len(members)))
            if len(pieces) != 1 or _example_count(pieces[0]) != len(members):
                raise PackingError(f"{len(members)} examples collated together did not give one micro-batch "
                                   "of them.")
            cut.append((pieces[0], tuple(members)))
        return cut, None

    def _budget_not_applied(self, why: str) -> None:
        """Warn once that ``dp_micro_batch_tokens`` is set but does not cut these batches, and why."""
        if getattr(self.args, "dp_micro_batch_tokens", None) is not None and not getattr(self,
                "_budget_warned", False):
            self._budget_warned = True
            logger.warning("dp_micro_batch_tokens is not applied: %s.", why)

    def _collated(self, rows: list) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
        """``rows`` collated by the training collator (its checks included) and prepared as a training step's
        inputs: ``(inputs, labels, units)``."""
        batch = dict(self._padding_collator(rows))
        batch.pop(RAW_EXAMPLES_KEY, None)
        if rows:
            batch = self._keyed_collator_draws(batch, rows, regroup=True)
        inputs = dict(self._prepare_inputs(batch))
        inputs.pop(NUM_EXAMPLES_KEY, None)
        units = inputs.pop(privacy_units.UNITS_KEY, None)
        return inputs, inputs.pop("labels"), units

    def _collator_row_seeds(self, rows: list) -> tuple[list[int], tuple[int, int]]:
        """Each row's seed of the collator's draws at this step, and the step's two probe seeds."""
        from hf_dpfilter.randomness.example_keys import example_digest

        optimizer = getattr(self, "dp_optimizer", None)
        randomness = getattr(optimizer, "example_randomness", None)
        if randomness is None:  # no DP optimizer yet (a probe): the draws of a fixed secret-free seed
            return [0] * len(rows), (1, 2)
        step = optimizer.accountant.steps
        seeds = [randomness.row_seed(step, "collator", example_digest(row)) for row in rows]
        probe = randomness.step_seed(step, "collator-probe")
        return seeds, (probe, probe ^ 1)

    def _keyed_collator_draws(self, batch: dict[str, Any], rows: list, regroup: bool = False) -> dict[str,
                                                                                                      Any]:
        """``batch`` with a random collator's draws each example's own
        (hf_dpfilter.proofs.collator_draws.keyed_draws):
        the logical batch of a step, and each micro-batch collated again from its rows (``regroup``: skipped
        when the step's logical batch showed no key drawn at random, as the two collations of its rows
        compare)."""
        collator: EmptySafeCollator = self._padding_collator
        step = getattr(getattr(getattr(self, "dp_optimizer", None), "accountant", None), "steps", None)
        if regroup and getattr(self, "_deterministic_collation_step", None) == step:
            return batch
        seeds, probe = self._collator_row_seeds(rows)
        side = declared_padding_side(self.data_collator, getattr(self, "processing_class", None))
        spans = None
        positions = batch.get("position_ids")
        if self._training_batch_structure().packed and isinstance(positions,
                                                                  torch.Tensor) and positions.dim() == 2:
            spans = PackedLayout.from_position_ids(positions).spans
        keyed = collator_draws.keyed_draws(collator.collate_fn, batch, rows, seeds, side, probe, spans)
        if not regroup:  # the logical batch: whether this step's collations draw anything at random
            self._deterministic_collation_step = step if keyed is batch else None
        return keyed

    def _alone(self, raw: Any, micro_batch: tuple | None = None, index: int = 0,
               each_row: bool = False) -> tuple:
        """One raw example as the trainer would compute it as a batch of one: the training collator on that
        row alone, ``_prepare_inputs``, then the micro-batch path with one example (its own padding, positions
        and packing; never a row sliced out of a collated batch). With ``micro_batch`` (the example is its
        ``index``-th), the keys the collator draws at random keep the example's draw in it, cropped to its own
        width (hf_dpfilter.proofs.collator_draws): the keys the probe found random, and with ``each_row``
        those this row shows random too (copies collated under several seeds, tens of ms on CPU for a few
        hundred tokens: the first-step check, and a re-check only on a mismatch). The collation alone runs on
        forked random streams, so the checks draw nothing from the run's (nor from the collator's own
        generator)."""
        collator: EmptySafeCollator = self._padding_collator
        structure = self._training_batch_structure()
        drawn = set(structure.random)  # the keys the probe found drawn at random
        (seed,), _ = self._collator_row_seeds([raw])
        # its draws as in its batch (keyed_draws)
        with collator_draws.seeded_streams(collator.collate_fn, seed):
            collated = collator.collate_fn([raw])
            if micro_batch is not None and each_row:  # the keys drawn at random, also as this row shows them
                drawn |= random_keys(collator.collate_fn, raw,
                                     set(structure.per_example | structure.per_token))
        inputs = dict(self._prepare_inputs(collated))
        inputs.pop(privacy_units.UNITS_KEY, None)  # the check compares examples, whatever the unit
        labels = inputs.pop("labels")
        if micro_batch is not None:
            inputs, labels = collator_draws.with_batch_draws(structure, inputs, labels, micro_batch, index,
                                                             drawn)
        pieces = list(self._micro_batches(inputs, labels, 1, size=1))
        if len(pieces) != 1 or _example_count(pieces[0]) != 1:
            raise PackingError("One example collated alone did not give one micro-batch of one example.")
        return self._no_cache_when_packed(pieces[0])

    def _first_check_examples(self) -> int:
        """How many examples the first-step check waits for in a micro-batch: two (a coupling needs two), one
        only when no micro-batch can hold two: ``per_device_train_batch_size=1`` without
        ``dp_micro_batch_tokens`` (a token budget fills a micro-batch with short examples whatever the
        size)."""
        if getattr(self.args, "dp_micro_batch_tokens", None) is not None:
            return 2
        return min(2, self.args.per_device_train_batch_size)

    def _padding_micro_batch(self) -> tuple[dict[str, Any], torch.Tensor]:
        """One training example as a micro-batch, for a process with no example of its own under FSDP2.

        Its forward and backward only keep the processes' collectives in step; the result is discarded.
        """
        collator: EmptySafeCollator = self._padding_collator
        inputs = dict(self._prepare_inputs(collator.collate_fn([collator.dataset[0]])))
        inputs.pop(privacy_units.UNITS_KEY, None)
        labels = inputs.pop("labels")
        return self._no_cache_when_packed(next(iter(self._micro_batches(inputs, labels, 1))))


def _decoder_side(model: Any) -> bool:
    """Whether the model is an encoder-decoder (declared by its config): its ``decoder_*`` tensors and its
    labels run along the decoder's tokens, not the encoder's ``attention_mask`` columns, even when the two
    lengths are equal by chance (a batch's longest source as long as its longest target); cutting them to the
    encoder's used width would drop target tokens of the batch that the example alone keeps."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


#: The model inputs that run along the tokens (one column per token), cut with a micro-batch's padding
#: columns.
TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids",
                        "special_tokens_mask",
                        "inputs_embeds", "mm_token_type_ids"})


def _example_count(micro_batch: tuple) -> int:
    """The number of examples of a micro-batch: its rows, or its layout's examples (a unit layout's
    members)."""
    _, labels, layout = micro_batch
    if layout is None:
        return labels.shape[0]
    return getattr(layout, "num_member_examples", layout.num_examples)


def declared_padding_side(collator: Any, processing_class: Any = None) -> str:
    """The side the training rows are padded on, as declared: the collator's ``padding_side`` or its
    tokenizer's (through the wrappers), else the trainer's processing class's; ``"right"`` when nothing
    declares one."""
    seen, todo = set(), [collator]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        side = getattr(obj, "padding_side", None)
        if side in ("left", "right"):
            return side
        todo.extend(getattr(obj, name, None) for name in ("tokenizer", "processing_class", "collate_fn",
                                                          "data_collator", "collator"))
    side = getattr(processing_class, "padding_side", None) or getattr(
        getattr(processing_class, "tokenizer", None), "padding_side", None)
    return side if side in ("left", "right") else "right"


def dropout_keys(micro_batch: tuple, raws: list | None, model: Any, side: str) -> dict[str, Any]:
    """``accumulate``'s keywords that key each row's dropout to its example
    (hf_dpfilter/randomness/example_keys.py):
    the raw rows the micro-batch holds, in its order, and the run's declared padding side (fixed for the run,
    so an example's indices are the same in every micro-batch and alone), which the attention mask must agree
    with; or no keys, with the reason a dropout draw is then refused for.

    Args:
        micro_batch: ``(inputs, labels, layout)``.
        raws: the micro-batch's raw examples, one per row (None: the batches carry no raw rows).
        model: the trained model (an encoder-decoder's left-padded sources cannot be keyed).
        side: the declared padding side (:func:`declared_padding_side`).
    """
    micro, _, layout = micro_batch
    if raws is None:
        return {"unkeyed_reason": "the training batches carry no raw rows (a get_train_dataloader of one's "
                                  "own)"}
    if layout is not None and (not isinstance(layout, privacy_units.UnitLayout) or layout.packed_rows):
        return {"unkeyed_reason": "the micro-batch packs several examples into one row, so a row's mask "
                                  "cannot be one example's"}
    if side == "left" and _decoder_side(model):
        return {"unkeyed_reason": "an encoder-decoder's sources are padded on the left and its targets on "
                                  "the right (the two axes of cross-attention count from different sides); "
                                  "pad on the right"}
    mask = micro.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 0 and not bool(mask.all()):
        wrong = mask[:, 0] if side == "right" else mask[:, -1]
        if bool((wrong == 0).any()):
            return {"unkeyed_reason": f"its rows are padded on the {'left' if side == 'right' else 'right'} "
                                      f"while the collator declares padding_side={side!r}; declare the side "
                                      "it pads on"}
    return {"example_keys": raws, "padding_side": side}
