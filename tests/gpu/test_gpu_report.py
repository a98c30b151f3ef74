"""`make gpu-report`: one clear line and exit 0 without CUDA; on a GPU, tables built from the steps' results,
within a time budget.

The GPU steps themselves need a GPU; here the report is checked on saved results of the formats the steps
write (speed_memory.py's and recipe_throughput.py's JSON, pytest's JUnit XML), every step's command line
names a script and flags that exist, the budget logic runs on fake steps (commands that write results and
sleep), and the wheels a GPU machine without network needs are listed without the network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpu_report  # noqa: E402  (the checkout's benchmarks package: tests run from its root)
from benchmarks.__main__ import SUBCOMMANDS  # noqa: E402


def test_without_cuda_it_prints_one_line_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_PYTHON=sys.executable)  # no GPU, whatever the machine
    proc = subprocess.run(["make", "-s", "gpu-report", "GPU_REPORT_ARGS=--budget-s 60"], cwd=ROOT,
                          capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [gpu_report.NO_CUDA], lines
    # the budget reaches the command: BUDGET_S (default 480), and GPU_REPORT_ARGS after it (the last flag
    # wins)
    for extra, flags in (([], "--budget-s 480"), (["BUDGET_S=60"], "--budget-s 60"),
                         (["GPU_REPORT_ARGS=--budget-s 30"], "--budget-s 480 --budget-s 30")):
        dry = subprocess.run(["make", "-n", "gpu-report", *extra], cwd=ROOT, capture_output=True, text=True,
                             env=env)
        assert f"-m benchmarks gpu-report {flags}" in dry.stdout, dry.stdout + dry.stderr


def test_every_step_runs_existing_scripts_with_their_flags(tmp_path, monkeypatch):
    # real-length then adds --tasks e2e: checked too
    monkeypatch.setattr(gpu_report, "_has_minilm", lambda: False)
    for step in gpu_report.STEPS:
        if step == "real_length" and "real-length" not in SUBCOMMANDS:  # another branch adds it
            assert gpu_report.unavailable(step, "data", "data") is not None
            continue
        for command in gpu_report.step_commands(step, str(tmp_path), "data", "data"):
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
    # the speed tables cover the models, full and LoRA; the headline points (measured first) are
    # RoBERTa-base and GPT-2 small, full and LoRA, with the untied GPT-2 that Opacus accepts
    cases = {(m, mode) for m, mode, _, _ in gpu_report.SPEED_CASES}
    for model in ("roberta", "roberta-large", "gpt2", "gpt2-medium"):
        assert {(model, "full"), (model, "lora")} <= cases
    assert {(m, mode) for m, mode, _, _ in gpu_report.HEADLINE_CASES} == {
        ("roberta", "full"), ("roberta", "lora"), ("gpt2", "full"), ("gpt2-untied", "full"), ("gpt2", "lora")}
    # the priority order of the issue: the CUDA tests, the headline points, real lengths, then the rest
    assert gpu_report.STEPS[:3] == ("tests", "speed_bf16", "real_length")
    assert set(gpu_report.STEPS) == set(gpu_report.TIME_LIMITS) == set(gpu_report.OUTPUTS)
    assert {"speed_fp32", "methods", "recipe", "speed_large", "sft"} == set(gpu_report.STEPS[3:])
    assert sum(gpu_report.TIME_LIMITS.values()) <= 27 * 60  # every step to its own limit: about 25 minutes
    assert gpu_report.DEFAULT_BUDGET_S <= 8 * 60  # one command of at most 8 minutes


def _speed_rows(case: str, ours: float, memory: float, opacus: float | None) -> list[dict]:
    rows = [{"case": case, "variant": "non-private", "time_s": 0.1, "time_ratio": 1.0, "grad_ratio": 1.0,
             "peak_mb": 1000.0, "mem_ratio": 1.0, "note": ""},
            {"case": case, "variant": "hf_dpfilter", "time_s": 0.1 * ours, "time_ratio": ours,
             "grad_ratio": ours,
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
    bf16 = _speed_rows("roberta full B=32 T=128", 1.2, 1.1, 2.0) + _speed_rows("gpt2 full B=16 T=512", 1.4,
                                                                               1.3, None)
    (results / "speed_cuda_bf16.json").write_text(json.dumps({"rows": bf16, "methods": []}))
    methods = [{"case": "roberta full B=32 T=128", "method": m, "step_s": 0.1 * r, "step_ratio": r,
                "opt_step_s": 0.01, "opt_extra_frac": 0.02} for m, r in (("dpsgd", 1.0), ("diff2", 1.9))]
    (results / "speed_cuda_methods.json").write_text(json.dumps({"rows": [], "methods": methods}))
    recipe = {"rows": [{"method": m, "train_runtime": t, "steps_time": t - 0.5, "steps": 60, "rest": 0.5}
                       for m, t in (("none", 10.0), ("dpsgd", 12.0))],
              "end_to_end_ratio": 1.2, "step_ratio": 1.21,
              "arguments": {"steps": 60, "batch": 32, "repeats": 1}}
    (results / "recipe_throughput_cuda.json").write_text(json.dumps(recipe))
    variant = {"step_s": 0.5, "ratio": 1.0, "ratios": [1.0], "first_step_s": 2.0, "padded_per_real": 3.0,
               "tokens_ratio": 1.0}
    real = {"settings": {"logical_batch": 256, "micro_batch": 32, "rounds": 5},
            "results": [{"task": "e2e", "model": "GPT-2 6x384", "examples": 4672, "mean_length": 40.0,
                         "max_length": 90,
                         "variants": {"Trainer": variant, "DPTrainer grouped": dict(
                             variant, step_s=0.45, ratio=0.9, padded_per_real=1.2, tokens_ratio=0.4)}}]}
    (results / "real_length_cuda.json").write_text(json.dumps(real))
    (results / "tests_cuda.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda" '
        'name="test_b"/><testcase classname="tests.test_cuda" name="test_c"><failure '
        'message="x"/></testcase></testsuite></testsuites>')
    meta = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-25 14:00 UTC", "torch": "2.13.0",
            "cuda": "13.0",
            "steps": [{"step": "speed_fp32", "status": "timed out", "seconds": 420.0,
                       "log": "speed_fp32.log"}]}
    text = gpu_report.render(str(results), meta)
    assert "## GPU report: NVIDIA H100 80GB HBM3, 2026-11-25 14:00 UTC" in text
    assert "`tests/gpu/test_cuda.py`: 2 passed, 1 failed, 0 skipped -- failed: tests.test_cuda.test_c" in text
    assert "`tests/gpu/test_cuda_sensitivity.py -k 'not cpu'`: not run" in text
    assert "| roberta full B=32 T=128 | 1.20x met | 1.10x met | 2.00x | yes (1.67x) |" in text
    assert "| gpt2 full B=16 T=512 | 1.40x **missed** | 1.30x **missed** | - | - |" in text
    assert "fp32 (timed out, 7.0 min)" in text and "Not measured." in text
    assert "| roberta full B=32 T=128 | diff2 | 0.190 s | 1.90x |" in text
    assert "| dpsgd | 12.00 s | 11.50 s | 0.50 s | 160.0 |" in text  # 60 steps x 32 examples / 12 s
    assert "| e2e | DPTrainer grouped | 0.450 | 0.90x | 2.00 | 1.20 | 0.40 |" in text
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
    """The real `tests` step (on CPU every CUDA case skips): subprocesses, JUnit files, the counts in the
    tables."""
    done = gpu_report.run_step("tests", str(tmp_path), "no-data", limit=300)
    assert done["status"] == "ok", (tmp_path / "tests.log").read_text()[-3000:]
    text = gpu_report.render(str(tmp_path), {"device": "d", "date": "t", "steps": [done]})
    counts = re.findall(r"`tests/gpu/test_cuda(?:_sensitivity)?\.py[^`]*`: (\d+) passed, (\d+) failed, (\d+) "
                        r"skipped", text)
    assert len(counts) == 2 and all(int(skipped) > 0 for _, _, skipped in counts), text
    import torch

    if not torch.cuda.is_available():  # only CUDA cases were selected: all skipped, none run on the CPU
        assert [passed for passed, _, _ in counts] == ["0", "0"], text
    skipped = gpu_report.run_step("recipe", str(tmp_path), str(tmp_path / "no-e2e"), limit=10)
    assert skipped["status"] == "skipped" and "no E2E CSV files" in skipped["note"]


# ------------------------------------------------------------------------------------------ the budget
#: fake steps: each appends its name to order.txt; `tests` writes a JUnit file, `speed_bf16` writes one case
#: of its JSON (as speed-memory does after every case), then starts a child that sleeps and waits for it: it
#: would overrun the budget; every later step would end at once
_FAKE = r"""
import json, os, subprocess, sys, time
step, results = sys.argv[1], sys.argv[2]
with open(os.path.join(results, "order.txt"), "a") as f:
    f.write(step + "\n")
