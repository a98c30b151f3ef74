"""Packed rows: several examples in one row, each clipped and counted as its own example.

Padding-free collators (``transformers.DataCollatorWithFlattening``, TRL's padding-free mode) concatenate the
examples of a batch into rows of shape ``(rows, T)`` whose ``position_ids`` restart at every example. The
model keeps attention inside each example from those restarts (``transformers.masking_utils
.find_packed_sequence_indices``: a new example begins wherever ``position_ids`` do not grow by exactly 1), so
this module takes the boundaries from the same rule, and a :class:`PackedLayout` says which tokens of which
row belong to which example.

Per-example gradients stay exact for the token-wise layers the engine supports (Linear, Conv1D, Embedding,
LayerNorm/RMSNorm, LoRA): their per-example gradient is a sum over the example's own tokens of a function of
that token's input and output gradient. Regrouping the recorded activations and output gradients from
``(rows, T, ...)`` to ``(examples, T_max, ...)`` (zeros after each example's end, which add nothing) before
the layer rule therefore gives each example's gradient exactly (:meth:`PackedLayout.regroup`). A module whose
recorded tensors are not token-wise on the packed rows (a pooled or sequence-level output) is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_dpfilter.losses.tasks import IGNORE_INDEX

__all__ = [
    "PackedLayout", "PackingError", "check_attention_stays_inside_examples", "packed_token_mean_loss",
    "regroup_record",
]

#: Keys of FlashAttention's packed-sequence arguments (``transformers.modeling_flash_attention_utils``): they
#: describe the boundaries of the examples, so a micro-batch gets them recomputed for its own examples.
FLASH_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Per-token index of the example (``DataCollatorWithFlattening(return_seq_idx=True)``), renumbered per
#: micro-batch.
SEQ_IDX_KEY = "seq_idx"


class PackingError(ValueError):
    """A packed batch whose example boundaries are unknown, inconsistent, or not exact to clip per example."""


@dataclass(frozen=True)
class PackedLayout:
    """Which tokens of which row belong to which example: ``spans[e] = (row, start, stop)``.

    ``rows`` and ``length`` are the packed tensors' first two dimensions. Examples are numbered in row order,
    then position order (the order the collator packed them in).
    """

    spans: tuple[tuple[int, int, int], ...]
    rows: int
    length: int
    _index_cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The spans clipped together, one group per clipped vector: one span (an example) each here; a
        privacy unit's several examples in :class:`hf_dpfilter.data.units.UnitLayout`."""
        return tuple((e,) for e in range(len(self.spans)))

    @property
    def num_examples(self) -> int:
        """The number of clipped vectors (the groups)."""
        return len(self.groups)

    @property
    def lengths(self) -> list[int]:
        return [sum(self.spans[e][2] - self.spans[e][1] for e in group) for group in self.groups]

    @property
    def max_length(self) -> int:
        return max(self.lengths, default=0)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedLayout:
        """The boundaries the model's attention mask uses: a new example wherever positions do not grow by
        1."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
            raise PackingError(
                "A packed batch needs `position_ids` of shape (rows, tokens) that restart at every example "
                "(as DataCollatorWithFlattening(return_position_ids=True) produces): they are the example "
                "boundaries."
            )
        rows, length = position_ids.shape
        ids = position_ids.detach().cpu()
        first = ids[:, :1] - 1
        starts = torch.diff(ids, prepend=first, dim=-1) != 1
        spans = []
        for row in range(rows):
            begins = starts[row].nonzero().flatten().tolist()
            if length and (not begins or begins[0] != 0):
                begins = [0, *begins]
            for k, begin in enumerate(begins):
                stop = begins[k + 1] if k + 1 < len(begins) else length
                spans.append((row, begin, stop))
        return cls(tuple(spans), rows, length)

    def check_flash_boundaries(self, inputs: dict) -> None:
        """FlashAttention keeps attention inside the examples of ``cu_seq_lens_*``: they must equal the
        boundaries of ``position_ids`` (which the loss and the clipping use), or examples would be split
        differently."""
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            value = inputs.get(key)
            if value is None:
                continue
            expected = [0]
            for row, _start, stop in self.spans:
                expected.append(row * self.length + stop)
            got = [int(v) for v in torch.as_tensor(value).flatten().tolist()]
            if got != expected:
                raise PackingError(
                    f"`{key}` {got} does not match the example boundaries of `position_ids` {expected}: the "
                    "attention would group tokens into other examples than the loss and the clipping do. "
                    "Build both from the same collator "
                    "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
                )

    def token_example_index(self, device: torch.device | None = None) -> torch.Tensor:
        """``(rows, T)`` long: the group (example, or unit) each token belongs to (every token belongs to
        one)."""
        index = torch.full((self.rows, self.length), -1, dtype=torch.long)
        for group, members in enumerate(self.groups):
            for e in members:
                row, start, stop = self.spans[e]
                index[row, start:stop] = group
        return index.to(device) if device is not None else index

    def _gather_index(self, device: torch.device) -> torch.Tensor:
        """``(E, T_max)`` indices into the flattened ``rows * T`` tokens (a group's spans one after the
        other); ``rows * T`` (a zero row) past an end."""
        key = str(device)
        cached = self._index_cache.get(key)
        if cached is not None:
            return cached
        pad = self.rows * self.length
        index = torch.full((self.num_examples, self.max_length), pad, dtype=torch.long)
        for group, members in enumerate(self.groups):
            tokens = [torch.arange(r * self.length + a, r * self.length + b) for r, a,
                      b in (self.spans[e] for e in members)]
            flat = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
            index[group, : len(flat)] = flat
        index = index.to(device)
        self._index_cache[key] = index
        return index

    def over_rows(self, width: int) -> PackedLayout | None:
        """This layout for a tensor viewed as ``(rows, width, ...)`` whose row r is all of example r's (a
        layer called on the batch merged with other axes, viewed per row); None here: packed examples share a
        row, and which axes were merged into it is not recorded (:class:`hf_dpfilter.data.units.UnitLayout`
        over padded rows, one example per row, has one)."""
        return None

    def is_token_wise(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and tuple(tensor.shape[:2]) == (self.rows, self.length)

    def regroup(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(rows, T, *rest)`` -> ``(examples, T_max, *rest)``: each example's tokens, zeros after its
        end."""
        if not self.is_token_wise(tensor):
            raise PackingError(f"expected a tensor of shape ({self.rows}, {self.length}, ...), got "
                               f"{tuple(tensor.shape)}")
        rest = tensor.shape[2:]
        flat = tensor.reshape(self.rows * self.length, *rest)
        flat = torch.cat([flat, flat.new_zeros((1, *rest))])
        index = self._gather_index(tensor.device)
        return flat.index_select(0, index.reshape(-1)).reshape(self.num_examples, self.max_length, *rest)



