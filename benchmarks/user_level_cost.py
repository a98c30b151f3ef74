"""What user-level DP costs: epsilon at the same noise, example level vs user level, on E2E grouped into
users.

E2E has no authors, so its examples are grouped into SYNTHETIC users with a skewed (Zipf-like) number of
examples each (seeded; documented as synthetic wherever the numbers are quoted). For each k
(max_examples_per_user) the user-level run is given the same noise multiplier, the same number of steps and
the same expected number of examples per step as the example-level run (B examples: B_u = B / mean(min(n_u,
k)) users), and every epsilon comes from the library's accountant (PRV) at one delta, the example-level
default N^-1.1 (smaller than the user-level default, so the user rows are not flattered). No training: the
accounting only.

    python -m benchmarks user-level-cost --data_dir ../shared/data/e2e

prints a Markdown table (docs/privacy.md, "The privacy unit").
"""

from __future__ import annotations

import argparse
import csv
import math
import os

import numpy as np

from hf_dpfilter.accounting.accountant import compute_epsilon, default_delta


def zipf_user_sizes(num_examples: int, exponent: float = 2.0, largest: int = 200, seed: int = 0) -> list[int]:
    """Synthetic users: sizes drawn from a Zipf law (truncated at ``largest``) until they cover the
    examples."""
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    while sum(sizes) < num_examples:
        sizes.append(int(min(rng.zipf(exponent), largest)))
    sizes[-1] -= sum(sizes) - num_examples
    return [s for s in sizes if s > 0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=os.path.join("..", "shared", "data", "e2e"))
    parser.add_argument("--noise_multiplier", type=float, default=1.0)
    parser.add_argument("--examples_per_step", type=int, default=64)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--zipf_exponent", type=float, default=2.0)
    parser.add_argument("--ks", default="1,4,16")
    args = parser.parse_args(argv)
    with open(os.path.join(args.data_dir, "devset.csv"), newline="") as f:
        n = sum(1 for _ in csv.DictReader(f))
    sizes = zipf_user_sizes(n, args.zipf_exponent)
    users = len(sizes)
    sigma, b = args.noise_multiplier, args.examples_per_step
    steps = math.ceil(args.epochs * int(n / b))
    q_example, delta_example = b / n, default_delta(n)
    eps_example = compute_epsilon([(sigma, q_example, steps)], delta_example, "prv")
    print(f"E2E devset: N = {n} examples, {users} synthetic Zipf({args.zipf_exponent:g}) users (largest "
          f"{max(sizes)}, median {int(np.median(sizes))}); sigma = {sigma:g}, {steps} steps, {b} examples "
          "per step")
    print()
    print("| unit | k | q | expected units per step | delta | epsilon |")
    print("|---|---|---|---|---|---|")
    print(f"| example | - | {q_example:.4g} | {b} | {delta_example:.2g} | {eps_example:.3g} |")
    for k in (int(x) for x in args.ks.split(",")):
        per_user = float(np.mean(np.minimum(sizes, k)))
        b_users = b / per_user
        q_user = min(1.0, b_users / users)
        delta_user = delta_example
        eps_user = compute_epsilon([(sigma, q_user, steps)], delta_user, "prv")
        print(f"| user | {k} | {q_user:.4g} | {b_users:.1f} | {delta_user:.2g} | {eps_user:.3g} |")


if __name__ == "__main__":
    main()
