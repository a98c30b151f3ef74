"""Worker for tests/distributed/test_fsdp.py: DP training of a tiny float64 RoBERTa sharded with FSDP2
(``fully_shard``).

``torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT CONFIG [...]`` shards the model as Accelerate's FSDP2
preparation does (one unit per transformer layer, then the root) and runs the DP optimizer and the clipping
engine on it over gloo; as a plain ``python`` process the same code trains the unsharded model on all examples
(the one-process reference). CONFIG is ``METHOD:SIGMA`` (a few DP steps; each process saves the whole
parameters, gathered from the shards, epsilon and steps to ``OUT/<method>_<sigma>/rank<r>.pt``) or ``noise`` /
``secure_rng`` (three released steps of pure noise; each process saves its shards of every update).

``trainer`` as the first CONFIG runs the same steps through ``DPTrainer`` instead (``accelerate launch
--config_file accelerate_configs/fsdp.yaml``; Accelerate enables FSDP only on GPUs).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
# the test folders mirror the package; workers import test modules by name, as the tests do
sys.path[:0] = [HERE] + sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                               if os.path.isdir(os.path.join(HERE, d))
                               and d not in ("scripts", "__pycache__"))

from helpers import ListDataset, PadCollator, freeze_imported_objects, make_examples  # noqa: E402
from models import VOCAB, tiny_roberta  # noqa: E402

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine, make_dp_optimizer  # noqa: E402
from hf_dpfilter.distributed.collectives import is_sharded  # noqa: E402
from hf_dpfilter.losses.tasks import per_example_loss  # noqa: E402

N_EXAMPLES, LOGICAL_BATCH, MICRO, STEPS, LR = 24, 8, 3, 4, 0.5
METHOD_ARGS = {
    "disk": {"gamma": 0.5},  # two parameter points (x_t and the look-ahead) per example
    "pmlf": {"k": 2},  # x_t and x_{t-1}
    "diff2": {"difference_max_grad_norm": 5.0, "restart_every": 2},  # difference rounds (weights +1, -1)
    "dicesgd": {"error_max_grad_norm": 0.05},
}


def whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if is_sharded(param) else param


def local(param: torch.Tensor) -> torch.Tensor:
    return param.detach().to_local() if is_sharded(param) else param.detach()


def shard(model: nn.Module) -> None:
    """FSDP2 as Accelerate's TRANSFORMER_BASED_WRAP applies it: each transformer layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.roberta.encoder.layer:
        fully_shard(layer)
    fully_shard(model)


def run(out: str, method: str, sigma: float) -> None:
    """STEPS DP steps on fixed logical batches; under torchrun each process takes every world-th example."""
    os.makedirs(out, exist_ok=True)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = tiny_roberta()  # float64, dropout off, seeded
    if world > 1:
        shard(model)
    engine = GhostClippingEngine(model)
    privacy = {} if method == "none" else {"noise_multiplier": sigma, "per_sample_max_grad_norm": 0.1,
                                           "expected_batch_size": LOGICAL_BATCH,
                                           "sample_rate": LOGICAL_BATCH / N_EXAMPLES, "seed": 7}
    optimizer = make_dp_optimizer(model.parameters(), base=torch.optim.SGD, method=method, lr=LR,
                                  method_args=METHOD_ARGS.get(method), **privacy)
    examples = make_examples(N_EXAMPLES, VOCAB, causal=False, seed=5)
    collate = PadCollator(1)
    for step in range(STEPS):
        batch = [examples[(step * LOGICAL_BATCH + i) % N_EXAMPLES] for i in range(LOGICAL_BATCH)]
        mine = batch[rank::world]
        optimizer.zero_grad()
        for start in range(0, len(mine), MICRO):
            inputs = collate(mine[start:start + MICRO])
            labels = inputs.pop("labels")

            def loss_fn(values, inputs=inputs, labels=labels):
                logits = engine.call_model(values, **inputs).logits
                return per_example_loss(logits, labels, causal_lm=False)

            optimizer.accumulate(engine, loss_fn, batch_size=labels.shape[0])
        optimizer.step()
    epsilon = optimizer.accountant.get_epsilon(1e-5) if method != "none" else float("inf")
    torch.save(
        {
            "params": {n: whole(p).detach().clone() for n, p in model.named_parameters()},
            "sharded": sorted(n for n, p in model.named_parameters() if is_sharded(p)),
            "epsilon": epsilon,
            "steps": optimizer.accountant.steps,
            "world_size": world,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def noise(out: str, secure: bool) -> None:
    """Three released steps of pure noise (empty batches) on a sharded model; each process saves its
    shards."""
    from torch.distributed.fsdp import fully_shard

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 101), nn.Linear(101, 7)).double()  # odd shapes: uneven shards
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    sigma, clip, batch = 1.5, 0.5, 4.0
    optimizer = make_dp_optimizer(model.parameters(), base=torch.optim.SGD, lr=1.0, noise_multiplier=sigma,
                                  per_sample_max_grad_norm=clip, expected_batch_size=batch, sample_rate=0.1, seed=11,
                                  secure_rng=secure)
    updates = []
    for _ in range(3):
        before = [local(p).clone() for p in model.parameters()]
        optimizer.accumulate(None, None, batch_size=0)  # an empty Poisson batch: the update is the noise
        optimizer.step()
        updates.append([(a - local(p)).clone() for a, p in zip(before, model.parameters())])
    torch.save({"updates": updates, "std": sigma * clip / batch,
                "epsilon": optimizer.accountant.get_epsilon(1e-5),
                "shapes": [tuple(p.shape) for p in model.parameters()]},
               os.path.join(out, f"rank{rank}.pt"))


