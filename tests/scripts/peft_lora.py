"""PEFT's quicktour pattern: ``LoraConfig(task_type=...)``, ``get_peft_model``,
``print_trainable_parameters``, then the Trainer; here a causal LM on text with
``DataCollatorForLanguageModeling(mlm=False)``.

The swap: ``Trainer`` -> ``DPTrainer``, ``TrainingArguments`` -> ``DPTrainingArguments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
)

from hf_dpfilter import DPTrainer as Trainer
from hf_dpfilter import DPTrainingArguments as TrainingArguments


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its Hub name."})
    train_file: str = field(metadata={"help": "A text file, one example per line."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})


def main(argv: list[str] | None = None) -> Trainer:
    script_args, training_args = HfArgumentParser((ScriptArguments,
                                                   TrainingArguments)).parse_args_into_dataclasses(
        args=argv)
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=script_args.lora_r,
                             lora_alpha=2 * script_args.lora_r, lora_dropout=0.1, target_modules=["c_attn"])
    model = get_peft_model(model, peft_config)
    model.print_trainable_parameters()

    dataset = load_dataset("text", data_files={"train": script_args.train_file})["train"]
    dataset = dataset.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=32),
                          batched=True,
                          remove_columns=["text"])
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    return trainer
