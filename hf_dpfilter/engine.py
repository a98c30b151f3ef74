"""The clipping engine: per-example gradients in compact (ghost) form, from one backward.

The engine computes; it never clips. Clipping, noise and accounting belong to the DP optimizer, which drives
the engine (one call per micro-batch)::

    engine = plan.make_engine(model)                      # or GhostClippingEngine(model)
    optimizer = plan.make_optimizer(model.parameters(), base=torch.optim.AdamW, lr=1e-3)
    optimizer.accumulate(engine, loss_fn, batch_size)     # forward(s), backward, clip per example, sum
    optimizer.step()                                      # noise once, account, base optimizer step

How it works. Forward hooks on every module that owns a trainable parameter save the module's input ``A``
and keep a handle on its output ``Z``. :meth:`per_example_gradients` then runs **one** backward,
``torch.autograd.grad(sum_i loss_i, [Z ...])``, which computes the output gradients ``B`` and skips every
weight-gradient GEMM (autograd only computes what the requested inputs need). Because the loss of example i
depends only on example i, ``B[i]`` is example i's own output gradient. Each layer's registered rule
(:mod:`hf_dpfilter.grad_rules`) turns ``(A, B)`` into per-example gradient terms, from which the engine gets

* per-example norms, per layer and per batch by the cheaper of the ghost identity
  ``||sum_t b_t a_t^T||^2 = sum_{t,s} (a_t.a_s)(b_t.b_s)`` (cost ~T^2 (p+d)) and materializing ``B_i^T A_i``
  (cost ~T p d), accumulated in fp32 (fp64 for fp64 models);
* the weighted sum ``sum_i c_i g_i`` for any coefficients (clip factors, or 1 for the unclipped sum that
  DiceSGD needs) directly from ``A`` and ``B`` (book-keeping: no second backward).

A module called several times in one recorded forward (several parameter points for DiSK/DP-PMLF/DIFF2,
or weight sharing) contributes the sum of its calls: the calls are concatenated along the token axis,
so the *combination* is what gets clipped. Tied parameters (GPT-2's ``wte``/``lm_head``) get the exact
cross term between the embedding and the output-layer use.

Which layer calls are per example is proven, not read from shapes (:mod:`hf_dpfilter.batch_axis`): the first
recorded step after attach traces the batch axis from the model's batch-first inputs through every torch
function, and caches a verdict per module and call. A call on a tensor that does not derive from the batch but
whose output has leading size 1 (BERT's and GPT-2's position ids, broadcast as ``(1, T)``) would return a
gradient summed over the batch; the forward hook expands such outputs to ``(B, T, d)`` (a view; it changes no
values) so their gradient stays per example. Any other call without a proven batch axis (``pos_emb(arange(T))``,
T5's relative attention bias) is refused by name as soon as the backward shows it carries gradient. The same
first step refuses parameters and buffers written by the forward and trainable modules never called; modules
that mix examples or write state are refused earlier, at attach (:mod:`hf_dpfilter.validators`).

Gradient checkpointing (transformers' non-reentrant ``torch.utils.checkpoint``). A checkpointed layer runs
its forward twice: once in the forward pass and again inside the backward, to rebuild the tensors autograd
needs. The hooks fire both times; only the first counts. A forward hook that fires inside a backward (an
autograd graph task) is a recomputation: it records nothing, so every layer call is recorded once per
gradient point, however many backwards replay it. Records hold the layer's *gradient edge*
(:func:`torch.autograd.graph.get_gradient_edge`), not its output tensor, so a checkpointed layer's output is
freed as checkpointing intends, and the backward still delivers that output's gradient. A forward at other
parameter values (:meth:`GhostClippingEngine.call_model`, DiSK/DP-PMLF/DIFF2) must be recomputed at the same
values: the engine wraps the checkpoint function transformers keeps on each checkpointed layer
(``_gradient_checkpointing_func``) so that its recomputation runs at the values of its original forward.
Reentrant checkpointing (``use_reentrant=True``) runs the first forward without autograd, so the hooks never
see those layers: it is refused, and a recomputation of a layer that was never recorded raises.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.batch_axis import BATCH, BROADCAST, LOST, BatchAxisTracer
from hf_dpfilter.collectives import is_sharded
from hf_dpfilter.grad_rules import DenseTerm, IndexTerm, OuterTerm, Term, find_grad_rule
from hf_dpfilter.packing import PackedLayout, regroup_record
from hf_dpfilter.validators import (
    ModuleValidationError,
    StateWrittenError,
    ValidationOptions,
    find_module_problems,
    hold_eval_modes,
)

__all__ = ["CheckpointingError", "GhostClippingEngine", "PerExampleGradients", "UnsupportedLayerError"]


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives in a module type that has no per-example gradient rule."""


@dataclass
class _Record:
    module: nn.Module
    activations: torch.Tensor
    # Where the output's gradient arrives. Not the output tensor itself: holding it would keep every
    # checkpointed layer's output alive (checkpointing frees them) and would follow in-place changes of it.
    output_edge: torch.autograd.graph.GradientEdge
    output_dtype: torch.dtype
    #: the tensors the forward used for the module's sharded parameters (FSDP2 gathers whole ones), for the check
    used: dict[str, torch.Tensor] | None = None
    #: why the call's batch axis is not proven (hf_dpfilter.batch_axis); refused if its output gets gradient
    unproven: str | None = None


