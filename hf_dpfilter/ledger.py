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
        #: ledgers of other output directories this run's history was continued from (branches resumed here)
        self.continued_from: list[str] = []
        #: steps the ledger counted beyond the checkpoint this session resumed from (a rollback or a crash)
        self.steps_beyond_checkpoint = 0

    def open_session(
        self, run_id: str, accountant: PrivacyAccountant, resumed_from_step: int | None,
        checkpoint_dir: str | None = None, all_processes: bool = True,
    ) -> None:
        """Start a session of run ``run_id``; ``accountant`` (the checkpoint's, or empty) is moved to the ledger's
        history when the ledger already counts this run (same ``run_id``) beyond it.

        ``resumed_from_step``: the checkpoint's step count, None for a fresh run. ``checkpoint_dir``: the
        checkpoint resumed from; when it lies in another output directory whose ledger counts this run (a branch
        resumed into a new ``output_dir``), that ledger's history is this one's start: the model of the origin
        directory was released from the same data, so its steps stay counted here too.
        """
        # all_processes=False: called on the saving process alone, which must not enter a collective
        existing = _read_on_main_process(self.path) if all_processes else read_ledger_file(self.path)
        self.run_id = run_id
        # the same run: resumed from one of its checkpoints, or train() called again on the same trainer. A ledger
        # of an earlier version (no run_id) met on a resume is taken as this run's: counting more, never fewer.
        same_run = existing is not None and (
            existing.get("run_id") == run_id or (existing.get("run_id") is None and resumed_from_step is not None)
        )
        source = existing if same_run else None
        self.continued_from = list(existing.get("continued_from", [])) if same_run else []
        if source is None and resumed_from_step is not None and checkpoint_dir:
            origin_path = os.path.join(os.path.dirname(os.path.abspath(os.path.normpath(checkpoint_dir))), LEDGER_FILE)
            origin = None if os.path.abspath(origin_path) == os.path.abspath(self.path) else (
                _read_on_main_process(origin_path) if all_processes else read_ledger_file(origin_path))
            if origin is not None and origin.get("run_id") == run_id:
                source = origin
                self.continued_from = [*origin.get("continued_from", []), origin_path]
        if existing is not None and not same_run:
            earlier = {k: v for k, v in existing.items() if k != "earlier_runs"}
            self.earlier_runs = [*existing.get("earlier_runs", []), earlier]
        if source is not None:
            self.sessions = list(source.get("sessions", []))
            if same_run:
                self.earlier_runs = list(existing.get("earlier_runs", []))
            counted = PrivacyAccountant(accountant.accountant)
            counted.load_state_dict(source["accountant"])
            if counted.steps >= accountant.steps:
                # every release of every branch of this run; the checkpoint's history is a prefix of it
                self.steps_beyond_checkpoint = counted.steps - accountant.steps
                accountant.load_state_dict(counted.state_dict())
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
            **({"continued_from": self.continued_from} if self.continued_from else {}),
            "earlier_runs": self.earlier_runs,
        }
        os.makedirs(self.output_dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(ledger, f, indent=1)
        os.replace(tmp, self.path)
        return ledger
