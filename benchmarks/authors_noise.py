"""The noise the authors' released codes of DiSK and DP-PMLF really add, measured by running their per-step
arithmetic.

    python -m benchmarks authors-noise      # writes benchmarks/results/authors_noise.json, prints a table

Both released codes run on fastDP, whose private gradient accumulates over the backward passes of a step: the
first backward creates ``private_grad = (clipped sum) + N(0, sigma^2 C^2)``, every later backward of the same
step adds its clipped sum without new noise, and the step hands ``private_grad / B`` to the base optimizer.
The privacy accounting of a run is DP-SGD's at the stated sigma. What each code releases per step, as a
function of the clipped sums of its backward passes and the step's one Gaussian draw, is re-stated below in a
few lines (:func:`disk_released`, :func:`pmlf_released`), and two quantities are measured on it in float64:

* the noise ratio: the standard deviation of the released gradient at zero gradients (Monte Carlo over
  ``--draws`` coordinates) over the stated ``sigma C / B``;
* the sensitivity ratio: the largest change of the released gradient between two neighbouring batches at zero
  noise (one example added, its per-pass gradients clipped to C: aligned, of alternating sign, and random),
  times ``B / C``.

Their quotient is the effective noise multiplier as a fraction of the stated sigma: the noise the released
code adds, per unit of its own sensitivity. ``benchmarks/paper_protocols.py`` runs its positive controls (the
method at the noise the authors' code releases) at the stated sigma times this measured fraction.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "authors_noise.json")

Release = Callable[[list[np.ndarray], np.ndarray, float], np.ndarray]


def disk_released(sums: list[np.ndarray], noise: np.ndarray, batch: float, kappa: float,
                  gamma: float) -> np.ndarray:
    """The gradient the DiSK authors' ``KFOptimizer`` (``prestep`` then ``step``) hands to the base optimizer
    in one step, under fastDP's accumulation. ``sums``: the clipped sums at x_t and at the look-ahead point
    x_t + gamma d (the one-pass gamma = (1 - kappa) / kappa evaluates the look-ahead point alone)."""
    if abs(gamma - (1.0 - kappa) / kappa) < 1e-3:  # their one-pass branch: one backward, at the look-ahead
        return (sums[-1] + noise) / batch
    scale = (gamma * kappa + kappa - 1.0) / (1.0 - kappa)
    private = sums[0] + noise  # prestep's first backward, at x_t: the step's clipped sum and its one draw
    private = private * scale  # prestep scales the private gradient,
    private = private + sums[1]  # runs the second backward at x_t + gamma d (a clipped sum, no new noise)
    private = private / scale  # and divides the scale out again
    private = private / (1.0 + 1.0 / scale)  # step
    return private / batch  # fastDP's step: the private gradient over B


def pmlf_released(sums: list[np.ndarray], noise: np.ndarray, batch: float) -> np.ndarray:
    """The gradient the DP-PMLF authors' ``DPLinearMomentumOptimizer`` releases in one step under fastDP:
    its ``prestep`` runs one backward per parameter point (the current one first) and weights the points'
    ``p.grad``, but fastDP's private gradient is the unweighted accumulation of the k clipped sums, noised
    once, and that is what the step uses."""
    private = sums[0] + noise
    for clipped_sum in sums[1:]:
        private = private + clipped_sum
    return private / batch


#: name -> (the release of one step, the number of backward passes, the settings, the analytic fraction)
CODES: dict[str, tuple[Release, int, dict[str, float], float]] = {
    "disk_kappa0.7_gamma0.5": (lambda s, n, b: disk_released(s, n, b, 0.7, 0.5), 2,
                               {"kappa": 0.7, "gamma": 0.5}, 1.0 - 0.3 / (0.7 * 0.5)),
    "disk_kappa0.7_gamma0.75": (lambda s, n, b: disk_released(s, n, b, 0.7, 0.75), 2,
                                {"kappa": 0.7, "gamma": 0.75}, 1.0 - 0.3 / (0.7 * 0.75)),
    "pmlf_k2": (pmlf_released, 2, {"k": 2}, 1.0 / 2),
    "pmlf_k3": (pmlf_released, 3, {"k": 3}, 1.0 / 3),
}


def clip(vectors: np.ndarray, norm: float) -> np.ndarray:
    """Each row scaled to norm at most ``norm``."""
    lengths = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors * np.minimum(1.0, norm / np.maximum(lengths, 1e-300))


def measure(release: Release, passes: int, draws: int = 200_000, sigma: float = 1.7,
            max_grad_norm: float = 0.5, batch: float = 100.0, seed: int = 0) -> dict[str, float]:
    """The noise ratio, the sensitivity ratio and their quotient (the effective noise multiplier over the
    stated sigma) of one code's release, in float64."""
    rng = np.random.default_rng(seed)
    zeros = [np.zeros(draws) for _ in range(passes)]
    noise = rng.normal(0.0, sigma * max_grad_norm, draws)
    noise_ratio = float(np.std(release(zeros, noise, batch)) / (sigma * max_grad_norm / batch))

    dim, examples = 64, 8
    per_example = clip(rng.normal(0.0, 1.0, (passes, examples, dim)), max_grad_norm)  # each pass's gradients
    sums = [per_example[j].sum(axis=0) for j in range(passes)]
    no_noise = np.zeros(dim)
    direction = rng.normal(0.0, 1.0, dim)
    candidates = [np.stack([direction] * passes),  # the added example's gradients aligned
                  np.stack([(-1.0) ** j * direction for j in range(passes)]),  # of alternating sign
                  *(rng.normal(0.0, 1.0, (passes, dim)) for _ in range(16))]  # random
    largest = 0.0
    for candidate in candidates:
        added = clip(candidate * 10.0, max_grad_norm)  # longer than C: clipped to C
        neighbour = [sums[j] + added[j] for j in range(passes)]
        change = release(neighbour, no_noise, batch) - release(sums, no_noise, batch)
        largest = max(largest, float(np.linalg.norm(change)))
    sensitivity_ratio = largest * batch / max_grad_norm
    return {"noise_ratio": noise_ratio, "sensitivity_ratio": sensitivity_ratio,
            "effective_noise_ratio": noise_ratio / sensitivity_ratio}


