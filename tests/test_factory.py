"""The plan is declarative and ONE factory builds what runs it.

* No import circle in ``hf_dpfilter`` (every import, module level or inside a function, except
  ``TYPE_CHECKING`` blocks), and the plan imports no engine and no optimizer, statically and at run time.
* Only ``hf_dpfilter/factory.py`` constructs a clipping engine, a DP optimizer or a batch sampler in the
  package; no module assigns ``__class__`` (the audit's weakened mechanisms are built by the factory, never by
  changing a live optimizer).
* ``make_private`` returns a consistent engine, optimizer and sampler; the audit's options build an observed
  (and optionally weakened) optimizer class before any optimizer exists.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import tiny_bert

from hf_dpfilter import PrivacyPlan, make_private
from hf_dpfilter.factory import AuditOptions, make_optimizer
from hf_dpfilter.optimizers.base import DPOptimizer
from hf_dpfilter.randomness.sampling import PoissonBatchSampler

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_dpfilter"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of hf_dpfilter it imports}`` (``hf_dpfilter`` itself, the lazy facade, excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def add(source: str, target: str) -> None:
        # the module named (``from a.b import c``: a.b.c if it is a module, else a.b); a package's __init__
        # that runs first is the package's business, not an edge (else every package would be a circle)
        parts = target.split(".")
        for i in range(len(parts), 1, -1):
            candidate = ".".join(parts[:i])
            if candidate in modules:
                if candidate != source:
                    graph[source].add(candidate)
                return

    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

        def visit(node: ast.AST, name: str = name, package: list[str] = package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for other in child.orelse:
                        visit(other)
                    continue
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(name, alias.name)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                    add(name, base)
                    for alias in child.names:
                        add(name, f"{base}.{alias.name}")
                visit(child)

        visit(ast.parse(path.read_text()))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_circle_in_the_package():
    assert _cycles(import_graph()) == []


def test_the_plan_imports_no_engine_and_no_optimizer():
    reachable = _reachable(import_graph(), "hf_dpfilter.plan")
    assert "hf_dpfilter.factory" not in reachable
    assert not {m for m in reachable if m.startswith("hf_dpfilter.engine")
                or m == "hf_dpfilter.optimizers.base"}
    # at run time too: creating (and describing) a DP-SGD plan loads neither the engine nor an optimizer
    code = (
        "import sys\nfrom hf_dpfilter.plan import PrivacyPlan\n"
        "plan = PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, noise_multiplier=1.0)\n"
        "plan.describe(10)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('hf_dpfilter.engine', "
        "'hf_dpfilter.optimizers.base', 'hf_dpfilter.factory'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


_BUILT_BY_THE_FACTORY = {"GhostClippingEngine", "PoissonBatchSampler", "ShuffledBatchSampler",
                         "UserPoissonBatchSampler", "optimizer_class"}


def test_only_the_factory_builds_engines_optimizers_and_samplers():
    offenders = []
    for name, path in _modules().items():
        if name == "hf_dpfilter.factory":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = getattr(func, "id", None) or getattr(func, "attr", None)
                if called in _BUILT_BY_THE_FACTORY:
                    offenders.append(f"{name}:{node.lineno} calls {called}")
            if isinstance(node, ast.Attribute) and node.attr == "optimizer_class" and isinstance(node.ctx,
                                                                                                 ast.Load):
                offenders.append(f"{name}:{node.lineno} reads a method's optimizer class")
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets
            ):
                offenders.append(f"{name}:{node.lineno} assigns __class__")
    assert offenders == []


def test_make_private_builds_one_consistent_run():
    model = tiny_bert(num_labels=2)
    plan = PrivacyPlan.create(num_examples=64, logical_batch_size=8, epochs=1, noise_multiplier=1.0,
                              method="disk",
                              per_sample_max_grad_norm=0.5, seed=3)
    engine, optimizer, sampler = make_private(plan, model, torch.optim.AdamW, lr=1e-3)
    assert optimizer.plan is plan and optimizer.method_name == "disk"
    assert isinstance(optimizer.original_optimizer, torch.optim.AdamW)
    assert set(engine.trainable_parameters) == {p for p in model.parameters() if p.requires_grad}
    assert isinstance(sampler, PoissonBatchSampler) and sampler.sample_rate == plan.sample_rate
    # a plan without a data set has no sampler; the null plan no engine
    no_data = PrivacyPlan.for_optimizer(noise_multiplier=1.0, sample_rate=0.1, expected_batch_size=4.0,
                                        seed=0)
    assert make_private(no_data, model).sampler is None
    null = PrivacyPlan.create(num_examples=64, logical_batch_size=8, epochs=1, method="none", seed=0)
    assert make_private(null, model).engine is None


class _Weakened(DPOptimizer):
    pass


def test_audit_options_build_an_observed_class_before_the_optimizer_exists():
    seen = []
    plan = PrivacyPlan.for_optimizer(noise_multiplier=0.0, sample_rate=1.0, expected_batch_size=1.0, seed=0)
    param = torch.nn.Parameter(torch.zeros(3))
    options = AuditOptions(weakened=_Weakened, observe_release=lambda released,
                           opt: seen.append(released[param]))
    optimizer = make_optimizer(plan, [param], lr=1.0, audit=options)
    assert type(optimizer).__mro__[1] is _Weakened and type(optimizer).__name__ == "Audited_Weakened"
    optimizer.accumulate(None, None, batch_size=0)
    optimizer.step()
    assert len(seen) == 1 and torch.equal(seen[0], torch.zeros(3))
    # a real run: the method's own class, untouched
    assert type(make_optimizer(plan, [torch.nn.Parameter(torch.zeros(1))], lr=1.0)) is DPOptimizer
    with pytest.raises(TypeError, match="must subclass DPOptimizer"):
        AuditOptions(weakened=torch.optim.SGD).optimizer_class(DPOptimizer)


# ----------------------------------------------------------------------------- one check of the DP settings
BAD_SETTINGS = [
    ({"clipping_fn": "soft"}, "clipping_fn must be one of"),
    ({"accountant": "moments"}, "accountant must be one of"),
    ({"per_sample_max_grad_norm": 0.0}, "per_sample_max_grad_norm must be > 0, got 0.0: it is the "
                                         "per-example clipping norm C"),
    ({"method": "dp-fancy"}, "Unknown dp_method 'dp-fancy': dp_method must be one of"),
    ({"method": "disk", "method_args": {"kapa": 1}}, "'kapa' is not a setting of dp_method='disk'"),
    ({"target_epsilon": 1.0}, r"exactly one of target_epsilon and noise_multiplier \(both"),
    ({"noise_multiplier": -1.0}, "noise_multiplier must be >= 0"),
    ({"target_delta": 1.5}, r"target_delta must be in \(0, 1/N\)"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_SETTINGS, ids=[m for _, m in BAD_SETTINGS])
def test_the_arguments_and_the_plan_share_one_check(tmp_path, bad, message):
    """Each DP setting is checked by hf_dpfilter.plan.check_dp_settings: the same message from the arguments
    (before any model is loaded) and from the plan."""
    from hf_dpfilter import DPTrainingArguments

    plan_kwargs = {"noise_multiplier": 1.0, **bad}
    with pytest.raises(ValueError, match=message):
        PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, **plan_kwargs)
    names = {"method": "dp_method", "method_args": "dp_method_args"}
    args_kwargs = {names.get(k, k): v for k, v in plan_kwargs.items()}
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **args_kwargs)