if step == "tests":
    with open(os.path.join(results, "tests_cuda.xml"), "w") as f:
        f.write('<testsuite name="pytest" tests="2" failures="0" errors="0" skipped="0">'
                '<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda" '
                'name="test_b"/></testsuite>')
if step == "speed_bf16":
    row = {"case": "roberta full B=32 T=128", "time_s": 0.1, "time_ratio": 1.0, "grad_ratio": 1.0, "peak_mb": 9.0,
           "mem_ratio": 1.0, "note": ""}
    rows = [dict(row, variant="non-private"), dict(row, variant="hf_dpfilter", time_ratio=1.21, mem_ratio=1.1)]
    with open(os.path.join(results, "speed_cuda_bf16.json"), "w") as f:
        json.dump({"rows": rows, "methods": []}, f)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(results, "child.pid"), "w") as f:
        f.write(str(child.pid))
    child.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_the_budget_runs_steps_in_priority_order_cuts_the_overrun_and_writes_partial_tables(tmp_path,
                                                                                            monkeypatch,
                                                                                           capsys):
    results = tmp_path / "results"
    results.mkdir()
    # a stale file of an earlier run: removed, not rendered
    (results / "speed_cuda_fp32.json").write_text("{}")
    monkeypatch.setattr(gpu_report, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_report, "device_info", lambda: {"device": "Fake GPU", "date": "today"})
    monkeypatch.setattr(gpu_report, "unavailable", lambda step, data_dir, data_root: None)
    monkeypatch.setattr(gpu_report, "step_commands",
                        lambda step, res, data_dir, data_root: [[sys.executable, "-c", _FAKE, step, res]])
    budget, reserve = 5.0, 1.0
    start = time.monotonic()
    steps = ",".join(reversed(gpu_report.STEPS))  # whatever order is asked, they run in priority order
    code = gpu_report.main(["--budget-s", str(budget), "--reserve-s", str(reserve), "--min-step-s", "0.5",
                            "--steps", steps, "--results", str(results), "--out", ""])
    elapsed = time.monotonic() - start
    assert code == 0
    assert elapsed < budget + 3, elapsed  # the deadline (budget - reserve) + the kill's grace + the tables
    assert (results / "order.txt").read_text().split() == ["tests", "speed_bf16"]
    child = int((results / "child.pid").read_text())
    for _ in range(50):  # the whole process group went, the step's child too
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    meta = json.loads((results / "gpu_report.json").read_text())
    statuses = {s["step"]: s["status"] for s in meta["steps"]}
    assert [s["step"] for s in meta["steps"]] == list(gpu_report.STEPS)
    assert statuses == {"tests": "ok", "speed_bf16": gpu_report.CUT,
                        **{s: gpu_report.NOT_RUN for s in gpu_report.STEPS[2:]}}
    text = (results / "gpu_report.md").read_text()
    assert "## GPU report: Fake GPU, today" in text and "budget 5 s" in text
    assert "| `tests` | ok |" in text and f"| `speed_bf16` | {gpu_report.CUT} |" in text
    assert all(f"| `{s}` | {gpu_report.NOT_RUN} |" in text for s in gpu_report.STEPS[2:])
    assert "`tests/gpu/test_cuda.py`: 2 passed, 0 failed, 0 skipped" in text
    # the cut step's partial JSON is in the tables; the steps not run say so
    assert f"bf16 autocast (fp32 weights) ({gpu_report.CUT}," in text
    assert "| roberta full B=32 T=128 | 1.21x met | 1.10x met | - | - |" in text
    assert f"fp32 ({gpu_report.NOT_RUN})" in text and "Not measured." in text
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("gpu-report: tables in")
    # the results brought back from a GPU machine render here, without CUDA; without saved results it refuses
    monkeypatch.setattr(gpu_report, "cuda_available", lambda: False)
    (results / "gpu_report.md").unlink()
    assert gpu_report.main(["--render", "--results", str(results), "--out", ""]) == 0
    assert (results / "gpu_report.md").read_text() == text
    with pytest.raises(SystemExit, match="no saved report"):
        gpu_report.main(["--render", "--results", str(tmp_path / "empty"), "--out", ""])