def measure_all(draws: int = 200_000, seed: int = 0) -> dict[str, Any]:
    """Every code of :data:`CODES`, measured."""
    measured: dict[str, Any] = {}
    for name, (release, passes, settings, analytic) in CODES.items():
        measured[name] = {**settings, **measure(release, passes, draws=draws, seed=seed),
                          "analytic_effective_noise_ratio": analytic}
    return {"draws": draws, "seed": seed, "codes": measured}


def effective_noise_ratio(name: str, path: str = RESULTS) -> float:
    """The measured effective noise multiplier over the stated sigma of ``name`` (a key of :data:`CODES`),
    read from the results file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: run `python -m benchmarks authors-noise` first.")
    with open(path) as f:
        codes = json.load(f)["codes"]
    if name not in codes:
        raise KeyError(f"{name!r} is not measured in {path} (it has {sorted(codes)}): run `python -m "
                       "benchmarks authors-noise`.")
    return float(codes[name]["effective_noise_ratio"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200_000, help="Gaussian draws (coordinates) per code")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=RESULTS)
    args = parser.parse_args(argv)
    results = measure_all(args.draws, args.seed)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print("| released code | noise / (σC/B) | sensitivity / C | effective σ / stated σ | analytic |")
    print("|---|---|---|---|---|")
    for name, row in results["codes"].items():
        print(f"| {name} | {row['noise_ratio']:.4f} | {row['sensitivity_ratio']:.4f} | "
              f"{row['effective_noise_ratio']:.4f} | {row['analytic_effective_noise_ratio']:.4f} |")
    return results
