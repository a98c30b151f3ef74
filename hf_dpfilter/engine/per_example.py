"""Per-example gradients of one recorded batch, in compact (ghost) form: norms, proven bounds, weighted
sums."""

from __future__ import annotations

import math

import torch
from torch import nn

from hf_dpfilter.engine.blocks import (
    CHUNK,
    CHUNK_ABOVE,
    OuterBlock,
    fuse_shared_sides,
    merge_terms,
    per_example_gram,
    quadratic,
    stack_blocks,
    use_ghost,
    weighted_outer,
)
from hf_dpfilter.engine.precision import bmm, higham_gamma, rounding_units, sum_tokens, underflow_unit
from hf_dpfilter.engine.rules import DenseTerm, IndexTerm, OuterTerm, Term

__all__ = ["PerExampleGradients"]

#: A stack of same-shape layers holds at most this share of the terms' memory (and at least _STACK_MIN_BYTES):
#: stacking copies the layers' A and B, a transient on top of what the terms hold.
_STACK_SHARE = 0.25
_STACK_MIN_BYTES = 16 * 2**20

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
        loss_scale: float = 1.0,
    ) -> None:
        """``terms`` is consumed: its entries are removed as they are merged, so that the originals can be
        freed as soon as a fused or stacked copy replaces them (the caller must not hold other references).

        ``stack_layers``: stack same-shape layers (see :func:`stack_blocks`); None means on CUDA only, where
        a step of a small model is bound by kernel launches. On CPU the batched products save nothing and the
        stack is a transient copy.

        ``loss_scale``: the terms are those of ``loss_scale * g_i`` (fp16 loss scaling: the backward ran on
        the scaled loss). Every result (norms, bounds, weighted sums) is of the unscaled ``g_i``: the scale is
        a power of two, so dividing the float64 squared norms and bounds by its square, and the fp32/fp64
        coefficients of the weighted sums by it, is exact (no rounding: only the exponent changes)."""
        if loss_scale <= 0 or math.frexp(loss_scale)[0] != 0.5:
            raise ValueError(f"loss_scale must be a power of two (exact to divide out), got {loss_scale!r}.")
        self.loss_scale = float(loss_scale)
        self.batch_size = batch_size
        self.precise = precise
        self.dtype = torch.float64 if precise else dtype
        self._input_dtypes = {
            p: next((t.left.dtype for t in ts if isinstance(t, OuterTerm)), self.dtype) for p,
            ts in terms.items()
        }
        # which tensors the layer rules returned, to find layers that share one (before dtype conversions)
        raw_sides = {
            p: (id(ts[0].left), id(ts[0].right)) for p,
            ts in terms.items() if len(ts) == 1 and isinstance(ts[0], OuterTerm)
        }
        merged = {p: merge_terms(terms.pop(p), self.dtype) for p in list(terms)}
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
        self._blocks = fuse_shared_sides(outers, raw_sides, self._input_dtypes)
        if self._blocks and (stack_layers if stack_layers is not None else self._blocks[0].left.is_cuda):
            held = sum(block.nbytes for block in self._blocks)
            self._blocks = stack_blocks(self._blocks, max(_STACK_MIN_BYTES, int(_STACK_SHARE * held)))
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
            # squares of fp32/bf16 values cannot underflow in float64; those of float64 values can
            out.append((squared, squared * (4 * higham_gamma(grad.shape[1] + 4, 2.0**-52))
                        + 4 * (grad.shape[1] + 4) * underflow_unit(torch.float64)))
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
        stacked layers, whose rows are then the batch): the computed squared norm per row, the terms of a
        bound ``E = sum_k c_k t_k`` on its rounding error (summed later for all parameters in one reduction),
        and the per-row gradient ``(batch, P, Q)`` when the outer term was materialized (it then replaces the
        term).

        Every block of the squared norm is bounded by what it sums (docs/privacy.md, "Mixed precision"):

        * ghost blocks (``sum_ts G_ts H_ts`` with computed Gram matrices ``G``, ``H``) *a posteriori*:
          ``|G^ H^ - G H| <= dG N_G |H^| + dH N_H |G^| + dG dH N_G N_H`` entrywise, ``N_G[t,s] = ||x_t||
          ||x_s||`` and ``dG`` the dot-product error of the Gram (``gamma`` of its length, or of chunk +
          chunks for long dot products), plus ``(u + gamma_R)`` times ``sum |G^ H^|`` for the product and the
          two-stage sum;
        * the other blocks (tied cross term, a dense gradient with token terms) by their pieces:
          ``((1 + eps)^2 (1 + gamma_R) - 1)`` times the sum of the products of the pieces' norms;
        * a materialized gradient ``B_i^T A_i`` is formed and squared in float64.

        Those bounds are relative and hold only where nothing underflows. Each operation whose result falls
        below the smallest normal number errs by at most ``eta`` (:func:`underflow_unit`) in absolute terms,
        and the error reaches the squared norm multiplied by the factors that operation's result is later
        multiplied by. One more term bounds that: ``eta`` times, per row, the number of such operations
        weighted by those factors (bounded from float64 norms of the stored rows: ``max_t ||a_t||^2`` for an
        error in the Gram of the output gradients, ``max_t ||b_t||^2`` for one in the Gram of the inputs, the
        largest entry for a single product), doubled for the underflow of the bound's own ingredients. It is
        about ``1e-30`` for a transformer layer in fp32, nothing beside a usual squared norm, but it keeps
        the clip an upper bound for an example whose gradient is so small (a confidently classified example,
        about ``exp(-margin)`` times a usual one) that its Gram products are subnormal. There the relative
        bound alone fell below the exact norm (measured: 0.86 times it at a loss scaled by ``2^-75``); the
        stabilizers of ``clip_factors`` (``+1e-6``, ``+0.01``) kept such an example's release within ``C``,
        but a factor ``C / N_i`` without one relies on ``N_i`` alone.
        """
        dtype = self.dtype
        unit, input_unit = rounding_units(dtype, device, input_dtype)
        materialized = None
        f64 = torch.float64
        parts: list[torch.Tensor] = []
        terms: list[tuple[float, torch.Tensor]] = []
        depth, dot, norm_length = 8, 1, 1  # longest reduction, longest dot product, longest norm
        s_outer = s_index = dense_norm = None
        f64_norms = lambda x: torch.linalg.vector_norm(x, dim=2, dtype=f64)  # noqa: E731 (no underflow)
        # the underflow term's weights, per row (see the docstring)
        tiny = torch.zeros(batch, dtype=f64, device=device)
        largest_left = largest_right = None

        def norms(x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.vector_norm(x, dim=2, dtype=dtype)

        def dot_error(length: int) -> float:
            chunk, chunks = (length, 1) if length <= CHUNK_ABOVE else (CHUNK, -(-length // CHUNK))
            return (1 + input_unit) ** 2 * (1 + higham_gamma(chunk + chunks, unit)) - 1

        if outer is not None:
            tokens, p, q = outer.left.shape[1], outer.left.shape[2], outer.right.shape[2]
            depth, norm_length = max(depth, 2 * tokens + 8), max(norm_length, p, q)
            n_left, n_right = norms(outer.left), norms(outer.right)
            s_outer = torch.linalg.vecdot(n_left, n_right)
            left64, right64 = f64_norms(outer.left), f64_norms(outer.right)
            largest_left = left64.square().amax(dim=1) if tokens else torch.zeros_like(tiny)
            largest_right = right64.square().amax(dim=1) if tokens else torch.zeros_like(tiny)
            if not use_ghost(outer):
                # narrow layer (LoRA, or T large): materialize in float64 (cheap here), store in the sum's
                # dtype
                grad = bmm(outer.left.transpose(1, 2), outer.right, f64)
                if dense is not None:
                    grad = grad + dense.grad.reshape(grad.shape).to(f64)
                parts.append(sum_tokens(grad * grad))
                extra = 0.0 if dense is None else torch.linalg.vector_norm(dense.grad.reshape(batch, -1),
                                                                           dim=1,
                                                                           dtype=dtype)
                scale = s_outer + extra
                factor = (1 + higham_gamma(tokens + 2, 2.0**-52)) ** 2 * (1 + higham_gamma(p + q + 8,
                                                                                           2.0**-52)) - 1
                terms.append((factor, scale * scale))
                # formed in float64 from the stored values (no underflow there); its cast to the sum's dtype
                # moves each entry by at most eta, the vector by sqrt(p q) eta
                scale64 = torch.linalg.vecdot(left64, right64)
                if dense is not None:
                    scale64 = scale64 + torch.linalg.vector_norm(dense.grad.reshape(batch, -1), dim=1,
                                                                 dtype=f64)
                tiny += 2 * math.sqrt(p * q) * scale64 + p * q * (2 * tokens + 2)
                materialized = grad.to(dtype)
                dense = DenseTerm(materialized)
                outer = None
                dense_done = True
            else:
                dense_done = False
                left_gram, d_left = per_example_gram(outer.left, dtype), dot_error(p)
                right_gram, d_right = per_example_gram(outer.right, dtype), dot_error(q)
                product = left_gram * right_gram
                parts.append(sum_tokens(product))
                magnitude = sum_tokens(product.abs_())
                del product
                # an entry of a Gram errs by <= its length x eta, times the other Gram's entries after it
                tiny += tokens * tokens * (p * largest_right + q * largest_left + 4)
                weighted_left = quadratic(n_left, right_gram.abs_())
                weighted_right = quadratic(n_right, left_gram.abs_())
                del left_gram, right_gram
                terms += [
                    (d_left, weighted_left),
                    (d_right, weighted_right),
                    (d_left * d_right, s_outer * s_outer),
                    (unit + higham_gamma(depth, unit) * (1 + unit), magnitude),
                ]
        else:
            dense_done = False
        if index is not None:
            tokens, q = index.right.shape[1], index.right.shape[2]
            depth, norm_length = max(depth, 2 * tokens + 8), max(norm_length, q)
            n_rows = norms(index.right)
            s_index = n_rows.sum(dim=1)
            same_row = index.ids.unsqueeze(2) == index.ids.unsqueeze(1)
            right_gram = per_example_gram(index.right, dtype).masked_fill_(~same_row, 0)
            parts.append(sum_tokens(right_gram))
            magnitude = sum_tokens(right_gram.abs_())
            del right_gram
            pairs = sum_tokens((n_rows.unsqueeze(2) * n_rows.unsqueeze(1)).masked_fill_(~same_row, 0))
            terms += [(dot_error(q), pairs), (unit + higham_gamma(depth, unit) * (1 + unit), magnitude)]
            tiny += tokens * tokens * (q + 4)
        cross_pieces: list[torch.Tensor] = []
        if outer is not None and index is not None:
            # Tied weights: 2 <sum_s l_s r_s^T, sum_t e_{id_t} r'_t^T> = 2 sum_{s,t} l_s[id_t] (r_s . r'_t)
            steps = outer.left.shape[1]
            dot = max(dot, outer.right.shape[2])
            gathered = outer.left.gather(2, index.ids.unsqueeze(1).expand(-1, steps, -1))
            cross = bmm(outer.right, index.right.transpose(1, 2), dtype).mul_(gathered)
            parts.append(2 * sum_tokens(cross))
            # a posteriori: |l_s[id_t]| d_Q ||r_s|| ||r'_t|| per pair, and the product and sum roundings
            weighted = torch.linalg.vecdot(
                torch.bmm(gathered.abs().to(dtype).transpose(1, 2), n_right.unsqueeze(2)).squeeze(2), n_rows
            )
            magnitude = sum_tokens(cross.abs_())
            del cross, gathered
            # |l_s[id_t]| <= ||a_s||
            tiny += 2 * steps * index.ids.shape[1] * (outer.right.shape[2] * largest_left.sqrt() + 4)
            terms += [
                (2 * dot_error(outer.right.shape[2]) * (1 + unit), weighted),
                (2 * (unit + higham_gamma(depth, unit) * (1 + unit)), magnitude),
            ]
        if dense is not None:
            flat = dense.grad.reshape(batch, -1)
            dense_norm = torch.linalg.vector_norm(flat, dim=1, dtype=dtype)
            first = dense.grad.shape[1] if dense.grad.dim() > 2 else 1
            depth = max(depth, 2 * max(first, flat.shape[1] // first) + 8)
            norm_length = max(norm_length, flat.shape[1])
            if not dense_done:
                grad = dense.grad.reshape(batch, first, -1)
                parts.append(sum_tokens(grad * grad))
                cross_pieces.append(dense_norm * dense_norm)
                tiny += 2 * flat.shape[1]
            if outer is not None:
                steps, p, q = outer.left.shape[1], outer.left.shape[2], outer.right.shape[2]
                tiny += 2 * steps * q * (p * largest_right.sqrt() + 4)
                dot = max(dot, outer.left.shape[2])
                d = dense.grad.reshape(batch, outer.left.shape[2], outer.right.shape[2])
                parts.append(2 * sum_tokens(bmm(outer.left, d, dtype).mul_(outer.right)))
                cross_pieces.append(2 * dense_norm * s_outer)
            if index is not None:
                d = dense.grad.reshape(batch, index.num_rows, -1)
                rows = d.gather(1, index.ids.unsqueeze(-1).expand(-1, -1, d.shape[2]))
                parts.append(2 * sum_tokens(rows.mul_(index.right)))
                cross_pieces.append(2 * dense_norm * s_index)
                tiny += 2 * index.right.shape[1] * index.right.shape[2] * 4
        eps = (1 + input_unit) ** 2 * (1 + higham_gamma(dot, unit)) * (1 + unit) - 1
        terms += [((1 + eps) ** 2 * (1 + higham_gamma(depth, unit)) - 1, piece) for piece in cross_pieces]
        # + 4: the parameter's squared norm rounded to the sum's dtype; x 2: the bound's own ingredients
        terms.append((2 * underflow_unit(dtype), tiny + 4))
        # the bound's own ingredients are rounded: norms of <= norm_length terms, sums of <= depth positive
        # terms
        safety = (1 + higham_gamma(2 * norm_length + 2 * depth + 16, unit)) ** 4
        total = parts[0]
        for part in parts[1:]:
            total = total + part.to(total.dtype)
        return total, [(c * safety, t) for c, t in terms], materialized

    def _param_norm_and_bound(self, param: nn.Parameter) -> tuple[torch.Tensor,
                                                                  list[tuple[float, torch.Tensor]]]:
        """:meth:`_norm_and_bound` of a parameter with an index or dense term (embeddings, tied weights)."""
        outer, index, dense = self._merged[param]
        total, terms, materialized = self._norm_and_bound(
            outer, index, dense, self.batch_size, param.device, self._input_dtypes.get(param, self.dtype)
        )
        if materialized is not None:
            self._merged[param] = (None, index,
                                   DenseTerm(materialized.reshape(self.batch_size, *param.shape)))
        return total, terms

    def _block_norm_and_bound(self, block: OuterBlock) -> tuple[torch.Tensor,
                                                                 list[tuple[float, torch.Tensor]]]:
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
            outer, None, dense, layers * batch, (block.grads if outer is None else block.left).device,
            block.input_dtype
        )
        if materialized is not None:
            block.grads, block.left, block.right = materialized.reshape(layers, batch, p, q), None, None
        return total.reshape(layers, batch), [(c, t.reshape(layers, batch)) for c, t in terms]

    def squared_norms(self) -> torch.Tensor:
        """``||g_i||^2`` over all trainable parameters, shape (B,), in fp32 (fp64 for fp64 models /
        precise)."""
        if self._squared_norms is None:
            # (k, B): squared norms of parameters, fused layers or stacked layers
            rows: list[torch.Tensor] = []
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
                # a constant number of kernels for all parameters: concatenate (each squared norm rounded to
                # this dtype once), then reduce over the rows in float64; both roundings are bounded below
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
            bound = bound + (cast_unit + higham_gamma(count, 2.0**-52)) * (magnitude + total.abs() + bound)
            if self.loss_scale != 1.0:  # the terms are of loss_scale * g_i: 1 / scale^2 is a power of two
                total, bound = total * self.loss_scale**-2, bound * self.loss_scale**-2
            self._squared_norms64 = total
            self._error_bounds = bound
            self._squared_norms = total.to(self.dtype)
        return self._squared_norms

    def norms(self) -> torch.Tensor:
        """The computed per-example norms (for reporting; clip with :meth:`clipping_norms`)."""
        return self.squared_norms().clamp_min(0).sqrt()

    def clipping_norms(self) -> torch.Tensor:
        """Norms to clip with: a proven upper bound of the exact per-example norm (see the class
        docstring)."""
        self.squared_norms()
        bound = (self._squared_norms64.clamp_min(0) + self._error_bounds).sqrt()
        # margin for the square root in float64, the cast to self.dtype and the clip factor's own rounding
        margin = 2.0**-50 if self.dtype == torch.float64 else 2.0**-20
        return (bound * (1.0 + margin)).to(self.dtype)

    def zero_examples(self, drop: torch.Tensor) -> None:
        """Replace the gradients of the examples where ``drop`` (bool, shape (B,)) is True by exact zeros.

        Used for examples whose loss or gradient is NaN/inf: a weighted sum with coefficient 0 would still
        give ``0 * nan = nan``, so their terms are zeroed (``torch.where``, not a product) before any sum.
        """
        if not bool(drop.any()):
            return

        def keep(t: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
            mask = (~drop).to(t.device).reshape(*([1] * batch_dim), -1, *([1] * (t.dim() - batch_dim - 1)))
            return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

        for param, (outer, index, dense) in self._merged.items():
            self._merged[param] = (
                None if outer is None else OuterTerm(left=keep(outer.left), right=keep(outer.right)),
                None if index is None
                else IndexTerm(ids=index.ids, right=keep(index.right), num_rows=index.num_rows),
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

    def weighted_sum(self, coefficients: torch.Tensor, release: bool = False) -> dict[nn.Parameter,
                                                                                      torch.Tensor]:
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
        # sum_i c_i g_i = sum_i (c_i / scale) (scale g_i), exactly (a power of two)
        if self.loss_scale != 1.0:
            coefficients = coefficients * (1.0 / self.loss_scale)
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
                total = weighted_outer(outer.left[None], outer.right[None], c,
                                        self.dtype).reshape(param.shape)
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
                c = converted[block.params[0].device] = coefficients.to(device=block.params[0].device,
                                                                        dtype=self.dtype)
            if block.grads is not None:
                layers, _, p, q = block.grads.shape
                # (B,) @ (L, B, P Q): one batched GEMV for the block's materialized layers
                totals = torch.matmul(c, block.grads.reshape(layers, self.batch_size, p * q)).reshape(layers,
                                                                                                      p, q)
            else:
                totals = weighted_outer(block.left, block.right, c, self.dtype)
            for param, (layer, dim, start, size) in zip(block.params, block.places):
                piece = totals[layer].narrow(dim, start, size)
                out[param] = (piece.reshape(param.shape) if dim == 0
                              else piece.contiguous().reshape(param.shape))
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
