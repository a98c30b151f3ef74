"""Fusion, stacking and Gram algebra of the per-example terms.

Layers that read one input (query, key, value) are fused into one block; same-shape layers may be stacked
into one batched product; the ghost identity's Gram matrices and the weighted sums of outer products are
computed here, all in the dtypes :mod:`hf_dpfilter.engine.precision` prescribes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_dpfilter.engine.precision import bmm, split_bf16, stored_term
from hf_dpfilter.engine.rules import DenseTerm, IndexTerm, OuterTerm, Term


def merge_terms(terms: list[Term], dtype: torch.dtype) -> tuple[OuterTerm | None, IndexTerm | None,
                                                                 DenseTerm | None]:
    """Combine every use of one parameter into at most one term of each kind (concatenating along tokens)."""
    outers = [t for t in terms if isinstance(t, OuterTerm)]
    indexes = [t for t in terms if isinstance(t, IndexTerm)]
    denses = [t for t in terms if isinstance(t, DenseTerm)]
    outer = index = dense = None

    def same_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        stored = [stored_term(t, dtype) for t in tensors]
        # uses in different dtypes: concatenate in the accumulation dtype
        if len({t.dtype for t in stored}) > 1:
            stored = [t.to(dtype) for t in stored]
        return stored

    # A single use (the common case) is kept as it is: torch.cat would copy every activation and output grad.
    if len(outers) == 1:
        outer = OuterTerm(left=stored_term(outers[0].left, dtype), right=stored_term(outers[0].right, dtype))
    elif outers:
        outer = OuterTerm(
            left=torch.cat(same_dtype([t.left for t in outers]), dim=1),
            right=torch.cat(same_dtype([t.right for t in outers]), dim=1),
        )
    if len(indexes) == 1:
        index = IndexTerm(ids=indexes[0].ids, right=stored_term(indexes[0].right, dtype),
                          num_rows=indexes[0].num_rows)
    elif indexes:
        index = IndexTerm(
            ids=torch.cat([t.ids for t in indexes], dim=1),
            right=torch.cat(same_dtype([t.right for t in indexes]), dim=1),
            num_rows=indexes[0].num_rows,
        )
    if denses:
        # dense gradients (biases, norms) are small: always kept in the accumulation dtype
        grad = denses[0].grad.to(dtype)
        for t in denses[1:]:
            grad = grad + t.grad.to(dtype)
        dense = DenseTerm(grad)
    return outer, index, dense


def use_ghost(outer: OuterTerm) -> bool:
    """Ghost identity unless the per-example gradient is no larger than the layer's stored ``A`` and ``B``.

    Per example, ghost costs ``T^2 (P+Q)`` for the norm plus ``T P Q`` for the weighted sum, and keeps only
    ``T^2`` extra numbers; materializing ``B_i^T A_i`` costs ``T P Q`` once (the weighted sum of the
    materialized gradients is then ``P Q``) but holds ``P Q`` numbers until all norms are known. So
    materialize exactly when ``P Q <= T (P + Q)``: then it is the faster choice *and* it replaces ``A``,
    ``B`` (``T (P+Q)`` numbers) by something no larger, so peak memory never grows with ``B P Q`` beyond
    the activations' own size. Decided per batch, since T varies (LoRA's rank-r layers materialize; full
    768x768 layers at T < 384 use the ghost identity).
    """
    tokens, p, q = outer.left.shape[1], outer.left.shape[2], outer.right.shape[2]
    return p * q > tokens * (p + q)


def weighted_outer(left: torch.Tensor, right: torch.Tensor, c: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``sum_i c_i sum_t left[l,i,t] (outer) right[l,i,t]`` for every l, as one batched GEMM, (L, P, Q).

    left (L, B, T, P), right (L, B, T, Q): L stacked layers (L = 1 for one layer). The narrower side is scaled
    by c, formed in ``dtype`` (the clip factor is never rounded to bf16). With a bf16 other side on CUDA, the
    scaled side is split into three bf16 pieces (:func:`split_bf16`) so the GEMMs run on tensor cores with
    fp32 accumulation; otherwise both sides are in ``dtype``.
    """
    layers, batch, tokens, p = left.shape
    q = right.shape[3]
    scale = c.reshape(1, batch, 1, 1)
    if p <= q:
        scaled, other = left.to(dtype) * scale, right
    else:
        scaled, other = right.to(dtype) * scale, left
    scaled = scaled.reshape(layers, batch * tokens, -1)
    other = other.reshape(layers, batch * tokens, -1)
    if other.is_cuda and other.dtype == torch.bfloat16 and dtype == torch.float32:
        pieces = split_bf16(scaled)
    else:
        pieces = [scaled]
    total = None
    for piece in pieces:
        part = bmm(piece.transpose(1, 2), other, dtype) if p <= q else bmm(other.transpose(1, 2), piece,
                                                                             dtype)
        total = part if total is None else total.add_(part)
    return total


@dataclass
class OuterBlock:
    """Weight parameters whose per-example gradients are all outer products, computed together.

    ``left`` (L, B, T, P) and ``right`` (L, B, T, Q) hold L layers stacked (L = 1 unless same-shape layers are
    stacked, see :class:`PerExampleGradients`). Layer l's ``P x Q`` gradient may be several parameters fused
    because they share one side (the query, key and value projections read the same input): parameter k is
    rows (``dim == 0``) or columns (``dim == 1``) ``start : start + size`` of layer ``layer``. The squared
    norm of a fused layer is the sum of its parameters' squared norms, and its Gram matrix of the shared side
    is computed once. ``grads`` (L, B, P, Q) replaces ``left`` and ``right`` once materialized (narrow
    layers).
    """

    params: list[nn.Parameter]
    places: list[tuple[int, int, int, int]]  # per parameter: (layer, dim, start, size)
    left: torch.Tensor | None
    right: torch.Tensor | None
    input_dtype: torch.dtype
    grads: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.left, self.right, self.grads) if t is not None)