def packed_token_mean_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    layout: PackedLayout,
    shift: bool,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Each packed example's mean token cross-entropy over its own labels, shape (examples,).

    logits ``(rows, T, V)``, labels ``(rows, T)``. With ``shift`` (causal LMs) the logits at t predict the
    label at t+1 *of the same example*: the first label of the next example is never predicted across the
    boundary, whatever the collator wrote there.
    """
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (layout.rows, layout.length):
        raise PackingError(
            f"Logits of shape {tuple(logits.shape)} on packed rows of shape ({layout.rows}, "
            f"{layout.length}): the "
            "model's output is not one prediction per token, so it cannot be split into the packed examples "
            "(a sequence-classification head pools over the row). Use a padding collator (one example per "
            "row) for this model."
        )
    if tuple(labels.shape) != (layout.rows, layout.length):
        raise PackingError(
            f"Labels of shape {tuple(labels.shape)} do not match the packed rows ({layout.rows}, "
            f"{layout.length})."
        )
    example = layout.token_example_index(labels.device)
    if shift:
        same = F.pad(example[:, 1:] == example[:, :-1], (0, 1), value=False)
        labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index).masked_fill(~same, ignore_index)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    token_losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing,
    )
    valid = (labels.reshape(-1) != ignore_index).to(token_losses.dtype)
    flat_example = example.reshape(-1)
    sums = token_losses.new_zeros(layout.num_examples).index_add(0, flat_example, token_losses)
    counts = valid.new_zeros(layout.num_examples).index_add(0, flat_example, valid)
    return sums / counts.clamp_min(1.0)


def regroup_record(
    layout: PackedLayout,
    module_name: Callable[[], str],
    activations: torch.Tensor | None,
    grad_output: torch.Tensor,
    cache: dict[int, torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One recorded layer call on packed rows, regrouped per example (see the module docstring).

    ``cache`` maps ``id(activations)`` to its regrouped copy within one backward, so layers that read one
    input (query, key and value projections) still share one tensor (the engine fuses them by identity).
    Refuses a layer whose input or output is not one entry per token of the packed rows: its per-example
    gradient would not be a sum over the example's own tokens, so regrouping could not make it exact.
    """
    if (not layout.is_token_wise(grad_output) and grad_output.dim() >= 3
        and grad_output.shape[0] == layout.rows):
        # one example per row (user-level units of padded rows): a row of another width (an encoder-decoder's
        # source tokens) is all its example's, its unit's rows concatenated (None where examples share rows)
        layout = layout.over_rows(grad_output.shape[1]) or layout
    tensors = [("output", grad_output)] + ([("input", activations)] if isinstance(activations, torch.Tensor)
                                           else [])
    for what, tensor in tensors:
        if not layout.is_token_wise(tensor):
            raise PackingError(
                f"Module '{module_name()}' has a trainable parameter and its {what} has shape "
                f"{tuple(tensor.shape)} on packed rows of shape ({layout.rows}, {layout.length}): it is not "
                "token-wise (e.g. a pooler or a sequence-classification head), so its per-example gradient "
                "cannot be separated between the examples packed in one row. Use a padding collator (one "
                "example per row) for this model, or freeze that module."
            )
    # routed tokens: moe regrouped them
    grouped = None if isinstance(activations, torch.Tensor) else activations
    if isinstance(activations, torch.Tensor):
        grouped = cache.get(id(activations))
        if grouped is None:
            grouped = cache[id(activations)] = layout.regroup(activations)
    return grouped, layout.regroup(grad_output)


