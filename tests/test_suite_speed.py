"""The settings that keep the default test run under its time limit (15 minutes on the 2-core CI machine)
hold."""

from __future__ import annotations

import gc

import torch


def test_the_objects_alive_after_collection_are_frozen_out_of_the_collector():
    """tests/conftest.py freezes the imported modules: without it each Trainer.train() (a full gc.collect())
    walks all of torch and transformers, a third to a half of the suite's CPU time."""
    assert gc.get_freeze_count() > 100_000


def test_one_intra_op_thread():
    assert torch.get_num_threads() == 1