def enable_fsdp2_on_cpu(trainer: DPTrainer) -> None:
    """Give a CPU (MULTI_CPU, gloo) run the FSDP2 state that `accelerate launch` with fsdp.yaml gives a GPU
    run.

    Accelerate 1.15 attaches its FSDP plugin only to GPU-type process groups, so on CPU this test sets it on
    the shared state itself; everything after (Accelerate's fully_shard preparation, the parameter switch in
    the optimizer, the DPTrainer glue) is the unmodified GPU code path.
    """
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["RobertaLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
    )
    state = trainer.accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def run_trainer(out: str, method: str, sigma: float) -> None:
    """The same kind of run through DPTrainer (under `accelerate launch` with an FSDP2 config on GPUs)."""
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    model = tiny_roberta()
    privacy = {} if method == "none" else {"noise_multiplier": sigma, "per_sample_max_grad_norm": 0.1}
    if method in METHOD_ARGS:
        privacy["dp_method_args"] = METHOD_ARGS[method]
    args = DPTrainingArguments(
        output_dir=os.path.join(out, f"trainer_rank{rank}"), dp_method=method,
        logical_batch_size=LOGICAL_BATCH,
        per_device_train_batch_size=MICRO, max_steps=STEPS, optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
        use_cpu=os.environ.get("FSDP_ON_CPU") == "1" or not torch.cuda.is_available(),
        remove_unused_columns=False, dp_seed=7, logging_steps=1, disable_tqdm=True, **privacy,
    )
    trainer = DPTrainer(model=model, args=args,
                        train_dataset=ListDataset(make_examples(N_EXAMPLES, VOCAB, False, 5)),
                        data_collator=PadCollator(1))
    if os.environ.get("FSDP_ON_CPU") == "1":
        enable_fsdp2_on_cpu(trainer)
    trainer.train()
    torch.save(
        {
            "params": {n: whole(p).detach().clone().cpu() for n, p in trainer.model.named_parameters()},
            "sharded": sorted(n for n, p in trainer.model.named_parameters() if is_sharded(p)),
            "epsilon": trainer.current_epsilon(),
            "steps": trainer.accountant.steps,
            "world_size": trainer.args.world_size,
            "distributed_type": str(trainer.accelerator.state.distributed_type),
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def main() -> None:
    torch.set_num_threads(1)
    freeze_imported_objects()
    out, configs = sys.argv[1], sys.argv[2:]
    trainer = configs[:1] == ["trainer"]
    if trainer:
        configs = configs[1:]
    elif "RANK" in os.environ:
        dist.init_process_group("gloo")
    for config in configs:
        if config in ("noise", "secure_rng"):
            noise(os.path.join(out, config), secure=config == "secure_rng")
            continue
        method, sigma = config.split(":")
        (run_trainer if trainer else run)(os.path.join(out, f"{method}_{sigma}"), method, float(sigma))
    if dist.is_initialized() and not trainer:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
