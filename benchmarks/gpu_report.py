"""The GPU figures of docs/performance.md from one command (``make gpu-report``), about 25 minutes on one H100.

On a machine with CUDA it runs, each step in its own process with a time limit (a step that fails or runs out
of time is reported as such; the others still run):

* ``tests``: ``tests/test_cuda.py`` (CPU/CUDA parity of every method, the noise, bf16, fp16 with the DP loss
  scaler and the precision contract) and the CUDA cases of ``tests/test_cuda_sensitivity.py`` (removing one example moves the clipped
  sum by at most C: fp32 and bf16 autocast, same-shape layers stacked and not);
* ``speed_bf16`` and ``speed_fp32``: ``python -m benchmarks speed-memory --device cuda`` -- time and memory of a
  private step against the non-private step and Opacus 1.6 ghost clipping, for RoBERTa-base/large and GPT-2
  small/medium, full fine-tuning and LoRA (variants interleaved, per-round ratios, medians);
* ``methods``: the step cost of DiSK, DOPPLER, DP-PMLF, DiceSGD and DIFF2 against DP-Adam (RoBERTa-base, bf16);
* ``recipe``: ``python -m benchmarks recipe-throughput --gpt2-small --bf16`` -- examples/s of
  ``recipes/table2text.py`` private against non-private (needs the E2E CSV files, ``--data_dir``).

Every model is built from its config (random weights): nothing is downloaded. Each step writes its JSON into
``--results`` (default ``benchmarks/results/gpu_report``); the tables, marked with the device and the date,
then go into ``--out`` (default ``docs/performance.md``) between its CUDA markers, and into
``<results>/gpu_report.md``. ``--steps`` runs some steps only (e.g. on machines whose commands have a
shorter time limit); ``--render`` only rebuilds the tables from the JSON files already in ``--results``.

Without CUDA it prints one line and exits 0 (nothing to measure). With CUDA it exits 1 when a step failed (a test
or a benchmark process), after writing the tables.

Usage::

    make gpu-report                                       # everything, ~25 min on one H100
    python -m benchmarks gpu-report --steps tests,methods # some steps
    python -m benchmarks gpu-report --render              # the tables from the saved JSON only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from benchmarks.generated_markers import BEGIN_CUDA, END_CUDA, replace_between

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("tests", "speed_bf16", "speed_fp32", "methods", "recipe", "sft")
#: the cases of the speed/memory table: (model, mode, B, T); gpt2-untied is GPT-2 small with an untied head,
#: which Opacus accepts (it refuses tied embeddings)
SPEED_CASES = [
    ("roberta", "full", 32, 128), ("roberta", "lora", 32, 128),
    ("roberta-large", "full", 32, 128), ("roberta-large", "lora", 32, 128),
    ("gpt2", "full", 16, 512), ("gpt2-untied", "full", 16, 512), ("gpt2", "lora", 16, 512),
    ("gpt2-medium", "full", 8, 512), ("gpt2-medium", "lora", 8, 512),
]
METHOD_CASE = ("roberta", "full", 32, 128)
#: seconds each step may take by default (about 25 min in all on one H100)
TIME_LIMITS = {"tests": 240, "speed_bf16": 480, "speed_fp32": 420, "methods": 180, "recipe": 240, "sft": 60}
NO_CUDA = ("gpu-report: no CUDA device visible (torch.cuda.is_available() is False): nothing measured. "
           "Run `make gpu-report` on a machine with a GPU (docs/performance.md, 'GPU report').")
#: the targets of the GPU issue, checked in the report
TARGET_TIME, TARGET_MEMORY = 1.3, 1.25


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cases_arg(cases) -> str:
    return ",".join(f"{m}:{mode}:{b}x{t}" for m, mode, b, t in cases)


def step_commands(step: str, results: str, data_dir: str) -> list[list[str]]:
    """The command line(s) of one step (run from the repository root with this interpreter)."""
    py = sys.executable
    if step == "tests":
        return [
            [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py",
             f"--junitxml={os.path.join(results, 'tests_cuda.xml')}"],
            [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda_sensitivity.py", "-k", "not cpu",
             f"--junitxml={os.path.join(results, 'tests_cuda_sensitivity.xml')}"],
        ]
    speed = [py, "-m", "benchmarks", "speed-memory", "--device", "cuda"]
    if step == "speed_bf16":
        return [speed + ["--bf16", "--no-methods", "--cases", _cases_arg(SPEED_CASES),
                         "--json", os.path.join(results, "speed_cuda_bf16.json")]]
    if step == "speed_fp32":
        return [speed + ["--no-methods", "--cases", _cases_arg(SPEED_CASES),
                         "--json", os.path.join(results, "speed_cuda_fp32.json")]]
    if step == "methods":
        return [speed + ["--bf16", "--only-methods", "--cases", _cases_arg([METHOD_CASE]),
                         "--json", os.path.join(results, "speed_cuda_methods.json")]]
    if step == "recipe":
        return [[py, "-m", "benchmarks", "recipe-throughput", "--gpt2-small", "--bf16", "--data_dir", data_dir,
                 "--json", os.path.join(results, "recipe_throughput_cuda.json")]]
    if step == "sft":
        return [[py, "-m", "benchmarks", "sft-throughput", "--gpu", "--bf16", "--hidden", "256", "--layers", "4",
                 "--json", os.path.join(results, "sft_throughput_cuda.json")]]
    raise ValueError(f"unknown step {step!r}; the steps are {', '.join(STEPS)}")


def run_step(step: str, results: str, data_dir: str, limit: float) -> dict:
    """Run one step's commands within ``limit`` seconds in all; its log goes to ``<results>/<step>.log``."""
    if step == "recipe" and not os.path.isfile(os.path.join(data_dir, "devset.csv")):
        return {"step": step, "status": "skipped", "seconds": 0.0,
                "note": f"no E2E CSV files in {data_dir} (--data_dir; see docs/performance.md, 'GPU report')"}
    start = time.time()
    status = "ok"
    with open(os.path.join(results, f"{step}.log"), "w") as log:
        for command in step_commands(step, results, data_dir):
            left = limit - (time.time() - start)
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            if left <= 0:
                status = "timed out"
                break
            try:
                proc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=left,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"))
            except subprocess.TimeoutExpired:
                status = "timed out"
                break
            if proc.returncode != 0:
                status = f"failed (exit {proc.returncode})"  # pytest: some test failed; the rest still ran
    return {"step": step, "status": status, "seconds": time.time() - start, "log": f"{step}.log"}


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
    lines = ["| model / mode / batch | variant | time per step | time ratio | fwd+bwd ratio | peak memory | memory ratio "
             "| note |", "|---|---|---|---|---|---|---|---|"]
    for r in saved["rows"]:
        def cell(key, fmt, r=r):
            return fmt.format(r[key]) if key in r else "-"

        lines.append(f"| {r['case']} | {r['variant']} | {cell('time_s', '{:.3f} s')} | {cell('time_ratio', '{:.2f}x')} "
                     f"| {cell('grad_ratio', '{:.2f}x')} | {cell('peak_mb', '{:.0f} MB')} | "
                     f"{cell('mem_ratio', '{:.2f}x')} | {r.get('note', '')} |")
    return lines


