"""Plots of a finished run from ``trainer.state.log_history`` (matplotlib, Agg backend, PNG files).

* ``epsilon.png``: the epsilon spent against optimizer steps (the ``epsilon`` that :class:`DPTrainer` adds
  to every log line), with the target epsilon as a dashed line when one was given;
* ``training.png``: the training loss against steps, and beside it every evaluation metric logged
  (``eval_loss``, ``eval_accuracy``, ``eval_bleu``, ...) against steps, with the majority-class baseline as a
  dashed line when one is given and the epsilon spent on a second axis, so progress reads against both.

Only post-processed, logged quantities are plotted (nothing private). Needs ``matplotlib``
(``pip install hf_dpfilter[plots]``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["plot_epsilon", "plot_training_curves", "plot_run"]

_SKIP_EVAL = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_epoch")


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Plots need matplotlib: pip install 'hf_dpfilter[plots]' (or matplotlib).") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _series(log_history: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for entry in log_history:
        if key in entry and "step" in entry and isinstance(entry[key], (int, float)):
            steps.append(float(entry["step"]))
            values.append(float(entry[key]))
    return steps, values


def plot_epsilon(
    log_history: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    target_epsilon: float | None = None,
    delta: float | None = None,
    title: str | None = None,
) -> str | None:
    """Epsilon against optimizer steps; returns the path, or None when no epsilon was logged."""
    steps, eps = _series(log_history, "epsilon")
    if not steps:
        return None
    if steps[0] > 0:
        steps, eps = [0.0, *steps], [0.0, *eps]  # nothing is spent before the first step
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(steps, eps, marker="o", markersize=3, label="epsilon spent")
    if target_epsilon is not None:
        ax.axhline(target_epsilon, color="gray", linestyle="--", label=f"target epsilon = {target_epsilon:g}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("epsilon" + (f" (delta = {delta:.2g})" if delta is not None else ""))
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "Privacy spent during training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_training_curves(
    log_history: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    title: str | None = None,
    baseline: float | None = None,
) -> str | None:
    """Training loss (left) and evaluation metrics (right) against steps; None if nothing was logged.

    ``baseline``: the majority-class accuracy, drawn on the metrics panel; the epsilon spent (if logged) is
    drawn on that panel's second axis."""
    train_steps, train_loss = _series(log_history, "loss")
    eval_keys = sorted(
        {k for e in log_history for k in e if k.startswith("eval_") and k not in _SKIP_EVAL
         and isinstance(e[k], (int, float))}
    )
    if not train_steps and not eval_keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    if train_steps:
        ax.plot(train_steps, train_loss, marker="o", markersize=3, label="training loss")
    eval_steps, eval_loss = _series(log_history, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, marker="s", markersize=4, label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Loss")
    ax = axes[1]
    plotted = False
    for key in eval_keys:
        if key == "eval_loss":
            continue
        steps, values = _series(log_history, key)
        if steps:
            ax.plot(steps, values, marker="s", markersize=4, label=key[len("eval_") :])
            plotted = True
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", label=f"majority-class baseline ({baseline:.3f})")
        plotted = True
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("metric")
    ax.grid(alpha=0.3)
    eps_steps, eps_values = _series(log_history, "epsilon")
    if eps_steps:
        twin = ax.twinx()
        twin.plot(eps_steps, eps_values, color="tab:red", alpha=0.6, linewidth=1.5, label="epsilon spent")
        twin.set_ylabel("epsilon spent", color="tab:red")
        twin.tick_params(axis="y", colors="tab:red")
        twin.set_ylim(bottom=0)
    if plotted:
        handles, labels = ax.get_legend_handles_labels()
        if eps_steps:
            more_handles, more_labels = twin.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax.legend(handles, labels, fontsize=8)
    else:
        ax.text(0.5, 0.5, "no evaluation metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Evaluation")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_run(
    log_history: Sequence[dict[str, Any]],
    output_dir: str | os.PathLike[str],
    target_epsilon: float | None = None,
    delta: float | None = None,
    title: str | None = None,
    baseline: float | None = None,
) -> list[str]:
    """Write ``epsilon.png`` and ``training.png`` into ``output_dir``; returns the files written."""
    os.makedirs(output_dir, exist_ok=True)
    written = [
        plot_epsilon(log_history, os.path.join(output_dir, "epsilon.png"), target_epsilon, delta, title),
        plot_training_curves(log_history, os.path.join(output_dir, "training.png"), title, baseline),
    ]
    return [p for p in written if p is not None]
