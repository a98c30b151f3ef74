"""``python -m benchmarks <sub-command>``: one entry point, one shared set-up, every sub-command reachable.

The benchmarks themselves take minutes to hours; here the entry point and its registry, each sub-command's
``--help``, the shared timing loop (median of per-round ratios) and a tiny speed/memory run through the entry
point (its memory workers are subprocesses of the same entry point) are checked.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import common  # noqa: E402  (the checkout's package: pyproject puts the root on sys.path)
from benchmarks.__main__ import SUBCOMMANDS, main, register  # noqa: E402

#: the claims the docs make, each with the sub-command that produces its figures
EXPECTED = {"speed-memory", "opacus-parity", "utility", "recipe-throughput", "checkpointing-memory",
            "gpu-report"}


def test_the_registry_covers_the_docs_claims_and_every_module_runs_its_help(capsys):
    assert EXPECTED <= set(SUBCOMMANDS)
    modules = {f"{s.module}.py" for s in SUBCOMMANDS.values()}
    on_disk = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    support = {"__init__.py", "__main__.py", "common.py", "generated_markers.py"}
    assert on_disk - support == modules, "a benchmark module that no sub-command runs, or a missing one"
    for name, sub in SUBCOMMANDS.items():
        assert (ROOT / sub.backs).is_file(), (name, sub.backs)
        assert f"python -m benchmarks {name}" in (ROOT / sub.backs).read_text(), (
            f"{sub.backs} does not say how to reproduce its figures with `python -m benchmarks {name}`")
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: python -m benchmarks {name}" in capsys.readouterr().out


def test_a_new_subcommand_is_one_registry_line(monkeypatch):
    monkeypatch.setattr("benchmarks.__main__.SUBCOMMANDS", dict(SUBCOMMANDS))
    import benchmarks.__main__ as entry

    register("my-benchmark", "sft_throughput", "docs/sft.md", "a benchmark added from outside")
    assert entry.SUBCOMMANDS["my-benchmark"].module == "sft_throughput"
    with pytest.raises(ValueError, match="exists already"):
        register("speed-memory", "speed_memory", "docs/performance.md", "again")


def test_time_interleaved_reports_the_median_of_per_round_ratios(monkeypatch):
    """Rounds (A, B) = (1, 3), (2, 2), (4, 4): per-round ratios 3, 1, 1 -> 1; the ratio of medians would be
    1.5."""
    durations = iter([1.0, 3.0, 2.0, 2.0, 4.0, 4.0])
    clock = itertools.count()
    now = {"t": 0.0}

    def perf_counter() -> float:
        if next(clock) % 2:  # the end of a step: advance by its duration
            now["t"] += next(durations)
        return now["t"]

    monkeypatch.setattr(common.time, "perf_counter", perf_counter)
    timing = common.time_interleaved({"a": lambda: 0.5, "b": lambda: 1.0}, rounds=3)
    assert timing["b"]["ratios"] == [3.0, 1.0, 1.0]
    assert timing["b"]["ratio"] == 1.0 and timing["b"]["time_s"] == 3.0 and timing["a"]["ratio"] == 1.0
    assert timing["b"]["grad_ratio"] == 2.0


def test_the_shared_setup_serves_the_benchmarks():
    """One set-up module: the benchmarks import their models, data and measurements from benchmarks.common."""
    for module in ("speed_memory", "tune_demo", "utility_sst2", "opacus_parity", "paper_protocols",
                   "recipe_throughput"):
        source = (ROOT / "benchmarks" / f"{module}.py").read_text()
        assert "from benchmarks.common import" in source, module
        # no per-script path set-up
        assert "sys.path.insert(0, os.path.join(os.path.dirname" not in source, module
    assert "from benchmarks.common import" in (ROOT / "benchmarks" / "checkpointing_memory.py").read_text()
    importlib.import_module("benchmarks.speed_memory")  # imports through the package, from any module


def test_speed_memory_runs_through_the_entry_point(tmp_path):
    """Tiny models (HF_DPFILTER_BENCH_TINY=1): timing rounds and a memory worker per variant, all via -m
    benchmarks."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, HF_DPFILTER_BENCH_TINY="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "speed-memory", "--models", "roberta", "--modes", "lora",
         "--points", "2x16", "--rounds", "2", "--no-opacus", "--no-methods", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"non-private", "hf_dpfilter"}, rows
    assert rows["hf_dpfilter"]["time_ratio"] > 0 and "error" not in json.dumps(rows)
    assert rows["hf_dpfilter"]["peak_mb"] is not None


def test_recheck_cost_runs_through_the_entry_point(tmp_path, monkeypatch):
    """The re-check cost benchmark on a tiny BERT and synthetic lengths: every variant steps, the re-checks
    run in the checked variants only, and the ratios are reported."""
    monkeypatch.setenv("HF_DPFILTER_DATA", str(tmp_path))  # no SST-2 there: synthetic lengths
    argv = ["--tiny", "--examples", "64", "--batch", "8", "--micro_batch", "4", "--warmup", "1", "--rounds",
            "2",
            "--first_step_repeats", "1"]
    result = importlib.import_module("benchmarks.recheck_cost").main(argv)
    assert result["lengths"] == "synthetic lengths"
    assert result["rechecks_timed"]["off"] == 0 and result["rechecks_timed"]["new shapes"] >= 0
    assert result["ratio_default_vs_off"] > 0 and result["first_step_ratio"] > 0


