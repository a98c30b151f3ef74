"""A fresh process pays no start-up for what it does not use (the fixed start-up of short private
runs).

* Building ``DPTrainingArguments`` as ``HfArgumentParser`` does (every field a keyword) imports none of the DP
  methods' modules: only keywords that are not fields are checked against the retired names.
* The epsilon of the start banner (PRV, capped by RDP) and the "rdp" accountant do not import ``opacus``:
  Opacus' ``rdp.py`` runs on its own (hf_dpfilter/accounting/rdp_analysis.py), with the values of Opacus' own
  import.

One subprocess (a fresh interpreter is the only place where ``sys.modules`` says what a start-up imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, sys
import numpy as np
from hf_dpfilter import DPTrainingArguments
from hf_dpfilter.accounting.accountant import compute_epsilon

from transformers import HfArgumentParser

(args,) = HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses(
    ["--output_dir", sys.argv[1], "--noise_multiplier", "1.0", "--logical_batch_size", "32",
     "--per_device_train_batch_size", "8", "--max_steps", "5", "--report_to", "none"])
methods_after_args = sorted(m for m in sys.modules if m.startswith("hf_dpfilter.optimizers.")
                            and m.rsplit(".", 1)[1] in ("disk", "doppler", "pmlf", "dicesgd", "diff2"))
history = [(1.0, 0.0625, 5)]
eps = {name: compute_epsilon(history, 1e-5, accountant=name) for name in ("prv", "rdp")}
opacus_after_eps = "opacus" in sys.modules
try:
    DPTrainingArguments(output_dir=sys.argv[1], noise_multiplier=1.0, disk_kappa=0.6)
    refused = ""
except ValueError as err:
    refused = str(err)
from hf_dpfilter.accounting.rdp_analysis import opacus_rdp
from opacus.accountants.analysis import rdp as imported
orders = [1.5, 2.0, 8.0, 64.0]
same = bool(np.array_equal(opacus_rdp().compute_rdp(q=0.0625, noise_multiplier=1.0, steps=5, orders=orders),
                           imported.compute_rdp(q=0.0625, noise_multiplier=1.0, steps=5, orders=orders)))
print("RESULT", json.dumps({"methods": methods_after_args, "opacus": opacus_after_eps, "eps": eps,
                            "refused": refused, "same_rdp": same}))
"""


def test_arguments_and_the_banner_epsilon_import_no_method_module_and_no_opacus(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True,
                          env=env,
                          check=False, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["methods"] == [], result["methods"]
    assert result["opacus"] is False
    # a keyword that is not a field is still checked
    assert "'disk_kappa' is no longer accepted" in result["refused"]
    assert result["same_rdp"] is True  # Opacus' file run alone gives Opacus' values
    assert 0 < result["eps"]["prv"] <= result["eps"]["rdp"]
