"""Gaussian noise for one logical step: seeded or from the OS CSPRNG, the same on every process, sharded or
not.

Functions that take what they need; the DP optimizer decides *when* noise is drawn (once per logical step) and
at which scale, these decide *how*:

* :func:`seeded_generator` -- the noise's own stream, derived from the plan's secret seed
  (:func:`hf_dpfilter.randomness.secure_rng.derive_seed`), the same on every process and device;
* :func:`gaussian_noise` -- one draw ``N(0, std^2)`` of a shape: seeded, or from the CSPRNG
  (:func:`hf_dpfilter.randomness.secure_rng.secure_gaussian`, the main process's draw shared with the others);
* :func:`sharded_gaussian_noise` -- this process's shard of one whole draw (FSDP2; docs/privacy.md,
  "Sharded noise");
* :func:`noisy_average` / :func:`noisy_averages` -- ``(sum + N(0, std^2 I)) / B`` for one tensor, or for every
  parameter of a step in one draw.

A :class:`NoiseSource` bundles where the draws come from. Its ``draw`` is the one function through which every
non-sharded draw of a step passes (the DP optimizer's
:meth:`~hf_dpfilter.optimizers.base.DPOptimizer.gaussian_noise`), so a step's noise can be observed (tests) at
a single point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hf_dpfilter.distributed.collectives import Collectives, as_layout_of, is_sharded
from hf_dpfilter.randomness import (
    secure_rng,  # looked up at the call: the CSPRNG's draw is observable in tests
)

__all__ = [
    "Draw",
    "NoiseSource",
    "gaussian_noise",
    "noisy_average",
    "noisy_averages",
    "seeded_generator",
    "sharded_gaussian_noise",
]

#: ``draw(shape, std, like)``: N(0, std^2) noise of ``shape`` in ``like``'s dtype and device (layout for
#: shards)
Draw = Callable[[torch.Size, float, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NoiseSource:
    """Where a step's Gaussian draws come from."""

    #: the draw of one tensor (usually :func:`gaussian_noise` with the fields below)
    draw: Draw
    #: the seeded generator of a device (unused with ``secure``)
    generator: Callable[[torch.device], torch.Generator]
    #: draw from the OS CSPRNG instead of the seeded stream
    secure: bool
    #: the processes of the run (the CSPRNG draw of the main process is shared with the others)
    collectives: Collectives


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """The noise's generator on ``device``: its own stream of the secret ``seed``, the same on every
    process."""
    generator = torch.Generator(device=device)
    generator.manual_seed(secure_rng.derive_seed(seed, "gaussian-noise"))
    return generator


def gaussian_noise(
    shape: torch.Size,
    std: float,
    like: torch.Tensor,
    *,
    secure: bool,
    generator: Callable[[torch.device], torch.Generator],
    collectives: Collectives,
) -> torch.Tensor:
    """N(0, std^2) noise of the given shape, from the seeded generator or a CSPRNG.

    For a sharded ``like`` (FSDP2), ``shape`` is the whole shape and the result this process's shard of one
    whole draw: :func:`sharded_gaussian_noise`.
    """
    if is_sharded(like):
        return sharded_gaussian_noise(shape, std, like, secure=secure, generator=generator,
                                      collectives=collectives)
    if std == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if secure:
        noise = secure_rng.secure_gaussian(shape, std, dtype=like.dtype, device=like.device)
        collectives.share_(noise)  # OS randomness differs per process: use the main process's draw
        return noise
    noise = torch.empty(shape, dtype=like.dtype, device=like.device)
    return noise.normal_(0.0, std, generator=generator(like.device))  # one pass: draw and scale


