"""Scripts written in the style of the Hugging Face stack's fine-tuning examples, made private by the
two-class swap.

Each mirrors one upstream example's pattern (``HfArgumentParser`` over its dataclasses, the same
preprocessing, collator, Trainer class and loss) with ``Trainer``/``TrainingArguments`` swapped for their DP
versions and nothing else private in the script: the DP settings come in as command-line flags. ``main(argv)``
runs in-process and returns the trainer, so that tests/trainers/test_upstream_scripts.py can run them quickly
on tiny models and a handful of local examples.
"""
