"""Test-wide settings.

The tests use tiny models, whose operations are far too small to gain from intra-op threads: one thread per
process avoids thread spin-up and contention, and keeps the suite fast and its timing steady.
"""

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# The test folders mirror the package; a test module reuses another's builders by module name
# (``from test_model_families import _args``), so every test folder is on the path.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS)] + sorted(
    str(folder) for folder in _TESTS.iterdir()
    if folder.is_dir() and folder.name not in {"scripts", "__pycache__"} and not folder.name.startswith(".")
)

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# Garbage collection. transformers' Trainer.train() starts with accelerate's free_memory(), a full
# gc.collect(), and Python runs its own full collections as objects pile up: each walks every object of the
# process (torch, transformers and all test modules: ~0.25 s each), a third to a half of the suite's CPU time.
# The objects alive once the tests are collected (modules, classes, functions) are frozen out of the
# collector: they stay alive anyway, so no collection would free them. Frozen again at each module's end,
# after its fixtures are torn down, for the modules imported lazily meanwhile. Every test still runs the same
# collections over its own objects.
def _freeze_what_is_alive() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session) -> None:
    _freeze_what_is_alive()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures, and the module's when it is the module's last test, are torn down
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_what_is_alive()
