"""``evaluate`` metric modules shipped with the recipes (not the library), loaded from their folder with no
network.

Each module is a directory ``recipes/common/metrics/<name>/`` holding the ``evaluate`` script
``<name>.py`` (an ``evaluate.Metric`` subclass):

* ``accuracy``: classification accuracy (the GLUE recipe's ``compute_metrics``), numpy.
* ``table2text``: BLEU, NIST, METEOR, ROUGE-L and CIDEr of E2E / DART against all references of each
  input; a thin wrapper around :func:`recipes.common.generation_metrics.compute_generation_metrics`.

:func:`load` passes the absolute path of the packaged script to ``evaluate.load``, so ``evaluate``
takes its local-script path and never asks the Hub (no download count either); this works with
``HF_HUB_OFFLINE=1`` / ``HF_EVALUATE_OFFLINE=1`` and with no network at all. The same works directly::

    import evaluate
    from recipes.common.metrics import module_path

    accuracy = evaluate.load(module_path("accuracy"))  # ".../recipes/common/metrics/accuracy/accuracy.py"

(the directory, ``module_path(name, script=False)``, works too). Note that ``evaluate.load("accuracy")``
with a bare name is a *different* module, fetched from the Hub.

Like every local script, ``evaluate`` copies the script into its dynamic-modules cache
(``$HF_MODULES_CACHE/evaluate_modules/metrics/<name>/<hash of the script>/``, by default under
``~/.cache/huggingface/modules``) and imports it from there; that directory must be writable. The scripts
import ``recipes.common.generation_metrics`` (the repository root is on ``sys.path`` wherever this module
was imported), so the metric code always comes from this checkout.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["METRICS", "load", "module_path"]

METRICS = ("accuracy", "table2text")

_HERE = os.path.dirname(os.path.abspath(__file__))


def module_path(name: str, *, script: bool = True) -> str:
    """Absolute path of the packaged ``evaluate`` module ``name``: its script, or its directory."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}; available: {', '.join(METRICS)}.")
    directory = os.path.join(_HERE, name)
    path = os.path.join(directory, f"{name}.py") if script else directory
    if not os.path.exists(path):  # pragma: no cover - a broken installation
        raise FileNotFoundError(f"The metric script {path} is missing from this checkout.")
    return path


def load(name: str, **kwargs: Any) -> Any:
    """``evaluate.load`` of the packaged metric ``name`` (``"accuracy"`` or ``"table2text"``), offline.

    ``kwargs`` go to ``evaluate.load`` (``config_name``, ``cache_dir``, ``experiment_id``,
    ``process_id`` / ``num_process``, ...). Unlike ``evaluate.load``, ``keep_in_memory`` defaults to
    True when ``num_process`` is 1: predictions are buffered in memory instead of Arrow files under
    ``~/.cache/huggingface/metrics``, so independent processes never share cache files. Returns an
    ``evaluate.EvaluationModule``.
    """
    import evaluate

    if kwargs.get("num_process", 1) == 1:
        kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(module_path(name), **kwargs)
