"""The ``evaluate`` modules shipped in ``recipes.common.metrics`` load with no network and give the exact
values.

* Both modules load from the package with ``HF_HUB_OFFLINE=1`` / ``HF_EVALUATE_OFFLINE=1`` while every socket
  connection and DNS lookup is refused and recorded: nothing may even try the network. A fresh interpreter
  with an empty modules cache checks the cold start.
* ``accuracy`` equals the numpy expression the GLUE recipe used before (and the recipe's ``compute_metrics``
  still returns it).
* ``table2text`` equals the direct calls of :mod:`recipes.common.generation_metrics` (the cross-check of that
  module against independent references lives in ``tests/apps/test_generation_metrics.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from recipes.common import generation_metrics as gm
from recipes.common import metrics as dpm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PREDICTIONS = [
    "The Eagle is a coffee shop near Burger King in the riverside area.",
    "Blue Spice is a cheap pub in the city centre. It is family friendly.",
    "The Rice Boat serves Italian food and has a high customer rating.",
]
REFERENCES = [
    [
        "The Eagle coffee shop is near Burger King by the riverside.",
        "Near Burger King in the riverside area is a coffee shop called The Eagle.",
    ],
    [
        "Blue Spice is a family friendly pub in the city centre with low prices.",
        "In the city centre there is a cheap, kid friendly pub named Blue Spice.",
        "Blue Spice is a pub.",
    ],
    ["The Rice Boat is a highly rated Italian restaurant."],
]


@pytest.fixture
def offline(monkeypatch):
    """Offline environment; every attempt to open a connection or resolve a name is refused and recorded."""
    import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)  # read when evaluate is imported
    attempts: list[str] = []

    def refuse(name):
        def blocked(*args, **kwargs):
            attempts.append(f"{name}{args[1:] if name.startswith('socket.') else args}")
            raise OSError(f"network access attempted in an offline test: {name}")

        return blocked

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    return attempts


def test_module_paths_are_inside_the_package():
    for name in dpm.METRICS:
        script = dpm.module_path(name)
        assert os.path.isabs(script) and os.path.isfile(script)
        assert os.path.dirname(script) == dpm.module_path(name, script=False)
        assert os.path.commonpath([script, os.path.dirname(dpm.__file__)]) == os.path.dirname(dpm.__file__)
    with pytest.raises(ValueError, match="Unknown metric"):
        dpm.module_path("bleu")


def test_accuracy_loads_offline_and_matches_numpy(offline):
    import evaluate

    metric = dpm.load("accuracy")
    assert isinstance(metric, evaluate.EvaluationModule)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(257, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=257)
    preds = np.argmax(logits, axis=-1)
    expected = float((preds == labels).mean())
    assert metric.compute(predictions=preds, references=labels) == {"accuracy": expected}
    # the instance is reusable, and list inputs work
    assert metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0]) == {"accuracy": 0.75}
    weights = rng.uniform(size=257)
    weighted = metric.compute(predictions=preds, references=labels, sample_weight=weights)["accuracy"]
    assert weighted == pytest.approx(float((weights * (preds == labels)).sum() / weights.sum()), rel=1e-12)
    # evaluate.load on the packaged directory works as well
    by_dir = evaluate.load(dpm.module_path("accuracy", script=False), keep_in_memory=True)
    assert by_dir.compute(predictions=preds, references=labels) == {"accuracy": expected}
    assert offline == []


def test_table2text_loads_offline_and_equals_generation_metrics(offline):
    metric = dpm.load("table2text")
    scores = metric.compute(predictions=PREDICTIONS, references=REFERENCES)
    assert set(scores) == {"bleu", "nist", "meteor", "rouge_l", "cider"}
    # the module is the exact implementation: the bundle and the individual metric functions
    assert scores == gm.compute_generation_metrics(PREDICTIONS, REFERENCES)
    direct = {
        "bleu": gm.corpus_bleu(PREDICTIONS, REFERENCES),
        "nist": gm.corpus_nist(PREDICTIONS, REFERENCES),
        "meteor": gm.meteor(PREDICTIONS, REFERENCES),
        "rouge_l": gm.rouge_l(PREDICTIONS, REFERENCES),
        "cider": gm.cider(PREDICTIONS, REFERENCES),
    }
    assert scores == pytest.approx(direct, rel=1e-12, abs=1e-15)
    assert 0.0 < scores["bleu"] < 1.0 and scores["nist"] > 0.0 and scores["cider"] > 0.0
    # a single reference string per prediction is one reference
    single = metric.compute(predictions=PREDICTIONS, references=[refs[0] for refs in REFERENCES])
    assert single == gm.compute_generation_metrics(PREDICTIONS, [[refs[0]] for refs in REFERENCES])
    assert offline == []


def test_glue_compute_metrics_uses_the_packaged_module(offline):
    from transformers import EvalPrediction

    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    try:
        import glue
    finally:
        sys.path.remove(os.path.join(ROOT, "recipes"))
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(101, 2)).astype(np.float32)
    labels = rng.integers(0, 2, size=101)
    expected = {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}
    assert glue.compute_accuracy(EvalPrediction(predictions=logits, label_ids=labels)) == expected
    assert glue.compute_accuracy(EvalPrediction(predictions=(logits, logits), label_ids=labels)) == expected
    assert glue.accuracy_metric() is glue.accuracy_metric()  # loaded once
    assert glue.accuracy_metric().name == "accuracy"
    assert offline == []


def test_cold_start_in_a_fresh_interpreter_needs_no_network(tmp_path):
    """Empty HF caches, offline variables set before evaluate is imported, sockets refused from the start."""
    code = textwrap.dedent(
        """
        import json, socket
        attempts = []
        def refuse(*args, **kwargs):
            attempts.append(repr(args[1:]))
            raise OSError("network access attempted")
        socket.socket.connect = socket.socket.connect_ex = refuse
        socket.getaddrinfo = socket.create_connection = refuse
        import evaluate
        import recipes.common.metrics as dpm
        out = {
            "accuracy": dpm.load("accuracy").compute(predictions=[1, 0, 1], references=[1, 1, 1]),
            "table2text": evaluate.load(dpm.module_path("table2text")).compute(
                predictions=["a cheap pub in the centre"], references=[["a cheap pub in the city centre"]]
            ),
            "offline": evaluate.config.HF_EVALUATE_OFFLINE,
            "attempts": attempts,
        }
        print(json.dumps(out))
        """
    )
    env = dict(os.environ)
    env.update({
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_OFFLINE": "1",
        "HF_EVALUATE_OFFLINE": "1",
    })
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)  # python -c: the checkout root (recipes.common) is on sys.path
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["attempts"] == [] and out["offline"] is True
    assert out["accuracy"] == {"accuracy": pytest.approx(2 / 3)}
    assert out["table2text"] == gm.compute_generation_metrics(
        ["a cheap pub in the centre"], [["a cheap pub in the city centre"]]
    )
    # evaluate copied the packaged scripts into the (fresh) modules cache and imported them from there
    cached = {p.name for p in (tmp_path / "modules").rglob("*.py")}
    assert {"accuracy.py", "table2text.py"} <= cached
