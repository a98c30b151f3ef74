"""`make gpu-report`: one clear line and exit 0 without CUDA; on a GPU, tables built from the steps' results.

The GPU steps themselves need a GPU; here the report is checked on saved results of the formats the steps
write (speed_memory.py's and recipe_throughput.py's JSON, pytest's JUnit XML), and every step's command line
names a script and flags that exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import gpu_report  # noqa: E402  (the checkout's benchmarks package: tests run from its root)
from benchmarks.__main__ import SUBCOMMANDS  # noqa: E402


def test_without_cuda_it_prints_one_line_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_PYTHON=sys.executable)  # no GPU, whatever the machine
    proc = subprocess.run(["make", "-s", "gpu-report"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [gpu_report.NO_CUDA], lines


def test_every_step_runs_existing_scripts_with_their_flags(tmp_path):
    for step in gpu_report.STEPS:
        for command in gpu_report.step_commands(step, str(tmp_path), "data"):
            assert command[0] == sys.executable
            if command[1:3] == ["-m", "pytest"]:
                target = next(a for a in command if a.startswith("tests/"))
            else:  # python -m benchmarks <sub-command> ...
                assert command[1:3] == ["-m", "benchmarks"] and command[3] in SUBCOMMANDS, command
                target = f"benchmarks/{SUBCOMMANDS[command[3]].module}.py"
            path = os.path.join(ROOT, target)
            assert os.path.isfile(path), target
            if target.startswith("benchmarks/"):
                source = open(path).read()
                for flag in (a for a in command if a.startswith("--")):
                    assert f'"{flag}"' in source, (target, flag)
    # the speed table covers the models, full and LoRA, and both precisions are steps
    cases = {(m, mode) for m, mode, _, _ in gpu_report.SPEED_CASES}
    for model in ("roberta", "roberta-large", "gpt2", "gpt2-medium"):
        assert {(model, "full"), (model, "lora")} <= cases
    assert {"speed_bf16", "speed_fp32", "methods", "recipe", "tests", "sft"} == set(gpu_report.STEPS)
    assert sum(gpu_report.TIME_LIMITS.values()) <= 27 * 60  # about 25 minutes on one H100


def _speed_rows(case: str, ours: float, memory: float, opacus: float | None) -> list[dict]:
    rows = [{"case": case, "variant": "non-private", "time_s": 0.1, "time_ratio": 1.0, "grad_ratio": 1.0,
             "peak_mb": 1000.0, "mem_ratio": 1.0, "note": ""},
            {"case": case, "variant": "hf_dpfilter", "time_s": 0.1 * ours, "time_ratio": ours, "grad_ratio": ours,
             "peak_mb": 1000.0 * memory, "mem_ratio": memory, "note": ""}]
    if opacus is None:
        rows.append({"case": case, "variant": "opacus", "note": "not run: ghost: parameter tying"})
    else:
        rows.append({"case": case, "variant": "opacus", "time_s": 0.1 * opacus, "time_ratio": opacus,
                     "grad_ratio": opacus, "peak_mb": 1300.0, "mem_ratio": 1.3, "note": "ghost"})
    return rows


def test_tables_from_saved_results_go_between_the_cuda_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    bf16 = _speed_rows("roberta full B=32 T=128", 1.2, 1.1, 2.0) + _speed_rows("gpt2 full B=16 T=512", 1.4, 1.3, None)
    (results / "speed_cuda_bf16.json").write_text(json.dumps({"rows": bf16, "methods": []}))
    methods = [{"case": "roberta full B=32 T=128", "method": m, "step_s": 0.1 * r, "step_ratio": r,
                "opt_step_s": 0.01, "opt_extra_frac": 0.02} for m, r in (("dpsgd", 1.0), ("diff2", 1.9))]
    (results / "speed_cuda_methods.json").write_text(json.dumps({"rows": [], "methods": methods}))
    recipe = {"rows": [{"method": m, "train_runtime": t, "steps_time": t - 0.5, "steps": 60, "rest": 0.5}
                       for m, t in (("none", 10.0), ("dpsgd", 12.0))],
              "end_to_end_ratio": 1.2, "step_ratio": 1.21, "arguments": {"steps": 60, "batch": 32, "repeats": 1}}
    (results / "recipe_throughput_cuda.json").write_text(json.dumps(recipe))
    (results / "tests_cuda.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda" name="test_b"/>'
        '<testcase classname="tests.test_cuda" name="test_c"><failure message="x"/></testcase></testsuite></testsuites>')
    meta = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-25 14:00 UTC", "torch": "2.13.0", "cuda": "13.0",
            "steps": [{"step": "speed_fp32", "status": "timed out", "seconds": 420.0, "log": "speed_fp32.log"}]}
    text = gpu_report.render(str(results), meta)
    assert "## GPU report: NVIDIA H100 80GB HBM3, 2026-11-25 14:00 UTC" in text
    assert "`tests/test_cuda.py`: 2 passed, 1 failed, 0 skipped -- failed: tests.test_cuda.test_c" in text
    assert "`tests/test_cuda_sensitivity.py -k 'not cpu'`: not run" in text
    assert "| roberta full B=32 T=128 | 1.20x met | 1.10x met | 2.00x | yes (1.67x) |" in text
    assert "| gpt2 full B=16 T=512 | 1.40x **missed** | 1.30x **missed** | - | - |" in text
    assert "fp32 (timed out, 7.0 min)" in text and "Not measured." in text
    assert "| roberta full B=32 T=128 | diff2 | 0.190 s | 1.90x |" in text
    assert "| dpsgd | 12.00 s | 11.50 s | 0.50 s | 160.0 |" in text  # 60 steps x 32 examples / 12 s
    doc = tmp_path / "performance.md"
    shutil.copy(os.path.join(ROOT, "docs", "performance.md"), doc)
    before = doc.read_text()
    gpu_report.write_into(str(doc), text)
    after = doc.read_text()
    head = before.split(gpu_report.BEGIN_CUDA)[0]
    tail = before.split(gpu_report.END_CUDA)[1]
    assert after == head + gpu_report.BEGIN_CUDA + "\n" + text + gpu_report.END_CUDA + tail
    with pytest.raises(SystemExit, match="markers"):
        gpu_report.write_into(str(tmp_path / "results" / "speed_cuda_bf16.json"), text)


def test_performance_doc_says_the_gpu_figures_are_still_to_be_measured():
    text = open(os.path.join(ROOT, "docs", "performance.md")).read()
    block = text.split(gpu_report.BEGIN_CUDA)[1].split(gpu_report.END_CUDA)[0]
    if "## GPU report:" not in block:  # until a GPU run has filled the markers, the doc says so plainly
        assert re.search(r"GPU figures .* still to be measured", text), "docs/performance.md must say so"
    assert "make gpu-report" in text


def test_the_tests_step_runs_and_its_counts_reach_the_report(tmp_path):
    """The real `tests` step (on CPU every CUDA case skips): subprocesses, JUnit files, the counts in the tables."""
    done = gpu_report.run_step("tests", str(tmp_path), "no-data", limit=300)
    assert done["status"] == "ok", (tmp_path / "tests.log").read_text()[-3000:]
    text = gpu_report.render(str(tmp_path), {"device": "d", "date": "t", "steps": [done]})
    counts = re.findall(r"`tests/test_cuda(?:_sensitivity)?\.py[^`]*`: (\d+) passed, (\d+) failed, (\d+) skipped", text)
    assert len(counts) == 2 and all(int(skipped) > 0 for _, _, skipped in counts), text
    import torch

    if not torch.cuda.is_available():  # only CUDA cases were selected: all skipped, none run on the CPU
        assert [passed for passed, _, _ in counts] == ["0", "0"], text
    skipped = gpu_report.run_step("recipe", str(tmp_path), str(tmp_path / "no-e2e"), limit=10)
    assert skipped["status"] == "skipped" and "no E2E CSV files" in skipped["note"]
