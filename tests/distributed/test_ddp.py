"""Several processes (torchrun, CPU, gloo) give exactly the single-process result.

* Poisson sampling is sharded so that the union of the shards is the single-process Poisson sample;
* the clipped sums are all-reduced and the noise is added once in total (every process draws the same noise),
  so two processes end at the same float64 parameters as one process on the same logical batches, with and
  without noise, for DP-SGD, the non-private path and each available noise-reducing method;
* every process reports the same epsilon and step count; only the main process writes results and plots;
* DeepSpeed and FSDP1 are refused with a clear error (FSDP2: tests/distributed/test_fsdp.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_dpfilter import available_methods
from hf_dpfilter.randomness.sampling import PoissonBatchSampler

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(HERE, "distributed_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_poisson_shards_union_is_one_poisson_sample(world):
    single = list(PoissonBatchSampler(50, 0.2, 6, seed=11))
    shards = [list(PoissonBatchSampler(50, 0.2, 6, seed=11, rank=r, world_size=world)) for r in range(world)]
    for step, batch in enumerate(single):
        parts = [set(shards[r][step]) for r in range(world)]
        assert sum(len(p) for p in parts) == len(set().union(*parts)), "shards overlap"
        assert set().union(*parts) == set(batch)
        for r, part in enumerate(parts):
            assert all(i % world == r for i in part)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configs() -> list[str]:
    methods = set(available_methods())
    configs = ["dpsgd:0", "dpsgd:1.0", "none:0"]
    configs += [f"{m}:0.5" for m in ("disk", "doppler", "pmlf", "dicesgd", "diff2") if m in methods]
    return configs


def test_two_processes_equal_one_process(tmp_path):
    configs = _configs()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), WORKER, str(tmp_path / "two"), *configs,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # The one-process reference runs here meanwhile (same worker code, no process group).
    one = subprocess.run(
        [sys.executable, WORKER, str(tmp_path / "one"), *configs], capture_output=True, text=True, env=env
    )
    output, _ = proc.communicate(timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert proc.returncode == 0, output[-5000:]
    # the start-of-training banner (hf_dpfilter/run/start_report.py): once per run, on the main process only
    banner = "***** Differential privacy"
    assert output.count(banner) == (one.stdout + one.stderr).count(banner) == len(configs), output.count(banner)
    for config in configs:
        method, sigma = config.split(":")
        name = f"{method}_{sigma}"
        ref = torch.load(tmp_path / "one" / name / "rank0.pt")
        ranks = [torch.load(tmp_path / "two" / name / f"rank{r}.pt") for r in range(2)]
        assert ranks[0]["world_size"] == 2 and ranks[0]["wrapped"] == "DistributedDataParallel"
        for r, got in enumerate(ranks):
            diff = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
            assert diff <= 1e-10, f"{name}: rank {r} differs from the one-process run by {diff:.2e}"
            assert got["steps"] == ref["steps"]
            assert got["epsilon"] == ref["epsilon"], f"{name}: rank {r} reports another epsilon"
        # Only the main process writes the results and plots.
        assert (tmp_path / "two" / name / "trainer_rank0" / "results.json").exists()
        if method == "dpsgd":
            # epsilon.png; no training.png here: without evaluation and without the (non-private, opt-in)
            # training loss there is no curve to draw
            assert (tmp_path / "two" / name / "trainer_rank0" / "epsilon.png").exists()
        assert not (tmp_path / "two" / name / "trainer_rank1" / "results.json").exists()
        assert not (tmp_path / "two" / name / "trainer_rank1" / "epsilon.png").exists()
    # Noise is really there when sigma > 0 (the comparison above is not trivially noise-free).
    noisy = torch.load(tmp_path / "one" / "dpsgd_1.0" / "rank0.pt")["params"]
    clean = torch.load(tmp_path / "one" / "dpsgd_0" / "rank0.pt")["params"]
    assert max((noisy[k] - clean[k]).abs().max().item() for k in clean) > 1e-3


def test_deepspeed_and_fsdp1_are_refused_fsdp2_is_not(tmp_path):
    sys.path.insert(0, HERE)
    from helpers import ListDataset, PadCollator, make_examples
    from models import VOCAB, tiny_roberta

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=4, max_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", remove_unused_columns=False,
    )
    trainer = DPTrainer(
        model=tiny_roberta(), args=args, train_dataset=ListDataset(make_examples(8, VOCAB, False)),
        data_collator=PadCollator(1),
    )
    trainer.is_deepspeed_enabled = True
    with pytest.raises(ValueError, match="DeepSpeed is not supported.*FSDP2"):
        trainer._refuse_sharded_training()
    trainer.is_deepspeed_enabled = False
    trainer.is_fsdp_enabled = True
    trainer.args.fsdp_config = {"version": 1}
    with pytest.raises(ValueError, match=r"FSDP \(version 1\) is not supported.*FSDP2"):
        trainer._refuse_sharded_training()
    trainer.args.fsdp_config = {"version": 2}
    trainer._refuse_sharded_training()  # FSDP2 is supported (tests/distributed/test_fsdp.py)
    trainer.is_fsdp_enabled = False
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))
    from _common import refuse_sharded_training

    for env, message in (
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed is not supported"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, r"FSDP \(version 1\) is not supported"),
    ):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with pytest.raises(ValueError, match=message):
                refuse_sharded_training()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    try:
        refuse_sharded_training()  # FSDP2 launches go through
    finally:
        del os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_VERSION"]


def _bucketed_sum_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hf_dpfilter.distributed.collectives import ProcessGroupCollectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    shapes = [(7, 3), (5,), (40, 40), (2, 2), (300,), (1,)]
    tensors = [torch.randn(s, dtype=torch.float64 if i % 3 == 0 else torch.float32) for i,
               s in enumerate(shapes)]
    per_tensor = [t.clone() for t in tensors]
    ProcessGroupCollectives(bucket_bytes=0).sum_(per_tensor)
    bucketed = [t.clone() for t in tensors]
    # several buckets, one tensor larger than a bucket
    ProcessGroupCollectives(bucket_bytes=1000).sum_(bucketed)
    torch.save({"per_tensor": per_tensor, "bucketed": bucketed,
                "default": ProcessGroupCollectives().bucket_bytes},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_bucketed_all_reduce_equals_one_call_per_tensor(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_bucketed_sum_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["default"] == 0  # gloo: one call per tensor by default (NCCL: 25 MiB buckets)
        for a, b in zip(got["per_tensor"], got["bucketed"]):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
