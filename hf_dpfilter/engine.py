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

Learned position embeddings whose ids arrive broadcast as ``(1, T)`` (BERT, GPT-2) would return a gradient
summed over the batch; the forward hook expands such outputs to ``(B, T, d)`` (a view; it changes no
values) so their gradient stays per example.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_dpfilter.collectives import is_sharded
from hf_dpfilter.grad_rules import DenseTerm, IndexTerm, OuterTerm, Term, find_grad_rule

__all__ = ["GhostClippingEngine", "PerExampleGradients", "UnsupportedLayerError"]


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives in a module type that has no per-example gradient rule."""


@dataclass
class _Record:
    module: nn.Module
    activations: torch.Tensor
    output: torch.Tensor
    #: the tensors the forward used for the module's sharded parameters (FSDP2 gathers whole ones), for the check
    used: dict[str, torch.Tensor] | None = None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge_terms(terms: list[Term], dtype: torch.dtype) -> tuple[OuterTerm | None, IndexTerm | None, DenseTerm | None]:
    """Combine every use of one parameter into at most one term of each kind (concatenating along tokens)."""
    outers = [t for t in terms if isinstance(t, OuterTerm)]
    indexes = [t for t in terms if isinstance(t, IndexTerm)]
    denses = [t for t in terms if isinstance(t, DenseTerm)]
    outer = index = dense = None
    # A single use (the common case) is kept as it is: torch.cat would copy every activation and output grad.
    if len(outers) == 1:
        outer = OuterTerm(left=outers[0].left.to(dtype), right=outers[0].right.to(dtype))
    elif outers:
        outer = OuterTerm(
            left=torch.cat([t.left.to(dtype) for t in outers], dim=1),
            right=torch.cat([t.right.to(dtype) for t in outers], dim=1),
        )
    if len(indexes) == 1:
        index = IndexTerm(ids=indexes[0].ids, right=indexes[0].right.to(dtype), num_rows=indexes[0].num_rows)
    elif indexes:
        index = IndexTerm(
            ids=torch.cat([t.ids for t in indexes], dim=1),
            right=torch.cat([t.right.to(dtype) for t in indexes], dim=1),
            num_rows=indexes[0].num_rows,
        )
    if denses:
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


def _weighted_outer(outer: OuterTerm, c: torch.Tensor) -> torch.Tensor:
    """``sum_i c_i sum_t left[i,t] (outer) right[i,t]`` as one GEMM, scaling the narrower side by c."""
    batch, tokens, p = outer.left.shape
    q = outer.right.shape[2]
    scale = c.reshape(batch, 1, 1)
    if p <= q:
        left, right = outer.left * scale, outer.right
    else:
        left, right = outer.left, outer.right * scale
    return torch.mm(left.reshape(batch * tokens, p).t(), right.reshape(batch * tokens, q))


class PerExampleGradients:
    """Per-example gradients of one recorded batch, kept in compact (ghost) form.

    ``squared_norms()`` gives ``||g_i||^2`` over all trainable parameters; ``weighted_sum(c)`` gives
    ``{param: sum_i c_i g_i[param]}``; ``clipping_norms()`` gives the norms to clip with.

    ``precise=True`` is for combinations with cancellation (a per-example *difference* of gradients at two
    points, as DIFF2's difference rounds, or any combination with a negative weight). The ghost identity sums
    products of token terms whose cross terms cancel, so its relative error grows like
    ``u (||g(x)|| / ||g(x) - g(x')||)^2``; a squared norm that rounds to <= 0 would give clip factor 1 and
    let the example in unclipped. In precise mode every term is promoted to float64 (exact for float32 and
    bfloat16 inputs), and :meth:`clipping_norms` returns an upper bound ``sqrt(max(n^2, 0) + E)`` where
    ``E = 2 u (L + K^2 + 4) s^2`` per parameter, ``u = 2^-53``, ``s = sum_k ||piece_k||`` over the example's
    pieces (token terms ``b_t a_t^T``, embedding rows, dense gradients), ``K`` their number and ``L`` the
    longest inner product: the standard bound for dot products and sums of ``n`` floating-point terms
    (``|fl(sum) - sum| <= n u sum |terms|``) applied to the Gram entries, their products and the final sum
    (docs/privacy.md, "Precision of the clip"). The clip then holds for the exact per-example combination
    whatever the cancellation; when cancellation dominates, the example is clipped harder, never less.
    """

    def __init__(
        self, terms: dict[nn.Parameter, list[Term]], batch_size: int, dtype: torch.dtype, precise: bool = False
    ) -> None:
        self.batch_size = batch_size
        self.precise = precise
        self.dtype = torch.float64 if precise else dtype
        self._merged = {p: _merge_terms(ts, self.dtype) for p, ts in terms.items()}
        self._squared_norms: torch.Tensor | None = None
        self._error_bounds: torch.Tensor | None = None
        self._released = False

    @property
    def parameters(self) -> list[nn.Parameter]:
        return list(self._merged)

    def _materialize(self, param: nn.Parameter) -> None:
        """Replace the outer term by the dense per-example gradient ``B_i^T A_i`` (frees A and B)."""
        outer, index, dense = self._merged[param]
        grad = torch.bmm(outer.left.transpose(1, 2), outer.right).reshape(self.batch_size, *param.shape)
        if dense is not None:
            grad = grad + dense.grad.reshape(grad.shape)
        self._merged[param] = (None, index, DenseTerm(grad))

    def _param_squared_norms(self, param: nn.Parameter) -> torch.Tensor:
        outer = self._merged[param][0]
        if outer is not None and not _use_ghost(outer):
            self._materialize(param)
        outer, index, dense = self._merged[param]
        total = torch.zeros(self.batch_size, dtype=self.dtype, device=param.device)
        if outer is not None:
            left_gram = torch.bmm(outer.left, outer.left.transpose(1, 2))
            right_gram = torch.bmm(outer.right, outer.right.transpose(1, 2))
            total = total + (left_gram * right_gram).sum(dim=(1, 2))
        if index is not None:
            same_row = (index.ids.unsqueeze(2) == index.ids.unsqueeze(1)).to(self.dtype)
            right_gram = torch.bmm(index.right, index.right.transpose(1, 2))
            total = total + (same_row * right_gram).sum(dim=(1, 2))
        if outer is not None and index is not None:
            # Tied weights: 2 <sum_s l_s r_s^T, sum_t e_{id_t} r'_t^T> = 2 sum_{s,t} l_s[id_t] (r_s . r'_t)
            steps = outer.left.shape[1]
            gathered = outer.left.gather(2, index.ids.unsqueeze(1).expand(-1, steps, -1))
            cross = torch.bmm(outer.right, index.right.transpose(1, 2))
            total = total + 2 * (gathered * cross).sum(dim=(1, 2))
        if dense is not None:
            flat = dense.grad.reshape(self.batch_size, -1)
            total = total + (flat * flat).sum(dim=1)
            if outer is not None:
                d = dense.grad.reshape(self.batch_size, outer.left.shape[2], outer.right.shape[2])
                total = total + 2 * torch.einsum("bpq,btq,btp->b", d, outer.right, outer.left)
            if index is not None:
                d = dense.grad.reshape(self.batch_size, index.num_rows, -1)
                rows = d.gather(1, index.ids.unsqueeze(-1).expand(-1, -1, d.shape[2]))
                total = total + 2 * (rows * index.right).sum(dim=(1, 2))
        return total

    def _param_error_bound(self, param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """(bound on the rounding error of this parameter's squared norm, s^2) per example; precise mode."""
        outer, index, dense = self._merged[param]
        s = torch.zeros(self.batch_size, dtype=torch.float64, device=param.device)
        pieces, length = 0, 1
        if outer is not None:
            s = s + (outer.left.norm(dim=2) * outer.right.norm(dim=2)).sum(dim=1)
            pieces += outer.left.shape[1]
            length = max(length, outer.left.shape[2], outer.right.shape[2])
        if index is not None:
            s = s + index.right.norm(dim=2).sum(dim=1)
            pieces += index.right.shape[1]
            length = max(length, index.right.shape[2])
        if dense is not None:
            s = s + dense.grad.reshape(self.batch_size, -1).norm(dim=1)
            pieces += 1
            length = max(length, dense.grad[0].numel())
        unit = 2.0**-53
        return 2.0 * unit * (length + pieces**2 + 4) * s * s, s * s

    def squared_norms(self) -> torch.Tensor:
        """``||g_i||^2`` over all trainable parameters, shape (B,), in fp32 (fp64 for fp64 models / precise)."""
        if self._squared_norms is None:
            total = bound = scale = None
            for param in self._merged:
                sq = self._param_squared_norms(param)
                total = sq if total is None else total + sq.to(total.device)
                if self.precise:
                    b, s2 = self._param_error_bound(param)
                    bound = b if bound is None else bound + b.to(bound.device)
                    scale = s2 if scale is None else scale + s2.to(scale.device)
            if total is None:
                total = torch.zeros(self.batch_size, dtype=self.dtype)
            self._squared_norms = total
            if self.precise and bound is not None:
                # the sum over parameters adds at most n u sum_p |sq_p| <= n u sum_p s_p^2 (+ the bounds)
                unit = 2.0**-53
                self._error_bounds = bound * (1 + 4 * unit * (len(self._merged) + 1)) + (
                    2 * unit * (len(self._merged) + 1) * scale
                )
        return self._squared_norms

    def norms(self) -> torch.Tensor:
        """The computed per-example norms (for reporting; clip with :meth:`clipping_norms`)."""
        return self.squared_norms().clamp_min(0).sqrt()

    def clipping_norms(self) -> torch.Tensor:
        """Norms to clip with: :meth:`norms`, or in precise mode a proven upper bound of the exact norm."""
        if not self.precise:
            return self.norms()
        squared = self.squared_norms()
        bound = 0.0 if self._error_bounds is None else self._error_bounds.to(device=squared.device)
        return (squared.clamp_min(0) + bound).sqrt() * (1.0 + 2.0**-50)

    def zero_examples(self, drop: torch.Tensor) -> None:
        """Replace the gradients of the examples where ``drop`` (bool, shape (B,)) is True by exact zeros.

        Used for examples whose loss or gradient is NaN/inf: a weighted sum with coefficient 0 would still give
        ``0 * nan = nan``, so their terms are zeroed (``torch.where``, not a product) before any sum.
        """
        if not bool(drop.any()):
            return

        def keep(t: torch.Tensor) -> torch.Tensor:
            mask = (~drop).to(t.device).reshape(-1, *([1] * (t.dim() - 1)))
            return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

        for param, (outer, index, dense) in self._merged.items():
            self._merged[param] = (
                None if outer is None else OuterTerm(left=keep(outer.left), right=keep(outer.right)),
                None if index is None else IndexTerm(ids=index.ids, right=keep(index.right), num_rows=index.num_rows),
                None if dense is None else DenseTerm(keep(dense.grad)),
            )
        self._squared_norms = None
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
        for param in list(self._merged):
            outer, index, dense = self._merged[param]
            if release:
                del self._merged[param]
            c = coefficients.to(device=param.device, dtype=self.dtype)
            total = None
            if outer is not None:
                total = _weighted_outer(outer, c).reshape(param.shape)
            if dense is not None:
                g = torch.mv(dense.grad.reshape(self.batch_size, -1).t(), c).reshape(param.shape)
                total = g if total is None else total.add_(g)
            if total is None:
                total = torch.zeros(param.shape, dtype=self.dtype, device=param.device)
            if index is not None:
                rows = total.view(index.num_rows, -1)
                weighted = (index.right * c[:, None, None]).reshape(-1, rows.shape[1])
                rows.index_add_(0, index.ids.reshape(-1), weighted)
            out[param] = total
            del outer, index, dense
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
    """

    def __init__(self, model: nn.Module, *args: Any, verify_first_backward: bool = True, **kwargs: Any) -> None:
        removed = [name for name in ("max_grad_norm", "clipping_fn") if name in kwargs]
        if args or removed:
            raise TypeError(f"GhostClippingEngine({', '.join(removed) or 'a clipping norm'}=...): {_OWNED_BY_THE_OPTIMIZER}")
        if kwargs:
            raise TypeError(f"GhostClippingEngine got unexpected arguments {sorted(kwargs)}.")
        self.model = model
        self.verify_first_backward = verify_first_backward
        self._records: list[_Record] = []
        self._recording = False
        self._batch_size: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        self._param_names: dict[nn.Parameter, str] = {}
        self._module_params: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self._sharded_modules: set[nn.Module] = set()
        self._pending_terms: dict[nn.Parameter, list[Term]] = {}
        self._pending_reference: dict[nn.Parameter, torch.Tensor] | None = None
        self._pending_low_precision = False
        self._pending_dtype = torch.float32
        self.attach()

    # ----------------------------------------------------------------------------------------- set-up
    def attach(self) -> None:
        """Find every trainable parameter's module, check it has a rule, and register forward hooks."""
        self.detach()
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
        if not self._owners:
            raise ValueError("The model has no trainable parameters: nothing to train privately.")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self._owners)

    def parameter_name(self, param: nn.Parameter) -> str:
        return self._param_names.get(param, "<unnamed>")

    # --------------------------------------------------------------------------------------- recording
    def _forward_hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor):
        if not self._recording or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
            return None
        if not output.requires_grad:
            return None
        activations = inputs[0].detach() if inputs else None
        batch = self._batch_size
        if batch is None:
            batch = output.shape[0]
            self._batch_size = batch
        if output.shape[0] == 1 and batch > 1:
            # Broadcast inputs (position ids of shape (1, T)): expand so the gradient stays per example.
            output = output.expand(batch, *output.shape[1:])
            if activations is not None:
                activations = activations.expand(batch, *activations.shape[1:])
        elif output.shape[0] != batch:
            raise RuntimeError(
                f"Module {type(module).__name__} produced an output with leading dimension {output.shape[0]} "
                f"while recording a batch of {batch} examples. Per-example clipping needs batch-first "
                "tensors; pass batch_size to engine.record() if the first layer's input is not batch-first."
            )
        used = None
        if module in self._sharded_modules and self.verify_first_backward:
            used = {name: getattr(module, name) for name in self._module_params[module]}
        self._records.append(_Record(module=module, activations=activations, output=output, used=used))
        return output

    @contextlib.contextmanager
    def record(self, batch_size: int | None = None) -> Iterator[None]:
        """Record the forward passes run inside the block (one or several, e.g. at several parameter points)."""
        self._records = []
        self._pending_terms = {}
        self._pending_reference = None
        self._pending_low_precision = False
        self._batch_size = batch_size
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def clear(self) -> None:
        self._records = []

    def call_model(self, param_values: dict[nn.Parameter, torch.Tensor] | None, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` at other values of some trainable parameters (None: the current ones).

        The ``loss_fn`` that :meth:`DPOptimizer.accumulate` calls receives such values for methods that
        evaluate several parameter points (DiSK, DP-PMLF, DIFF2); a functional call, the model is untouched.
        """
        if not param_values:
            return self.model(*args, **kwargs)
        values = {self.parameter_name(p): v for p, v in param_values.items()}
        return torch.func.functional_call(self.model, values, args=args, kwargs=kwargs, strict=False)

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
        if not records:
            raise RuntimeError("Nothing was recorded: run the forward pass inside `with engine.record():`.")
        self._pending_dtype = _accumulation_dtype(per_example_loss.dtype)
        total = per_example_loss.sum()
        if self.verify_first_backward:
            self._pending_low_precision |= any(r.output.dtype in (torch.float16, torch.bfloat16) for r in records)
            self._add_reference(total, records)
        output_grads = torch.autograd.grad(total, [r.output for r in records], allow_unused=True)
        for record, grad_output in zip(records, output_grads):
            if grad_output is None:
                continue
            rule = find_grad_rule(record.module)
            module_params = self._module_params[record.module]
            for param_name, term in rule(record.module, record.activations, grad_output).items():
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
        grads = PerExampleGradients(terms, self._batch_size, self._pending_dtype, precise=precise)
        if self.verify_first_backward:
            reference = self._pending_reference or {}
            self._verify(grads, tuple(reference.get(p) for p in self.trainable_parameters), self._pending_low_precision)
            self.verify_first_backward = False
        self._pending_reference = None
        self._pending_low_precision = False
        return grads

    def _verify(
        self, grads: PerExampleGradients, reference: tuple[torch.Tensor | None, ...], low_precision: bool = False
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
