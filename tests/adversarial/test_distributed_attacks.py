"""Two gloo processes with the per-example re-checks on (attacked through the public API): the
re-checks run on each process without a collective and leave the run equal to one process; a refusal on one
process ends both. Worker: tests/recheck_worker.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

RECHECK_WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "recheck_worker.py")


def test_rechecks_in_two_processes_neither_desync_nor_hang_on_one_refusal(tmp_path):
    """Left-padded GPT-2 (positions from the mask), every micro-batch re-checked alone, two gloo processes:
    each process re-checks its own micro-batches without a collective, and the run equals the one-process run
    (the derived positions are the same on both); a refusal on process 0 alone (a gradient hook before step 2)
    ends both processes promptly instead of leaving the other in the step's all-reduce."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    two = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), RECHECK_WORKER, str(tmp_path / "two"), "train", "refuse"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    one = subprocess.run([sys.executable, RECHECK_WORKER, str(tmp_path / "one"), "train"],
                         capture_output=True,
                         text=True, env=env, timeout=240)
    output, _ = two.communicate(timeout=240)  # the timeout is the hang detector
    assert one.returncode == 0, one.stderr[-3000:]
    ref = torch.load(tmp_path / "one" / "train" / "rank0.pt")
    for rank in range(2):
        got = torch.load(tmp_path / "two" / "train" / f"rank{rank}.pt")
        assert got["steps"] == ref["steps"] == 3 and got["rechecks"] > 0
        assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) <= 1e-10
    assert two.returncode != 0 and "GradientHookError" in output  # process 0 refused, and both ended
    assert not (tmp_path / "two" / "refuse" / "rank1.pt").exists()
