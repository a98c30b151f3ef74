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

**Several writers at once lose nothing.** Every write re-reads the file and replaces it under an exclusive
lock (``fcntl.flock`` on ``_privacy_ledger.lock``): two trainers (or two sessions) writing one ``output_dir``
at the same time each keep the other's entry, the newest one of each session, instead of the last writer's
file winning. An entry is identified by its last session's public random ``id``: a session's own earlier
writes, and the entry it continued from, are replaced by its newest one; every other entry is kept.

**The unit is part of the run's identity.** Each entry records the privacy unit it counted (``privacy_unit``:
the unit, the id column, k, the number of units; see :mod:`hf_dpfilter.run.unit_identity`); the session's
``source_unit`` is what the entry it continues recorded, for the caller to compare before the first step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from hf_dpfilter.accounting.accountant import PrivacyAccountant

try:  # POSIX; elsewhere the ledger is written without a lock (one writer per output_dir)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

logger = logging.getLogger(__name__)

__all__ = [
    "LEDGER_FILE", "LOCK_FILE", "PrivacyLedger", "ledger_lock", "read_ledger_file", "released_steps",
    "write_json_atomically",
]

LEDGER_FILE = "privacy_ledger.json"
#: the lock file beside the ledger (its "_" prefix keeps it out of the Trainer's Hub uploads, like every "_*")
LOCK_FILE = "_privacy_ledger.lock"


def read_ledger_file(path: str) -> dict[str, Any] | None:
    """The ledger at ``path`` as written (None if there is none)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def ledger_lock(output_dir: str) -> Iterator[None]:
    """An exclusive lock on ``output_dir``'s ledger files, across processes (``fcntl.flock`` on a lock file
    beside the ledger, which is itself replaced atomically and so cannot carry the lock)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, LOCK_FILE), "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write_json_atomically(path: str, content: Any) -> None:
    """``content`` as JSON at ``path``, replaced atomically (a temporary file of this writer, then a
    rename)."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1)
    os.replace(tmp, path)


def _entries(ledger: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every entry of a ledger file, oldest first: its earlier runs, then its own (without
    ``earlier_runs``)."""
    if ledger is None:
        return []
    return [*ledger.get("earlier_runs", []), {k: v for k, v in ledger.items() if k != "earlier_runs"}]


def _key(entry: dict[str, Any]) -> str:
    """What identifies an entry across rewrites: its last session's id, or (an entry of an earlier version,
    copied verbatim ever since) a hash of its content."""
    sessions = entry.get("sessions") or []
    if sessions and isinstance(sessions[-1], dict) and sessions[-1].get("id"):
        return str(sessions[-1]["id"])
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def _merged(*lists: list[dict[str, Any]], drop: set[str]) -> list[dict[str, Any]]:
    """The entries of all lists, one per key (the one that counts the most steps: the same session's newest
    write), in order of first appearance, without the keys in ``drop``."""
    out: dict[str, dict[str, Any]] = {}
    for entries in lists:
        for entry in entries:
            key = _key(entry)
            if key in drop:
                continue
            if key not in out or entry.get("steps", 0) >= out[key].get("steps", 0):
                out[key] = entry
    return list(out.values())