def sharded_gaussian_noise(
    shape: torch.Size,
    std: float,
    like: torch.Tensor,
    *,
    secure: bool,
    generator: Callable[[torch.device], torch.Generator],
    collectives: Collectives,
) -> torch.Tensor:
    """This process's shard of one N(0, std^2 I) draw of the whole ``shape`` (docs/privacy.md, "Sharded
    noise").

    Seeded noise: every process draws the whole tensor from the shared stream, as one process would, and
    keeps its own rows. The shards are then disjoint pieces of exactly the one-process draw (no piece twice,
    none repeated across processes), and a sharded run releases bit for bit what one process releases.
    Drawing only one's own rows would need a stream keyed by (step, parameter, offset), which ties the noise
    to the shard layout; the whole draw costs each process what one process pays, as under DDP. With
    ``secure`` each process draws its own rows from its own OS CSPRNG: independent draws, so the
    whole vector is again one Gaussian draw, with nothing to exchange.
    """
    local = like.to_local()
    if std == 0:
        return as_layout_of(like, torch.zeros_like(local))
    if secure:
        return as_layout_of(like,
                secure_rng.secure_gaussian(local.shape, std, dtype=local.dtype, device=local.device))
    whole = torch.empty(shape, dtype=local.dtype, device=local.device)
    whole.normal_(0.0, std, generator=generator(local.device))
    return collectives.shard_of(like, whole)


def noisy_average(summed: torch.Tensor, std: float, batch: float, draw: Draw) -> torch.Tensor:
    """``(summed + N(0, std^2 I)) / batch`` as a new tensor, in two memory passes.

    The noise is drawn directly at scale ``std / batch`` and the sum added into it: on CPU the Gaussian draw
    for every trainable parameter is the largest cost of a DP step after the backward (124M draws for GPT-2
    small), so the separate scale / add / divide passes of the naive form are worth avoiding.
    """
    return draw(summed.shape, std / batch, summed).add_(summed, alpha=1.0 / batch)


def noisy_averages(
    sums: dict[nn.Parameter, torch.Tensor], std: float, batch: float, source: NoiseSource,
    noise_dtype: torch.dtype | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """``(sum_p + N(0, std^2 I)) / batch`` for every parameter: the step's one Gaussian draw, taken at once.

    The noise of all parameters (per device and dtype, in the order of ``sums``) is **one** draw of
    ``sum_p numel(p)`` coordinates from the generator (or the CSPRNG), split into views, and the sums are
    added with one ``foreach`` kernel: a constant number of kernels per step instead of three per
    parameter. The values are views of one buffer (contiguous, disjoint). ``noise_dtype`` (unsharded sums):
    draw the noise in that dtype and return the averages in it, each ``noise + sum / batch`` computed in the
    sums' precision and rounded once (float32 noise on float64 sums, DIFF2: the draw costs a fraction of a
    float64 one, and the sums are not rounded before the noise is added; the final rounding is
    post-processing).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p, s in sums.items():
        groups.setdefault((s.device, s.dtype), []).append(p)
    out: dict[nn.Parameter, torch.Tensor] = {}
    for params in groups.values():
        values = [sums[p] for p in params]
        sizes = [v.numel() for v in values]  # whole sizes, also for sharded (FSDP2) sums
        if any(is_sharded(v) for v in values):
            out.update(zip(params, _sharded_noisy_averages(values, sizes, std / batch, 1.0 / batch, source)))
            continue
        like = values[0] if noise_dtype is None else values[0].new_empty(0, dtype=noise_dtype)
        flat = source.draw(torch.Size([sum(sizes)]), std / batch, like)
        noisy = [piece.view(v.shape) for piece, v in zip(flat.split(sizes), values)]
        torch._foreach_add_(noisy, values, alpha=1.0 / batch)
        out.update(zip(params, noisy))
    return {p: out[p] for p in sums}


def _sharded_noisy_averages(
    values: list[torch.Tensor], sizes: list[int], std: float, scale: float, source: NoiseSource
) -> list[torch.Tensor]:
    """:func:`noisy_averages` when some sums are shards (FSDP2): seeded noise is the one-process flat draw of
    the whole group, of which each process keeps its parameters' rows (so a sharded run releases exactly what
    one process releases); CSPRNG noise is each process's own draw of its rows (independent, no exchange)."""
    if std == 0 or source.secure:
        noisy = [source.draw(v.shape, std, v) for v in values]
    else:
        local = values[0].to_local() if is_sharded(values[0]) else values[0]
        whole = torch.empty(sum(sizes), dtype=local.dtype, device=local.device)
        whole.normal_(0.0, std, generator=source.generator(local.device))
        pieces = [piece.view(v.shape) for piece, v in zip(whole.split(sizes), values)]
        noisy = [source.collectives.shard_of(v, piece) if is_sharded(v) else piece for piece,
                 v in zip(pieces, values)]
    for n, v in zip(noisy, values):
        n.add_(v, alpha=scale)
    return noisy
