"""Worker for tests/data/test_units.py::test_two_processes_user_sensitivity (torchrun, 2 processes, CPU,
gloo).

Each process takes its users from :class:`~hf_dpfilter.data.units.UserPoissonBatchSampler` (q = 1: every user,
whole users per process), cuts its packed micro-batches at user boundaries and accumulates the clipped sums
(float32 GPT-2, noise 0); the sums are all-reduced. Four aggregates: with and without the victim user, clipped
per user and (negative control) per example. Rank 0 writes ``OUT/result.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# the test folders mirror the package; workers import test modules by name, as the tests do
sys.path[:0] = [HERE] + sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                               if os.path.isdir(os.path.join(HERE, d))
                               and d not in ("scripts", "__pycache__"))

from helpers import ListDataset, flat, freeze_imported_objects  # noqa: E402
from test_units import _extreme_user, _users, accumulate_packed_users  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from hf_dpfilter.data.units import UserIndex, UserPoissonBatchSampler  # noqa: E402
from hf_dpfilter.factory import make_private  # noqa: E402
from hf_dpfilter.plan import PrivacyPlan  # noqa: E402

CLIP, K, MICRO = 0.5, 3, 2


def aggregate(data: list[dict], per_example: bool, rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    from models import tiny_gpt2

    model = tiny_gpt2(dtype=torch.float32)
    plan = PrivacyPlan.for_optimizer(method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=CLIP,
                                     expected_batch_size=4.0, sample_rate=1.0, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=0.5,
                                        verify_first_backward=False)
    index = UserIndex.from_dataset(ListDataset(data), "user")
    batch_indices = next(iter(UserPoissonBatchSampler(index, 1.0, K, 1, seed=1, rank=rank, world_size=world)))
    examples = [{k: v for k, v in data[i].items() if k != "user"} for i in batch_indices]
    if examples:
        accumulate_packed_users(engine, optimizer, examples,
                                torch.tensor([index.unit_of[i] for i in batch_indices]),
                                MICRO, per_example)
    local = optimizer._local_sums()
    total = flat([local[p].detach().double() if p in local else torch.zeros_like(p, dtype=torch.float64)
                  for p in optimizer.params])
    dist.all_reduce(total)
    return total, [data[i]["user"] for i in batch_indices]


def data_sets() -> tuple[list[dict], list[dict]]:
    """D (with the victim user 99, in the middle) and D' (without)."""
    others, users = _users(5, [1, 3, 2, 4, 1], seed=1)
    d_prime = [{**e, "user": u} for e, u in zip(others, users)]
    d = d_prime[:4] + [{**e, "user": 99} for e in _extreme_user(K)] + d_prime[4:]
    return d, d_prime


def train_user_level(out: str) -> dict[str, torch.Tensor]:
    """One DPTrainer step at user level (q = 1, k = 3, noise 0, float64, packed micro-batches of 2 examples);
    under torchrun each process trains on its own users and the DP optimizer all-reduces."""
    from models import tiny_gpt2

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    model = tiny_gpt2()
    d, _ = data_sets()
    args = DPTrainingArguments(
        output_dir=out, dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=CLIP,
        logical_batch_size=6, per_device_train_batch_size=MICRO, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=7, disable_tqdm=True, privacy_unit="user", user_id_column="user",
        max_examples_per_user=K, ddp_backend="gloo" if "RANK" in os.environ else None,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(d),
                        data_collator=DataCollatorWithFlattening())
    assert trainer.args.world_size == int(os.environ.get("WORLD_SIZE", "1"))
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(out: str) -> None:
    freeze_imported_objects()
    params = train_user_level(os.path.join(out, "trainer"))  # sets up the gloo process group (DDP)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(params, os.path.join(out, f"trainer_rank{rank}.pt"))
    d, d_prime = data_sets()
    results = {}
    seen = {}
    for name, data in (("d", d), ("d_prime", d_prime)):
        for per_example in (False, True):
            total, mine = aggregate(data, per_example, rank, world)
            results[(name, per_example)] = total
            gathered = [None] * world
            dist.all_gather_object(gathered, sorted(set(mine)))
            seen[name] = gathered
    if rank == 0:
        whole = all(not (set(a) & set(b)) for a, b in [(seen["d"][0], seen["d"][1]), (seen["d_prime"][0],
                                                                                     seen["d_prime"][1])])
        result = {
            "clip": CLIP, "k": K,
            "moved_unit": float((results[("d", False)] - results[("d_prime", False)]).norm()),
            "moved_per_example": float((results[("d", True)] - results[("d_prime", True)]).norm()),
            "whole_users_per_process": whole,
            "victim_ranks": sum(99 in s for s in seen["d"]),
            "users_per_rank": [len(s) for s in seen["d"]],
        }
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
