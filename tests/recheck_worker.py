"""Worker for tests/adversarial/test_run_attacks.py: DPTrainer on a tiny float64 GPT-2 with left padding
(positions from the mask) and every micro-batch re-checked alone, in one process or two (``torchrun``, CPU,
gloo).

``python tests/recheck_worker.py OUT MODE [MODE]``, each MODE in ``OUT/MODE``: ``train``: 3 steps, each
process saves its parameters and how many re-checks it ran to ``rank<r>.pt``; ``refuse``: process 0 alone
registers a gradient hook before step 2 (a callback), so that it alone refuses while the other goes on to the
step's collectives.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the test folders mirror the package; workers import test modules by name, as the tests do
sys.path[:0] = [HERE] + sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                               if os.path.isdir(os.path.join(HERE, d))
                               and d not in ("scripts", "__pycache__"))

from helpers import LeftPadCollator, ListDataset, freeze_imported_objects, make_examples  # noqa: E402
from models import VOCAB, tiny_gpt2  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_dpfilter import DPTrainer, DPTrainingArguments  # noqa: E402


class HookOnRankZero(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1 and int(os.environ.get("RANK", "0")) == 0:
            self.trainer.model.lm_head.weight.register_hook(lambda grad: None)


def main() -> None:
    torch.set_num_threads(1)
    freeze_imported_objects()
    for mode in sys.argv[2:]:  # ``train refuse``: both in one launch (the refusal ends it)
        run(os.path.join(sys.argv[1], mode), mode)


def run(out: str, mode: str) -> None:
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    args = DPTrainingArguments(
        output_dir=os.path.join(out, f"trainer_rank{rank}"), dp_method="dpsgd", noise_multiplier=0.0,
        per_sample_max_grad_norm=1.0, logical_batch_size=8, per_device_train_batch_size=2, max_steps=3,
        optim="sgd",
        learning_rate=0.5, lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=3, dp_recheck_rate=1.0, disable_tqdm=True,
        ddp_backend="gloo" if "RANK" in os.environ else None, ddp_timeout=600,
    )
    model = tiny_gpt2()
    trainer = DPTrainer(model=model, args=args,
                        train_dataset=ListDataset(make_examples(16, VOCAB, True, seed=2)),
                        data_collator=LeftPadCollator())
    if mode == "refuse":
        trainer.add_callback(HookOnRankZero(trainer))
    trainer.train()
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "rechecks": trainer._separation.rechecks_run, "steps": trainer.accountant.steps},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
