"""The randomness of the privacy mechanism: the Gaussian noise and the Poisson sampling.

Two sources:

* **OS CSPRNG** (``secure_rng=True``, recommended for any run whose result is published): uniform bits
  from ``os.urandom``. Gaussians come from the Box-Muller transform in float64, Poisson coins from 53-bit
  uniforms. Not reproducible by design; nothing about the noise or the batches can be recovered from the
  run's configuration.
* **Seeded generators** (default): torch generators seeded from the secret DP seed (``dp_seed``; a fresh
  random seed when not given). The guarantee then assumes that the seed stays secret: anyone who knows it
  can regenerate the noise and the batches. Each consumer gets its own stream, derived from the seed by a
  hash with the stream's name (:func:`derive_seed`), so the sampler and the noise never share a generator
  state, whatever the seed (0 included) and the epoch.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets

import numpy as np
import torch

__all__ = ["derive_seed", "fresh_seed", "secure_gaussian", "secure_uniform"]


def fresh_seed() -> int:
    """A new secret 62-bit seed from the OS CSPRNG."""
    return secrets.randbits(62)


def derive_seed(seed: int, stream: str, *indices: int) -> int:
    """A 63-bit seed for ``stream`` (e.g. ``"noise"``, ``"poisson-sampler"``) and optional indices (the
    epoch).

    SHA-256 of the master seed, the stream name and the indices: different streams and epochs get unrelated
    seeds, so two generators never start from the same state.
    """
    text = ":".join(["hf_dpfilter", str(int(seed)), stream, *(str(int(i)) for i in indices)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def secure_uniform(count: int) -> torch.Tensor:
    """``count`` float64 uniforms in [0, 1) with 53 random bits each, from the OS CSPRNG."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return torch.from_numpy((raw >> np.uint64(11)).astype(np.float64) / 2.0**53)


def secure_gaussian(shape: torch.Size | tuple[int, ...], std: float, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """N(0, std^2) noise from the OS CSPRNG (Box-Muller in float64)."""
    count = math.prod(shape)
    pairs = (count + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    # 53 random bits -> uniform in (0, 1], never 0 so the log is finite.
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) / 2.0**53
    radius = np.sqrt(-2.0 * np.log(u1))
    normals = np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])[:count]
    return torch.from_numpy(normals * std).reshape(shape).to(dtype=dtype, device=device)
