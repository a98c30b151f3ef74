"""transformers' examples/pytorch/question-answering/run_qa.py pattern: SQuAD-style json,
``prepare_train_features`` (offsets -> start/end token positions, the CLS index for an answer outside the
span), ``DataCollatorWithPadding``.

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``; the per-example
start/end loss is built in (hf_dpfilter/losses/question_answering.py), ``remove_unused_columns`` stays at its
default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForQuestionAnswering,
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
    train_file: str = field(metadata={"help": "A json file with id, question, context and answers."})
    validation_file: str | None = field(default=None, metadata={"help": "The same for held-out data."})
    max_seq_length: int = field(default=48, metadata={"help": "Longer question+context pairs are truncated."})
    doc_stride: int = field(default=8,
                            metadata={"help": "Overlap of the chunks a long context is split into."})
    keep_example_id: bool = field(default=False, metadata={
        "help": "Keep each feature's example id (example_id), as run_qa does for its validation features: "
                "the user column of a run that protects examples, not features (--privacy_unit user "
                "--user_id_column example_id)."})


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset("json", data_files=data_files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForQuestionAnswering.from_pretrained(model_args.model_name_or_path)
    column_names = raw_datasets["train"].column_names

    def prepare_train_features(examples):
        examples["question"] = [q.lstrip() for q in examples["question"]]
        tokenized_examples = tokenizer(
            examples["question"], examples["context"], truncation="only_second",
            max_length=data_args.max_seq_length,
            stride=data_args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
            padding=False,
        )
        sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
        if data_args.keep_example_id:  # several features of one long context: one unit (docs/tasks.md)
            tokenized_examples["example_id"] = [examples["id"][i] for i in sample_mapping]
        offset_mapping = tokenized_examples.pop("offset_mapping")
        tokenized_examples["start_positions"] = []
        tokenized_examples["end_positions"] = []
        for i, offsets in enumerate(offset_mapping):
            input_ids = tokenized_examples["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id)
            sequence_ids = tokenized_examples.sequence_ids(i)
            answers = examples["answers"][sample_mapping[i]]
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            token_start_index = 0
            while sequence_ids[token_start_index] != 1:
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != 1:
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized_examples["start_positions"].append(cls_index)
                tokenized_examples["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized_examples["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized_examples["end_positions"].append(token_end_index + 1)
        return tokenized_examples

    with training_args.main_process_first(desc="train dataset map pre-processing"):
        features = raw_datasets.map(prepare_train_features, batched=True, remove_columns=column_names)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=features["train"],
        eval_dataset=features["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    trainer.train()
    if training_args.do_eval:
        trainer.evaluate()  # the model's own loss on the held-out features
    return trainer
