"""Per-example clipping functions: the factor c_i that multiplies example i's gradient.

* ``"abadi"`` (default): ``c_i = min(1, C / ||g_i||)`` -- Abadi et al. 2016; ``||c_i g_i|| <= C``.
* ``"automatic"``: ``c_i = C / (||g_i|| + 0.01)`` -- automatic clipping (Bu et al. 2023), used by the DiSK
  and DOPPLER papers; ``||c_i g_i|| < C`` as well, so the sensitivity is C either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_dpfilter.engine import PerExampleGradients

CLIPPING_FNS = ("abadi", "automatic")
AUTOMATIC_CLIPPING_STABILITY = 0.01


def clip_factors(norms: torch.Tensor, max_grad_norm: float, clipping_fn: str = "abadi") -> torch.Tensor:
    """Per-example factors such that ``||factor_i * g_i|| <= max_grad_norm``."""
    if clipping_fn == "abadi":
        # 1e-6 keeps 0/0 finite; an example with zero gradient gets factor 1 (its contribution is 0 anyway).
        return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    if clipping_fn == "automatic":
        return max_grad_norm / (norms + AUTOMATIC_CLIPPING_STABILITY)
    raise ValueError(f"clipping_fn must be one of {CLIPPING_FNS}, got {clipping_fn!r}.")


def zero_nonfinite_examples(grads: PerExampleGradients, losses: torch.Tensor) -> torch.Tensor | None:
    """Zero the contribution of examples with a NaN/inf loss or gradient norm; their mask (on ``losses``'
    device), or None when every example is finite.

    The zeroed example contributes the zero vector, which is within the sensitivity bound, so the guarantee
    is unaffected; the other examples of the micro-batch are untouched (their gradients are per example).
    """
    bad = ~torch.isfinite(grads.norms()) | ~torch.isfinite(losses.to(grads.norms().device))
    if not bool(bad.any()):
        return None
    grads.zero_examples(bad)
    return bad.to(losses.device)
