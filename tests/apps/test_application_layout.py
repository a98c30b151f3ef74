"""The package is the privacy machinery only: the demo, the pretrained-model helpers, plots and metrics live
beside it.

``hf_dpfilter/`` imports none of the application code (``recipes``, ``examples``, ``benchmarks`` and what used
to live in the package: ``demo``, ``models``, ``plotting``, ``generation_metrics``, ``metrics``); the
application code runs from a checkout, started by path, from any working directory.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import script_help

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_dpfilter"

#: application code: top-level packages of the checkout, and the package's former application modules
APPLICATION = ("recipes", "examples", "benchmarks")
MOVED_OUT = ("demo", "models", "plotting", "generation_metrics", "metrics")
FORBIDDEN = APPLICATION + tuple(f"hf_dpfilter.{name}" for name in MOVED_OUT)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module an ``import``/``from`` names (relative ones resolved), and every string constant naming a
    module under ``hf_dpfilter.`` (the lazy ``_EXPORTS`` table, ``importlib.import_module`` arguments)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # from pkg import submodule
        elif isinstance(node, ast.Constant) and isinstance(node.value,
                                                           str) and node.value.startswith("hf_dpfilter."):
            found.add(node.value)
    return found


def _is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def test_the_package_imports_no_application_code():
    offenders = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, files  # the walk found the package
    for path in files:
        offenders += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(_imported_modules(path))
                      if _is_forbidden(m)]
    assert not offenders, "the library imports application code:\n" + "\n".join(offenders)


def test_the_checker_sees_each_kind_of_import():
    """The AST walk catches absolute, relative, ``from pkg import module`` and lazy-table imports."""
    fake = ROOT / "hf_dpfilter" / "optimizers" / "x.py"  # only its path is used, to resolve relative imports
    cases = {
        "import recipes.common.models": "recipes.common.models",
        "from ..plotting import plot_run": "hf_dpfilter.plotting",
        "from hf_dpfilter import metrics": "hf_dpfilter.metrics",
        "_EXPORTS = {'packaged_model_path': 'hf_dpfilter.models'}": "hf_dpfilter.models",
        "from benchmarks import setup": "benchmarks",
    }
    for source, expected in cases.items():
        tree_modules = _imported_modules(fake, source)
        assert expected in tree_modules and any(_is_forbidden(m) for m in tree_modules), (source,
                                                                                          tree_modules)


def test_the_moved_modules_are_gone_from_the_package_and_its_exports():
    import hf_dpfilter

    for name in MOVED_OUT:
        assert not (PACKAGE / f"{name}.py").exists() and not (PACKAGE / name).exists(), name
    assert "packaged_model_path" not in hf_dpfilter.__all__
    with pytest.raises(AttributeError):
        hf_dpfilter.packaged_model_path  # noqa: B018
    for relative in ("recipes/common/models.py", "recipes/common/plotting.py", "recipes/common/data.py",
                     "recipes/common/generation_metrics.py", "recipes/common/metrics/__init__.py",
                     "examples/demo.py"):
        assert (ROOT / relative).is_file(), relative


def test_make_demo_runs_the_example_script():
    makefile = (ROOT / "Makefile").read_text()
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "examples/demo.py" in demo and "hf_dpfilter.demo" not in makefile, demo


@pytest.mark.parametrize("script", ["examples/demo.py", "recipes/glue.py", "recipes/table2text.py"])
def test_application_scripts_start_by_path_from_any_directory(script):
    """A fresh interpreter, started elsewhere, with nothing on PYTHONPATH: the script finds recipes.common.
    (The run is shared with the tests that read the recipes' --help text.)"""
    proc = script_help(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


def test_metrics_load_offline_from_a_script_started_elsewhere(tmp_path):
    """``evaluate.load`` of the moved metric scripts works from a recipe-like script in another directory."""
    script = tmp_path / "score.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from recipes.common.metrics import load\n"
        "print(load('accuracy').compute(predictions=[1, 0], references=[1, 1])['accuracy'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == 0.5
