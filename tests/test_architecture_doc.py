"""docs/architecture.md's example method runs as printed: registered, trained end to end, accounted as DP-SGD.

The doc says adding a method is one file plus one registry line; this test executes the doc's code block
(``register_method`` with the real signature), trains a tiny model with ``DPTrainer(dp_method="ema")``, checks
that the update is the documented average of the privatized gradients, and that the doc's registry line has
the shape of the real table's lines and names the example's classes.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.optimizers import make_dp_optimizer, registry

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture
def ema(monkeypatch, tmp_path):
    """The doc's example as a user's module, imported; the registration is undone afterwards."""
    monkeypatch.setattr(registry, "_custom", dict(registry._custom))
    path = tmp_path / "architecture_doc_example.py"
    path.write_text(_python_blocks()[0])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    assert "ema" in registry.method_names()
    return module


def test_the_doc_registry_line_matches_the_table_and_the_example():
    example, line = _python_blocks()[:2]
    entry = ast.literal_eval("{" + line.strip().rstrip(",") + "}")
    (name, (config_path, optimizer_path)), = entry.items()
    (module, config_name), (optimizer_module,
                            optimizer_name) = config_path.split(":"), optimizer_path.split(":")
    assert module == optimizer_module == f"hf_dpfilter.optimizers.{name}"
    assert (f"class {config_name}(MethodConfig)" in example
            and f"class {optimizer_name}(DPOptimizer)" in example)
    table = Path(registry.__file__).read_text()
    built_in = re.findall(r'^    "(\w+)": \("hf_dpfilter\.optimizers\.\w+:\w+", '
                          r'"hf_dpfilter\.optimizers\.\w+:\w+"\),$', table, re.MULTILINE)
    # the doc's line has the shape of the real table's lines
    assert "dpsgd" in built_in and "disk" in built_in


def test_the_example_method_post_processes_the_privatized_gradient(ema):
    """``postprocess`` hands the base optimizer the documented average of the privatized gradients."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = make_dp_optimizer([weight], torch.optim.SGD, method="ema", method_args={"beta": 0.5}, lr=1.0,
                                  noise_multiplier=0.0, per_sample_max_grad_norm=1e6, expected_batch_size=1)
    grads = [torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
             torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64)]
    expected_average = [grads[0], 0.5 * grads[0] + 0.5 * grads[1]]
    for grad, average in zip(grads, expected_average):
        before = weight.detach().clone()
        out = optimizer.postprocess({weight: grad.clone()})
        assert torch.equal(out[weight], average)
        assert torch.equal(weight.detach(), before)  # postprocess alone does not step
    assert type(optimizer).__name__ == "EMAOptimizer" and optimizer.config.beta == 0.5


def test_the_example_method_trains_end_to_end_and_is_accounted_as_dpsgd(ema, tmp_path):
    def run(method: str, **method_args):
        torch.manual_seed(0)
        args = DPTrainingArguments(
            output_dir=str(tmp_path / method), report_to=[], use_cpu=True, save_strategy="no",
            remove_unused_columns=False, dp_method=method, dp_method_args=method_args or None,
            noise_multiplier=1.0, per_sample_max_grad_norm=1.0, logical_batch_size=4,
            per_device_train_batch_size=4,
            max_steps=3, learning_rate=1e-2, seed=0,
        )
        trainer = DPTrainer(model=tiny_roberta(), args=args,
                            train_dataset=ListDataset(make_examples(16, VOCAB, False)),
                            data_collator=PadCollator(1))
        trainer.train()
        return trainer

    with pytest.raises(ValueError, match="beta must be in"):
        DPTrainingArguments(output_dir=str(tmp_path), dp_method="ema", dp_method_args={"beta": 1.0},
                            noise_multiplier=1.0)
    trainer = run("ema", beta=0.8)
    report = trainer.privacy_report()
    assert report["method"] == "ema" and report["steps"] == 3
    assert trainer.dp_optimizer._average is not None  # the method's post-processing ran
    assert set(trainer.dp_optimizer.method_state_dict()) == {"average"}
    reference = run("dpsgd").privacy_report()
    # DP-SGD's accounting, unchanged
    assert report["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-9)
