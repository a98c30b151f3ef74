"""transformers' examples/pytorch/text-classification/run_glue.py pattern: csv/json files,
DataCollatorWithPadding.

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
)

from hf_dpfilter import DPTrainer as Trainer
from hf_dpfilter import DPTrainingArguments as TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A csv or json file with the training data."})
    validation_file: str | None = field(default=None, metadata={"help": "A csv or json file with held-out "
        "data."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer sequences are truncated."})


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset(data_args.train_file.rsplit(".", 1)[-1], data_files=data_files)
    label_list = sorted(raw_datasets["train"].unique("label"))
    num_labels = len(label_list)

    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=num_labels,
                                        finetuning_task="sst2")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, config=config)
    label_to_id = {v: i for i, v in enumerate(label_list)}

    def preprocess_function(examples):
        result = tokenizer(examples["sentence"], padding=False, max_length=data_args.max_seq_length,
                           truncation=True)
        result["label"] = [label_to_id[label] for label in examples["label"]]
        return result

    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw_datasets = raw_datasets.map(preprocess_function, batched=True,
                                        desc="Running tokenizer on dataset")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=raw_datasets["train"] if training_args.do_train else None,
        eval_dataset=raw_datasets["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
    )
    if training_args.do_train:
        trainer.train()
    if training_args.do_eval:
        trainer.evaluate()
    return trainer