def test_a_missing_real_length_subcommand_is_marked_not_available(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.__main__.SUBCOMMANDS",
                        {k: v for k, v in SUBCOMMANDS.items() if k != "real-length"})
    done = gpu_report.run_steps(["real_length"], str(tmp_path), "no-e2e", "no-data",
                                deadline=time.monotonic() + 60,
                                time_scale=1.0, min_step_s=1.0)
    assert done[0]["status"] == "not available" and "real-length" in done[0]["note"]
    text = gpu_report.render(str(tmp_path), {"steps": done})
    assert "### Real-length training (SST-2, E2E), bf16 (not available)" in text


def test_the_wheels_for_a_gpu_machine_without_network(capsys):
    """Every pin of requirements-lock.txt has a decision (carried, on the GPU image, not needed); the carried
    ones are downloaded at their locked versions for the image's Python, without their dependencies (dry
    run)."""
    from benchmarks import gpu_carry

    pins = gpu_carry.read_lock(os.path.join(ROOT, "requirements-lock.txt"))
    assert gpu_carry.unclassified(pins) == []
    assert gpu_carry.unclassified({**pins, "newpkg": "1.0"}) == ["newpkg"]
    wanted = gpu_carry.wheel_list(pins)
    assert f"transformers=={pins['transformers']}" in wanted and f"opacus=={pins['opacus']}" in wanted
    assert not any(w.startswith("torch==") for w in wanted)  # the image's CUDA torch is used
    assert len({gpu_carry._name(w) for w in wanted}) == len(wanted)  # one version of each
    command = gpu_carry.pip_command(wanted, "dest")
    assert command[3:6] == ["download", "-q", "--no-deps"] and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert gpu_carry.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pip download" in out and "transformers==" in out and ".gpu-data/" in out
    # the session script installs exactly those wheels without an index and runs the report within the budget
    script = open(os.path.join(ROOT, "benchmarks", "gpu_session.sh")).read()
    for needle in ("--no-index --no-deps", "--target", "PYTHONPATH", "gpu-report", "BUDGET_S",
                   "HF_DPFILTER_DATA"):
        assert needle in script, needle
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu_session.sh")]).returncode == 0


def test_a_test_run_cut_at_the_deadline_keeps_the_counts_of_the_tests_it_finished(tmp_path):
    """The deadline's first signal is SIGINT: pytest stops and still writes the JUnit file of what it ran."""
    (tmp_path / "test_fake.py").write_text("import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    "
                                           "time.sleep(60)\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir",
               str(tmp_path), str(tmp_path / "test_fake.py"), f"--junitxml={tmp_path / 'tests_cuda.xml'}"]
    with open(tmp_path / "tests.log", "w") as log:
        assert gpu_report._run_until(command, log, time.monotonic() + 6) is None
    counts = gpu_report._junit(str(tmp_path / "tests_cuda.xml"))
    assert counts["passed"] == 1 and counts["failed"] == [], (tmp_path / "tests.log").read_text()
