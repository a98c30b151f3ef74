"""Precision policy of the engine: term and accumulation dtypes, low-precision products, rounding-error
bounds.

Terms are kept in the dtype the layers computed in (bf16 under autocast); every product accumulates in fp32
(fp64 for fp64 models and precise mode). The error constants (:func:`higham_gamma`, :func:`rounding_units`)
are the ingredients of the proven norm bounds of :class:`hf_dpfilter.engine.per_example.PerExampleGradients`
(docs/privacy.md, "Precision of the clip").
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dpfilter.engine.rules import IndexTerm, OuterTerm, Term


def term_dtype(term: Term) -> torch.dtype:
    return term.left.dtype if isinstance(term, OuterTerm) else term.right.dtype if isinstance(term,
            IndexTerm) else term.grad.dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


LOW_PRECISION = (torch.float16, torch.bfloat16)

try:  # transformers is a dependency, but keep the engine importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover
    _HFConv1D = None

#: Layers whose forward is one GEMM of their input, which autocast runs in bf16/fp16 (exact types: a subclass
#: may do other work on its input first). Their input is cast before the call (see _autocast_pre_hook).
AUTOCAST_MATMUL_LAYERS = tuple(t for t in (nn.Linear, _HFConv1D) if t is not None)


def stored_term(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A term tensor as the engine keeps it: low-precision (bf16/fp16) tensors stay as the layer computed them
    when the accumulation dtype is fp32 (products then accumulate in fp32, see :func:`bmm`); anything else is
    converted to the accumulation dtype (float64 in precise mode: exact for fp32/bf16/fp16 values)."""
    if t.dtype == dtype or (dtype == torch.float32 and t.dtype in LOW_PRECISION):
        return t
    return t.to(dtype)


def bmm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (batched) with the result in ``dtype``, accumulating in ``dtype``.

    Low-precision inputs keep their dtype: on CUDA the product runs on tensor cores with fp32 accumulation and
    an fp32 output (``torch.bmm(..., out_dtype=torch.float32)``); elsewhere (no such kernel on CPU) each
    product upcasts its two operands for its own duration only, so nothing larger is kept.
    """
    if a.dtype == dtype and b.dtype == dtype:
        return torch.bmm(a, b)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in LOW_PRECISION and dtype == torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.to(dtype), b.to(dtype))


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``dtype``; low-precision inputs as in :func:`bmm`."""
    if a.dtype == dtype and b.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in LOW_PRECISION and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(dtype), b.to(dtype))


def split_bf16(x: torch.Tensor) -> list[torch.Tensor]:
    """Three bf16 tensors whose fp32 sum is ``x`` (fp32) to a relative error of at most ``2^-27`` per element.

    bf16 keeps fp32's exponent range, so each residual is exact in fp32 and at most ``2^-9`` of the previous
    one. Lets a bf16 GEMM with fp32 accumulation multiply by fp32-scaled values (clip factors) on tensor cores
    without rounding the scale to bf16 (which would move a clipped contribution by up to ``2^-9`` of it).
    """
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return [hi, mid, lo]


def sum_tokens(x: torch.Tensor) -> torch.Tensor:
    """Sum a (B, m, n) tensor over its last two axes in two reductions (n, then m terms).

    Any order of summing k terms errs by at most ``(k-1) u`` times the sum of their magnitudes; in two stages
    each term passes through at most ``m + n - 2`` additions, where one flat reduction would allow ``m n - 1``
    (the error bound of :meth:`PerExampleGradients.clipping_norms` counts on this).
    """
    return x.sum(dim=2).sum(dim=1)


def higham_gamma(n: int, unit: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: bound on the relative error of ``n`` roundings."""
    return n * unit / (1.0 - n * unit)


def underflow_unit(dtype: torch.dtype) -> float:
    """The absolute error one operation can add near zero, in an accumulation in ``dtype``: the smallest
    normal number (``2^-126`` for fp32, ``2^-1022`` for fp64).

    The relative bounds (:func:`higham_gamma`) hold only where no intermediate underflows. A product or a
    sum whose result is subnormal errs by half a subnormal spacing under gradual underflow, and by up to the
    smallest normal number where denormals are flushed to zero (``torch.set_flush_denormal(True)``, or a
    kernel that sets the flag); this unit covers both. It matters for an example whose gradient is tiny (a
    confidently classified example: about ``exp(-margin)``), whose squared norm can fall into the subnormal
    range of fp32 while its clip factor scales it up to ``C``.
    """
    return 2.0**-1022 if dtype == torch.float64 else 2.0**-126


def rounding_units(dtype: torch.dtype, device: torch.device, input_dtype: torch.dtype) -> tuple[float,
                                                                                                 float]:
    """(accumulation unit, input-rounding unit) of the engine's products in ``dtype`` on ``device``.

    The accumulation unit is twice the unit roundoff (``2^-23`` for fp32, ``2^-52`` for fp64), which also
    covers accumulators that truncate instead of rounding to nearest (tensor cores do; Fasi, Higham, Mikaitis
    & Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021). Products of two fp32, bf16 or fp16
    values are exact in fp32 accumulation only if the inputs are not rounded first: with TF32 allowed for
    fp32 matmuls on CUDA, inputs lose 13 bits (unit ``2^-10`` with truncation).
    """
    accumulation = 2.0**-52 if dtype == torch.float64 else 2.0**-23
    tf32 = (
        device.type == "cuda"
        and input_dtype == torch.float32
        and dtype == torch.float32
        and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest")
    )
    return accumulation, (2.0**-10 if tf32 else 0.0)
