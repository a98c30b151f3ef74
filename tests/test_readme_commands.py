"""Every command the README's "Recipes" block and the recipes' ``--help`` examples show runs as written.

The commands are read from the files themselves (so they cannot rot) and run in order with bash from the
repository root, with this interpreter's folder first on PATH (``python`` and ``accelerate`` of the venv).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def _join_continuations(lines: list[str]) -> list[str]:
    commands, current = [], ""
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1].strip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return commands


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- commands -->\n```bash\n(.*?)```", text, flags=re.S)
    assert match, "README.md lost its <!-- commands --> block"
    return _join_continuations(match.group(1).splitlines())


def help_example_commands() -> list[str]:
    commands = []
    for script in ("glue.py", "table2text.py"):
        result = subprocess.run([sys.executable, str(ROOT / "recipes" / script), "--help"], capture_output=True,
                                text=True, check=True, cwd=ROOT)
        block = result.stdout.split("Examples::", 1)[1]
        lines = []
        for line in block.splitlines()[1:]:
            if line and not line.startswith("    "):
                break  # the end of the indented examples
            lines.append(line)
        commands += _join_continuations(lines)
    return commands


def test_the_help_shows_the_same_commands_as_the_readme():
    assert set(help_example_commands()) == set(readme_commands())


@pytest.mark.skipif(not (DATA / "glue" / "SST-2").exists() or not (DATA / "e2e").exists(), reason="no ../shared/data")
def test_readme_commands_run_as_written(capsys):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    timings = []
    for command in readme_commands():
        start = time.time()
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
        timings.append((time.time() - start, command))
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if "recipes/" in command:
            assert "Privacy plan:" in result.stdout and "WARNING: Only 3 optimizer steps" in result.stdout
    with capsys.disabled():
        for seconds, command in timings:
            print(f"\n  {seconds:6.1f} s  {command[:110]}")