def test_checks_cost_runs_both_sides_interleaved_without_git(tmp_path, monkeypatch):
    """The cost of the per-example checks against a reference commit, with both sides this tree (``--reference .``:
    no git): two worker processes, every case and variant steps, and a ratio per case and variant is
    reported."""
    monkeypatch.setenv("HF_DPFILTER_DATA", str(tmp_path))  # no SST-2 there: synthetic lengths
    argv = ["--reference", ".", "--tiny", "--examples", "48", "--batch", "8", "--micro_batch", "4",
            "--warmup", "1",
            "--rounds", "2", "--steps", "1"]
    result = importlib.import_module("benchmarks.checks_cost").main(argv)
    assert result["lengths"] == "synthetic lengths"
    assert result["imported"]["reference"] == result["imported"]["current"]
    assert set(result["figures"]) == {"bert", "gpt2", "gpt2-packed"}
    for row in result["figures"].values():
        assert row["reference_step_ms"] > 0
        assert all(row[v]["median"] > 0 for v in ("default", "rate 0", "no per-example checks"))


def test_recheck_cost_breakdown_times_each_check_where_it_runs(tmp_path, monkeypatch):
    """``checks-breakdown --setup tiny``: the first-step check once, the state comparison on every recorded
    micro-batch, the new-shape re-checks, each as a fraction of the run's step time."""
    monkeypatch.setenv("HF_DPFILTER_DATA", str(tmp_path))  # no SST-2 there: synthetic lengths
    argv = ["--setup", "tiny", "--examples", "48", "--batch", "8", "--micro_batch", "4", "--steps", "2"]
    result = importlib.import_module("benchmarks.checks_breakdown").main(argv)
    fractions = result["fractions"]
    assert fractions["first-step check"]["calls"] == 1
    assert fractions["state comparison"]["calls"] >= 2 * result["micro_batches"]  # snapshot and comparison
    assert all(0 <= row["of_run"] < 1 for row in fractions.values())
    assert result["new_shapes"] >= 1


def test_shape_census_counts_new_shapes_random_and_grouped():
    """The census of micro-batch shapes: every shape of the first step is new, both orders cut the same draws
    into as many micro-batches, and the fractions are of those micro-batches."""
    from benchmarks.checks_breakdown import shape_census

    lengths = [3 + (i * 7) % 40 for i in range(2000)]
    random_order = shape_census(lengths, 64, 16, 60, grouped=False)
    grouped = shape_census(lengths, 64, 16, 60, grouped=True)
    assert random_order["new_fraction_by_stretch"]["1-1"] == grouped["new_fraction_by_stretch"]["1-1"] == 1.0
    assert grouped["micro_batches"] == random_order["micro_batches"]
    for census in (random_order, grouped):
        assert 0 < census["new_fraction"] <= 1 and census["distinct_shapes"] <= census["micro_batches"]


def test_real_length_reports_every_variant_with_its_padding(tmp_path, monkeypatch):
    """The real-length benchmark on tiny models and synthetic lengths (64 examples, one SST-2-like and one
    E2E-like task): every variant steps, is timed against the non-private Trainer, and its padded/real token
    ratio is counted (at least 1: every forward sees its real tokens and its padding); the JSON holds it
    all."""
    monkeypatch.setenv("HF_DPFILTER_DATA", str(tmp_path))  # no data there: synthetic lengths
    out = tmp_path / "real_length.json"
    argv = ["--tiny", "--quick", "--examples", "64", "--logical-batch", "16", "--micro-batch", "8",
            "--rounds", "1",
            "--json", str(out)]
    module = importlib.import_module("benchmarks.real_length")
    module.main(argv)
    results = json.loads(out.read_text())["results"]
    assert [r["task"] for r in results] == ["sst2", "e2e"]
    for result in results:
        assert result["lengths"].startswith("synthetic")
        expected = (set(module.VARIANTS) if result["grouping_field"]
                    else set(module.VARIANTS) - {"DPTrainer grouped"})
        assert set(result["variants"]) == expected
        for row in result["variants"].values():
            assert row["step_s"] > 0 and row["ratio"] > 0 and row["first_step_s"] > 0
            assert row["padded_per_real"] >= 1.0 and row["real_tokens"] > 0 and row["forwards_per_step"] >= 1
            assert 0.0 <= row["recheck_share"] < 1.0 and row["ratio_without_rechecks"] > 0
        assert (result["variants"]["Trainer"]["ratio"] == 1.0
                and result["variants"]["Trainer"]["tokens_ratio"] == 1.0)
        if result["grouping_field"]:  # the same sampled batches, ordered by length: never more padding
            dp, grouped = result["variants"]["DPTrainer"], result["variants"]["DPTrainer grouped"]
            assert grouped["real_tokens"] == dp["real_tokens"] and grouped["positions"] <= dp["positions"]