def _targets(saved: dict) -> list[str]:
    """The GPU issue's targets, in bf16: a DP step <= 1.3x the time and <= 1.25x the memory, faster than Opacus."""
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
    lines = ["| `--method` | train_runtime | of which optimizer steps | rest | examples/s |", "|---|---|---|---|---|"]
    for method in ("none", "dpsgd"):
        rows = [r for r in saved["rows"] if r["method"] == method]
        if not rows:
            continue
        runtime = statistics.median(r["train_runtime"] for r in rows)
        lines.append(f"| {method} | {runtime:.2f} s | {statistics.median(r['steps_time'] for r in rows):.2f} s | "
                     f"{statistics.median(r['rest'] for r in rows):.2f} s | {examples / runtime:.1f} |")
    lines += ["", f"Private over non-private: {saved['end_to_end_ratio']:.3f}x end to end, {saved['step_ratio']:.3f}x "
              f"for the steps alone (medians of {args.get('repeats', '?')} alternating runs each)."]
    return lines


def render(results: str, meta: dict) -> str:
    """The report's markdown from the JSON files in ``results`` (whatever steps have run)."""
    status = {s["step"]: s for s in meta.get("steps", [])}

    def state(step: str) -> str:
        s = status.get(step)
        return "" if s is None else f" ({s['status']}, {s['seconds'] / 60:.1f} min)"

    lines = [
        f"## GPU report: {meta.get('device', '?')}, {meta.get('date', '?')}",
        "",
        f"Generated by `make gpu-report` (`python -m benchmarks gpu-report`) on {meta.get('device', '?')} "
        f"(torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}), {meta.get('date', '?')}. Models built from "
        "their configs (random weights), AdamW, noise multiplier 1, C = 1. Time: variants interleaved, the ratio "
        "is the median over rounds of the per-round ratio; memory: `torch.cuda.max_memory_allocated()` of two "
        "steady-state steps minus the weights, each variant in its own process.",
        "",
        f"### Tests on the GPU{state('tests')}",
        "",
    ]
    for name, label in (("tests_cuda.xml", "tests/test_cuda.py"),
                        ("tests_cuda_sensitivity.xml", "tests/test_cuda_sensitivity.py -k 'not cpu'")):
        counts = _junit(os.path.join(results, name))
        if counts is None:
            lines.append(f"* `{label}`: not run")
            continue
        lines.append(f"* `{label}`: {counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                     f"{counts['skipped']} skipped" + (f" -- failed: {', '.join(counts['failed'])}" if counts["failed"]
                                                      else ""))
    for step, file, title in (("speed_bf16", "speed_cuda_bf16.json", "bf16 autocast (fp32 weights)"),
                              ("speed_fp32", "speed_cuda_fp32.json", "fp32")):
        saved = _load(os.path.join(results, file))
        lines += ["", f"### Private vs non-private vs Opacus 1.6, {title}{state(step)}", ""]
        if saved is None or not saved.get("rows"):
            lines.append("Not measured.")
            continue
        lines += _speed_table(saved) + ["", f"Against the targets ({title}):", ""] + _targets(saved)
    saved = _load(os.path.join(results, "speed_cuda_methods.json"))
    lines += ["", f"### DP methods against DP-Adam, bf16{state('methods')}", ""]
    lines += (["Not measured."] if saved is None or not saved.get("methods") else _methods_table(saved) + [
        "", "DIFF2's step is the median over rounds, most of which are difference rounds (two gradient points); "
        "DP-PMLF with k points runs k forwards."])
    saved = _load(os.path.join(results, "recipe_throughput_cuda.json"))
    lines += ["", f"### Recipe throughput, `recipes/table2text.py`, GPT-2 small shape, bf16{state('recipe')}", ""]
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
        lines += ["", f"DP packed over DP unpacked: {saved['packed_over_unpacked']:.2f}x; DP packed over non-private "
                  f"`SFTTrainer`: {saved['dp_over_nonprivate']:.2f}x (medians of per-round ratios)."]
    return "\n".join(lines) + "\n"