def _same_values(copy: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``copy``'s values (NaN equal to NaN); True when no copy was kept."""
    if copy is None:
        return True
    if copy.shape != tensor.shape or copy.dtype != tensor.dtype:
        return False
    if copy.is_floating_point() or copy.is_complex():
        return bool(((copy == tensor) | (copy.isnan() & tensor.isnan())).all())
    return bool(torch.equal(copy, tensor))


def _inside_backward() -> bool:
    """True while autograd runs a backward (where checkpointed layers are recomputed)."""
    return torch._C._current_graph_task_id() != -1


class CheckpointingError(RuntimeError):
    """Gradient checkpointing set up in a way per-example clipping cannot see (reentrant, or unknown)."""


_REENTRANT_REFUSED = (
    "Reentrant gradient checkpointing (use_reentrant=True) is not supported with per-example clipping: it runs "
    "the first forward of every checkpointed layer without autograd, so the clipping hooks never see those "
    "layers. Use the non-reentrant kind: gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' "
    "default when no kwargs are given), or model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False})."
)


def checkpoint_function_is_reentrant(function: Callable) -> bool | None:
    """Whether transformers' checkpoint function (a ``functools.partial`` of ``torch.utils.checkpoint``)
    is reentrant: True/False when its keywords say, True when unset (torch's default), None when unknown."""
    while isinstance(function, _CheckpointAtRecordedValues):
        function = function.checkpoint
    if not isinstance(function, functools.partial):
        return None
    return bool(function.keywords.get("use_reentrant", True))


class _CheckpointAtRecordedValues:
    """transformers' per-layer checkpoint function, with the recomputation run at the parameter values of the
    original forward (those given to :meth:`GhostClippingEngine.call_model`, or the current ones)."""

    def __init__(self, checkpoint: Callable, engine: GhostClippingEngine) -> None:
        self.checkpoint = checkpoint
        self.engine = engine

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        values = engine._active_values  # None: the current values, which are in place at recomputation too

        def at_recorded_values(*inner_args: Any, **inner_kwargs: Any) -> Any:
            if not _inside_backward():
                return function(*inner_args, **inner_kwargs)  # the original forward: the values are in place
            from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

            engine._replaying_values += 1
            try:
                if values is None:
                    return function(*inner_args, **inner_kwargs)
                with _reparametrize_module(engine.model, dict(values), tie_weights=True, strict=False):
                    return function(*inner_args, **inner_kwargs)
            finally:
                engine._replaying_values -= 1

        return self.checkpoint(at_recorded_values, *args, **kwargs)


def _term_dtype(term: Term) -> torch.dtype:
    return term.left.dtype if isinstance(term, OuterTerm) else term.right.dtype if isinstance(term, IndexTerm) else term.grad.dtype


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_LOW_PRECISION = (torch.float16, torch.bfloat16)

try:  # transformers is a dependency, but keep the engine importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover
    _HFConv1D = None

#: Layers whose forward is one GEMM of their input, which autocast runs in bf16/fp16 (exact types: a subclass
#: may do other work on its input first). Their input is cast before the call (see _autocast_pre_hook).
_AUTOCAST_MATMUL_LAYERS = tuple(t for t in (nn.Linear, _HFConv1D) if t is not None)


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A term tensor as the engine keeps it: low-precision (bf16/fp16) tensors stay as the layer computed them
    when the accumulation dtype is fp32 (products then accumulate in fp32, see :func:`_bmm`); anything else is
    converted to the accumulation dtype (float64 in precise mode: exact for fp32/bf16/fp16 values)."""
    if t.dtype == dtype or (dtype == torch.float32 and t.dtype in _LOW_PRECISION):
        return t
    return t.to(dtype)


def _bmm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (batched) with the result in ``dtype``, accumulating in ``dtype``.

    Low-precision inputs keep their dtype: on CUDA the product runs on tensor cores with fp32 accumulation and
    an fp32 output (``torch.bmm(..., out_dtype=torch.float32)``); elsewhere (no such kernel on CPU) each
    product upcasts its two operands for its own duration only, so nothing larger is kept.
    """
    if a.dtype == dtype and b.dtype == dtype:
        return torch.bmm(a, b)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _LOW_PRECISION and dtype == torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.to(dtype), b.to(dtype))


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``dtype``; low-precision inputs as in :func:`_bmm`."""
    if a.dtype == dtype and b.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _LOW_PRECISION and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(dtype), b.to(dtype))


def _split_bf16(x: torch.Tensor) -> list[torch.Tensor]:
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


def _sum_tokens(x: torch.Tensor) -> torch.Tensor:
    """Sum a (B, m, n) tensor over its last two axes in two reductions (n, then m terms).

    Any order of summing k terms errs by at most ``(k-1) u`` times the sum of their magnitudes; in two stages
    each term passes through at most ``m + n - 2`` additions, where one flat reduction would allow ``m n - 1``
    (the error bound of :meth:`PerExampleGradients.clipping_norms` counts on this).
    """
    return x.sum(dim=2).sum(dim=1)


def _merge_terms(terms: list[Term], dtype: torch.dtype) -> tuple[OuterTerm | None, IndexTerm | None, DenseTerm | None]:
    """Combine every use of one parameter into at most one term of each kind (concatenating along tokens)."""
    outers = [t for t in terms if isinstance(t, OuterTerm)]
    indexes = [t for t in terms if isinstance(t, IndexTerm)]
    denses = [t for t in terms if isinstance(t, DenseTerm)]
    outer = index = dense = None

    def same_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        stored = [_stored(t, dtype) for t in tensors]
        if len({t.dtype for t in stored}) > 1:  # uses in different dtypes: concatenate in the accumulation dtype
            stored = [t.to(dtype) for t in stored]
        return stored

    # A single use (the common case) is kept as it is: torch.cat would copy every activation and output grad.
    if len(outers) == 1:
        outer = OuterTerm(left=_stored(outers[0].left, dtype), right=_stored(outers[0].right, dtype))
    elif outers:
        outer = OuterTerm(
            left=torch.cat(same_dtype([t.left for t in outers]), dim=1),
            right=torch.cat(same_dtype([t.right for t in outers]), dim=1),
        )
    if len(indexes) == 1:
        index = IndexTerm(ids=indexes[0].ids, right=_stored(indexes[0].right, dtype), num_rows=indexes[0].num_rows)
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


def _use_ghost(outer: OuterTerm) -> bool:
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


def _weighted_outer(left: torch.Tensor, right: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_i c_i sum_t left[l,i,t] (outer) right[l,i,t]`` for every l, as one batched GEMM, (L, P, Q).

    left (L, B, T, P), right (L, B, T, Q): L stacked layers (L = 1 for one layer). The narrower side is scaled
    by c, formed in ``dtype`` (the clip factor is never rounded to bf16). With a bf16 other side on CUDA, the
    scaled side is split into three bf16 pieces (:func:`_split_bf16`) so the GEMMs run on tensor cores with
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
        pieces = _split_bf16(scaled)
    else:
        pieces = [scaled]
    total = None
    for piece in pieces:
        part = _bmm(piece.transpose(1, 2), other, dtype) if p <= q else _bmm(other.transpose(1, 2), piece, dtype)
        total = part if total is None else total.add_(part)
    return total


@dataclass
class _OuterBlock:
    """Weight parameters whose per-example gradients are all outer products, computed together.

    ``left`` (L, B, T, P) and ``right`` (L, B, T, Q) hold L layers stacked (L = 1 unless same-shape layers are
    stacked, see :class:`PerExampleGradients`). Layer l's ``P x Q`` gradient may be several parameters fused
    because they share one side (the query, key and value projections read the same input): parameter k is
    rows (``dim == 0``) or columns (``dim == 1``) ``start : start + size`` of layer ``layer``. The squared norm
    of a fused layer is the sum of its parameters' squared norms, and its Gram matrix of the shared side is
    computed once. ``grads`` (L, B, P, Q) replaces ``left`` and ``right`` once materialized (narrow layers).
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


#: A stack of same-shape layers holds at most this share of the terms' memory (and at least _STACK_MIN_BYTES):
#: stacking copies the layers' A and B, a transient on top of what the terms hold.
_STACK_SHARE = 0.25
_STACK_MIN_BYTES = 16 * 2**20


def _fuse_shared_sides(
    outers: dict[nn.Parameter, OuterTerm], raw_sides: dict[nn.Parameter, tuple[int, int]], input_dtypes: dict
) -> list[_OuterBlock]:
    """One block (L = 1) per layer, fusing the weight parameters that share a side (the same recorded tensor).

    ``raw_sides`` holds the ids of the (left, right) tensors the layer rules returned, before any dtype
    conversion, so sharing is what the model did, not a coincidence of values. Linear layers keep their input
    on the right (``weight = B^T A``), Conv1D on the left. The other sides are concatenated along features; each
    original is dropped from ``outers`` as soon as its block is built, so the transient copy is one layer's.
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
        blocks.append(_OuterBlock(params, places, left.unsqueeze(0), right.unsqueeze(0), input_dtypes[params[0]]))
    return blocks


def _stack_blocks(blocks: list[_OuterBlock], budget: int) -> list[_OuterBlock]:
    """Stack blocks of the same shapes, dtypes and device (same-shape layers) into blocks of several layers.

    Each stack's terms and Gram matrices stay within ``budget`` bytes (stacking copies the terms while the
    originals still exist). The kernel count of the norms and sums then no longer grows with the number of
    layers, only with the number of distinct shapes and with the memory the terms take.
    """
    by_shape: dict[tuple, list[_OuterBlock]] = {}
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
            out.append(_OuterBlock(params, places, left, right, chunk[0].input_dtype))
    return out


_CHUNK_ABOVE = 4096  # Gram matrices over longer dot products (vocabulary-sized) are accumulated in chunks
_CHUNK = 1024


def _gram(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x x^T`` per example, (B, T, T) in ``dtype``. A dot product longer than ``_CHUNK_ABOVE`` (GPT-2's
    ``lm_head`` output gradient: 50257) is summed in chunks of ``_CHUNK``, so its error bound grows with
    ``chunk + chunks`` (~1100) instead of its length (see :meth:`PerExampleGradients._param_norm_and_bound`)."""
    length = x.shape[2]
    if length <= _CHUNK_ABOVE:
        return _bmm(x, x.transpose(1, 2), dtype)
    gram = None
    for start in range(0, length, _CHUNK):
        part = x[:, :, start : start + _CHUNK]
        chunk = _bmm(part, part.transpose(1, 2), dtype)
        gram = chunk if gram is None else gram.add_(chunk)
    return gram