def fuse_shared_sides(
    outers: dict[nn.Parameter, OuterTerm], raw_sides: dict[nn.Parameter, tuple[int, int]], input_dtypes: dict
) -> list[OuterBlock]:
    """One block (L = 1) per layer, fusing the weight parameters that share a side (the same recorded tensor).

    ``raw_sides`` holds the ids of the (left, right) tensors the layer rules returned, before any dtype
    conversion, so sharing is what the model did, not a coincidence of values. Linear layers keep their input
    on the right (``weight = B^T A``), Conv1D on the left. The other sides are concatenated along features;
    each original is dropped from ``outers`` as soon as its block is built, so the transient copy is one
    layer's.
    """
    groups: list[tuple[str, list[nn.Parameter]]] = []
    remaining = [p for p in outers if p in raw_sides]
    for side in ("right", "left"):
        shared: dict[tuple, list[nn.Parameter]] = {}
        for param in remaining:
            outer = outers[param]
            other = outer.left if side == "right" else outer.right
            key = (raw_sides[param][1 if side == "right" else 0], other.shape[:2], other.dtype, other.device)
            shared.setdefault(key, []).append(param)
        groups += [(side, params) for params in shared.values() if len(params) > 1]
        remaining = [p for params in shared.values() if len(params) == 1 for p in params]
    fused = {id(p) for _, params in groups for p in params}
    groups += [("own", [p]) for p in outers if id(p) not in fused]
    blocks = []
    for side, params in groups:
        if side == "own":
            outer = outers.pop(params[0])
            left, right, places = outer.left, outer.right, [(0, 0, 0, outer.left.shape[2])]
        elif side == "right":
            sizes = [outers[p].left.shape[2] for p in params]
            right = outers[params[0]].right
            left = torch.cat([outers.pop(p).left for p in params], dim=2)
            places = [(0, 0, sum(sizes[:k]), size) for k, size in enumerate(sizes)]
        else:
            sizes = [outers[p].right.shape[2] for p in params]
            left = outers[params[0]].left
            right = torch.cat([outers.pop(p).right for p in params], dim=2)
            places = [(0, 1, sum(sizes[:k]), size) for k, size in enumerate(sizes)]
        blocks.append(OuterBlock(params, places, left.unsqueeze(0), right.unsqueeze(0),
                                  input_dtypes[params[0]]))
    return blocks


def stack_blocks(blocks: list[OuterBlock], budget: int) -> list[OuterBlock]:
    """Stack blocks of the same shapes, dtypes and device (same-shape layers) into blocks of several layers.

    Each stack's terms and Gram matrices stay within ``budget`` bytes (stacking copies the terms while the
    originals still exist). The kernel count of the norms and sums then no longer grows with the number of
    layers, only with the number of distinct shapes and with the memory the terms take.
    """
    by_shape: dict[tuple, list[OuterBlock]] = {}
    for block in blocks:
        key = (block.left.shape, block.right.shape, block.left.dtype, block.right.dtype, block.left.device,
               block.input_dtype)
        by_shape.setdefault(key, []).append(block)
    out = []
    for same in by_shape.values():
        _, batch, tokens, _ = same[0].left.shape
        gram_bytes = 3 * batch * tokens * tokens * 8  # two Gram matrices and their product, at most float64
        per_layer = same[0].nbytes + gram_bytes
        size = max(1, budget // per_layer)
        for start in range(0, len(same), size):
            chunk = same[start : start + size]
            if len(chunk) == 1:
                out.append(chunk[0])
                continue
            params, places = [], []
            for layer, block in enumerate(chunk):
                params += block.params
                places += [(layer, dim, begin, length) for _, dim, begin, length in block.places]
            left = torch.cat([b.left for b in chunk])
            right = torch.cat([b.right for b in chunk])
            for block in chunk:  # drop the per-layer terms now: only the stack holds them
                block.left = block.right = None
            out.append(OuterBlock(params, places, left, right, chunk[0].input_dtype))
    return out


CHUNK_ABOVE = 4096  # Gram matrices over longer dot products (vocabulary-sized) are accumulated in chunks
CHUNK = 1024


def per_example_gram(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x x^T`` per example, (B, T, T) in ``dtype``. A dot product longer than ``CHUNK_ABOVE`` (GPT-2's
    ``lm_head`` output gradient: 50257) is summed in chunks of ``CHUNK``, so its error bound grows with
    ``chunk + chunks`` (~1100) instead of its length (see
    :meth:`PerExampleGradients._param_norm_and_bound`)."""
    length = x.shape[2]
    if length <= CHUNK_ABOVE:
        return bmm(x, x.transpose(1, 2), dtype)
    gram = None
    for start in range(0, length, CHUNK):
        part = x[:, :, start : start + CHUNK]
        chunk = bmm(part, part.transpose(1, 2), dtype)
        gram = chunk if gram is None else gram.add_(chunk)
    return gram


def quadratic(n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``n_i^T M_i n_i`` per example for n (B, T) and M (B, T, T)."""
    return torch.bmm(n.unsqueeze(1), torch.bmm(m, n.unsqueeze(2))).reshape(-1)