def released_steps(ledger: dict[str, Any]) -> int:
    """The steps every entry of a ledger file counts together (its own and its earlier runs')."""
    return sum(int(entry.get("steps", 0)) for entry in _entries(ledger))


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
        #: the privacy unit this session counts (recorded in its entry), and the one its source entry recorded
        self.unit: dict[str, Any] | None = None
        self.source_unit: dict[str, Any] | None = None
        self._consumed: set[str] = set()

    def open_session(
        self, run_id: str, accountant: PrivacyAccountant, resumed_from_step: int | None,
        checkpoint_dir: str | None = None, all_processes: bool = True,
    ) -> None:
        """Start a session of run ``run_id``; ``accountant`` (the checkpoint's, or empty) is moved to the
        ledger's history when the ledger already counts this run (same ``run_id``) beyond it.

        ``resumed_from_step``: the checkpoint's step count, None for a fresh run. ``checkpoint_dir``: the
        checkpoint resumed from; when it lies in another output directory whose ledger counts this run (a
        branch resumed into a new ``output_dir``), that ledger's history is this one's start: the model of the
        origin directory was released from the same data, so its steps stay counted here too.
        """
        # all_processes=False: called on the saving process alone, which must not enter a collective
        existing = _read_on_main_process(self.path) if all_processes else read_ledger_file(self.path)
        self.run_id = run_id
        entries = _entries(existing)
        # the same run: resumed from one of its checkpoints, or train() called again on the same trainer; its
        # entry may be the file's own or (another run wrote here since) one of its earlier runs: the one
        # counting most. A ledger of an earlier version (no run_id) met on a resume is taken as this run's:
        # counting more.
        mine = [e for e in entries if e.get("run_id") == run_id]
        if existing is not None and existing.get("run_id") is None and resumed_from_step is not None:
            mine.append(entries[-1])
        source = max(mine, key=lambda e: e.get("steps", 0)) if mine else None
        self.continued_from = list(source.get("continued_from", [])) if source is not None else []
        self._consumed = {_key(source)} if source is not None else set()
        if source is None and resumed_from_step is not None and checkpoint_dir:
            origin_path = os.path.join(os.path.dirname(os.path.abspath(os.path.normpath(checkpoint_dir))),
                                       LEDGER_FILE)
            origin = None if os.path.abspath(origin_path) == os.path.abspath(self.path) else (
                _read_on_main_process(origin_path) if all_processes else read_ledger_file(origin_path))
            if origin is not None and origin.get("run_id") == run_id:
                source = origin
                self.continued_from = [*origin.get("continued_from", []), origin_path]
        # every entry of this file stays, except the one this session continues (its history is now this
        # one's)
        self.earlier_runs = _merged(entries, drop=self._consumed)
        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if source is None and entries and main:
            other = entries[-1]
            # said, not silent: the file goes on counting the earlier run, but a model published from this
            # directory before carries that run's epsilon, not this one's
            logger.warning(
                "%s already holds the privacy ledger of another run (%s steps%s): it is kept under "
                "earlier_runs and this run is accounted on its own. Each model you publish carries the "
                "epsilon of the run that trained it; use a new output_dir per run to keep them apart.",
                self.path, other.get("steps", "?"),
                ", stopped before its end" if other.get("status") == "step_in_flight" else "")
        self.source_unit = source.get("privacy_unit") if source is not None else None
        if source is not None:
            self.sessions = list(source.get("sessions", []))
            counted = PrivacyAccountant(accountant.accountant)
            counted.load_state_dict(source["accountant"])
            if counted.steps >= accountant.steps:
                # every release of every branch of this run; the checkpoint's history is a prefix of it
                self.steps_beyond_checkpoint = counted.steps - accountant.steps
                accountant.load_state_dict(counted.state_dict())
        self.sessions.append(
            {"id": uuid.uuid4().hex, "resumed_from_step": resumed_from_step, "steps_released": 0,
             "status": "started"}
        )
        self._session_start = accountant.steps

    def record(self, fields: dict[str, Any], history: PrivacyAccountant, status: str) -> dict[str, Any]:
        """The ledger's content with ``history`` (everything counted so far, in flight included); written."""
        session = self.sessions[-1]
        session["steps_released"] = history.steps - self._session_start
        session["status"] = status
        own = {
            "run_id": self.run_id,
            "status": status,
            "steps": history.steps,
            **fields,
            **({"privacy_unit": self.unit} if self.unit is not None else {}),
            "accountant": history.state_dict(),
            "sessions": self.sessions,
            **({"continued_from": self.continued_from} if self.continued_from else {}),
        }
        with ledger_lock(self.output_dir):
            # re-read under the lock: another writer's entries since this session's last write are kept
            drop = {*self._consumed, _key(own)}
            self.earlier_runs = _merged(_entries(read_ledger_file(self.path)), self.earlier_runs, drop=drop)
            ledger = {**own, "earlier_runs": self.earlier_runs}
            write_json_atomically(self.path, ledger)
        return ledger
