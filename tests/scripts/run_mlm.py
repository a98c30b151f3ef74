"""transformers' examples/pytorch/language-modeling/run_mlm.py pattern: line-by-line texts, padded by
``DataCollatorForLanguageModeling`` which draws the masked positions at random for each example.

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``. ``--freeze`` (not
upstream) names parameters kept frozen; the tests freeze nothing (BERT's tied ``cls.predictions.bias``
trains).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
)

from hf_dpfilter import DPTrainer as Trainer
from hf_dpfilter import DPTrainingArguments as TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})
    freeze: list[str] = field(default_factory=list, metadata={"help": "Names of parameters to keep frozen."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file with the training data (one example per line)."})
    max_seq_length: int = field(default=32, metadata={"help": "Longer lines are truncated."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Ratio of tokens to mask."})


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    raw_datasets = load_dataset("text", data_files={"train": data_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForMaskedLM.from_pretrained(model_args.model_name_or_path)
    for name, param in model.named_parameters():
        if name in model_args.freeze:
            param.requires_grad_(False)

    def tokenize_function(examples):
        examples["text"] = [line for line in examples["text"] if len(line) > 0 and not line.isspace()]
        return tokenizer(examples["text"], padding=False, truncation=True,
                         max_length=data_args.max_seq_length,
                         return_special_tokens_mask=True)

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=["text"])

    data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer,
                                                    mlm_probability=data_args.mlm_probability)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized_datasets["train"],
        processing_class=tokenizer,
        data_collator=data_collator,
    )
    trainer.train()
    return trainer