def check_attention_stays_inside_examples(
    model: torch.nn.Module, position_start: int, extra_inputs: dict | None = None,
    lengths: tuple[int, int] = (5, 6)
) -> bool:
    """Prove on synthetic tokens (no training data) that the model keeps packed examples apart, or refuse.

    Returns False when the proof cannot be run (no vocabulary size to draw tokens from, or not one output per
    token): the caller must then rely on another check or refuse.

    Two rows ``[a, b]`` and ``[a', b]`` packed as the collator packs (``position_ids`` restarting at
    ``position_start``), with ``a != a'``: if attention stays inside each example, ``b``'s outputs do not
    depend on ``a`` (masked positions contribute exact zeros, so they agree to rounding at most). An attention
    implementation that ignores the restarts (an encoder's bidirectional mask, a custom kernel, a cache) makes
    them differ. Runs in eval mode under ``no_grad``: no dropout, no gradient, no state written.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(getattr(model, "config", None),
                                                                   "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 4:
        return False
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    first, second = lengths
    a, a_other, b = (torch.randint(vocab // 2, vocab, (n,), generator=generator)
                     for n in (first, first, second))
    positions = torch.cat([torch.arange(first),
                           torch.arange(second)]).add(position_start).unsqueeze(0).to(device)
    modes = {module: module.training for module in model.modules()}
    outputs = []
    try:
        model.eval()
        with torch.no_grad():
            for head in (a, a_other):
                ids = torch.cat([head, b]).unsqueeze(0).to(device)
                out = model(input_ids=ids, position_ids=positions, **(extra_inputs or {}))
                logits = out["logits"] if hasattr(out, "keys") else out[0]
                if logits.dim() < 3 or logits.shape[1] != first + second:
                    # not one output per token: the per-example loss refuses such a head on packed rows
                    return False
                outputs.append(logits[0, first:].double())
    finally:
        for module, mode in modes.items():
            module.training = mode
    difference = float((outputs[0] - outputs[1]).norm())
    scale = float(outputs[1].norm())
    if difference > 1e-5 * scale:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise PackingError(
            f"The model does not keep packed examples apart (attention implementation {implementation!r}): "
            f"the outputs of an example change when the example before it in the row changes (relative "
            f"{difference / max(scale, 1e-30):.1e}), so each example's gradient would depend on the others "
            "packed with it. Use a padding collator (one example per row) for this model, or an attention "
            "implementation that keeps packed sequences apart (transformers' causal LMs with 'sdpa', 'eager' "
            "or flash attention)."
        )
    return True
