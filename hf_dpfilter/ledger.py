"""The privacy ledger: ``output_dir/privacy_ledger.json`` counts every step ever released from that model.

The file is append-only across resumes and branches. A run carries a public random ``run_id`` (saved in its
checkpoints' ``optimizer.pt``); a ``train()`` call is a *session* of that run. When a session resumes from a
checkpoint of the run the ledger already describes, its accountant starts from the ledger's history, not the
checkpoint's: a rollback (resuming from a checkpoint older than the newest release, or after a crash) counts
the steps released after that checkpoint too, on the other branch, and so does every epsilon reported later.
A session of another run (a fresh ``train()`` or a foreign checkpoint in the same ``output_dir``) keeps the
earlier ledger whole under ``earlier_runs``: nothing is ever dropped from the file.

The ledger is written before each noisy step is computed (see ``DPTrainer._write_privacy_ledger``), so a crash
never leaves it below what was spent.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from hf_dpfilter.accounting import PrivacyAccountant

__all__ = ["LEDGER_FILE", "PrivacyLedger", "read_ledger_file"]

LEDGER_FILE = "privacy_ledger.json"


def read_ledger_file(path: str) -> dict[str, Any] | None:
    """The ledger at ``path`` as written (None if there is none)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _read_on_main_process(path: str) -> dict[str, Any] | None:
    """Process 0's reading of the ledger, on every process (all must continue from the same accountant)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [read_ledger_file(path) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return read_ledger_file(path)


class PrivacyLedger:
    """The ledger of one output directory, as one training session extends it."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LEDGER_FILE)
        self.run_id: str | None = None
        self.sessions: list[dict[str, Any]] = []
        self.earlier_runs: list[dict[str, Any]] = []
        #: steps the ledger counted beyond the checkpoint this session resumed from (a rollback or a crash)
        self.steps_beyond_checkpoint = 0

    def open_session(
        self, run_id: str, accountant: PrivacyAccountant, resumed_from_step: int | None, all_processes: bool = True
    ) -> None:
        """Start a session of run ``run_id``; ``accountant`` (the checkpoint's, or empty) is moved to the ledger's
        history when the ledger already counts this run (same ``run_id``) beyond it.

        ``resumed_from_step``: the checkpoint's step count, None for a fresh run.
        """
        # all_processes=False: called on the saving process alone, which must not enter a collective
        existing = _read_on_main_process(self.path) if all_processes else read_ledger_file(self.path)
        self.run_id = run_id
        # the same run: resumed from one of its checkpoints, or train() called again on the same trainer. A ledger
        # of an earlier version (no run_id) met on a resume is taken as this run's: counting more, never fewer.
        same_run = existing is not None and (
            existing.get("run_id") == run_id or (existing.get("run_id") is None and resumed_from_step is not None)
        )
        if same_run:
            self.sessions = list(existing.get("sessions", []))
            self.earlier_runs = list(existing.get("earlier_runs", []))
            counted = PrivacyAccountant(accountant.accountant)
            counted.load_state_dict(existing["accountant"])
            if counted.steps >= accountant.steps:
                # every release of every branch of this run; the checkpoint's history is a prefix of it
                self.steps_beyond_checkpoint = counted.steps - accountant.steps
                accountant.load_state_dict(counted.state_dict())
        elif existing is not None:
            earlier = {k: v for k, v in existing.items() if k != "earlier_runs"}
            self.earlier_runs = [*existing.get("earlier_runs", []), earlier]
        self.sessions.append(
            {"resumed_from_step": resumed_from_step, "steps_released": 0, "status": "started"}
        )
        self._session_start = accountant.steps

    def record(self, fields: dict[str, Any], history: PrivacyAccountant, status: str) -> dict[str, Any]:
        """The ledger's content with ``history`` (everything counted so far, in flight included); written."""
        session = self.sessions[-1]
        session["steps_released"] = history.steps - self._session_start
        session["status"] = status
        ledger = {
            "run_id": self.run_id,
            "status": status,
            "steps": history.steps,
            **fields,
            "accountant": history.state_dict(),
            "sessions": self.sessions,
            "earlier_runs": self.earlier_runs,
        }
        os.makedirs(self.output_dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(ledger, f, indent=1)
        os.replace(tmp, self.path)
        return ledger
