"""TRL's trl/scripts/sft.py pattern: ``TrlParser`` over ScriptArguments, the SFT config and ModelConfig, the
model given by name, ``get_peft_config(model_args)`` (LoRA with ``--use_peft``).

The swap: ``SFTTrainer`` -> ``DPSFTTrainer``, ``SFTConfig`` -> ``DPSFTConfig``.
"""

from __future__ import annotations

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from hf_dpfilter import DPSFTConfig as SFTConfig
from hf_dpfilter import DPSFTTrainer as SFTTrainer


def main(argv: list[str] | None = None) -> SFTTrainer:
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)

    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    return trainer
