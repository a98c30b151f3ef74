"""transformers' examples/pytorch/language-modeling/run_clm.py pattern: text files, ``group_texts`` into
blocks of ``block_size``, ``default_data_collator`` (the labels are a copy of the ids; the model shifts them).

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``. The privacy unit is
then a block of concatenated text, not a document (docs/choosing.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator

from hf_dpfilter import DPTrainer as Trainer
from hf_dpfilter import DPTrainingArguments as TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file with the training data."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file with held-out data."})
    block_size: int = field(default=16, metadata={"help": "Length of the blocks the concatenated texts are "
                                                          "cut into."})


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset("text", data_files=data_files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=["text"])
    block_size = data_args.block_size

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True, desc="Grouping texts in chunks of "
            f"{block_size}")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm_datasets["train"] if training_args.do_train else None,
        eval_dataset=lm_datasets["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if training_args.do_train:
        trainer.train()
    if training_args.do_eval:
        trainer.evaluate()
    return trainer
