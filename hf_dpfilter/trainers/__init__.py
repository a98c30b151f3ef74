"""The Hugging Face glue: thin subclasses of the stack's trainers and arguments.

* ``arguments``: :class:`DPTrainingArguments` and :class:`DPArgumentsMixin` (the DP fields, with ``help``).
* ``trainer``: :class:`DPTrainer` and :class:`DPTrainerMixin` (Trainer hooks around the DP optimizer).
* ``seq2seq``: :class:`DPSeq2SeqTrainer` and its arguments.
* ``sft``: :class:`DPSFTTrainer` and :class:`DPSFTConfig` for TRL.
* ``loss_scaling``: fp16 loss scaling under per-example clipping.
"""
