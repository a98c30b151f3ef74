"""FSDP2 (``fully_shard``, two processes over gloo on CPU) gives exactly the one-process result.

* Each process clips its own examples from the whole (gathered) layer activations, the clipped sums are
  reduce-scattered into the parameter shards and the base optimizer steps on the shards: the parameters after
  a few steps equal the one-process run in float64 for DP-SGD, the non-private path and every method (DiSK and
  DP-PMLF at two parameter points, DIFF2's difference rounds, DiceSGD's error buffer, DOPPLER's filter), and
  every process reports the same epsilon;
* the noise of the shards is exactly one N(0, sigma^2 Delta^2 I) draw for the whole model: with seeded noise
  the shards put together are the one-process draw (so the noisy runs agree too), no shard repeats another's
  noise and no step repeats an earlier one; with ``secure_rng`` the std is right and the shards are
  independent.

* the DPTrainer path (Accelerate's FSDP2 preparation) equals the one-process DPTrainer run. ``accelerate
  launch`` with accelerate_configs/fsdp.yaml cannot start it on CPU: Accelerate 1.15 attaches its FSDP plugin
  only to GPU process groups (a CPU launch becomes MULTI_CPU, i.e. DDP; ``--cpu`` starts one process), so the
  worker sets the plugin on the state as the launcher would on GPUs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")
if not torch_dist.is_available() or not torch_dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(HERE, "fsdp_worker.py")
METHODS = ("dpsgd", "none", "disk", "doppler", "pmlf", "dicesgd", "diff2")
CONFIGS = [f"{m}:0" for m in METHODS] + ["dpsgd:1.0", "dicesgd:0.5", "diff2:0.5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the worker once with two FSDP2 processes and once as one process, over every configuration."""
    out = tmp_path_factory.mktemp("fsdp")
    configs = [*CONFIGS, "noise", "secure_rng"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), WORKER, str(out / "two"), *configs,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    one = subprocess.run([sys.executable, WORKER, str(out / "one"), *configs], capture_output=True, text=True,
                         env=env)
    output, _ = proc.communicate(timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert proc.returncode == 0, output[-5000:]
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_two_sharded_processes_equal_one_process(runs, config):
    name = config.replace(":", "_")
    ref = torch.load(runs / "one" / name / "rank0.pt")
    ranks = [torch.load(runs / "two" / name / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["sharded"] == sorted(ref["params"]), "every parameter must be an FSDP2 shard (a DTensor)"
    # a trained reference, to see that things move
    initial = torch.load(runs / "one" / "dpsgd_0" / "rank0.pt")
    for r, got in enumerate(ranks):
        diff = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        assert diff <= 1e-10, f"{config}: rank {r} differs from the one-process run by {diff:.2e}"
        assert got["steps"] == ref["steps"]
        assert got["epsilon"] == ref["epsilon"], f"{config}: rank {r} reports another epsilon"
    if config != "dpsgd:0":  # each method really differs from DP-SGD (the comparison is not vacuous)
        moved = max((ref["params"][k] - initial["params"][k]).abs().max().item() for k in ref["params"])
        assert moved > 1e-4, f"{config} ended where DP-SGD without noise ends"


def _shards(runs, kind: str) -> list[list[list[torch.Tensor]]]:
    """[rank][step][parameter] -> that process's rows of the released update."""
    return [torch.load(runs / "two" / kind / f"rank{r}.pt")["updates"] for r in range(2)]


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.numel(), b.numel())
    a, b = a.reshape(-1)[:n], b.reshape(-1)[:n]
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_sharded_noise_is_exactly_the_one_process_draw(runs):
    one = torch.load(runs / "one" / "noise" / "rank0.pt")
    shards = _shards(runs, "noise")
    two = torch.load(runs / "two" / "noise" / "rank0.pt")
    assert two["epsilon"] == torch.load(runs / "two" / "noise" / "rank1.pt")["epsilon"] == one["epsilon"]
    for step, whole_update in enumerate(one["updates"]):
        for j, whole in enumerate(whole_update):
            pieces = [shards[r][step][j] for r in range(2)]
            assert pieces[0].shape[0] + pieces[1].shape[0] == whole.shape[0]
            assert torch.equal(torch.cat(pieces), whole), "the shards are not the rows of one whole draw"


@pytest.mark.parametrize("kind", ["noise", "secure_rng"])
def test_sharded_noise_has_the_right_std_and_no_repeats(runs, kind):
    std = torch.load(runs / "two" / kind / "rank0.pt")["std"]
    shards = _shards(runs, kind)
    released = torch.cat([u.reshape(-1) for r in range(2) for step in shards[r] for u in step])
    assert released.numel() > 20_000
    # sample std of n Gaussians: relative error ~ 1/sqrt(2n) < 0.5 %; 3 % is six of those
    assert abs(float(released.std()) / std - 1) < 0.03, f"std {float(released.std()):.4f}, expected {std:.4f}"
    assert abs(float(released.mean())) < 0.03 * std
    # per step and process, all its rows of every parameter (~3,600 numbers: a correlation's std is ~0.017)
    vectors = [[torch.cat([u.reshape(-1) for u in shards[r][step]]) for step in range(3)] for r in range(2)]
    for step in range(3):
        for j in range(len(shards[0][step])):
            a, b = shards[0][step][j], shards[1][step][j]
            assert not torch.equal(a[: b.shape[0]], b), "two shards got the same noise"
        assert abs(_corr(vectors[0][step], vectors[1][step])) < 0.1, "the shards' noise is correlated"
        if step:
            for r in range(2):
                assert abs(_corr(vectors[r][step],
                                 vectors[r][step - 1])) < 0.1, "a step repeated earlier noise"


def test_dptrainer_under_accelerate_fsdp2_equals_one_process(tmp_path):
    """The DPTrainer path: Accelerate's FSDP2 preparation (fully_shard, the optimizer's parameter switch),
    Poisson shards of different sizes (padding micro-batches keep the gathers in step), noise included.

    Accelerate attaches its FSDP plugin only to GPU process groups, so the worker sets the plugin that
    `accelerate launch --config_file accelerate_configs/fsdp.yaml` would set (FSDP_ON_CPU=1); the rest is
    the unmodified code path.
    """
    configs = ["trainer", "dpsgd:1.0", "pmlf:0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), WORKER, str(tmp_path / "two"), *configs,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env, FSDP_ON_CPU="1"))
    one = subprocess.run([sys.executable, WORKER, str(tmp_path / "one"), *configs], capture_output=True,
                         text=True,
                         env=env)
    output, _ = proc.communicate(timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert proc.returncode == 0, output[-5000:]
    for config in configs[1:]:
        name = config.replace(":", "_")
        ref = torch.load(tmp_path / "one" / name / "rank0.pt")
        for r in range(2):
            got = torch.load(tmp_path / "two" / name / f"rank{r}.pt")
            assert got["world_size"] == 2 and got["sharded"] == sorted(ref["params"])
            diff = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
            assert diff <= 1e-10, f"{config}: rank {r} differs from the one-process DPTrainer run by {diff:.2e}"
            assert got["steps"] == ref["steps"] and got["epsilon"] == ref["epsilon"]
