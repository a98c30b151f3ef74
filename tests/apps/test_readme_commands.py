"""Every shell command the README shows runs as printed, after ``make demo`` or ``make test`` created
``.venv``.

The commands are read from the files themselves, so a new one is covered without touching this test: every
fenced ``bash`` block of README.md and docs/*.md. The HTML comment on the line just above a block says how it
is checked:

* no marker (or a label such as ``<!-- commands -->``): run in order with bash from the repository root, as
  printed -- nothing on PATH is assumed, so each command names ``.venv/bin/...`` or a ``make`` target;
* ``<!-- slow: why -->``: run only by the slow test (``pytest -m slow``);
* ``<!-- not-run: why -->``: never run here (GPUs, the set-up itself); still checked statically.

Statically, every command (README and docs, fenced or indented) that runs a repository script names a file
that exists and only flags that the script defines, and the recipes' ``--help`` examples equal the README's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import recipe_flags, recipe_help

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int
    marker: str  # "" (run), "slow", "not-run" or a plain label such as "commands"
    reason: str
    commands: list[str]

    @property
    def kind(self) -> str:
        return self.marker if self.marker in ("slow", "not-run") else "run"


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


def bash_blocks(path: Path) -> list[Block]:
    """The fenced ``bash`` blocks of ``path`` with the marker on the line above each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh", "```shell"):
            above = lines[i - 1].strip() if i else ""
            match = MARKER.match(above)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append(Block(path, i + 1, match.group(1) if match else "",
                                (match and match.group(2)) or "",
                                _join_continuations(lines[i + 1:end])))
            i = end
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in bash_blocks(path)]


def readme_commands() -> list[str]:
    """The README's recipe block (label ``<!-- commands -->``), which the recipes' ``--help`` repeats."""
    labelled = [b for b in bash_blocks(ROOT / "README.md") if b.marker == "commands"]
    assert len(labelled) == 1, "README.md lost its <!-- commands --> block"
    return labelled[0].commands


def help_example_commands() -> list[str]:
    commands = []
    for script in ("glue.py", "table2text.py"):
        block = recipe_help(script).split("Examples::", 1)[1]
        lines = []
        for line in block.splitlines()[1:]:
            if line and not line.startswith("    "):
                break  # the end of the indented examples
            lines.append(line)
        commands += _join_continuations(lines)
    return commands


def test_the_help_shows_the_same_commands_as_the_readme():
    assert set(help_example_commands()) == set(readme_commands())


def test_the_readme_has_the_blocks_this_test_runs():
    kinds = [b.kind for b in bash_blocks(ROOT / "README.md")]
    assert kinds.count("run") >= 2 and "slow" in kinds and "not-run" in kinds, kinds
    for block in all_blocks():
        assert block.commands, f"{block.path.name}:{block.line}: an empty bash block"
        if block.kind != "run":
            assert block.reason, f"{block.path.name}:{block.line}: say why the block is {block.kind}"


def test_every_command_runs_without_an_activated_venv():
    """`accelerate launch ...` failed on a fresh clone unless the reader had activated .venv; say where it
    is."""
    for block in all_blocks():
        for command in block.commands:
            program = shlex.split(command)[0]
            assert program == "make" or program.startswith(".venv/bin/"), (
                f"{block.path.name}:{block.line}: {command[:80]!r} needs an activated venv: write "
                f".venv/bin/{program}"
            )


# -------------------------------------------------------------------------------------- static checks
_SCRIPT = re.compile(r"(?:^|[\s`(])(?:[^\s`]*/)?python3?\s+"
                     r"((?:benchmarks|examples|recipes|tests)/[\w/]+\.py)((?:\s+[^`|;&#]*)?)")
_LAUNCH = re.compile(r"(?:^|\s)(?:\S*/)?(?:accelerate "
                     r"launch|torchrun)\b[^`]*?\s((?:recipes|examples|benchmarks)/[\w/]+\.py)((?:\s+[^`|;&#]*)?)")
_MODULE = re.compile(r"(?:^|\s)(?:\S*/)?python3?\s+-m\s+(hf_dpfilter[\w.]*)")
_BENCHMARK = re.compile(r"(?:^|[\s`(])(?:\S*/)?python3?\s+-m\s+benchmarks\s+([a-z][\w-]*)((?:\s+[^`|;&#]*)?)")


def _benchmark_module(subcommand: str) -> str:
    """``benchmarks/<module>.py`` of a ``python -m benchmarks <sub-command>`` (the one entry point's
    registry)."""
    from benchmarks.__main__ import SUBCOMMANDS

    assert subcommand in SUBCOMMANDS, f"python -m benchmarks {subcommand}: no such sub-command"
    return f"benchmarks/{SUBCOMMANDS[subcommand].module}.py"


def _script_mentions() -> list[tuple[str, str, str]]:
    """(where, script, the rest of its command line) for every script a README/docs command runs."""
    found = []
    for path in DOCS:
        # continuation lines, in blocks and indented commands
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for number, line in enumerate(text.splitlines(), 1):
            for pattern in (_SCRIPT, _LAUNCH):
                for match in pattern.finditer(line):
                    found.append((f"{path.name}:{number}", match.group(1), match.group(2) or ""))
            for match in _BENCHMARK.finditer(line):
                found.append((f"{path.name}:{number}", _benchmark_module(match.group(1)),
                              match.group(2) or ""))
    return found


def test_documented_scripts_exist_and_take_the_flags_shown():
    """Cheap check of every command in README.md and docs/*.md, including the ones too slow to run here."""
    mentions = _script_mentions()
    assert len(mentions) > 20, mentions  # the pattern still finds the docs' commands
    for where, script, rest in mentions:
        path = ROOT / script
        assert path.is_file(), f"{where}: {script} does not exist"
        source = path.read_text()
        if script.startswith("tests/"):
            continue  # pytest's flags
        # the recipes' flags are their HfArgumentParser's (dataclass fields, not strings in the source): the
        # ones --help lists
        flags = recipe_flags(path.name) if script.startswith("recipes/") else None
        for flag in re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", rest):
            if flag in ("--help",):
                continue
            if flags is not None:
                assert flag in flags, f"{where}: {script} has no flag {flag}"
            else:
                assert f'"{flag}"' in source or f"'{flag}'" in source, f"{where}: {script} has no flag {flag}"


def test_documented_modules_exist():
    import importlib.util

    for path in DOCS:
        for module in _MODULE.findall(path.read_text()):
            if module == "hf_dpfilter":
                continue
            assert importlib.util.find_spec(module) is not None, f"{path.name}: no module {module}"


# ------------------------------------------------------------------------------------------ running
def _run_blocks(kind: str, capsys) -> None:
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv in the repository root (make demo / make test creates it)")
    # No PATH changes: the commands must run as printed. PYTHONPATH: this checkout's package, also for the
    # recipes that `accelerate launch` starts from recipes/ (an editable install may point at another
    # checkout).
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    timings = []
    for block in all_blocks():
        if block.kind != kind:
            continue
        for command in block.commands:
            start = time.time()
            result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                                    text=True)
            timings.append((time.time() - start, command))
            assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            if "recipes/" in command and "--max_train_samples 1000" in command:
                assert "Privacy plan:" in result.stdout and re.search(r"WARNING: Only [34] optimizer steps",
                                                                      result.stdout)
    assert timings, f"no {kind} block"
    with capsys.disabled():
        for seconds, command in timings:
            print(f"\n  {seconds:6.1f} s  {command[:110]}")


@pytest.mark.skipif(not (DATA / "glue" / "SST-2").exists() or not (DATA / "e2e").exists(),
                    reason="no ../shared/data")
def test_readme_commands_run_as_written(capsys):
    _run_blocks("run", capsys)


@pytest.mark.slow
def test_slow_readme_commands_run_as_written(capsys):
    _run_blocks("slow", capsys)


def test_the_readme_is_a_five_minute_read():
    """The README is the entry point: what it is, the two commands, the quickstart, the methods with what they
    measured, the guarantee, links. Everything else lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 180, f"README.md has {len(lines)} lines: move the detail to docs/"
