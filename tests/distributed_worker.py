"""Worker for tests/distributed/test_ddp.py: a few DPTrainer steps on a tiny float64 RoBERTa.

Run as ``torchrun --nproc_per_node 2 tests/distributed_worker.py OUT METHOD:SIGMA [METHOD:SIGMA ...]`` (CPU,
gloo) or as a plain ``python`` process. For each configuration, each process saves its final parameters,
epsilon and steps to ``OUT/<method>_<sigma>/rank<r>.pt`` and calls the recipes' ``finish_run``, which writes
to the trainer's own ``OUT/<method>_<sigma>/trainer_rank<r>`` folder (only the main process may write
results there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the test folders mirror the package; workers import test modules by name, as the tests do
sys.path[:0] = [HERE] + sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                               if os.path.isdir(os.path.join(HERE, d))
                               and d not in ("scripts", "__pycache__"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))

from _common import DataArguments, ModelArguments, RecipeArgs, RunArguments, finish_run  # noqa: E402
from helpers import ListDataset, PadCollator, freeze_imported_objects, make_examples  # noqa: E402
from models import VOCAB, tiny_roberta  # noqa: E402

from hf_dpfilter import DPTrainer, DPTrainingArguments  # noqa: E402

N_EXAMPLES, LOGICAL_BATCH, MICRO, STEPS = 24, 8, 3, 4


def run(out: str, method: str, sigma: float) -> None:
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    model = tiny_roberta()  # float64, dropout off, seeded
    examples = make_examples(N_EXAMPLES, VOCAB, causal=False, seed=5)
    privacy = {} if method == "none" else {"noise_multiplier": sigma}
    if method == "diff2":
        # DIFF2 needs its difference threshold C2
        privacy["dp_method_args"] = {"difference_max_grad_norm": 5.0}
    args = DPTrainingArguments(
        output_dir=os.path.join(out, f"trainer_rank{rank}"),
        dp_method=method,
        logical_batch_size=LOGICAL_BATCH,
        per_device_train_batch_size=MICRO,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
        dp_seed=7,
        logging_steps=1,
        ddp_backend="gloo" if "RANK" in os.environ else None,
        disable_tqdm=True,
        **privacy,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    start = time.time()
    trainer.train()
    cli = RecipeArgs(model=ModelArguments(), data=DataArguments(),
                     run=RunArguments(no_plots=method != "dpsgd", save_model=False), task=argparse.Namespace(),
                     training={"output_dir": args.output_dir}, given=frozenset(), args_class=DPTrainingArguments)
    finish_run(trainer, cli, {"note": "distributed test"}, start, {"method": method}, title="distributed test")
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "epsilon": trainer.current_epsilon(),
            "steps": trainer.accountant.steps,
            "world_size": trainer.args.world_size,
            "wrapped": type(trainer.model_wrapped).__name__,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def main() -> None:
    torch.set_num_threads(1)
    freeze_imported_objects()
    out = sys.argv[1]
    for config in sys.argv[2:]:
        method, sigma = config.split(":")
        run(os.path.join(out, f"{method}_{sigma}"), method, float(sigma))


if __name__ == "__main__":
    main()
