"""Which tensors carry the batch axis: proven by tracing the first recorded forward, never guessed from a
shape.

The engine treats a layer call as per example when its input is split by example along the leading axis.
A shape cannot prove that: a positional table called as ``pos_emb(torch.arange(T))`` returns ``(T, d)``, and
T5's relative attention bias ``(q, k, heads)``; when T equals the micro-batch size those look batch-first but
are shared by every example. So on the first recorded step the engine runs the forward under
:class:`BatchAxisTracer`, a :class:`torch.overrides.TorchFunctionMode` that tags the tensors given to the
model whose leading size is the declared batch size (``input_ids``, ``attention_mask``, ``inputs_embeds``,
...) with "batch axis 0" and propagates the tag through every torch function: a result gets a tag when one of
its inputs has one, with the batch axis followed through transposes, permutes, broadcasting, indexing and
reshapes (a view that merges the batch axis with the dimensions after it, as ``Conv1D``'s ``x.view(-1, d)``
does, keeps it as the major part of the merged dimension, and a view back recovers it; an operation along a
merged dimension, like one along a plain batch axis, loses it), and marked lost
(``LOST``) where an operation reduces, concatenates, splits, merges into an earlier dimension or
advanced-indexes along it, normalises over it (``F.batch_norm`` in training, ``F.normalize``/
``cosine_similarity`` along it, ``group_norm``/``instance_norm``/``layer_norm`` whose statistics span it), or
pairs two batch-derived operands example by example (``h @ h.T``, ``cdist(h, h)``, ``outer``, an einsum
keeping two batch letters, an operand lost or on another dimension: ``h / h.sum(0)``, ``h + h.T``). Tensors
that derive only from parameters, buffers and constants (``arange`` position ids, bucketed relative positions,
a weight matrix) carry no tag, except a constant of leading size 1 expanded to the batch size
(``token_type_ids`` buffers, ``position_ids.expand(B, -1)``): one copy per example, batch-first by
construction.

A layer call is then:

* ``BATCH`` -- its input's batch axis is the leading one: per example, as the rules assume;
* ``BROADCAST`` -- its input carries no batch axis and its output has leading size 1 (BERT's and GPT-2's
  ``(1, T)`` position ids): the engine expands the output to the batch (a view), so the gradient stays per
  example, exactly, provided every use of the expanded copy broadcasts it along the batch; an operation that
  mixes or drops its batch axis (``out[0]``, a sum over the examples) refuses the module on the first step;
* ``MERGED`` -- its input's leading dimension is the batch merged with the dimensions after it (the tag
  ``(0, k)`` with ``k > 1``: OPT's ``hidden_states.reshape(-1, d)`` before its feed-forward block, BLOOM's
  attention on ``(B*H, T, D)``): row ``r`` belongs to example ``r // k`` because the tracer followed the views
  that made the dimension, not because its size is a multiple of the batch. A row-wise layer (Linear,
  LayerNorm, Embedding, ...) called on it is per example once its input and output gradient are viewed as
  ``(B, k, ...)``, which the engine does (``k`` is the leading size over the batch size at every step, as the
  proven views make it);
* ``SHARED`` -- its output carries no batch axis at all: it derives only from parameters, buffers, constants
  and shapes (a learned positional table that reads only the shape of its input, as BART's; T5's relative
  attention bias on bucketed ``arange`` positions), so one tensor serves every example. Its per-example
  gradient is each example's own gradient of that tensor (:mod:`hf_dpfilter.engine.shared_outputs`), exact
  whatever the model does with it. Proven only when the module's forward read no values of the batch into
  Python (``int(x)``, ``x.item()``, ``x.tolist()``, ...: counted in :attr:`BatchAxisTracer.host_reads`), which
  could make its output depend on the examples' data without a tag;
* unproven -- anything else. Such a call is recorded but refused, naming the module, as soon as the backward
  shows that it carries gradient; a call whose output gets no gradient (DoRA's weight-norm path, which is
  detached) is harmless and skipped.

The verdicts are cached per module and call (the k-th call of a module in a micro-batch) and per signature of
the model's inputs (engine/proving.py: a new one is traced on its own step); a call the proof did not see is
treated as unproven and makes the next step trace again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["BATCH", "BROADCAST", "LOST", "MERGED", "SHARED", "BatchAxisTracer"]

BATCH = "batch"
BROADCAST = "broadcast"
#: a layer call whose input's leading dimension is the batch merged with the dimensions after it (proven by
#: tracing)
MERGED = "merged"
#: a layer call whose output derives from no batch tensor: one output shared by every example (see above)
SHARED = "shared"
#: the tag of a tensor derived from the batch whose batch axis could not be followed
LOST = -1

_TRANSPOSES = {"transpose", "transpose_", "swapaxes", "swapaxes_", "swapdims", "swapdims_"}
_REDUCTIONS = {
    "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "std", "var", "std_mean",
    "var_mean", "norm", "logsumexp", "all", "any", "argmax", "argmin", "median", "nanmedian", "mode",
    "count_nonzero", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "log_softmax",
    "sort", "argsort", "topk", "kthvalue", "unique", "unique_consecutive",
}
#: operations that select or reorder along a dimension: along the batch axis, rows no longer match examples
_ALONG_DIM = {
    "index_select", "gather", "take_along_dim", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill",
    "index_fill_", "index_reduce", "index_reduce_", "roll", "flip", "narrow", "select", "diff",
    "cumulative_trapezoid",
}
_MATMULS = {"matmul", "mm", "bmm", "__matmul__", "__rmatmul__"}
#: products of two tensors whose rows pair every row of one with every row of the other (a (B, B) result when
#: both derive from the batch: in-batch similarities, minibatch discrimination)
_PAIRWISE = {"cdist", "outer", "ger"}
#: ``input + batch1 @ batch2`` batched over dimension 0 (addbmm also sums over it): see _batched_addmm_tag
_BATCHED_ADDMMS = {"baddbmm", "baddbmm_", "addbmm", "addbmm_"}
#: normalisations: (where the statistics are taken, relative to the batch axis) -> mixes the examples or not
_BATCH_NORMS = {"batch_norm", "native_batch_norm"}
_STATISTICS_ALONG = {"group_norm", "instance_norm", "layer_norm", "normalize", "cosine_similarity", "softmin"}
_SPLITS = {"unbind", "split", "chunk", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit"}
_CONCATS = {"cat", "concat", "concatenate"}
_STACKS = {"stack"}
#: element-wise operations (names without their operator underscores, or in-place ``_``): they broadcast
_ELEMENTWISE = {"add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "div", "truediv",
                "rtruediv",
                "itruediv", "true_divide", "where", "maximum", "minimum", "masked_fill", "addcmul", "addcdiv",
                "lerp"}
_BROADCASTS = {"expand", "broadcast_to", "repeat", "expand_copy"}
#: reads of a tensor's attributes (``p.device``, ``p.shape``, ``p.dim()``): not uses of its values
_METADATA_READS = {
    "__get__", "dim", "size", "numel", "nelement", "ndimension", "element_size", "stride", "storage_offset",
    "data_ptr", "is_contiguous", "is_floating_point", "is_complex", "untyped_storage", "__hash__", "__len__",
    "__repr__", "__format__", "get_device",
}
#: operations that read a tensor's values into Python: what is built from them carries no tag
_HOST_READS = {"item", "tolist", "numpy", "__int__", "__float__", "__index__", "__bool__", "__complex__",
               "__array__"}
_RESHAPES = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "ravel", "_unsafe_view"}


def _normalize(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _prod(sizes: Any) -> int:
    out = 1
    for size in sizes:
        out *= int(size)
    return out


def _dims_argument(args: tuple, kwargs: dict) -> Any:
    if "dim" in kwargs:
        return kwargs["dim"]
    if "axis" in kwargs:
        return kwargs["axis"]
    if len(args) > 1 and isinstance(args[1], (int, tuple, list)) and not isinstance(args[1], bool):
        return args[1]
    return None


def dropout_input(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a dropout call draws a mask over (``F.dropout``/``torch.dropout`` in training with ``p >
    0``, the query of ``F.scaled_dot_product_attention`` with ``dropout_p > 0``), or None."""
    import torch.nn.functional as F

    def arg(index: int, name: str, default: Any) -> Any:
        return kwargs[name] if name in kwargs else (args[index] if len(args) > index else default)

    if func is F.dropout or func is torch.dropout:
        training = arg(2, "training" if func is F.dropout else "train", True)
        return arg(0, "input", None) if training and float(arg(1, "p", 0.5)) != 0.0 else None
    if func is F.scaled_dot_product_attention and float(arg(4, "dropout_p", 0.0)) != 0.0:
        return arg(0, "query", None)
    return None


