"""transformers' examples/pytorch/token-classification/run_ner.py pattern: words and tags, labels aligned to
the sub-word tokens with ``word_ids()`` (-100 on special tokens and later pieces of a word),
``DataCollatorForTokenClassification``.

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    HfArgumentParser,
)

from hf_dpfilter import DPTrainer as Trainer
from hf_dpfilter import DPTrainingArguments as TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A json file with `tokens` and `ner_tags` columns."})
    label_all_tokens: bool = field(default=False, metadata={"help": "Label every piece of a word, not only "
        "the first."})


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    raw_datasets = load_dataset("json", data_files={"train": data_args.train_file})
    label_list = sorted({tag for tags in raw_datasets["train"]["ner_tags"] for tag in tags})
    label_to_id = {label: i for i, label in enumerate(label_list)}
    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=len(label_list),
                                        label2id=label_to_id, id2label=dict(enumerate(label_list)))
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForTokenClassification.from_pretrained(model_args.model_name_or_path, config=config)

    def tokenize_and_align_labels(examples):
        tokenized_inputs = tokenizer(examples["tokens"], padding=False, truncation=True,
                                     is_split_into_words=True)
        labels = []
        for i, label in enumerate(examples["ner_tags"]):
            word_ids = tokenized_inputs.word_ids(batch_index=i)
            previous_word_idx = None
            label_ids = []
            for word_idx in word_ids:
                if word_idx is None:
                    label_ids.append(-100)
                elif word_idx != previous_word_idx:
                    label_ids.append(label_to_id[label[word_idx]])
                else:
                    label_ids.append(label_to_id[label[word_idx]] if data_args.label_all_tokens else -100)
                previous_word_idx = word_idx
            labels.append(label_ids)
        tokenized_inputs["labels"] = labels
        return tokenized_inputs

    with training_args.main_process_first(desc="train dataset map pre-processing"):
        train_dataset = raw_datasets["train"].map(tokenize_and_align_labels, batched=True,
                                                  remove_columns=raw_datasets["train"].column_names)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForTokenClassification(tokenizer),
    )
    trainer.train()
    return trainer
