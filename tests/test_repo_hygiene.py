"""The repository stands on its own: no file cites internal working material or a machine-specific path.

Code, docs and tests may cite papers and the project's own docs (``docs/*.md``). They must not point at a
private folder of working material outside the repository, cite that material by section, or use an
absolute path into the machine's work area. Relative references such as ``../shared/data`` (the documented
default data location beside the checkout) are fine.

The patterns are assembled from pieces so that this file does not match its own checks.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache",
              ".mypy_cache", "node_modules", "wandb", "runs", "outputs"}
_BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".pt", ".bin", ".safetensors", ".npz", ".npy",
                    ".pkl", ".zip", ".gz", ".tar", ".whl", ".so", ".pyc", ".ico", ".woff", ".woff2", ".ttf"}
_MAX_BYTES = 2_000_000

_NOTES = "no" + "tes"
_WORK = "wo" + "rk"
_NOTE_FILES = "|".join(["audit", "disk", "doppler", "dicesgd", "diff2", "pmlf", "prior-art"])

# (description, compiled pattern)
_CHECKS: list[tuple[str, re.Pattern[str]]] = [
    ("path into the private working-material folder", re.compile(re.escape("shared" + "/" + _NOTES))),
    # An absolute path starting at the work area's root: not preceded by a word character, a dot
    # (a relative "../"), a colon or a slash (inside a URL the path has a word character before it).
    ("absolute path into the machine's work area", re.compile(r"(?<![\w.:/~-])/" + _WORK + r"/")),
    # Citations of the working material: "<topic> N", "the N", "N section 4.1", "N' table" with N = _NOTES.
    ("citation of private working material",
     re.compile(rf"\b(?:{_NOTE_FILES}|the|internal|developer)\s+{_NOTES}\b", re.IGNORECASE)),
    ("citation of private working material",
     re.compile(rf"\b{_NOTES}(?:'|\s+(?:section|sec\.|§))", re.IGNORECASE)),
    # A file of that material cited by name ("<topic>.md sec. 4.2"); the project's docs/<name>.md is allowed.
    ("citation of a private working-material file", re.compile(rf"(?<![\w/.-])(?:{_NOTE_FILES})\.md\b")),
]


def _candidate_files() -> list[Path]:
    """Tracked files plus untracked, non-ignored ones (new files count too); os.walk if git is unavailable."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout
        names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
        if names:
            return [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        files.extend(Path(dirpath) / f for f in filenames)
    return files


def _read_text(path: Path) -> str | None:
    if path.suffix.lower() in _BINARY_SUFFIXES or not path.is_file() or path.is_symlink():
        return None
    try:
        if path.stat().st_size > _MAX_BYTES:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_internal_references():
    problems = []
    scanned = 0
    for path in _candidate_files():
        text = _read_text(path)
        if text is None:
            continue
        scanned += 1
        rel = path.relative_to(ROOT).as_posix()
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pattern in _CHECKS:
                if pattern.search(line):
                    problems.append(f"{rel}:{lineno}: {what}: {line.strip()[:160]}")
    assert scanned > 10, f"only {scanned} text files found under {ROOT}"
    assert not problems, "internal references found (cite papers or docs/ instead):\n" + "\n".join(problems)


def test_patterns_catch_what_they_should():
    def hits(line: str) -> bool:
        return any(p.search(line) for _, p in _CHECKS)

    bad = [
        "see /" + _WORK + "/shared/data for the files",
        '"/' + _WORK + '/main/.venv/bin/python"',
        "Reference numbers come from ../shared/" + _NOTES + "/audit.md",
        "(audit " + _NOTES + " section 4.1)",
        "matches the " + _NOTES + "' exact-GDP table",
        "the DiSK " + _NOTES + " (disk" + ".md sec. 4.2)",
        "as the PMLF " + _NOTES + " predict",
        _NOTES.capitalize() + " section 10.2: expected values",
    ]
    good = [
        "cite docs/audit.md §4 and docs/privacy.md",
        "python recipes/glue.py --data_dir ../shared/data/glue",
        "https://github.com/example/" + _WORK + "/blob/main/x.py",
        "    " + _NOTES + ": dict[str, str] = {}",
        "Steinke, Nasr & Jagielski 2023, Appendix D",
    ]
    assert [line for line in bad if not hits(line)] == []
    assert [line for line in good if hits(line)] == []