def write_into(path: str, text: str) -> None:
    """Replace what is between the CUDA markers of ``path`` with ``text``."""
    replace_between(path, BEGIN_CUDA, END_CUDA, text, what="tables")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps to run: " + ", ".join(STEPS))
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "gpu_report"),
                        help="folder for each step's JSON and log")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"),
                        help="markdown file whose CUDA markers receive the tables ('' = none)")
    parser.add_argument("--data_dir", default=None,
                        help="E2E CSV files for the recipe step (default: ../shared/data/e2e, else shared/data/e2e)")
    parser.add_argument("--time_scale", type=float, default=1.0, help="multiply every step's time limit")
    parser.add_argument("--render", action="store_true", help="only rebuild the tables from the saved JSON")
    args = parser.parse_args(argv)
    if not cuda_available():
        print(NO_CUDA, flush=True)
        return 0
    import torch

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}; the steps are {', '.join(STEPS)}")
    data_dir = args.data_dir or next(
        (d for d in (os.path.join(ROOT, "..", "shared", "data", "e2e"), os.path.join(ROOT, "shared", "data", "e2e"))
         if os.path.isdir(d)), os.path.join(ROOT, "..", "shared", "data", "e2e"))
    os.makedirs(args.results, exist_ok=True)
    meta_path = os.path.join(args.results, "gpu_report.json")
    meta = _load(meta_path) or {}
    if not args.render:
        meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        done = {s["step"]: s for s in meta.get("steps", []) if s["step"] not in steps}
        for step in steps:
            print(f"gpu-report: {step} (at most {TIME_LIMITS[step] * args.time_scale / 60:.0f} min) ...", flush=True)
            done[step] = run_step(step, args.results, data_dir, TIME_LIMITS[step] * args.time_scale)
            print(f"gpu-report: {step}: {done[step]['status']} in {done[step]['seconds'] / 60:.1f} min", flush=True)
            meta["steps"] = [done[s] for s in STEPS if s in done]
            with open(meta_path, "w") as f:
                json.dump(meta, f, indent=1)
    text = render(args.results, meta)
    with open(os.path.join(args.results, "gpu_report.md"), "w") as f:
        f.write(text)
    if args.out:
        write_into(args.out, text)
    print(text, flush=True)
    unclean = [s["step"] for s in meta.get("steps", []) if re.match(r"failed|timed out", s["status"])]
    print(f"gpu-report: tables in {args.out or os.path.join(args.results, 'gpu_report.md')}"
          + (f"; not clean: {', '.join(unclean)} (see the logs in {args.results})" if unclean else ""), flush=True)
    # a failed step (a CUDA test failing, a benchmark crashing) fails the command; a timed-out one is in the tables
    return 1 if any(s["status"].startswith("failed") for s in meta.get("steps", [])) else 0