class BatchAxisTracer(TorchFunctionMode):
    """Tags tensors with their batch axis and propagates the tags (see the module docstring).

    A tag is ``(axis, inner)``: the batch is the major part of dimension ``axis``, whose size is
    ``batch * inner`` (``inner`` is 1 unless a view merged the batch with the dimensions after it), or
    ``(LOST, 1)`` for a tensor that derives from the batch without a batch axis the tracer could follow.
    """

    def __init__(self, batch_size: int | None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self._tags: dict[int, tuple[weakref.ref, int, int]] = {}
        #: tensor id -> the broadcast layer calls (keys) its values come from, and those whose expanded output
        #: reached an operation that mixed or dropped its batch axis (see :meth:`mark_broadcast`)
        self._origins: dict[int, frozenset] = {}
        self.misused: set = set()
        #: how many times values of a batch-derived tensor were read into Python (see ``SHARED``)
        self.host_reads = 0
        #: a tag was decided from values of this batch (see ``_mask_rows``): the verdicts hold for this step
        #: only
        self.value_dependent = False
        #: id(parameter) -> (parameter, check): ``check()`` is called at each use of the parameter by a torch
        #: function (the engine checks that it runs inside the module whose rule covers it)
        self.watched: dict[int, tuple[torch.Tensor, Any]] = {}
        #: (tag, innermost running module) of each input a dropout drew a mask for, in call order: keyed to
        #: the rows of its leading axis, or drawn once for all (an nn.Dropout on a tensor free of the batch)
        #: by hf_dpfilter.randomness.example_keys; the engine refuses any other
        self.dropout_inputs: list[tuple[tuple[int, int] | None, Any]] = []
        #: the innermost module running (set by the engine's proving step)
        self.current_module: Any = lambda: None

    # ---------------------------------------------------------------------------------------- tags
    def tag_of(self, tensor: Any) -> tuple[int, int] | None:
        """``(axis, inner)`` of ``tensor`` (axis LOST if lost), or None when it does not derive from the
        batch."""
        if not isinstance(tensor, torch.Tensor):
            return None
        entry = self._tags.get(id(tensor))
        if entry is None or entry[0]() is not tensor:  # a dead entry whose id another tensor now has
            return None
        return entry[1], entry[2]

    def axis(self, tensor: Any) -> int | None:
        """The batch axis of ``tensor`` if it is a whole dimension (LOST otherwise), None if not from the
        batch."""
        tag = self.tag_of(tensor)
        if tag is None:
            return None
        return tag[0] if tag[1] == 1 else LOST

    def tag(self, tensor: torch.Tensor, axis: int, inner: int = 1, origins: frozenset = frozenset()) -> None:
        try:
            self._tags[id(tensor)] = (weakref.ref(tensor), axis, inner)
        except TypeError:  # pragma: no cover -- a tensor type without weak references: not followed
            return
        if origins:
            self._origins[id(tensor)] = origins
        else:
            self._origins.pop(id(tensor), None)

    def untag(self, tensor: torch.Tensor) -> None:
        """``tensor`` derives from no batch tensor (a value the caller proved independent of the batch)."""
        self._tags.pop(id(tensor), None)
        self._origins.pop(id(tensor), None)

    def copy_tag(self, source: Any, target: torch.Tensor) -> None:
        """``target`` carries ``source``'s tag (or none, as ``source``): for a caller that proved ``target``
        an elementwise function of ``source`` along its leading dimensions and of batch-independent values."""
        tag = self.tag_of(source)
        if tag is None:
            self.untag(target)
        else:
            self.tag(target, tag[0], tag[1], self._origins_of(source))

    def mark_broadcast(self, expanded: torch.Tensor, key: Any) -> None:
        """``expanded`` is a broadcast layer output expanded to the batch (one copy per example). Its gradient
        is per example only if every use broadcasts it along the batch; an operation that mixes or drops the
        batch axis of anything derived from it (``out[0]``, a sum over the batch) puts ``key`` in
        ``misused``."""
        self.tag(expanded, 0, 1, frozenset([key]))

    def _origins_of(self, tensor: torch.Tensor) -> frozenset:
        return self._origins.get(id(tensor), frozenset()) if self.tag_of(tensor) is not None else frozenset()

    def tag_batch_inputs(self, args: tuple, kwargs: dict) -> bool:
        """Tag every tensor given to the model whose leading size is the batch size as batch-first; whether
        there was one."""
        found = False
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == self.batch_size:
                found = True
                if self.tag_of(leaf) is None:
                    self.tag(leaf, 0)
        return found

    # --------------------------------------------------------------------------------- propagation
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        drawn = dropout_input(func, args, kwargs)
        if drawn is not None:
            self.dropout_inputs.append((self.tag_of(drawn), self.current_module()))
        out = func(*args, **kwargs)
        leaves = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
        if self.watched and getattr(func, "__name__", "") not in _METADATA_READS:
            for leaf in leaves:
                watch = self.watched.get(id(leaf))
                if watch is not None and watch[0] is leaf:
                    watch[1]()
        tagged = [(t, tag) for t in leaves if (tag := self.tag_of(t)) is not None]
        if tagged and getattr(func, "__name__", "") in _HOST_READS:
            self.host_reads += 1
        if not tagged:
            self._maybe_broadcast_over_batch(func, args, out)
            return out
        outputs = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        if getattr(func, "__name__", "") == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            outputs = [args[0]]  # x[...] = y writes y into x, in place
        origins = frozenset().union(*(self._origins_of(t) for t, _ in tagged))
        # An operation that mixes whole examples (batch statistics, pairings) is not a misuse of a broadcast
        # output's expanded copy: what it feeds is refused by its own verdict (a trainable layer), and a loss
        # that mixes examples is the first-step per-example check's and the loss policy's to refuse, by name.
        mixing = self._mixes_examples(getattr(func, "__name__", ""), tagged)
        for result in outputs:
            axis, inner = self._result_tag(func, args, kwargs, tagged, result)
            if origins and axis == LOST and not mixing:
                self.misused |= origins
            # past a mixer the broadcast copies are mixed with whole examples: not followed further either
            self.tag(result, axis, inner, frozenset() if mixing and axis == LOST else origins)
        return out

    @staticmethod
    def _mixes_examples(name: str, tagged: list) -> bool:
        """Whether ``name`` is one of the whole-example mixers the tracer marks LOST (see _method_axis and
        _pairs_batches), as opposed to an operation that drops or reorders rows of the batch axis."""
        if name in _BATCH_NORMS or name in _PAIRWISE or name in _STATISTICS_ALONG:
            return True
        return (name in _MATMULS or name == "einsum") and len(tagged) >= 2

    def _maybe_broadcast_over_batch(self, func: Any, args: tuple, out: Any) -> None:
        """A constant with leading size 1 expanded to the batch size (BERT's ``token_type_ids`` buffer,
        ``position_ids.expand(B, -1)``) is one copy per example: its leading axis is the batch axis."""
        if getattr(func, "__name__", "") not in _BROADCASTS or not args or not isinstance(out, torch.Tensor):
            return
        source = args[0]
        if (
            isinstance(source, torch.Tensor)
            and self.batch_size is not None
            and source.dim() >= 1
            and source.shape[0] == 1
            and out.dim() == source.dim()
            and out.shape[0] == self.batch_size
        ):
            self.tag(out, 0)

    def _result_tag(self, func: Any, args: tuple, kwargs: dict, tagged: list,
                    result: torch.Tensor) -> tuple[int, int]:
        name = getattr(func, "__name__", "")
        # a property: h.T, h.mT transpose (their getter is named __get__, like h.shape's)
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        first = args[0] if args else None
        first_tag = self.tag_of(first)
        if name == "__getitem__" and first_tag == (0, 1) and len(args) > 1:
            rows = self._mask_rows(first, args[1])
            if rows is not None:
                return 0, rows
        if first_tag is not None and first_tag[0] != LOST:
            if name in _RESHAPES:
                return self._reshape_tag(first, first_tag, result)
            # a merged batch (inner > 1) moves, or is lost, with its whole dimension: the same rules hold for
            # it (reduced or normalised along it, the examples mix)
            special = self._method_axis(name, first, first_tag[0], args, kwargs, result)
            if special is not None:
                return (special, first_tag[1]) if special != LOST else (LOST, 1)
        if name in _MATMULS and len(args) >= 2:
            contracted = self._contracts_batch(args[0], args[1])
            if contracted:
                return LOST, 1
        if (name in _MATMULS or name in _PAIRWISE) and len(args) >= 2:
            paired = self._pairs_batches(name, args[0], args[1], result)
            if paired is not None:
                return paired
        if name in _BATCHED_ADDMMS and args:
            batched = self._batched_addmm_tag(name, args, kwargs, result)
            if batched is not None:
                return batched
        if name == "einsum":
            axis = self._einsum_axis(args, tagged)
            if axis is not None:
                return axis, 1
        if name in _CONCATS and args and isinstance(args[0], (list, tuple)):
            dim = _normalize(kwargs.get("dim", args[1] if len(args) > 1 else 0), result.dim())
            if any(tag[0] == LOST or tag[0] == dim for _, tag in tagged):
                return LOST, 1
        if name in _STACKS and args and isinstance(args[0], (list, tuple)):
            return self._stack_tag(args, kwargs, tagged, result)
        return self._combined_tag(tagged, result, name.strip("_") in _ELEMENTWISE)

    @staticmethod
    def _combined_tag(tagged: list, result: torch.Tensor, elementwise: bool = False) -> tuple[int, int]:
        """The general rule: every batch-derived input's batch axis lands on one and the same dimension of the
        result; an input whose batch axis was lost (``w.sum(0)``) or lands elsewhere (``h + h.T``) carries the
        other examples' values into every row, so the result is LOST (``w / w.sum(0)`` mixes the examples)."""
        landed = set()
        for source, (axis, inner) in tagged:
            if axis == LOST:
                return LOST, 1
            # an element-wise operation broadcasts from the right: a (B, d) operand of a (L, B, d) result has
            # its batch on dimension 1 even when L == B (other functions, F.embedding(ids), grow dimensions at
            # the end)
            if axis == 0 and result.dim() >= 1 and result.shape[0] == source.shape[0] and not (
                    elementwise and source.dim() < result.dim()):
                landed.add((0, inner))
                continue
            aligned = result.dim() - source.dim() + axis  # broadcasting aligns trailing dimensions
            if not (0 <= aligned < result.dim() and result.shape[aligned] == source.shape[axis]):
                return LOST, 1
            landed.add((aligned, inner))
        return landed.pop() if len(landed) == 1 else (LOST, 1)

    @staticmethod
    def _stack_tag(args: tuple, kwargs: dict, tagged: list, result: torch.Tensor) -> tuple[int, int]:
        """``torch.stack(tensors, dim)``: the batch axis moves by one if after ``dim``; LOST unless every
        batch operand has the same tag (that two tensors stacked for B == 2 make a leading size B says
        nothing)."""
        dim = _normalize(kwargs.get("dim", args[1] if len(args) > 1 else 0), result.dim())
        (axis, inner), *others = {tag for _, tag in tagged}
        return (LOST, 1) if others or axis == LOST else ((axis + 1 if axis >= dim else axis), inner)

    def _contracts_batch(self, a: Any, b: Any) -> bool:
        """Whether ``a @ b`` sums over the batch axis of either operand (``h.T @ h``)."""
        tag_a, tag_b = self.tag_of(a), self.tag_of(b)
        if tag_a is not None and tag_a[0] != LOST and isinstance(a, torch.Tensor) and tag_a[0] == a.dim() - 1:
            return True
        if tag_b is not None and tag_b[0] != LOST and isinstance(b, torch.Tensor):
            contracted = b.dim() - 2 if b.dim() >= 2 else 0
            return tag_b[0] == contracted
        return False

    def _batched_addmm_tag(self, name: str, args: tuple, kwargs: dict, result: torch.Tensor) -> tuple[int,
            int] | None:
        """``input + batch1 @ batch2`` batched over dimension 0 (BLOOM's ``alibi.baddbmm(q, k)``): the
        product's tag when the added input carries the same one or none; LOST where the batch is contracted,
        or summed over dimension 0 (``addbmm``); None: the general rule applies (one operand derives from the
        batch)."""
        added = args[0]
        batch1 = args[1] if len(args) > 1 else kwargs.get("batch1")
        batch2 = args[2] if len(args) > 2 else kwargs.get("batch2")
        tags = [self.tag_of(batch1), self.tag_of(batch2)]
        if name.startswith("addbmm"):
            return (LOST, 1) if any(tag is not None and tag[0] in (0, LOST) for tag in tags) else None
        if self._contracts_batch(batch1, batch2):
            return LOST, 1
        product = self._pairs_batches("bmm", batch1, batch2, result)
        if product is None:
            return None
        added_tag = self.tag_of(added)
        return product if added_tag is None or added_tag == product else (LOST, 1)

    def _pairs_batches(self, name: str, a: Any, b: Any, result: torch.Tensor) -> tuple[int, int] | None:
        """The tag of a product of two batch-derived operands: where their batch axes land in its result (LOST
        when they land on two dimensions: ``h @ h.T``, ``cdist(h, h)``, ``outer(h, h)`` pair every example
        with every other); None unless both operands carry a batch axis. A batch merged with other dimensions
        (tag ``(axis, k)``, k > 1) is kept only on a batched (leading, non-matrix) dimension of both operands,
        with the same k and size: ``bmm`` over BLOOM's ``(B*H, T, T) @ (B*H, T, D)``, or DeBERTa's ``(B*heads,
        T, D)`` queries and keys, pairs row i with row i."""
        tag_a, tag_b = self.tag_of(a), self.tag_of(b)
        if tag_a is None or tag_b is None or not isinstance(a, torch.Tensor) or not isinstance(b,
                                                                                               torch.Tensor):
            return None
        if LOST in (tag_a[0], tag_b[0]):
            return LOST, 1
        if tag_a[1] != 1 or tag_b[1] != 1:
            return self._pairs_merged_batches(name, a, b, tag_a, tag_b, result)
        if name in ("outer", "ger"):
            return LOST, 1  # the result's rows are a's examples, its columns b's
        if a.dim() < 2 or b.dim() < 2:
            return None  # a vector operand: its axis is contracted (see _contracts_batch)
        # the row dimension of a, and of b for cdist (x1 (.., P, M), x2 (.., R, M) -> (.., P, R)); the column
        # dimension of b for a matmul; leading (batched) dimensions align from the right
        rows_b = b.dim() - 2 if name == "cdist" else b.dim() - 1
        land_a = result.dim() - 2 if tag_a[0] == a.dim() - 2 else result.dim() - a.dim() + tag_a[0]
        land_b = result.dim() - 1 if tag_b[0] == rows_b else result.dim() - b.dim() + tag_b[0]
        return (land_a, 1) if land_a == land_b else (LOST, 1)

    @staticmethod
    def _pairs_merged_batches(
        name: str, a: torch.Tensor, b: torch.Tensor, tag_a: tuple[int, int], tag_b: tuple[int, int],
        result: torch.Tensor,
    ) -> tuple[int, int]:
        """``_pairs_batches`` where an operand's batch is merged with other dimensions (see there)."""
        if name not in _MATMULS or tag_a[1] != tag_b[1] or a.dim() < 3 or b.dim() < 3:
            return LOST, 1
        if tag_a[0] >= a.dim() - 2 or tag_b[0] >= b.dim() - 2:
            return LOST, 1  # on a matrix dimension: rows of one example meet columns of every other
        land_a = result.dim() - a.dim() + tag_a[0]
        land_b = result.dim() - b.dim() + tag_b[0]
        if land_a != land_b or not a.shape[tag_a[0]] == b.shape[tag_b[0]] == result.shape[land_a]:
            return LOST, 1
        return land_a, tag_a[1]

    def _einsum_axis(self, args: tuple, tagged: list) -> int | None:
        """The batch axis of an einsum's result from its equation (LOST if the batch letter is summed over);
        None when the equation uses '...' or its operands are not given as separate tensors."""
        equation = args[0] if args and isinstance(args[0], str) else None
        operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        if equation is None or "..." in equation or "->" not in equation:
            return None
        inputs, output = equation.replace(" ", "").split("->")
        terms = inputs.split(",")
        if len(terms) != len(operands):
            return None
        letters = set()
        for term, operand in zip(terms, operands):
            tag = self.tag_of(operand)
            if tag is None:
                continue
            if tag[0] == LOST or tag[1] != 1 or tag[0] >= len(term):
                return LOST
            letters.add(term[tag[0]])
        if not letters:
            return None
        if len(letters) > 1:
            return LOST  # two operands' examples on two letters ('bd,cd->bc'): every pair of examples
        letter = letters.pop()
        return output.index(letter) if letter in output else LOST

    def _reshape_tag(self, source: torch.Tensor, tag: tuple[int, int], result: torch.Tensor) -> tuple[int,
                                                                                                      int]:
        """The tag after a view/reshape: the batch stays the major part of the result dimension whose outer
        dimensions hold as many elements as the source's outer dimensions (see the class docstring)."""
        axis, _ = tag
        batch = self.batch_size or 1
        outer = _prod(source.shape[:axis])
        if source.shape[axis] % batch:
            return LOST, 1
        running = 1
        for k, size in enumerate(result.shape):
            if running == outer and size >= batch and size % batch == 0 and size > 0:
                return k, size // batch
            running *= int(size)
            if running > outer:
                break
        return LOST, 1

    def _method_axis(
        self, name: str, source: torch.Tensor, axis: int, args: tuple, kwargs: dict, result: torch.Tensor
    ) -> int | None:
        """The batch axis after an operation that moves, removes or mixes it; None: the general rule
        applies."""
        ndim = source.dim()
        if name in _TRANSPOSES:
            dims = [kwargs.get("dim0", args[1] if len(args) > 1 else None),
                    kwargs.get("dim1", args[2] if len(args) > 2 else None)]
            if None in dims:
                return None
            d0, d1 = (_normalize(d, ndim) for d in dims)
            return d1 if axis == d0 else d0 if axis == d1 else axis
        if name in ("t", "t_"):
            return (1 - axis) if ndim == 2 else axis
        if name == "T":  # reverses every dimension
            return ndim - 1 - axis
        if name in ("mT", "mH"):  # swaps the last two
            return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(axis, axis) if ndim >= 2 else axis
        if name == "permute":
            dims = args[1:] if len(args) > 2 or isinstance(args[1] if len(args) > 1 else None, int) else (
                args[1] if len(args) > 1 else kwargs.get("dims"))
            dims = [_normalize(d, ndim) for d in dims]
            return dims.index(axis) if axis in dims else LOST
        if name in ("movedim", "moveaxis"):
            src = args[1] if len(args) > 1 else kwargs.get("source")
            dst = args[2] if len(args) > 2 else kwargs.get("destination")
            src = [src] if isinstance(src, int) else list(src)
            dst = [dst] if isinstance(dst, int) else list(dst)
            src = [_normalize(d, ndim) for d in src]
            dst = [_normalize(d, ndim) for d in dst]
            order: list[int | None] = [None] * ndim
            for s, d in zip(src, dst):
                order[d] = s
            rest = iter(d for d in range(ndim) if d not in src)
            order = [next(rest) if o is None else o for o in order]
            return order.index(axis)
        if name in _BATCH_NORMS:
            # F.batch_norm(input, running_mean, running_var, weight, bias, training, ...) and
            # torch.batch_norm(input, weight, bias, running_mean, running_var, training, ...): in training,
            # statistics over every dimension but 1 (the channels), so over the examples unless the batch axis
            # is the channel axis
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            return LOST if training and axis != 1 else None
        if name in ("group_norm", "instance_norm"):  # (_STATISTICS_ALONG)
            # statistics per entry of dimension 0 (and, for instance_norm, of the channels): examples mix
            # unless the batch axis is dimension 0 (instance_norm: 0 or 1)
            return LOST if axis != 0 and not (name == "instance_norm" and axis == 1) else None
        if name == "layer_norm":
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
            count = 1 if isinstance(shape, int) else len(shape) if shape is not None else 0
            return LOST if axis >= ndim - count else None
        if name in ("normalize", "cosine_similarity", "softmin"):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
            if dim is None and name == "normalize":
                dim = 1
            if dim is None and name == "cosine_similarity":
                dim = 1
            if dim is None:
                return None
            return LOST if _normalize(int(dim), ndim) == axis else None
        if name in _REDUCTIONS:
            dim = _dims_argument(args, kwargs)
            if dim is None:
                return LOST if name not in ("softmax", "log_softmax") else None
            dims = [dim] if isinstance(dim, int) else list(dim)
            if axis in {_normalize(d, ndim) for d in dims}:
                return LOST
            return None
        if name in _ALONG_DIM:
            if name == "flip":
                dims = args[1] if len(args) > 1 else kwargs.get("dims")
            elif name == "roll":
                dims = args[2] if len(args) > 2 else kwargs.get("dims")
                if dims is None:
                    return LOST  # rolls the flattened tensor
            elif name == "diff":
                dims = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            else:
                dims = _dims_argument(args, kwargs)
            if dims is None:
                return None
            dims = [dims] if isinstance(dims, int) else list(dims)
            if axis in {_normalize(d, ndim) for d in dims}:
                return LOST
            return None
        if name in _SPLITS:
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) if name != "unbind" else kwargs.get(
                "dim", args[1] if len(args) > 1 else 0)
            if isinstance(dim, int) and _normalize(dim, ndim) == axis:
                return LOST
            return None
        if name == "__getitem__":
            return self._index_axis(source, axis, args[1] if len(args) > 1 else None)
        return None

    def _mask_rows(self, source: torch.Tensor, index: Any) -> int | None:
        """``x[mask]`` with a boolean mask over ``x``'s leading dimensions that selects the same number ``k``
        of entries in every example (BART's classification head picks each example's ``<eos>`` states this
        way): the result's rows are example by example, ``k`` each, so the batch is the major part of its
        first dimension. Checked on the values, which another batch may not repeat: the engine traces every
        step that relies on it again (``value_dependent``). None otherwise (the general rule marks it
        lost)."""
        items = index if isinstance(index, tuple) else (index,)
        mask = items[0]
        if (
            not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() < 1
            or tuple(mask.shape) != tuple(source.shape[:mask.dim()])
            or any(not (isinstance(item, slice) and item == slice(None)) for item in items[1:])
        ):
            return None
        counts = mask.reshape(mask.shape[0], -1).sum(dim=1)
        if counts.numel() == 0 or int(counts[0]) == 0 or not bool((counts == counts[0]).all()):
            return None
        self.value_dependent = True
        return int(counts[0])

    @staticmethod
    def _index_axis(source: torch.Tensor, axis: int, index: Any) -> int:
        """The batch axis of ``source[index]``."""
        items = index if isinstance(index, tuple) else (index,)
        advanced = [i for i, item in enumerate(items) if isinstance(item, (torch.Tensor, list))]
        if axis == 0 and advanced and advanced[0] == 0 and advanced == list(range(len(advanced))):
            # x[torch.arange(B), lengths - 1]: one row per example, in order (checked on the values, once)
            # (or transformers' mask functions' padding_mask[arange(B).view(B, 1, 1, 1), kv_idx]: the other
            # indices have no more dimensions, so the broadcast's leading one is the rows': each example reads
            # its own row)
            rows = items[0]
            if (
                isinstance(rows, torch.Tensor)
                and rows.dim() >= 1
                and not rows.is_floating_point()
                and rows.dtype != torch.bool
                and rows.shape[0] == source.shape[0] == rows.numel()
                and all(isinstance(items[i], torch.Tensor) and items[i].dim() <= rows.dim() for i in advanced)
                and bool(torch.equal(rows.reshape(-1).cpu(), torch.arange(source.shape[0])))
            ):
                return 0
        if len(advanced) > 1 and advanced != list(range(advanced[0], advanced[-1] + 1)):
            return LOST  # non-adjacent advanced indices move their dimensions first
        consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
        position, out_position = 0, 0
        for item in items:
            if item is None:
                out_position += 1
                continue
            if item is Ellipsis:
                span = source.dim() - consumed
                if position <= axis < position + span:
                    return out_position + axis - position
                position += span
                out_position += span
                continue
            if position == axis:
                return out_position if isinstance(item, slice) and item == slice(None) else LOST
            if isinstance(item, slice):
                out_position += 1
            elif not isinstance(item, int):
                return LOST  # an advanced index before the batch axis
            position += 1
        return out_position + axis - position
