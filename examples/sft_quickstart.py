"""The two-class switch of README.md ("DP supervised fine-tuning through TRL"), runnable offline on a CPU.

A tiny Llama built from a config and the library's byte-level chat tokenizer stand in for a Hub chat model;
with a Hub model pass its name as ``model`` and its tokenizer as ``processing_class`` instead.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: recipes.common

# --- README snippet begins
import datasets

from hf_dpfilter import DPSFTConfig, DPSFTTrainer  # was: from trl import SFTConfig, SFTTrainer
from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama  # offline stand-ins (repository root)

tokenizer = byte_level_chat_tokenizer()  # offline; or AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B")
model = small_llama(tokenizer)  # offline; or "Qwen/Qwen3-0.6B"
train = datasets.Dataset.from_list([
    {"messages": [{"role": "user", "content": f"name[Cafe {i}], food[Italian]"},
                  {"role": "assistant", "content": f"Cafe {i} serves Italian food."}]} for i in range(256)
])
args = DPSFTConfig(  # was: SFTConfig(...), with the same SFT options
    output_dir="outputs/sft-quickstart", assistant_only_loss=True, packing=True, max_length=128,
    num_train_epochs=1, learning_rate=1e-3, bf16=False, use_cpu=True, report_to=[],
    target_epsilon=8.0, logical_batch_size=32, per_device_train_batch_size=4,  # the DP settings
)
trainer = DPSFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
trainer.train()
print(trainer.privacy_report()["epsilon"])
# --- README snippet ends
