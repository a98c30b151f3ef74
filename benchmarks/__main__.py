"""``python -m benchmarks <sub-command> [options]``: the benchmarks behind the docs' figures, one entry point.

Each sub-command is a module of this package with a ``main(argv)``; ``python -m benchmarks <sub-command>
--help`` shows its options. Run from the repository root.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str  # under benchmarks/, with a main(argv: list[str] | None) -> int | None
    backs: str  # the page whose figures it produces
    help: str


#: the sub-command registry: one line per benchmark.
SUBCOMMANDS: dict[str, Subcommand] = {
    "speed-memory": Subcommand("speed_memory", "docs/performance.md",
                               "time and memory of a DP step against the non-private one and Opacus"),
    "recipe-throughput": Subcommand("recipe_throughput", "docs/performance.md",
                                    "examples/s of recipes/table2text.py, private against non-private"),
    "operator-count": Subcommand("profile_step", "docs/performance.md",
                                 "operators (kernels) one DP step launches, per method, stacked or not"),
    "allreduce-bucketing": Subcommand("allreduce_bucketing", "docs/performance.md",
                                      "cost of summing the clipped sums across processes, bucketed or not"),
    "gpu-report": Subcommand("gpu_report", "docs/performance.md",
                             "every GPU figure in one run (make gpu-report); one line and exit 0 without CUDA"),
    "gpu-carry": Subcommand("gpu_carry", "docs/performance.md",
                            "the wheels and data a GPU machine without network needs, into ignored folders"),
    "checkpointing-memory": Subcommand("checkpointing_memory", "docs/large_models.md",
                                       "peak memory of a DP step with and without activation checkpointing"),
    "opacus-parity": Subcommand("opacus_parity", "docs/opacus_parity.md",
                                "DP-Adam against Opacus on SST-2: deterministic checks and paired seeds"),
    "utility": Subcommand("paper_protocols", "docs/results.md",
                          "each method against its paper's baseline on SST-2 (the verdict table)"),
    "authors-noise": Subcommand("authors_noise", "docs/results.md",
                                "the noise DiSK's and DP-PMLF's released codes really add, from their per-step "
                                "arithmetic"),
    "utility-finetune": Subcommand("utility_sst2", "docs/results.md",
                                   "every method fine-tuning the whole MiniLM on SST-2, one seed per cell"),
    "demo-tuning": Subcommand("tune_demo", "docs/results.md",
                              "the demo's settings, chosen on a validation split of the training set"),
    "generation": Subcommand("generation_protocol", "docs/results.md",
                             "E2E generation, a warm-started encoder-decoder: DP, non-private, baselines"),
    "sft-throughput": Subcommand("sft_throughput", "docs/sft.md",
                                 "examples/s of DP SFT packed vs unpacked, and DP vs non-private SFTTrainer"),
    "recheck-cost": Subcommand("recheck_cost", "docs/performance.md",
                               "step time with the per-example re-checks at the default rate vs off, "
                               "first-step check"),
    "checks-breakdown": Subcommand("checks_breakdown", "docs/performance.md",
                                   "each privacy check's share of a step on real lengths; new shapes; "
                                   "dynamic scripts"),
    "checks-cost": Subcommand("checks_cost", "docs/performance.md",
                              "step time of the current code vs the step before issue 29 (b24efd1), "
                              "interleaved"),
    "real-length": Subcommand("real_length", "docs/performance.md",
                              "time per logical batch and padded/real tokens on SST-2 and E2E lengths, DP vs "
                              "Trainer"),
    "user-level-cost": Subcommand("user_level_cost", "docs/privacy.md",
                                  "epsilon at the same noise, example vs user level, on E2E with synthetic "
                                  "users"),
}


def register(name: str, module: str, backs: str, help: str) -> None:
    """Add a sub-command (``module`` under benchmarks/, with a ``main(argv)``)."""
    if name in SUBCOMMANDS:
        raise ValueError(f"benchmark sub-command {name!r} exists already")
    SUBCOMMANDS[name] = Subcommand(module, backs, help)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
        epilog="sub-commands:\n" + "\n".join(f"  {n:22s}{s.help} ({s.backs})" for n,
                                             s in SUBCOMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS), metavar="SUB-COMMAND")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name, rest = parser.parse_args(argv[:1]).subcommand, argv[1:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(f"benchmarks.{SUBCOMMANDS[name].module}")
    sys.argv = [f"python -m benchmarks {name}", *rest]  # the sub-command's --help shows how it was called
    result = module.main(rest)
    return result if isinstance(result, int) else 0  # a benchmark may return its figures instead of a code


if __name__ == "__main__":
    sys.exit(main())
