"""``DPSFTTrainer``: TRL's ``SFTTrainer`` trained with the DP glue of :class:`hf_dpfilter.DPTrainerMixin` (the
same as DPTrainer).

``DPSFTTrainer(DPTrainerMixin, SFTTrainer)``: TRL prepares the data (chat templates, prompt-completion,
assistant-only and completion-only labels, truncation to ``max_length``, PEFT, the padding-free collator);
everything that touches the privacy of training is the mixin's, shared with DPTrainer (Poisson sampling,
micro-batches, per-example losses and clipping, noise, accounting, the refusals), reached through the same
hooks (the MRO puts the mixin first:
``training_step``, ``get_train_dataloader``, ``compute_loss``, ``log``, ``create_optimizer``).

Three things differ from TRL's own training, each because TRL's choice would couple examples:

* the loss: each example's loss is its own mean token NLL over its unmasked (completion/assistant) tokens
  (DPTrainer's per-example loss); TRL's batch-level token mean and ``num_items_in_batch`` never apply;
* packing: the training set is not packed (:meth:`_prepare_dataset`); each step's Poisson sample is packed
  best-fit decreasing into micro-batches (:mod:`hf_dpfilter.trainers.sft.packing`, :meth:`_micro_batches`);
* the options that cannot be honoured per example are refused when the config or the trainer is created
  (:data:`hf_dpfilter.trainers.sft.config.SFT_FIELD_POLICIES`).
"""

from __future__ import annotations

from typing import Any

from trl import SFTTrainer

from hf_dpfilter.trainers.sft.config import DPSFTConfig, check_sft_fields
from hf_dpfilter.trainers.sft.packing import micro_batch_bins, pack_rows
from hf_dpfilter.trainers.trainer import DPTrainerMixin

__all__ = ["DPSFTTrainer"]

#: the column TRL's packing writes (the lengths of the examples packed in a row): a pre-packed data set
PACKED_COLUMN = "seq_lengths"


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with (epsilon, delta)-differential privacy; ``args`` must be a :class:`DPSFTConfig`.

    Same constructor as ``SFTTrainer`` (model or model name, ``train_dataset`` in any of TRL's formats,
    ``processing_class``, ``peft_config``, ``formatting_func``, ...). After ``train()``,
    :meth:`privacy_report` gives the epsilon spent.
    """

    def __init__(self, model: Any, args: DPSFTConfig | None = None, *rest: Any, **kwargs: Any) -> None:
        if not isinstance(args, DPSFTConfig):
            raise TypeError(
                f"DPSFTTrainer needs a DPSFTConfig as `args` (got {type(args).__name__}): it holds both "
                "TRL's SFT options and the DP settings. Replace SFTConfig(...) by DPSFTConfig(..., "
                "target_epsilon=...)."
            )
        train_dataset = kwargs.get("train_dataset", rest[1] if len(rest) > 1 else None)
        columns = getattr(train_dataset, "column_names", None) or []
        if PACKED_COLUMN in columns:
            raise ValueError(
                f"The training set has a '{PACKED_COLUMN}' column: it is already packed (several examples "
                "per row), so a packed row, not an example, would be the sampled and clipped unit. Pass the "
                "unpacked data set and packing=True: DPSFTTrainer samples the examples first and packs each "
                "step's sample."
            )
        super().__init__(model, args, *rest, **kwargs)
        check_sft_fields(self.args, "trainer")  # the values may have been changed after the config was built
        # TRL turns the MoE load-balancing loss on (output_router_logits) with router_aux_loss_coef or the
        # model's own coefficient: the DP mixin computes it per example with self.router_aux_loss_coef
        # (router_loss.py).

    # ------------------------------------------------------------------------------------------- data
    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, packing: bool,
                         formatting_func: Any,
                         dataset_name: str) -> Any:
        """TRL's preparation, without packing the training set: a packed row would become the sampled unit.

        The examples are truncated to ``max_length`` instead (TRL truncates whenever it does not pack), and
        each step's sample is packed in :meth:`_micro_batches`. Other columns (a user id column) are kept."""
        if dataset_name == "train":
            packing = False
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func,
                                        dataset_name)

    def _micro_batches(self, inputs: dict[str, Any], labels: Any, num_examples: int | None = None,
                       size: int | None = None):
        """With ``packing=True``: the step's sample packed best-fit decreasing,
        ``per_device_train_batch_size`` rows of at most ``max_length`` tokens per micro-batch (attention stays
        inside each example). Otherwise (and for the one-example micro-batches of the per-example checks)
        DPTrainer's micro-batches."""
        if size is not None or not self._packs_sample(labels):
            yield from super()._micro_batches(inputs, labels, num_examples, size)
            return
        for micro_batch, _members in self._packed_sample(inputs, labels, num_examples):
            yield micro_batch

    def _micro_batches_with_members(self, inputs: dict[str, Any], labels: Any,
                                    num_examples: int | None = None):
        """The micro-batches with the sample's examples each holds: with packing, the best-fit bins' examples
        in the order :func:`pack_rows` lays them out (row by row, each bin in the order of the sample)."""
        if not self._packs_sample(labels):
            return super()._micro_batches_with_members(inputs, labels, num_examples)
        return list(self._packed_sample(inputs, labels, num_examples))

    def _packs_sample(self, labels: Any) -> bool:
        # privacy_unit='user': DPTrainer cuts the micro-batches at user boundaries (a user's examples are
        # clipped as one vector); regrouping examples across users here would split them, so its micro-batches
        # are kept.
        per_example_unit = getattr(self.args, "privacy_unit", "example") == "example"
        return bool(self._training_batch_structure().packed and self.args.packing and labels.numel()
                    and per_example_unit)

    def _packed_sample(self, inputs: dict[str, Any], labels: Any, num_examples: int | None):
        structure = self._training_batch_structure()
        # all the sample's examples as one validated packed row (example count checked against the sampler's)
        (whole, whole_labels, layout), = structure.micro_batches(inputs, labels, labels.shape[-1] + 1,
                                                                 num_examples)
        capacity = self.args.max_length or max(layout.lengths)
        for bins in micro_batch_bins(layout.lengths, capacity, self.args.per_device_train_batch_size):
            yield pack_rows(structure, whole, whole_labels, layout, bins), tuple(i for b in bins for i in b)

    # ---------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """TRL adds token counts, accuracy and entropy of the training batches to the logs: computed from the
        private batches without noise, so left out unless ``dp_log_nonprivate_metrics``."""
        metrics = getattr(self, "_metrics", None)
        if metrics is not None and self.privacy_plan.is_private and not self.args.dp_log_nonprivate_metrics:
            metrics["train"].clear()
            # TRL logs its count of the *training* tokens seen with every evaluation too (eval_num_tokens): 0
            # here (the DP loop never calls TRL's training loss), never published, whichever loss counts them
            metrics.get("eval", {}).pop("num_tokens", None)
        super().log(logs, *args, **kwargs)
