"""The privacy unit is part of a run's identity: recorded with every release, and a resume that changes it
refused.

A run's (ε, δ) is a statement about one unit. Resuming 3 example-level steps at ``privacy_unit="user"`` (or a
user-level run with another ``user_id_column``, another k, or another grouping of the examples into users)
would report user-level (ε, δ) for a history that was partly something else. So every session records the unit
it counts, and before the first step of a resume (``DPTrainer`` ``on_train_begin``) the unit is compared with
what the checkpoint and the ledger recorded; any change is refused with the fix.

What is recorded, and where:

* **Public** (:func:`unit_record`): the unit, the id column, k, at user level the number of users, and
  ``dp_row_is_unit`` when declared (a row, which may hold several examples, is then what is protected) -- the
  settings of ``training_args.bin`` and the N the plan, the report and the model card already publish. Kept in
  the checkpoint's ``optimizer.pt`` (``dp.privacy_unit``) and in each ledger entry (``privacy_unit``).
* **Private** (:func:`partition_digest`): a SHA-256 of the user partition, i.e. of the sorted multiset of the
  users' groups of example indices. It holds no id and no data, but it is a deterministic function of which
  examples belong to whom: an adversary who knows every user but one computes it for both neighbouring data
  sets and tells them apart (membership, ε = ∞). It is therefore **never written to a file a user would
  publish**: it lives in ``output_dir/_privacy_unit_partitions.json`` (run id -> digest), whose ``_`` prefix
  keeps it out of the Trainer's Hub uploads (``ignore_patterns=["_*", ...]``); checkpoint folders, uploaded
  whole with ``hub_strategy="checkpoint"``, never hold it. A resume into another ``output_dir`` also reads the
  file of the checkpoint's own directory; a checkpoint copied away from both cannot have its partition checked
  (a warning says so), while its public record still is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from hf_dpfilter.data.user_ids import PrivacyUnitError
from hf_dpfilter.run.ledger import ledger_lock, read_ledger_file, write_json_atomically

if TYPE_CHECKING:
    from hf_dpfilter.data.units import UserIndex

logger = logging.getLogger(__name__)

__all__ = ["PARTITIONS_FILE", "check_resumed_unit", "partition_digest", "record_partition", "unit_record"]

#: the private file of user-partition digests (the "_" prefix: not uploaded by the Trainer's Hub pushes)
PARTITIONS_FILE = "_privacy_unit_partitions.json"


def unit_record(args: Any, users: UserIndex | None) -> dict[str, Any]:
    """The public record of the unit a run counts: what its ``training_args`` and its report already
    publish."""
    unit = getattr(args, "privacy_unit", "example")
    # dp_row_is_unit: the steps protected rows, not the examples in them; recorded only when declared, so the
    # records of runs that never set it (and of earlier versions) stay the same
    row = {"row_is_unit": True} if getattr(args, "dp_row_is_unit", False) else {}
    if users is None:
        return {"unit": unit, **row}
    return {"unit": unit, "user_id_column": users.column, "max_examples_per_user": args.max_examples_per_user,
            "num_units": users.num_users, **row}


def partition_digest(users: UserIndex) -> str:
    """SHA-256 of the sorted multiset of the users' example-index groups (private: see the module
    docstring)."""
    groups = sorted(sorted(group) for group in users.examples)
    return hashlib.sha256(json.dumps(groups, separators=(",", ":")).encode()).hexdigest()


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "an unrecorded unit"
    return ", ".join(f"{'privacy_unit' if k == 'unit' else k}={v!r}" for k, v in record.items())


def _refuse(where: str, recorded: str, current: str, run_id: str) -> None:
    raise PrivacyUnitError(
        f"Cannot resume run {run_id}: its {where} counted its released steps with {recorded}, but this run "
        f"declares {current}. The (ε, δ) reported for the whole history would claim this unit for steps that "
        "protected another one. Resume with the unit, user_id_column, max_examples_per_user, dp_row_is_unit "
        "and training set of the checkpoint, or start a fresh run from the original model (no "
        "resume_from_checkpoint, a new output_dir)."
    )


def _partition_files(output_dir: str, checkpoint_dir: str | None) -> list[str]:
    paths = [os.path.join(output_dir, PARTITIONS_FILE)]
    if checkpoint_dir:  # a branch resumed into another output_dir: the checkpoint's own directory too
        origin = os.path.join(os.path.dirname(os.path.abspath(os.path.normpath(checkpoint_dir))),
                              PARTITIONS_FILE)
        if os.path.abspath(origin) != os.path.abspath(paths[0]):
            paths.append(origin)
    return paths


def check_resumed_unit(
    run_id: str, current: dict[str, Any], digest: str | None, checkpoint: dict[str, Any] | None,
    ledger: dict[str, Any] | None, output_dir: str, checkpoint_dir: str | None, resumed: bool = False,
) -> None:
    """Refuse a resume whose unit differs from the one its history counted.

    ``current``: this run's :func:`unit_record`; ``digest``: its :func:`partition_digest` (None at example
    level). ``checkpoint``/``ledger``: the records of the checkpoint's ``optimizer.pt`` and of the ledger
    entry this session continues (None where nothing was recorded: written by an earlier version).
    ``resumed``: the session resumes a checkpoint (one without any record is accepted with a warning).
    """
    for where, recorded in (("checkpoint (optimizer.pt)", checkpoint), ("privacy ledger", ledger)):
        if recorded is not None and recorded != current:
            _refuse(where, _describe(recorded), _describe(current), run_id)
    if resumed and checkpoint is None and ledger is None:
        logger.warning(
            "Resuming run %s from a checkpoint that records no privacy unit (written by an earlier version): "
            "its steps are taken as counted with %s. If they protected another unit, start a fresh run "
            "instead.",
            run_id, _describe(current),
        )
    if current.get("unit") != "user":
        return
    found = False
    for path in _partition_files(output_dir, checkpoint_dir):
        recorded_digest = (read_ledger_file(path) or {}).get(run_id)
        if recorded_digest is None:
            continue
        found = True
        if recorded_digest != digest:
            _refuse(f"user partition ({os.path.basename(path)})", "another grouping of the examples into "
                "users",
                    f"this training set's users under column {current.get('user_id_column')!r}", run_id)
    if not found and checkpoint is not None:
        logger.warning(
            "Resuming user-level run %s: no record of its user partition was found beside the checkpoint or "
            "in output_dir (%s); the unit, column, k and number of users match, but whether the examples are "
            "grouped into the same users cannot be checked. Keep the checkpoint in its output_dir to have it "
            "checked.",
            run_id, PARTITIONS_FILE,
        )


def record_partition(output_dir: str, run_id: str, digest: str) -> None:
    """Add this run's partition digest to ``output_dir``'s private file (under the ledger's lock)."""
    path = os.path.join(output_dir, PARTITIONS_FILE)
    with ledger_lock(output_dir):
        digests = read_ledger_file(path) or {}
        if digests.get(run_id) != digest:
            write_json_atomically(path, {**digests, run_id: digest})
