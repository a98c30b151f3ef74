"""Several processes are ONE DP run, or the run is refused before training.

Under a launcher (torchrun, ``accelerate launch``, mpirun) every process runs the training script. They form
one DP run only inside one ``torch.distributed`` process group whose size is the Trainer's world size: the
Poisson sample is sharded over the processes, the clipped sums are summed and the noise is added once
(:mod:`hf_dpfilter.distributed.collectives`). Without the group each process would be a full DP run of its
own, with its own noise and its own epsilon, all written into the same output directory: the data would be
released once per process while each ledger counts one run. Two launcher set-ups end there silently, and are
refused:

* ``torchrun --nproc_per_node 2`` on a machine without a GPU and without ``use_cpu=True``: Accelerate finds
  no backend (no CUDA) and starts no process group, although ``WORLD_SIZE=2``;
* ``accelerate launch --num_processes 2`` with a config whose ``distributed_type`` is ``NO`` or ``MULTI_CPU``
  (``accelerate_configs/cpu.yaml``) and no ``mpirun`` hostfile: Accelerate's *simple launcher* starts the
  script ONCE (it only sets ``ACCELERATE_USE_CPU`` and ``MASTER_ADDR``/``MASTER_PORT``); the run asked for two
  processes and would silently be one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.distributed as dist

__all__ = ["check_one_dp_run", "launcher_world_size"]

#: the variables launchers set to the number of processes (torchrun, Intel MPI, Open MPI, MVAPICH, SLURM's
#: srun). SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: a batch script runs once with SLURM_NTASKS set to the
#: allocation's task count, while srun sets the step's number of tasks in each task it starts (Accelerate
#: reads none of SLURM's variables, so ``srun -n 2 python train.py`` would be two separate DP runs).
_WORLD_SIZE_VARIABLES = (
    "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "SLURM_STEP_NUM_TASKS",
)
#: the variables launchers set to a process's index
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
                   "SLURM_PROCID")


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def launcher_world_size(env: Mapping[str, str]) -> int:
    """The number of processes the launcher's environment announces (1 without a launcher)."""
    sizes = [v for v in (_int(env, n) for n in _WORLD_SIZE_VARIABLES) if v is not None]
    ranks = [v for v in (_int(env, n) for n in _RANK_VARIABLES) if v is not None]
    return max([1, *sizes, *(r + 1 for r in ranks)])


def check_one_dp_run(
    trainer_world_size: int, env: Mapping[str, str] | None = None, group_size: int | None = None
) -> None:
    """Refuse, naming the fix, unless this process and its peers form one DP run.

    ``trainer_world_size``: the Trainer's ``args.world_size``; ``env`` defaults to ``os.environ``;
    ``group_size`` to the size of the initialized ``torch.distributed`` process group (None: no group).
    """
    env = os.environ if env is None else env
    if group_size is None and dist.is_available() and dist.is_initialized():
        group_size = dist.get_world_size()
    announced = launcher_world_size(env)
    world = max(1, trainer_world_size)
    if announced > 1 and (group_size is None or world != announced):
        joined = "no torch.distributed process group joins them" if group_size is None else (
            f"the Trainer runs as {world} process(es)")
        raise RuntimeError(
            f"The launcher started {announced} processes (WORLD_SIZE/RANK/LOCAL_RANK, or "
            f"SLURM_STEP_NUM_TASKS/SLURM_PROCID, are set) but {joined}: each "
            "process would be a separate DP run with its own noise and epsilon on the same data, writing "
            "into the same output_dir. On a machine without a GPU, pass use_cpu=True (--use_cpu in the "
            "recipes) so that Accelerate joins the processes in one gloo process group; on GPUs, check that "
            "CUDA is visible to every process. Under SLURM, start torchrun or accelerate launch with srun "
            "(one task per node), not the script itself in several tasks. Or start a single process."
        )
    if group_size is not None and group_size != world:
        raise RuntimeError(
            f"The torch.distributed process group has {group_size} processes but the Trainer's world size is "
            f"{trainer_world_size}: the Poisson sample would be sharded and the noise added for another "
            "number of processes than the ones that train. Let Accelerate create the process group (launch "
            "with torchrun or accelerate launch and do not call init_process_group yourself), or start a "
            "single process."
        )
    if announced == 1 and group_size is None and "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env:
        raise RuntimeError(
            "accelerate launch was asked for several processes (or machines) but started ONE: with a config "
            "whose distributed_type is NO or MULTI_CPU (accelerate_configs/cpu.yaml) and no "
            "--mpirun_hostfile, Accelerate's simple launcher runs the script once (it sets "
            "MASTER_ADDR/MASTER_PORT and nothing else). For several CPU processes forming one DP run use "
            "torchrun --nproc_per_node N <script> --use_cpu (one gloo process group), or mpirun through "
            "--mpirun_hostfile; for one process drop --num_processes (and unset MASTER_ADDR)."
        )
