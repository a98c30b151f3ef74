"""Gaussian noise from the operating system's cryptographically secure generator (``secure_noise=True``).

Pseudo-random generators such as torch's Philox/Mersenne Twister are predictable from their state; an
attacker who could recover it could subtract the noise. This draws uniform bits from ``os.urandom`` and
turns them into Gaussians with the Box-Muller transform in float64. It is slower than ``torch.randn``
and not reproducible by design.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch


def secure_gaussian(shape: torch.Size | tuple[int, ...], std: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    count = math.prod(shape)
    pairs = (count + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    # 53 random bits -> uniform in (0, 1], never 0 so the log is finite.
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) / 2.0**53
    radius = np.sqrt(-2.0 * np.log(u1))
    normals = np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])[:count]
    return torch.from_numpy(normals * std).reshape(shape).to(dtype=dtype, device=device)
