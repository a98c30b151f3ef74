"""transformers' examples/pytorch/summarization/run_summarization.py pattern: json with text/summary,
``text_target`` labels with the pad token replaced by -100, ``DataCollatorForSeq2Seq``, ``Seq2SeqTrainer``
with ``predict_with_generate``.

The swap: ``Seq2SeqTrainer`` -> ``DPSeq2SeqTrainer``, ``Seq2SeqTrainingArguments`` ->
``DPSeq2SeqTrainingArguments``. ``--lora_r`` (not upstream) trains LoRA adapters on q and v; the tests
fine-tune T5 fully (its relative position bias included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser

from hf_dpfilter import DPSeq2SeqTrainer as Seq2SeqTrainer
from hf_dpfilter import DPSeq2SeqTrainingArguments as Seq2SeqTrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on q and v (0: full fine-tuning)."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A json file with `text` and `summary` columns."})
    validation_file: str | None = field(default=None, metadata={"help": "The same for held-out data."})
    max_source_length: int = field(default=32, metadata={"help": "Longer sources are truncated."})
    max_target_length: int = field(default=8, metadata={"help": "Longer targets are truncated."})
    source_prefix: str = field(default="", metadata={"help": "A prefix added to every source (T5: "
        "'summarize: ')."})


def main(argv: list[str] | None = None) -> Seq2SeqTrainer:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset("json", data_files=data_files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    if model_args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=model_args.lora_r, lora_alpha=2 * model_args.lora_r,
                                                 target_modules=["q", "v"], lora_dropout=0.0))

    def preprocess_function(examples):
        inputs = [data_args.source_prefix + text for text in examples["text"]]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding=False,
                                 truncation=True)
        labels = tokenizer(text_target=examples["summary"], max_length=data_args.max_target_length,
                           truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    with training_args.main_process_first(desc="dataset map pre-processing"):
        tokenized = raw_datasets.map(preprocess_function, batched=True, remove_columns=["text", "summary"])

    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        preds = [[t for t in row if t >= 0] for row in preds]
        decoded = tokenizer.batch_decode(preds, skip_special_tokens=True)
        return {"gen_len": sum(len(d.split()) for d in decoded) / max(len(decoded), 1)}

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
    )
    trainer.train()
    if training_args.do_eval:
        trainer.evaluate(max_length=training_args.generation_max_length,
                         num_beams=training_args.generation_num_beams)
    return trainer
