"""The noise for a target epsilon, or the epsilon of a noise, from the command line (DP-SGD, Poisson).

    python -m hf_dpfilter.accounting --epsilon 3 --n 60000 --batch 1000 --epochs 3      # -> sigma
    python -m hf_dpfilter.accounting --sigma 1.1 --n 60000 --batch 1000 --epochs 3      # -> epsilon

The run is what DPTrainer plans for the same settings: sample rate q = batch / n, floor(n / batch) steps per
epoch, ceil(epochs x that) steps (or ``--steps``), delta = n^-1.1 unless given, the PRV accountant unless
another is named. The multi-point methods release other mechanisms per step: their sigma is in the plan the
trainer prints before training.
"""

from __future__ import annotations

import argparse
import math
import sys

from hf_dpfilter.accounting.accountant import ACCOUNTANTS, compute_epsilon, default_delta
from hf_dpfilter.accounting.calibration import calibrate_noise_multiplier


def run_steps(n: int, batch: float, epochs: float | None, steps: int | None) -> int:
    """The planned steps: ``steps`` if given, else ``ceil(epochs * floor(n / batch))``."""
    if steps is not None:
        return int(steps)
    if epochs is None:
        raise SystemExit("error: give --epochs or --steps (the noise depends on the run's length).")
    return math.ceil(epochs * max(1, int(n / batch + 1e-9)))


def main(argv: list[str] | None = None) -> str:
    """Print (and return) sigma for ``--epsilon``, or epsilon for ``--sigma``."""
    parser = argparse.ArgumentParser(prog="python -m hf_dpfilter.accounting", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--epsilon", type=float, help="the target epsilon: print the noise multiplier sigma")
    target.add_argument("--sigma", type=float, help="the noise multiplier: print the epsilon it spends")
    parser.add_argument("--n", type=int, required=True, help="privacy units in the training set (examples "
                                                              "or users)")
    parser.add_argument("--batch", type=float, required=True, help="expected logical batch (units per step)")
    parser.add_argument("--epochs", type=float, default=None, help="epochs (or give --steps)")
    parser.add_argument("--steps", type=int, default=None, help="logical steps (instead of --epochs)")
    parser.add_argument("--delta", type=float, default=None, help="default: n^-1.1, as DPTrainer's")
    parser.add_argument("--accountant", default="prv", choices=list(ACCOUNTANTS))
    args = parser.parse_args(argv)
    if args.n < 1 or not 0 < args.batch <= args.n:
        parser.error(f"need 0 < --batch <= --n, got --batch {args.batch:g} and --n {args.n}.")
    steps = run_steps(args.n, args.batch, args.epochs, args.steps)
    q = args.batch / args.n
    delta = args.delta if args.delta is not None else default_delta(args.n)
    run = f"q = {q:.4g}, {steps} steps, delta = {delta:.3g}, {args.accountant} accountant"
    if args.epsilon is not None:
        sigma = calibrate_noise_multiplier(args.epsilon, delta, q, steps, args.accountant)
        line = f"sigma = {sigma:.4f} for epsilon = {args.epsilon:g} ({run})"
    else:
        epsilon = compute_epsilon([(args.sigma, q, steps)], delta, args.accountant)
        line = f"epsilon = {epsilon:.4f} for sigma = {args.sigma:g} ({run})"
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