def _quadratic(n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``n_i^T M_i n_i`` per example for n (B, T) and M (B, T, T)."""
    return torch.bmm(n.unsqueeze(1), torch.bmm(m, n.unsqueeze(2))).reshape(-1)


def _gamma(n: int, unit: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: bound on the relative error of ``n`` roundings."""
    return n * unit / (1.0 - n * unit)


def _rounding_units(dtype: torch.dtype, device: torch.device, input_dtype: torch.dtype) -> tuple[float, float]:
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


class PerExampleGradients:
    """Per-example gradients of one recorded batch, kept in compact (ghost) form.

    ``squared_norms()`` gives ``||g_i||^2`` over all trainable parameters; ``weighted_sum(c)`` gives
    ``{param: sum_i c_i g_i[param]}``; ``clipping_norms()`` gives the norms to clip with: a proven upper bound
    of the exact norm of the per-example gradient the terms describe (docs/privacy.md, "Precision of the
    clip" and "Mixed precision: the norm under bf16").

    The terms are kept in the dtype the layers computed in (bf16 under autocast; no fp32 copies) and every
    product accumulates in fp32 (fp64 for fp64 models and precise mode). :meth:`clipping_norms` returns
    ``sqrt(max(n^2, 0) + E) (1 + 2^-20)`` (``2^-50`` in float64), where ``n^2`` is the computed squared norm
    and ``E`` a proven bound on its rounding error, built per parameter by :meth:`_param_norm_and_bound`
    (a posteriori for the ghost Gram products, from the pieces' norms for the other blocks; docs/privacy.md,
    "Mixed precision: the norm under bf16"), so the clip holds for the exact per-example gradient of the
    stored terms whatever the scale or the cancellation.

    ``precise=True`` is for combinations with cancellation (a per-example *difference* of gradients at two
    points, as DIFF2's difference rounds, or any combination with a negative weight): every term is promoted
    to float64 (exact for float32 and bfloat16 inputs), so ``u = 2^-52`` and the bound is tight enough that
    even a squared norm dominated by cancellation is clipped correctly (never less, at worst harder).
    """

    def __init__(
        self,
        terms: dict[nn.Parameter, list[Term]],
        batch_size: int,
        dtype: torch.dtype,
        precise: bool = False,
        stack_layers: bool | None = None,
    ) -> None:
        """``terms`` is consumed: its entries are removed as they are merged, so that the originals can be freed
        as soon as a fused or stacked copy replaces them (the caller must not hold other references).

        ``stack_layers``: stack same-shape layers (see :func:`_stack_blocks`); None means on CUDA only, where
        a step of a small model is bound by kernel launches. On CPU the batched products save nothing and the
        stack is a transient copy."""
        self.batch_size = batch_size
        self.precise = precise
        self.dtype = torch.float64 if precise else dtype
        self._input_dtypes = {
            p: next((t.left.dtype for t in ts if isinstance(t, OuterTerm)), self.dtype) for p, ts in terms.items()
        }
        # which tensors the layer rules returned, to find layers that share one (before dtype conversions)
        raw_sides = {
            p: (id(ts[0].left), id(ts[0].right)) for p, ts in terms.items() if len(ts) == 1 and isinstance(ts[0], OuterTerm)
        }
        merged = {p: _merge_terms(terms.pop(p), self.dtype) for p in list(terms)}
        # Parameters with only a dense per-example gradient (biases, LayerNorm: most tensors of a transformer)
        # are handled together: one (B, N) matrix per device, so their norms and weighted sums cost a few
        # kernels in all instead of a few per parameter.
        self._dense_params: dict[torch.device, list[nn.Parameter]] = {}
        for param, (outer, index, dense) in merged.items():
            if outer is None and index is None and dense is not None:
                self._dense_params.setdefault(dense.grad.device, []).append(param)
        self._dense_groups: dict[torch.device, torch.Tensor] = {
            device: torch.cat([merged.pop(p)[2].grad.reshape(batch_size, -1) for p in params], dim=1)
            for device, params in self._dense_params.items()
        }
        # Parameters with only an outer-product gradient (the weights of Linear/Conv1D layers): fused where
        # layers share an input, and stacked across same-shape layers when asked to.
        outers = {p: terms_[0] for p, terms_ in merged.items() if terms_[1] is None and terms_[2] is None}
        for param in outers:
            del merged[param]
        self._blocks = _fuse_shared_sides(outers, raw_sides, self._input_dtypes)
        if self._blocks and (stack_layers if stack_layers is not None else self._blocks[0].left.is_cuda):
            held = sum(block.nbytes for block in self._blocks)
            self._blocks = _stack_blocks(self._blocks, max(_STACK_MIN_BYTES, int(_STACK_SHARE * held)))
        self._merged = merged
        self._squared_norms: torch.Tensor | None = None
        self._squared_norms64: torch.Tensor | None = None
        self._error_bounds: torch.Tensor | None = None
        self._released = False

    @property
    def parameters(self) -> list[nn.Parameter]:
        return (
            list(self._merged)
            + [p for block in self._blocks for p in block.params]
            + [p for params in self._dense_params.values() for p in params]
        )

    def _dense_group_squared_norms(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(squared norms, error bound) in float64 of each dense group: a sum of squares, no cancellation."""
        out = []
        for grad in self._dense_groups.values():
            squared = torch.linalg.vector_norm(grad, dim=1, dtype=torch.float64).square()
            out.append((squared, squared * (4 * _gamma(grad.shape[1] + 4, 2.0**-52))))
        return out

    def _norm_and_bound(
        self,
        outer: OuterTerm | None,
        index: IndexTerm | None,
        dense: DenseTerm | None,
        batch: int,
        device: torch.device,
        input_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, list[tuple[float, torch.Tensor]], torch.Tensor | None]:
        """``(n^2, [(c_k, t_k)], materialized)`` for the terms of one parameter (or of one block of fused or
        stacked layers, whose rows are then the batch): the computed squared norm per row, the terms of a bound
        ``E = sum_k c_k t_k`` on its rounding error (summed later for all parameters in one reduction), and the
        per-row gradient ``(batch, P, Q)`` when the outer term was materialized (it then replaces the term).

        Every block of the squared norm is bounded by what it sums (docs/privacy.md, "Mixed precision"):

        * ghost blocks (``sum_ts G_ts H_ts`` with computed Gram matrices ``G``, ``H``) *a posteriori*:
          ``|G^ H^ - G H| <= dG N_G |H^| + dH N_H |G^| + dG dH N_G N_H`` entrywise, ``N_G[t,s] = ||x_t|| ||x_s||``
          and ``dG`` the dot-product error of the Gram (``gamma`` of its length, or of chunk + chunks for long
          dot products), plus ``(u + gamma_R)`` times ``sum |G^ H^|`` for the product and the two-stage sum;
        * the other blocks (tied cross term, a dense gradient with token terms) by their pieces:
          ``((1 + eps)^2 (1 + gamma_R) - 1)`` times the sum of the products of the pieces' norms;
        * a materialized gradient ``B_i^T A_i`` is formed and squared in float64.
        """
        dtype = self.dtype
        unit, input_unit = _rounding_units(dtype, device, input_dtype)
        materialized = None
        f64 = torch.float64
        parts: list[torch.Tensor] = []
        terms: list[tuple[float, torch.Tensor]] = []
        depth, dot, norm_length = 8, 1, 1  # longest reduction, longest dot product, longest norm
        s_outer = s_index = dense_norm = None

        def norms(x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.vector_norm(x, dim=2, dtype=dtype)

        def dot_error(length: int) -> float:
            chunk, chunks = (length, 1) if length <= _CHUNK_ABOVE else (_CHUNK, -(-length // _CHUNK))
            return (1 + input_unit) ** 2 * (1 + _gamma(chunk + chunks, unit)) - 1

        if outer is not None:
            tokens, p, q = outer.left.shape[1], outer.left.shape[2], outer.right.shape[2]
            depth, norm_length = max(depth, 2 * tokens + 8), max(norm_length, p, q)
            n_left, n_right = norms(outer.left), norms(outer.right)
            s_outer = torch.linalg.vecdot(n_left, n_right)
            if not _use_ghost(outer):
                # narrow layer (LoRA, or T large): materialize in float64 (cheap here), store in the sum's dtype
                grad = _bmm(outer.left.transpose(1, 2), outer.right, f64)
                if dense is not None:
                    grad = grad + dense.grad.reshape(grad.shape).to(f64)
                parts.append(_sum_tokens(grad * grad))
                extra = 0.0 if dense is None else torch.linalg.vector_norm(dense.grad.reshape(batch, -1), dim=1,
                                                                           dtype=dtype)
                scale = s_outer + extra
                factor = (1 + _gamma(tokens + 2, 2.0**-52)) ** 2 * (1 + _gamma(p + q + 8, 2.0**-52)) - 1
                terms.append((factor, scale * scale))
                materialized = grad.to(dtype)
                dense = DenseTerm(materialized)
                outer = None
                dense_done = True
            else:
                dense_done = False
                left_gram, d_left = _gram(outer.left, dtype), dot_error(p)
                right_gram, d_right = _gram(outer.right, dtype), dot_error(q)
                product = left_gram * right_gram
                parts.append(_sum_tokens(product))
                magnitude = _sum_tokens(product.abs_())
                del product
                weighted_left = _quadratic(n_left, right_gram.abs_())
                weighted_right = _quadratic(n_right, left_gram.abs_())
                del left_gram, right_gram
                terms += [
                    (d_left, weighted_left),
                    (d_right, weighted_right),
                    (d_left * d_right, s_outer * s_outer),
                    (unit + _gamma(depth, unit) * (1 + unit), magnitude),
                ]
        else:
            dense_done = False
        if index is not None:
            tokens, q = index.right.shape[1], index.right.shape[2]
            depth, norm_length = max(depth, 2 * tokens + 8), max(norm_length, q)
            n_rows = norms(index.right)
            s_index = n_rows.sum(dim=1)
            same_row = index.ids.unsqueeze(2) == index.ids.unsqueeze(1)
            right_gram = _gram(index.right, dtype).masked_fill_(~same_row, 0)
            parts.append(_sum_tokens(right_gram))
            magnitude = _sum_tokens(right_gram.abs_())
            del right_gram
            pairs = _sum_tokens((n_rows.unsqueeze(2) * n_rows.unsqueeze(1)).masked_fill_(~same_row, 0))
            terms += [(dot_error(q), pairs), (unit + _gamma(depth, unit) * (1 + unit), magnitude)]
        cross_pieces: list[torch.Tensor] = []
        if outer is not None and index is not None:
            # Tied weights: 2 <sum_s l_s r_s^T, sum_t e_{id_t} r'_t^T> = 2 sum_{s,t} l_s[id_t] (r_s . r'_t)
            steps = outer.left.shape[1]
            dot = max(dot, outer.right.shape[2])
            gathered = outer.left.gather(2, index.ids.unsqueeze(1).expand(-1, steps, -1))
            cross = _bmm(outer.right, index.right.transpose(1, 2), dtype).mul_(gathered)
            parts.append(2 * _sum_tokens(cross))
            # a posteriori: |l_s[id_t]| d_Q ||r_s|| ||r'_t|| per pair, and the product and sum roundings
            weighted = torch.linalg.vecdot(
                torch.bmm(gathered.abs().to(dtype).transpose(1, 2), n_right.unsqueeze(2)).squeeze(2), n_rows
            )
            magnitude = _sum_tokens(cross.abs_())
            del cross, gathered
            terms += [
                (2 * dot_error(outer.right.shape[2]) * (1 + unit), weighted),
                (2 * (unit + _gamma(depth, unit) * (1 + unit)), magnitude),
            ]
        if dense is not None:
            flat = dense.grad.reshape(batch, -1)
            dense_norm = torch.linalg.vector_norm(flat, dim=1, dtype=dtype)
            first = dense.grad.shape[1] if dense.grad.dim() > 2 else 1
            depth = max(depth, 2 * max(first, flat.shape[1] // first) + 8)
            norm_length = max(norm_length, flat.shape[1])
            if not dense_done:
                grad = dense.grad.reshape(batch, first, -1)
                parts.append(_sum_tokens(grad * grad))
                cross_pieces.append(dense_norm * dense_norm)
            if outer is not None:
                dot = max(dot, outer.left.shape[2])
                d = dense.grad.reshape(batch, outer.left.shape[2], outer.right.shape[2])
                parts.append(2 * _sum_tokens(_bmm(outer.left, d, dtype).mul_(outer.right)))
                cross_pieces.append(2 * dense_norm * s_outer)
            if index is not None:
                d = dense.grad.reshape(batch, index.num_rows, -1)
                rows = d.gather(1, index.ids.unsqueeze(-1).expand(-1, -1, d.shape[2]))
                parts.append(2 * _sum_tokens(rows.mul_(index.right)))
                cross_pieces.append(2 * dense_norm * s_index)
        eps = (1 + input_unit) ** 2 * (1 + _gamma(dot, unit)) * (1 + unit) - 1
        terms += [((1 + eps) ** 2 * (1 + _gamma(depth, unit)) - 1, piece) for piece in cross_pieces]
        # the bound's own ingredients are rounded: norms of <= norm_length terms, sums of <= depth positive terms
        safety = (1 + _gamma(2 * norm_length + 2 * depth + 16, unit)) ** 4
        total = parts[0]
        for part in parts[1:]:
            total = total + part.to(total.dtype)
        return total, [(c * safety, t) for c, t in terms], materialized

    def _param_norm_and_bound(self, param: nn.Parameter) -> tuple[torch.Tensor, list[tuple[float, torch.Tensor]]]:
        """:meth:`_norm_and_bound` of a parameter with an index or dense term (embeddings, tied weights)."""
        outer, index, dense = self._merged[param]
        total, terms, materialized = self._norm_and_bound(
            outer, index, dense, self.batch_size, param.device, self._input_dtypes.get(param, self.dtype)
        )
        if materialized is not None:
            self._merged[param] = (None, index, DenseTerm(materialized.reshape(self.batch_size, *param.shape)))
        return total, terms

    def _block_norm_and_bound(self, block: _OuterBlock) -> tuple[torch.Tensor, list[tuple[float, torch.Tensor]]]:
        """:meth:`_norm_and_bound` of a block, its L layers as L times more rows: values shaped (L, B)."""
        if block.grads is not None:  # materialized by an earlier call (norms taken again after zero_examples)
            layers, batch, p, q = block.grads.shape
            outer, dense = None, DenseTerm(block.grads.reshape(layers * batch, p, q))
        else:
            (layers, batch, tokens, p), q = block.left.shape, block.right.shape[3]
            outer = OuterTerm(left=block.left.reshape(layers * batch, tokens, p),
                              right=block.right.reshape(layers * batch, tokens, q))
            dense = None
        total, terms, materialized = self._norm_and_bound(
            outer, None, dense, layers * batch, (block.grads if outer is None else block.left).device, block.input_dtype
        )
        if materialized is not None:
            block.grads, block.left, block.right = materialized.reshape(layers, batch, p, q), None, None
        return total.reshape(layers, batch), [(c, t.reshape(layers, batch)) for c, t in terms]

    def squared_norms(self) -> torch.Tensor:
        """``||g_i||^2`` over all trainable parameters, shape (B,), in fp32 (fp64 for fp64 models / precise)."""
        if self._squared_norms is None:
            rows: list[torch.Tensor] = []  # (k, B): squared norms of parameters, fused layers or stacked layers
            coefficients: list[float] = []
            pieces: list[torch.Tensor] = []  # (k, B) each, one coefficient per row
            for param in self._merged:
                squared, terms = self._param_norm_and_bound(param)
                rows.append(squared.unsqueeze(0))
                for c, t in terms:
                    coefficients.append(c)
                    pieces.append(t.unsqueeze(0))
            for block in self._blocks:
                squared, terms = self._block_norm_and_bound(block)
                rows.append(squared)
                for c, t in terms:
                    coefficients += [c] * t.shape[0]
                    pieces.append(t)
            groups = self._dense_group_squared_norms()
            device = (rows or [g[0] for g in groups] or [torch.zeros(0)])[0].device
            total = torch.zeros(self.batch_size, dtype=torch.float64, device=device)
            bound = torch.zeros(self.batch_size, dtype=torch.float64, device=device)
            magnitude = torch.zeros(self.batch_size, dtype=torch.float64, device=device)
            count = len(groups) + 1
            if rows:
                # a constant number of kernels for all parameters: concatenate (each squared norm rounded to this
                # dtype once), then reduce over the rows in float64; both roundings are bounded below
                stacked_norms = torch.cat([r.to(device=device, dtype=self.dtype) for r in rows]).double()
                total = total + stacked_norms.sum(dim=0)
                magnitude = stacked_norms.abs().sum(dim=0)
                count += stacked_norms.shape[0]
            if pieces:
                # every parameter's bound terms in one reduction: sum_k c_k t_k in float64
                weights = torch.tensor(coefficients, dtype=torch.float64, device=device).unsqueeze(1)
                stacked = torch.cat([t.to(device=device, dtype=self.dtype) for t in pieces]).double()
                bound = bound + stacked.mul_(weights).sum(dim=0)
            for squared, group_bound in groups:
                total = total + squared.to(device)
                bound = bound + group_bound.to(device)
            cast_unit = 2.0**-52 if self.dtype == torch.float64 else 2.0**-23
            bound = bound + (cast_unit + _gamma(count, 2.0**-52)) * (magnitude + total.abs() + bound)
            self._squared_norms64 = total
            self._error_bounds = bound
            self._squared_norms = total.to(self.dtype)
        return self._squared_norms

    def norms(self) -> torch.Tensor:
        """The computed per-example norms (for reporting; clip with :meth:`clipping_norms`)."""
        return self.squared_norms().clamp_min(0).sqrt()

    def clipping_norms(self) -> torch.Tensor:
        """Norms to clip with: a proven upper bound of the exact per-example norm (see the class docstring)."""
        self.squared_norms()
        bound = (self._squared_norms64.clamp_min(0) + self._error_bounds).sqrt()
        # margin for the square root in float64, the cast to self.dtype and the clip factor's own rounding
        margin = 2.0**-50 if self.dtype == torch.float64 else 2.0**-20
        return (bound * (1.0 + margin)).to(self.dtype)

    def zero_examples(self, drop: torch.Tensor) -> None:
        """Replace the gradients of the examples where ``drop`` (bool, shape (B,)) is True by exact zeros.

        Used for examples whose loss or gradient is NaN/inf: a weighted sum with coefficient 0 would still give
        ``0 * nan = nan``, so their terms are zeroed (``torch.where``, not a product) before any sum.
        """
        if not bool(drop.any()):
            return

        def keep(t: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
            mask = (~drop).to(t.device).reshape(*([1] * batch_dim), -1, *([1] * (t.dim() - batch_dim - 1)))
            return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

        for param, (outer, index, dense) in self._merged.items():
            self._merged[param] = (
                None if outer is None else OuterTerm(left=keep(outer.left), right=keep(outer.right)),
                None if index is None else IndexTerm(ids=index.ids, right=keep(index.right), num_rows=index.num_rows),
                None if dense is None else DenseTerm(keep(dense.grad)),
            )
        for device, grad in self._dense_groups.items():
            self._dense_groups[device] = keep(grad)
        for block in self._blocks:  # (L, B, ...): the batch is the second axis
            block.left, block.right, block.grads = (None if t is None else keep(t, 1)
                                                    for t in (block.left, block.right, block.grads))
        self._squared_norms = None
        self._squared_norms64 = None
        self._error_bounds = None

    def weighted_sum(self, coefficients: torch.Tensor, release: bool = False) -> dict[nn.Parameter, torch.Tensor]:
        """``sum_i coefficients[i] * g_i``, per parameter, in the accumulation dtype.

        ``release=True`` frees each parameter's stored activations and output gradients as soon as its sum is
        built (the sums then replace them in memory instead of adding to them); the object cannot be used
        afterwards. Use it for the last weighted sum of a batch.
        """
        if self._released:
            raise RuntimeError("weighted_sum(..., release=True) was already called: the terms are gone.")
        if release:
            self.squared_norms()  # norms need every term; compute them before anything is freed
            self._released = True
        out: dict[nn.Parameter, torch.Tensor] = {}
        converted: dict[torch.device, torch.Tensor] = {}
        for param in list(self._merged):
            outer, index, dense = self._merged[param]
            if release:
                del self._merged[param]
            c = converted.get(param.device)
            if c is None:
                c = converted[param.device] = coefficients.to(device=param.device, dtype=self.dtype)
            total = None
            if outer is not None:
                total = _weighted_outer(outer.left[None], outer.right[None], c, self.dtype).reshape(param.shape)
            if dense is not None:
                g = torch.mv(dense.grad.reshape(self.batch_size, -1).t(), c).reshape(param.shape)
                total = g if total is None else total.add_(g)
            if total is None:
                total = torch.zeros(param.shape, dtype=self.dtype, device=param.device)
            if index is not None:
                rows = total.view(index.num_rows, -1)
                weighted = (index.right.to(self.dtype) * c[:, None, None]).reshape(-1, rows.shape[1])
                rows.index_add_(0, index.ids.reshape(-1), weighted)
            out[param] = total
            del outer, index, dense
        for block in list(self._blocks):
            if release:
                self._blocks.remove(block)
            c = converted.get(block.params[0].device)
            if c is None:
                c = converted[block.params[0].device] = coefficients.to(device=block.params[0].device, dtype=self.dtype)
            if block.grads is not None:
                layers, _, p, q = block.grads.shape
                # (B,) @ (L, B, P Q): one batched GEMV for the block's materialized layers
                totals = torch.matmul(c, block.grads.reshape(layers, self.batch_size, p * q)).reshape(layers, p, q)
            else:
                totals = _weighted_outer(block.left, block.right, c, self.dtype)
            for param, (layer, dim, start, size) in zip(block.params, block.places):
                piece = totals[layer].narrow(dim, start, size)
                out[param] = piece.reshape(param.shape) if dim == 0 else piece.contiguous().reshape(param.shape)
            del block, totals
        for device in list(self._dense_groups):
            grad, params = self._dense_groups[device], self._dense_params[device]
            if release:
                del self._dense_groups[device]
            c = coefficients.to(device=device, dtype=self.dtype)
            flat = torch.mv(grad.t(), c)  # one GEMV for every dense-only parameter on this device
            del grad
            for param, piece in zip(params, flat.split([p.numel() for p in params])):
                out[param] = piece.view(param.shape)
        return out


_OWNED_BY_THE_OPTIMIZER = (
    "The clipping engine no longer clips: the DP optimizer is the only owner of the clipping norm, the noise "
    "and the accounting, so the noise can never be sized for a different C than the one the sum was clipped "
    "at. Build the pair from one plan (engine, optimizer = plan.build(model, base=...)) or create "
    "GhostClippingEngine(model) without a norm, and call optimizer.accumulate(engine, loss_fn, batch_size) once "
    "per micro-batch, then optimizer.step() (README, 'Without the Trainer')."
)


class GhostClippingEngine:
    """Attaches per-example gradient hooks to ``model`` (see module docstring). It computes, it never clips.

    Args:
        model: the model whose trainable parameters are trained privately. Attach after PEFT wrapping and
            after moving the model to its device; the engine never wraps or patches the model.
        verify_first_backward: on the first backward, also compute the ordinary (unclipped) gradient with
            autograd and check that the engine's unclipped sum matches it for every trainable parameter.
            This catches parameters that receive gradient through a path the hooks do not see.
        stack_layers: stack same-shape layers into one batched product for the norms and clipped sums (fewer
            kernel launches, a bounded transient copy; see :class:`PerExampleGradients`). None: on CUDA only.
        batchnorm_eval: accept frozen BatchNorms (no trainable parameter, or affine=False) and hold them in eval
            mode, with their stored statistics, in every recorded step (:meth:`hold_eval_modes`). Without it every
            BatchNorm is refused (:mod:`hf_dpfilter.validators`); a trainable BatchNorm is refused either way.
    """

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        verify_first_backward: bool = True,
        stack_layers: bool | None = None,
        batchnorm_eval: bool = False,
        **kwargs: Any,
    ) -> None:
        removed = [name for name in ("max_grad_norm", "clipping_fn") if name in kwargs]
        if args or removed:
            raise TypeError(f"GhostClippingEngine({', '.join(removed) or 'a clipping norm'}=...): {_OWNED_BY_THE_OPTIMIZER}")
        if kwargs:
            raise TypeError(f"GhostClippingEngine got unexpected arguments {sorted(kwargs)}.")
        self.model = model
        self.verify_first_backward = verify_first_backward
        self._records: list[_Record] = []
        self._recording = False
        self._recorded_modules: set[int] = set()  # ids of the modules recorded since record() began
        self._ran_without_autograd: set[int] = set()  # ... and of those that ran under no_grad there
        self._active_values: dict[str, torch.Tensor] | None = None  # call_model's values, during its forward
        self._recorded_at_other_values = False
        self._replaying_values = 0
        self._in_own_backward = False
        self._batch_size: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        self._param_names: dict[nn.Parameter, str] = {}
        self._module_params: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self._sharded_modules: set[nn.Module] = set()
        self._pending_terms: dict[nn.Parameter, list[Term]] = {}
        self._recorded_inputs: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
        self.stack_layers = stack_layers
        self._pending_reference: dict[nn.Parameter, torch.Tensor] | None = None
        self._pending_low_precision = False
        self._pending_dtype = torch.float32
        self._packing: PackedLayout | None = None  # declared by packed() for packed rows
        self.validation_options = ValidationOptions(batchnorm_eval=batchnorm_eval)
        # Batch-axis verdicts per module id and call index, proven on the first recorded step (None: not yet).
        self._axis_verdicts: dict[int, list[str]] | None = None
        self._new_verdicts: dict[int, list[str]] = {}
        self._call_counts: dict[int, int] = {}
        self._reprove = False  # a later step made a call the proving step did not see: prove again
        self._tracer: BatchAxisTracer | None = None
        self._trace_depth = 0
        self._check_parameters = True  # whether the state checks compare parameters (not under FSDP2)
        self._forward_ran = False  # a module of the model ran in the proving step
        self._model_forwards = 0  # the model's forwards in the current record() block
        self._proven_forwards = 0  # ... in the block that proved the verdicts
        self.attach()

    # ----------------------------------------------------------------------------------------- set-up
    def attach(self) -> None:
        """Validate every module, find every trainable parameter's module, check it has a rule, register hooks."""
        self.detach()
        # Every module, frozen ones too (hf_dpfilter.validators): one error listing each problem and its fix.
        problems = find_module_problems(self.model, self.validation_options)
        if problems:
            raise ModuleValidationError(problems)
        self._axis_verdicts = None  # the hooked modules may have changed: prove the batch axes again
        self._owners = {}
        self._param_names = {}
        self._module_params = {}
        self._sharded_modules = set()
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if param.requires_grad:
                self._param_names.setdefault(param, name)
        for param, name in self._param_names.items():
            if param.dtype in (torch.float16, torch.bfloat16):
                raise TypeError(
                    f"Trainable parameter '{name}' is {param.dtype}. hf_dpfilter keeps trainable parameters in "
                    "fp32 and accumulates norms and clipped sums in fp32: load the model in float32 and use "
                    "bf16 autocast (TrainingArguments(bf16=True)) for mixed precision."
                )
        hooked: list[nn.Module] = []
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            rule = find_grad_rule(module)
            if rule is None:
                param_name, _ = own[0]
                full = f"{module_name}.{param_name}" if module_name else param_name
                raise UnsupportedLayerError(
                    f"Trainable parameter '{full}' belongs to module '{module_name or '<root>'}' of type "
                    f"{type(module).__module__}.{type(module).__name__}, which has no per-example gradient rule. "
                    "Freeze it (param.requires_grad_(False)) or register a rule with "
                    f"hf_dpfilter.register_grad_rule({type(module).__name__})."
                )
            for param_name, param in own:
                self._owners.setdefault(param, []).append((module, param_name))
            # The module's parameters as attached: under FSDP2 the module holds other (gathered) tensors while
            # it runs, so the terms of a recorded call are keyed by these, the optimizer's parameters.
            self._module_params[module] = dict(own)
            if any(is_sharded(param) for _, param in own):
                self._sharded_modules.add(module)
            if all(module is not m for m in hooked):
                hooked.append(module)
                # Before FSDP2's own post-forward hook on a sharded unit, which swaps the gathered parameters
                # back to the shards: the first-backward check needs the tensors the forward used.
                self._handles.append(
                    module.register_forward_hook(self._forward_hook, prepend=module in self._sharded_modules)
                )
                if type(module) in _AUTOCAST_MATMUL_LAYERS:
                    self._handles.append(module.register_forward_pre_hook(self._autocast_pre_hook))
        if not self._owners:
            raise ValueError("The model has no trainable parameters: nothing to train privately.")
        # the model's forwards inside record(): the verdicts proven for one forward extend to repeated forwards
        # (several parameter points), never to more calls within one forward (see _call_verdict)
        self._handles.append(self.model.register_forward_pre_hook(self._count_model_forward))

    def hold_eval_modes(self) -> None:
        """Put the modules the options hold in eval mode back there (``batchnorm_eval``); call after
        ``model.train()`` (the DPTrainer does, and so does :meth:`record`)."""
        hold_eval_modes(self.model, self.validation_options)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self.model.modules():
            function = module.__dict__.get("_gradient_checkpointing_func")
            if isinstance(function, _CheckpointAtRecordedValues) and function.engine is self:
                module._gradient_checkpointing_func = function.checkpoint

    def _adopt_checkpointing(self) -> None:
        """Check transformers' gradient checkpointing (refuse reentrant) and make its recomputations run at the
        parameter values of their original forward (see the module docstring)."""
        for module in self.model.modules():
            function = module.__dict__.get("_gradient_checkpointing_func")
            if function is None or not getattr(module, "gradient_checkpointing", False):
                continue
            if checkpoint_function_is_reentrant(function):
                raise CheckpointingError(_REENTRANT_REFUSED)
            if not isinstance(function, _CheckpointAtRecordedValues):
                module._gradient_checkpointing_func = _CheckpointAtRecordedValues(function, self)

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self._owners)

    def parameter_name(self, param: nn.Parameter) -> str:
        return self._param_names.get(param, "<unnamed>")

    def _module_name(self, module: nn.Module) -> str:
        return next((n for n, m in self.model.named_modules() if m is module), type(module).__name__)

    # --------------------------------------------------------------------------------------- recording
    def _forward_hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor):
        if not torch.is_grad_enabled():
            if self._recording:
                self._ran_without_autograd.add(id(module))
            return None
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        if _inside_backward():
            # A checkpointed layer recomputed by the backward: already recorded by its original forward.
            if self._in_own_backward:
                self._check_recomputation(module)
            return None
        if not self._recording:
            return None
        source = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        dtype = None
        if (
            source is not None
            and output.dtype in _LOW_PRECISION
            and source.is_floating_point()
            and source.dtype != output.dtype
        ):
            # The layer computed in bf16/fp16 (autocast): it multiplied the input rounded to that dtype, which
            # is exactly this cast. Keeping the rounded copy instead of the wider input halves what we hold and
            # makes the per-example gradient the one the layer's own backward computes with.
            dtype = output.dtype
        # Layers fed the same input (query, key and value projections) get the same tensor object, so the
        # engine sees that they share it (PerExampleGradients fuses them) and keeps one bf16 copy, not three.
        activations = None if source is None else self._recorded_input(source, dtype)
        batch = self._batch_size
        if self._packing is not None:  # packed rows: the recorded tensors' leading axis is rows, not examples
            batch = self._packing.rows
        elif batch is None:
            batch = output.shape[0]
            self._batch_size = batch
        verdict = self._call_verdict(module, source, output)
        unproven = None
        if verdict == BROADCAST and output.shape[0] == 1:
            if batch > 1:
                # Broadcast inputs (position ids of shape (1, T)): expand so the gradient stays per example.
                output = output.expand(batch, *output.shape[1:])
                if activations is not None:
                    activations = activations.expand(batch, *activations.shape[1:])
                if self._tracer is not None:  # proven per example only if every use broadcasts it
                    self._tracer.mark_broadcast(output, (id(module), self._call_counts[id(module)] - 1))
        elif verdict != BATCH:
            # Not proven per example: kept, and refused by the backward if gradient reaches its output.
            unproven = verdict if verdict != BROADCAST else "has an output of leading size other than 1 where the first step proved a broadcast"
        elif output.shape[0] != batch:
            raise RuntimeError(
                f"Module '{self._module_name(module)}' ({type(module).__name__}) produced an output with leading "
                f"dimension {output.shape[0]} from a batch-first input while recording a batch of {batch} examples: "
                "its output is not computed row by row from its input (e.g. a positional embedding that only reads "
                "the shape of input_ids), so its per-example gradient is unknown. Per-example clipping needs "
                "batch-first tensors: freeze the module (requires_grad_(False)), or pass batch_size to "
                "engine.record() if the model's inputs are not batch-first."
            )
        used = None
        if module in self._sharded_modules and self.verify_first_backward:
            used = {name: getattr(module, name) for name in self._module_params[module]}
        self._records.append(
            _Record(
                module=module,
                activations=activations,
                output_edge=torch.autograd.graph.get_gradient_edge(output),
                output_dtype=output.dtype,
                used=used,
                unproven=unproven,
            )
        )
        self._recorded_modules.add(id(module))
        return output

    def _autocast_pre_hook(self, module: nn.Module, args: tuple) -> tuple | None:
        """Under autocast, hand a Linear/Conv1D its input already cast to the autocast dtype, once per input.

        Autocast would make this very cast inside the layer (the GEMM runs in bf16/fp16), so the layer computes
        the same values; but the cast is then a tensor the forward hook can keep instead of making its own copy,
        autograd saves that same tensor for the layer's backward, and layers reading one input (query, key,
        value) share it. Without this, every such layer's input would be held twice while recording.
        """
        if not self._recording or not args or not torch.is_grad_enabled() or _inside_backward():
            return None
        source = args[0]
        if not isinstance(source, torch.Tensor) or source.dtype != torch.float32:
            return None  # autocast casts only fp32 inputs
        device_type = source.device.type
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in _LOW_PRECISION:
            return None
        # differentiable: the gradient reaches the fp32 input as autocast's own cast would
        return (self._once_per_input(source, ("cast", dtype), lambda: source.to(dtype)), *args[1:])

    def _recorded_input(self, source: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """``source.detach()`` (cast to ``dtype`` if given), made once per input tensor and version while recording."""
        return self._once_per_input(
            source, ("record", dtype), lambda: source.detach() if dtype is None else source.detach().to(dtype)
        )

    def _once_per_input(self, source: torch.Tensor, kind: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, computed once per (input tensor, version, kind) while recording: layers reading one input
        then get one tensor object (one copy in memory, and the engine can see that they share it)."""
        key = (id(source), source._version, kind)
        cached = self._recorded_inputs.get(key)
        # a weak reference: the entry must not keep a wider input alive, and a dead one (whose id another
        # tensor may now have) never matches
        if cached is not None and cached[0]() is source:
            return cached[1]
        made = make()
        self._recorded_inputs[key] = (weakref.ref(source), made)
        return made

    def _check_recomputation(self, module: nn.Module) -> None:
        if id(module) not in self._recorded_modules:
            raise CheckpointingError(
                f"Module {type(module).__name__} was recomputed during the backward but its forward was never "
                f"recorded: its first forward ran without autograd, as reentrant checkpointing does. "
                f"{_REENTRANT_REFUSED}"
            )
        if self._recorded_at_other_values and not self._replaying_values:
            raise CheckpointingError(
                f"Module {type(module).__name__} was recomputed by a gradient checkpoint that the engine does not "
                "know (not transformers' gradient checkpointing) after a forward at other parameter values "
                "(engine.call_model, used by disk/pmlf/diff2): the recomputation would run at the current values "
                "and give wrong gradients. Use transformers' model.gradient_checkpointing_enable(...) (or "
                "TrainingArguments(gradient_checkpointing=True)), or a method with one gradient point (dpsgd)."
            )

    @contextlib.contextmanager
    def record(self, batch_size: int | None = None) -> Iterator[None]:
        """Record the forward passes run inside the block (one or several, e.g. at several parameter points)."""
        self._adopt_checkpointing()
        self._records = []
        self._recorded_modules = set()
        self._ran_without_autograd = set()
        self._recorded_at_other_values = False
        self._pending_terms = {}
        self._recorded_inputs = {}
        self._pending_reference = None
        self._pending_low_precision = False
        self._batch_size = batch_size
        self._recording = True
        self._model_forwards = 0
        try:
            with self._proving_step():  # first step: batch axes traced, no state written (see _proving_step)
                yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def packed(self, layout: PackedLayout | None) -> Iterator[None]:
        """Declare that the batches recorded inside the block are packed rows with this layout (None: not packed).

        The recorded tensors then have rows as their leading axis, the per-example losses one entry per example
        of the layout, and each layer's activations and output gradients are regrouped per example before its
        rule (:mod:`hf_dpfilter.packing`), so every example gets its own gradient and its own clip.
        """
        previous, self._packing = self._packing, layout
        try:
            yield
        finally:
            self._packing = previous

    # ---------------------------------------------------------------- proven structure (first step)
    @contextlib.contextmanager
    def _proving_step(self) -> Iterator[None]:
        """Hold the option-frozen modules in eval mode; on the first recorded step after attach, also prove.

        Proving runs the block under :class:`~hf_dpfilter.batch_axis.BatchAxisTracer` (each layer call's batch
        axis traced from the model's inputs, cached per module and call for later steps), checks that every
        trainable parameter's module was recorded, and that no parameter or buffer was written (in place or
        replaced) by the forward: all before the backward, so before anything is released.
        """
        self.hold_eval_modes()
        self._call_counts = {}
        if self._axis_verdicts is not None and not self._reprove:
            # Later steps: a forward may write state only on some steps (e.g. a dynamic RoPE replacing its
            # inv_freq once a batch is long enough), so every step compares identities and version counters, and
            # the buffers' values (a write through `.data` moves no version counter), before its backward, i.e.
            # before anything of the step is released. Buffers are small next to the parameters.
            snapshot = self._state_snapshot(self._check_parameters)
            yield
            if self._recorded_modules and not self._state_surely_unchanged(snapshot):
                self._check_state_unchanged(snapshot, self._check_parameters)  # finds and names the change
            return
        self._reprove = False
        with_parameters = self._check_parameters = not self._under_fsdp()
        snapshot = self._state_snapshot(with_parameters)
        # packed rows: the model's inputs are rows (the layout maps them to examples)
        tracer = BatchAxisTracer(self._packing.rows if self._packing is not None else self._batch_size)
        self._tracer, self._new_verdicts, self._trace_depth = tracer, {}, 0
        self._forward_ran = False
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self._trace_entry, prepend=True, with_kwargs=True))
            handles.append(module.register_forward_hook(self._trace_exit, always_call=True))
        try:
            with tracer:
                yield
        finally:
            self._tracer = None
            for handle in handles:
                handle.remove()
        if not self._recorded_modules:
            if self._forward_ran:
                # the model ran but none of its trainable modules did (e.g. LoRA through target_parameters, whose
                # lora_A/lora_B weights are used by a parametrization): name them rather than "nothing recorded"
                self._check_every_trainable_module_recorded()
            return  # nothing ran (an empty micro-batch): prove on the next step
        self._check_state_unchanged(snapshot, with_parameters)
        if tracer.misused:
            names = sorted({self._module_name(m) for m in self.model.modules() if id(m) in {k[0] for k in tracer.misused}})
            raise RuntimeError(
                f"The broadcast output of {', '.join(repr(n) for n in names)} (called on ids of shape (1, T), whose "
                "output the engine expands to one copy per example) is used along the batch axis (indexed, reduced "
                "or flattened over the examples), so its expanded gradient would not be per example. Fix: freeze "
                "it (requires_grad_(False)), or call it on ids shaped (B, T) and use its output per example. "
                "Nothing was released."
            )
        self._check_every_trainable_module_recorded()
        if (tracer.batch_size or 0) > 1:
            # With one example every tensor of leading size 1 looks batch-first (an explicit (1, T) position_ids
            # input too), so the verdicts would not tell broadcast from batch: prove again on a larger batch.
            self._axis_verdicts = self._new_verdicts
            self._proven_forwards = self._model_forwards

    def _trace_entry(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The outermost module call of a traced forward: tag its batch inputs (see BatchAxisTracer)."""
        tracer = self._tracer
        self._forward_ran = True
        if tracer is not None and self._trace_depth == 0:
            if tracer.batch_size is None:
                from torch.utils._pytree import tree_flatten

                leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
                if leaves:
                    tracer.batch_size = leaves[0].shape[0]
                    if self._batch_size is None:
                        self._batch_size = tracer.batch_size
            if not tracer.tag_batch_inputs(args, kwargs) and tracer.batch_size is not None:
                raise RuntimeError(
                    f"None of the tensors given to {type(module).__name__} has a leading dimension of "
                    f"{tracer.batch_size}, the recorded batch size: per-example clipping needs batch-first tensors "
                    "(the batch axis of every layer is traced from them). Pass batch_size to engine.record() equal "
                    "to the number of examples, and give the model its inputs batch-first."
                )
        self._trace_depth += 1

    def _trace_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._trace_depth = max(0, self._trace_depth - 1)

    def _call_verdict(self, module: nn.Module, source: torch.Tensor | None, output: torch.Tensor) -> str:
        """BATCH, BROADCAST, or why this call's batch axis is not proven (hf_dpfilter.batch_axis)."""
        key = id(module)
        index = self._call_counts.get(key, 0)
        self._call_counts[key] = index + 1
        tracer = self._tracer
        if tracer is not None:
            axis = tracer.axis(source if source is not None else output)
            if axis == 0:
                verdict = BATCH
            elif axis is None and output.dim() >= 1 and output.shape[0] == 1:
                verdict = BROADCAST
            elif axis is None:
                verdict = (
                    "does not derive from the batch inputs (e.g. a positional table called on torch.arange(T), a "
                    "relative position bias, an adapter applied to a weight matrix)"
                )
            elif axis == LOST:
                verdict = "derives from the batch but lost its batch axis (flattened, reduced or mixed across examples)"
            else:
                verdict = f"has its batch axis at dimension {axis}, not the leading one"
            self._new_verdicts.setdefault(key, []).append(verdict)
            return verdict
        verdicts = (self._axis_verdicts or {}).get(key)
        if verdicts and (index < len(verdicts) or (len(set(verdicts)) == 1 and self._repeats_proven_calls(
                len(verdicts), index))):
            return verdicts[min(index, len(verdicts) - 1)]
        self._reprove = True  # a call the first step did not see: prove the batch axes again next step
        return "was not seen by the step that proved the batch axes (run the same forward in every step)"

    def _count_model_forward(self, module: nn.Module, args: tuple) -> None:
        if self._recording and torch.is_grad_enabled() and not _inside_backward():
            self._model_forwards += 1

    def _repeats_proven_calls(self, proven_calls: int, index: int) -> bool:
        """Whether call ``index`` of a module proven with ``proven_calls`` same-verdict calls is one of the same
        calls in a repeated forward (DiSK/PMLF/DIFF2 run the model at several parameter points; a DIFF2 restart
        step runs it once) rather than an extra call within a forward: a table called on the batch ids in the
        proving step and later also on ``torch.arange(T)`` (T == B by chance) must not inherit the verdict."""
        proven, now = self._proven_forwards, self._model_forwards
        if not proven or not now or proven_calls % proven:
            return True  # the model's own forward was not seen (a loss_fn calling submodules): as proven
        return index < proven_calls // proven * now

    def _unproven_batch_axis_error(self, record: _Record) -> RuntimeError:
        name = self._module_name(record.module)
        params = ", ".join(self._module_params.get(record.module, {}))
        return RuntimeError(
            f"Module '{name}' ({type(record.module).__name__}, trainable: {params}) was called on a tensor that "
            f"{record.unproven}: its output has no per-example batch axis, so its gradient cannot be split by "
            "example (clipping it as if it had one would let one example move the others' contributions). Fix: "
            "freeze it (requires_grad_(False) on its parameters), or call it on ids derived from the batch, "
            "shaped (B, T), or broadcast as (1, T). Nothing was released."
        )

    def _module_name(self, module: nn.Module) -> str:
        for name, candidate in self.model.named_modules(remove_duplicate=False):
            if candidate is module:
                return name or "<root>"
        return type(module).__name__

    def _state_snapshot(self, parameters: bool) -> dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]:
        """Every buffer (and parameter if asked) with its version counter; buffers also with a copy of their
        values, since native kernels write some of them without counting a version (BatchNorm's running_mean
        and running_var), and so does a write through ``.data``. Buffers are small next to the parameters."""
        out = {name: (t, t._version, t.detach().clone()) for name, t in self.model.named_buffers()}
        if parameters:
            out.update({name: (t, t._version, None) for name, t in self.model.named_parameters()})
        return out

    def _state_surely_unchanged(self, before: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]) -> bool:
        """The check of every later step in one device synchronisation per device: True when no tensor was
        replaced, no version moved and every buffer holds its values (False: look closer)."""
        after = dict(self.model.named_buffers())
        if self._check_parameters:
            after.update(self.model.named_parameters())
        if after.keys() != before.keys():
            return False
        equal: dict[torch.device, list[torch.Tensor]] = {}
        for name, (tensor, version, copy) in before.items():
            if after[name] is not tensor or tensor._version != version:
                return False
            if copy is not None:
                if copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                    return False
                same = (copy == tensor) | (copy.isnan() & tensor.isnan()) if copy.is_floating_point() else copy == tensor
                equal.setdefault(tensor.device, []).append(same.all())
        return all(bool(torch.stack(flags).all()) for flags in equal.values())

    def _under_fsdp(self) -> bool:
        """FSDP2 swaps each module's sharded parameters for gathered ones around its forward (and the DP
        optimizer's multi-point path writes the shards inside the block): its parameters are not compared."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return False
        return any(is_sharded(p) for p in self.model.parameters()) or any(
            isinstance(m, FSDPModule) for m in self.model.modules())

    def _check_state_unchanged(
        self, before: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]], parameters: bool
    ) -> None:
        after = self._state_snapshot(parameters)
        changed = []
        for name in sorted(set(before) | set(after)):
            if name not in before or name not in after:
                changed.append((name, "was added" if name not in before else "was removed"))
            elif after[name][0] is not before[name][0]:
                changed.append((name, "was replaced by a new tensor"))
            elif after[name][1] != before[name][1] or not _same_values(before[name][2], after[name][0]):
                changed.append((name, "was written in place"))
        if changed:
            raise StateWrittenError(
                [(name, name.rpartition(".")[0] or "<root>", how) for name, how in changed]
            )

    def _check_every_trainable_module_recorded(self) -> None:
        missing = [
            param for param, owners in self._owners.items()
            # a module that ran without autograd gets the more specific CheckpointingError from the backward
            if not any(id(module) in self._recorded_modules | self._ran_without_autograd for module, _ in owners)
        ]
        if missing:
            lines = "\n".join(
                f"- '{self.parameter_name(p)}' (module '{self._module_name(self._owners[p][0][0])}')" for p in missing
            )
            raise UnsupportedLayerError(
                "Trainable parameters whose module was never called in the first recorded forward: their gradient "
                "(if any) reaches them through a path the per-example hooks do not see (a weight used outside its "
                "module's forward, e.g. PEANuT's peanut_A or VeLoRA's lora_A), or they are unused and would silently "
                f"never train.\n{lines}\nFix: freeze them (requires_grad_(False)), or call each through its "
                "module's forward. Nothing was released."
            )

    def clear(self) -> None:
        self._records = []
        self._recorded_inputs = {}

    def call_model(self, param_values: dict[nn.Parameter, torch.Tensor] | None, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` at other values of some trainable parameters (None: the current ones).

        The ``loss_fn`` that :meth:`DPOptimizer.accumulate` calls receives such values for methods that
        evaluate several parameter points (DiSK, DP-PMLF, DIFF2); a functional call, the model is untouched.
        """
        if not param_values:
            return self.model(*args, **kwargs)
        values = {self.parameter_name(p): v for p, v in param_values.items()}
        if any(v.dtype == torch.float64 and p.dtype != torch.float64 for p, v in param_values.items()):
            # A point given in float64 runs the whole model in float64 (frozen parameters and floating buffers
            # too): DIFF2's difference rounds, whose per-example difference g(x) - g(x') cancels, so that its
            # terms carry no float32 rounding (which depends on the batch's composition through the kernels'
            # blocking) amplified by ||g|| / ||g(x) - g(x')||. First names only: functional_call ties the other
            # names of tied weights (tie_weights=True).
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if name not in values and tensor.is_floating_point() and tensor.dtype != torch.float64:
                    values[name] = tensor.double() if tensor.requires_grad else tensor.detach().double()
        if self._recording:
            self._recorded_at_other_values = True
        previous, self._active_values = self._active_values, values  # for checkpointed layers' recomputation
        try:
            return torch.func.functional_call(self.model, values, args=args, kwargs=kwargs, strict=False)
        finally:
            self._active_values = previous

    # ---------------------------------------------------------------------------------------- backward
    def per_example_gradients(self, per_example_loss: torch.Tensor, precise: bool = False) -> PerExampleGradients:
        """One backward of ``sum_i loss_i`` to the recorded layer outputs; returns the compact per-example grads.

        ``precise=True``: float64 terms and proven norm bounds, for combinations with cancellation (see
        :class:`PerExampleGradients`).
        """
        self.backward_recorded(per_example_loss)
        return self.recorded_gradients(precise=precise)

    def backward_recorded(self, per_example_loss: torch.Tensor) -> None:
        """One backward of ``sum_i loss_i`` to the layer outputs recorded since the last call; keeps their terms.

        Several calls (one per forward) add up to what one backward of the summed losses gives: the terms of
        every call are kept until :meth:`recorded_gradients`. The DP optimizer uses this under FSDP2, where
        each parameter point is written into the shards and needs its own forward and backward.
        """
        if per_example_loss.dim() != 1:
            raise ValueError(
                f"per_example_loss must have shape (batch,), got {tuple(per_example_loss.shape)}: reduce each "
                "example's loss over its own tokens only (see hf_dpfilter.losses)."
            )
        batch = per_example_loss.shape[0]
        if self._batch_size is not None and batch != self._batch_size:
            raise ValueError(f"per_example_loss has {batch} entries but the recorded batch has {self._batch_size}.")
        self._batch_size = batch
        records, self._records = self._records, []
        self._recorded_inputs = {}  # the records hold what they need; the inputs themselves may go
        if not records:
            raise RuntimeError(
                "Nothing was recorded: run the forward pass inside `with engine.record():` (with autograd on; "
                "reentrant gradient checkpointing runs it without, see CheckpointingError)."
            )
        hidden = self._ran_without_autograd - self._recorded_modules
        if hidden:
            names = sorted({n for n, m in self.model.named_modules() if id(m) in hidden})
            raise CheckpointingError(
                f"Modules with trainable parameters ran without autograd inside engine.record() ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): their gradients would be invisible to per-example clipping. "
                "Reentrant gradient checkpointing does this; "
                f"{_REENTRANT_REFUSED} If these layers are meant to get no gradient, freeze their parameters."
            )
        self._pending_dtype = _accumulation_dtype(per_example_loss.dtype)
        total = per_example_loss.sum()
        self._in_own_backward = True
        try:
            if self.verify_first_backward:
                self._pending_low_precision |= any(r.output_dtype in (torch.float16, torch.bfloat16) for r in records)
                self._add_reference(total, records)
            output_grads = torch.autograd.grad(total, [r.output_edge for r in records], allow_unused=True)
        finally:
            self._in_own_backward = False
        regrouped: dict[int, torch.Tensor] = {}  # packed rows: layers sharing an input share its regrouped copy
        for record, grad_output in zip(records, output_grads):
            if grad_output is None:
                continue
            if record.unproven is not None:
                raise self._unproven_batch_axis_error(record)
            rule = find_grad_rule(record.module)
            module_params = self._module_params[record.module]
            activations = record.activations
            if self._packing is not None:
                activations, grad_output = regroup_record(
                    self._packing, lambda m=record.module: self._module_name(m), activations, grad_output, regrouped
                )
            for param_name, term in rule(record.module, activations, grad_output).items():
                self._pending_terms.setdefault(module_params[param_name], []).append(term)

    def _add_reference(self, total: torch.Tensor, records: list[_Record]) -> None:
        """Add autograd's ordinary gradient of ``total`` to the reference of the first-backward check.

        A sharded parameter (FSDP2) is not in the autograd graph: the forward used a gathered whole tensor,
        recorded by the hook, so the reference is the gradient with respect to that tensor.
        """
        params = self.trainable_parameters
        used: dict[nn.Parameter, torch.Tensor] = {}
        for record in records:
            for name, tensor in (record.used or {}).items():
                used.setdefault(self._module_params[record.module][name], tensor)
        targets = [used.get(p, p) for p in params]
        grads = torch.autograd.grad(total, targets, retain_graph=True, allow_unused=True)
        reference = self._pending_reference if self._pending_reference is not None else {}
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            grad = grad.full_tensor() if is_sharded(grad) else grad
            reference[param] = grad if param not in reference else reference[param] + grad
        self._pending_reference = reference

    def recorded_gradients(self, precise: bool = False) -> PerExampleGradients:
        """The per-example gradients of every backward since the last call (see :meth:`backward_recorded`)."""
        terms, self._pending_terms = self._pending_terms, {}
        if self._batch_size is None:
            raise RuntimeError("No backward was run: call backward_recorded() after the recorded forward.")
        # Parameters whose gradient the forward itself computes in float32 inside a float64 model (Gemma's
        # RMSNorm multiplies in float32): autograd's gradient is then only float32-accurate, and so is the check.
        float32_terms = {param for param, ts in terms.items() if any(_term_dtype(t) == torch.float32 for t in ts)}
        grads = PerExampleGradients(
            terms, self._batch_size, self._pending_dtype, precise=precise, stack_layers=self.stack_layers
        )
        if self.verify_first_backward:
            reference = self._pending_reference or {}
            self._verify(grads, tuple(reference.get(p) for p in self.trainable_parameters), self._pending_low_precision,
                         float32_terms)
            self.verify_first_backward = False
        self._pending_reference = None
        self._pending_low_precision = False
        return grads

    def _verify(
        self,
        grads: PerExampleGradients,
        reference: tuple[torch.Tensor | None, ...],
        low_precision: bool = False,
        float32_terms: set[nn.Parameter] | None = None,
    ) -> None:
        ours = grads.weighted_sum(torch.ones(grads.batch_size))
        # Some gradients are zero in exact arithmetic (attention key biases: softmax is shift-invariant) and
        # only rounding noise in practice, so the tolerance has a floor relative to the whole gradient.
        total = sum(float(r.double().norm()) ** 2 for r in reference if r is not None) ** 0.5
        for param, ref in zip(self.trainable_parameters, reference):
            ref = torch.zeros(param.shape, dtype=param.dtype, device=param.device) if ref is None else ref
            mine = ours.get(param)
            mine = torch.zeros(param.shape, dtype=ref.dtype, device=ref.device) if mine is None else mine
            err = (mine.to(ref.dtype) - ref).norm().item()
            scale = ref.norm().item()
            # autograd's own gradient is computed in bf16 under autocast: compare at that precision.
            tol = 5e-2 if low_precision else (1e-3 if ref.dtype != torch.float64 else 1e-8)
            if ref.dtype == torch.float64 and float32_terms and param in float32_terms:
                tol = max(tol, 1e-5)
            if err > tol * scale + tol * 1e-4 * total + 1e-12:
                raise RuntimeError(
                    f"Per-example gradients of '{self.parameter_name(param)}' do not add up to its ordinary "
                    f"gradient (relative error {err / max(scale, 1e-30):.2e}): the parameter receives gradient "
                    "through a path the hooks do not see (used outside its module's forward, or an in-place "
                    "change of a layer output). Freeze it or register a grad rule for the module that uses it."
                )

    def clip_and_accumulate(self, *args: Any, **kwargs: Any) -> None:
        """Removed: the optimizer clips (``optimizer.accumulate(engine, loss_fn, batch_size)``)."""
        raise RuntimeError(f"engine.clip_and_accumulate(...) was removed. {_OWNED_BY_THE_OPTIMIZER}")
