"""Mixture-of-experts layers (Mixtral, Qwen2-MoE): per-example rules for the router and the experts.

A sparse MoE block flattens its hidden states to a token axis ``(B·T, d)``, routes each token by its own
hidden state (``router_logits = x W_r^T``, a softmax and a top-k over the experts, i.e. along each token's own
row) and runs each expert on the tokens routed to it, gathered across the whole batch; the experts' outputs
are added back at the tokens' rows. What makes this per example, and how each piece is established:

* **The token axis.** The batch-axis tracer (:mod:`hf_dpfilter.proofs.batch_axis`) follows ``view(-1, d)``:
  the batch is the major part of the merged axis (tag ``(0, T)``), so row ``n`` belongs to example ``n // T``.
  The engine records such a call as ``MERGED`` with ``rows_per_example = T`` (the one mechanism of
  :mod:`hf_dpfilter.proofs.batch_axis` for merged batch axes, which OPT and BLOOM use too) and views its rows
  back as ``(B, T, ...)`` before the rule (proven on the first step, never read from a shape); the routing
  recorded with an experts call is viewed alike (:func:`split_rows`).
* **The routing.** The routing indices and weights given to the experts must carry the same merged token axis
  (traced from the hidden states through the router's per-row softmax and top-k); a router that chose tokens
  per expert over the batch (capacity limits, token dropping: a top-k along the token axis) loses that tag and
  the call is refused by name.
* **The experts.** ``MixtralExperts`` / ``Qwen2MoeExperts`` (and any class with their declared layout: 3-D
  ``gate_up_proj`` (E, 2I, d) and ``down_proj`` (E, d, I), concatenated gate/up, no bias, no post-expert norm)
  compute, for each token ``n`` and each of its routes ``(e, w)``, ``w · down_e(act(gate_e x_n) · up_e x_n)``
  added at row ``n``: row ``n`` of the output depends on row ``n`` of the three inputs only, whichever kernel
  runs it (eager loop, grouped or batched matmuls). This is checked once per class and kernel on a probe
  against :func:`_experts_reference`, which is row-wise by construction; the tracer then tags the output with
  the input's token axis. The rule recomputes each route's activations from the recorded inputs and gives, per
  example, the sum over its own tokens only: an :class:`OuterTerm` whose left factor places each token's
  gradient in the block of the expert it was routed to (zero elsewhere), so ``G_i[e] = sum_{t of i routed to
  e} dh_t ⊗ x_t``.
* **The router** is a bias-free linear map of each token: ``G_i = sum_t dlogits_t ⊗ x_t``.
* **The load-balancing loss** (``output_router_logits`` with ``router_aux_loss_coef != 0``) is a statistic of
  all the tokens of a batch in transformers; the DPTrainer computes it per example
  (:mod:`hf_dpfilter.losses.router`). Router jitter is refused as randomness
  (:mod:`hf_dpfilter.proofs.randomness`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hf_dpfilter.engine.rules import OuterTerm, Term, register_grad_rule
from hf_dpfilter.proofs.batch_axis import BATCH, MERGED
from hf_dpfilter.proofs.validators import ModuleProblem, ValidationOptions, register_module_validator

if TYPE_CHECKING:
    from hf_dpfilter.data.packing import PackedLayout
    from hf_dpfilter.proofs.batch_axis import BatchAxisTracer

__all__ = ["RoutedTokens", "experts_layout_problem", "is_experts", "is_router", "split_rows"]

_ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter")
_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts")
_MODULES = {"Mixtral": "transformers.models.mixtral.modeling_mixtral",
            "Qwen2Moe": "transformers.models.qwen2_moe.modeling_qwen2_moe"}


@dataclass
class RoutedTokens:
    """What an experts call saw: the tokens ``(N, d)``, their expert indices and routing weights ``(N,
    k)``."""

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor


def split_rows(value: torch.Tensor | RoutedTokens | None, batch: int,
               packing: PackedLayout | None = None) -> torch.Tensor | RoutedTokens | None:
    """``(B·T, ...) -> (B, T, ...)`` for a call whose merged leading axis has the batch as its major part; the
    routing of user-level units over padded rows regrouped per unit (``(U, T_max, ...)``, zero past a unit's
    end:
    a zero token with zero weight and zero output gradient adds nothing to any expert's gradient)."""
    if value is None:
        return None
    if isinstance(value, RoutedTokens):
        layout = packing.over_rows(value.index.shape[0] // batch) if packing is not None else None
        if layout is not None:  # units of padded rows: each unit's rows concatenated (zeros route nothing)
            return RoutedTokens(*(layout.regroup(split_rows(t, batch)) for t in (value.hidden, value.index,
                                                                                    value.weights)))
        if packing is not None:
            from hf_dpfilter.data.packing import PackingError

            raise PackingError(
                "Mixture-of-experts layers on packed rows are not supported (their routed tokens are not "
                "regrouped per packed example). Use a padding collator (one example per row) for this model "
                "(DPSFTConfig: packing=False, padding_free=False)."
            )
        return RoutedTokens(*(split_rows(t, batch) for t in (value.hidden, value.index, value.weights)))
    return value.reshape(batch, value.shape[0] // batch, *value.shape[1:])


def is_router(module: nn.Module) -> bool:
    return type(module).__name__ in _ROUTERS and _from_known_module(module)


def is_experts(module: nn.Module) -> bool:
    return type(module).__name__ in _EXPERTS and _from_known_module(module)


def _from_known_module(module: nn.Module) -> bool:
    return type(module).__module__ in _MODULES.values()


# ------------------------------------------------------------------------------------------------ router
def _router(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # forward: router_logits = F.linear(x.reshape(-1, d), weight); the recorded output is router_logits, whose
    # gradient gathers every use of the routing (the experts' weights, a loss on the logits).
    if not module.weight.requires_grad:
        return {}
    return {"weight": OuterTerm(left=grad_output, right=activations)}


# ----------------------------------------------------------------------------------------------- experts
def experts_layout_problem(module: nn.Module) -> str | None:
    """Why ``module``'s experts layout is not the one :func:`_experts_reference` computes (None: it is)."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
    wrong = [f"{name}={getattr(module, name, None)!r}" for name, want in flags.items()
             if getattr(module, name, want) != want]
    if wrong:
        return f"its experts layout ({', '.join(wrong)}) is not the concatenated gate/up layout without bias"
    if getattr(module, "_is_expert_parallel", False):
        return "it runs expert-parallel (each process holds some experts and drops the others' tokens)"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 or (
            down.dim() != 3 or down.shape[0] != gate_up.shape[0] or gate_up.shape[1] != 2 * down.shape[2]):
        return "its gate_up_proj/down_proj are not 3-D (E, 2I, d) and (E, d, I)"
    return None


def _apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    apply = getattr(module, "_apply_gate", None)
    if apply is not None:
        return apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _experts_reference(module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """What the experts compute, token by token (row n from row n of the inputs only, by construction)."""
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        rows, slot = torch.where(index == e)
        if rows.numel():
            h = _apply_gate(module, F.linear(hidden[rows], gate_up[e]))
            out = out.index_add(0, rows, F.linear(h, down[e]) * weights[rows, slot, None].to(hidden.dtype))
    return out


_CHECKED_FORMS: dict[tuple, str | None] = {}


def check_experts_forward(module: nn.Module) -> str | None:
    """Whether ``module.forward`` equals :func:`_experts_reference` on a probe (None if so), once per class,
    experts kernel (``config._experts_implementation``, chosen per model) and dtype."""
    kernel = getattr(getattr(module, "config", None), "_experts_implementation", None)
    key = (type(module), str(kernel), getattr(module.gate_up_proj, "dtype", None))
    if key not in _CHECKED_FORMS:
        problem = experts_layout_problem(module)
        if problem is None:
            problem = _probe(module)
        _CHECKED_FORMS[key] = problem
    return _CHECKED_FORMS[key]


def _probe(module: nn.Module) -> str | None:
    num_experts, _, hidden_dim = module.gate_up_proj.shape
    k = min(2, num_experts)
    generator = torch.Generator().manual_seed(0)
    device, dtype = module.gate_up_proj.device, module.gate_up_proj.dtype
    hidden = torch.randn(7, hidden_dim, generator=generator).to(device=device, dtype=dtype)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(7)]).to(device)
    weights = torch.rand(7, k, generator=generator).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            # not through the hooks: a probe, not a recorded call
            got = module.forward(hidden, index, weights)
            want = _experts_reference(module, hidden, index, weights, module.gate_up_proj, module.down_proj)
    except Exception as error:  # noqa: BLE001 -- a forward that fails on the probe is not a form we know
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    low = dtype in (torch.float16, torch.bfloat16)
    tolerance = ({"rtol": 2e-2, "atol": 1e-2} if low else {"rtol": 1e-4, "atol": 1e-5}
                 if dtype != torch.float64
                 else {"rtol": 1e-9, "atol": 1e-10})
    if got.shape != want.shape or not torch.allclose(got, want, **tolerance):
        return "its forward is not the token-wise sum of each token's routed experts"
    return None


def _experts(module: nn.Module, activations: RoutedTokens, grad_output: torch.Tensor) -> dict[str, Term]:
    """Per-example terms of ``gate_up_proj`` and ``down_proj`` from the recorded routing (B, T, ...)."""
    x, index, weights = activations.hidden, activations.index, activations.weights
    # in the recorded tokens' dtype: float64 when a precise combination (DIFF2) records a float32 model in
    # float64
    gate_up, down = module.gate_up_proj.detach().to(x.dtype), module.down_proj.detach().to(x.dtype)
    num_experts, two_i, d = gate_up.shape
    inter = down.shape[2]
    batch, tokens, k = index.shape
    dtype = x.dtype
    g = grad_output.to(dtype)
    # gate_up: every route of token t has the input x_t; its gradient dh goes to the block of its expert
    # (a token's k routes are k different experts, so one row per token holds them all).
    left_gate_up = x.new_zeros(batch, tokens, num_experts, two_i)
    # down_proj: route (t, j) has input a_{t,j} and output gradient w_{t,j} g_t, in the block of its expert.
    left_down = x.new_zeros(batch, tokens, k, num_experts, d)
    right_down = x.new_zeros(batch, tokens, k, inter)
    for e in range(num_experts):
        b, t, j = torch.where(index == e)
        if not b.numel():
            continue
        with torch.enable_grad():
            h = F.linear(x[b, t], gate_up[e]).requires_grad_(True)
            a = _apply_gate(module, h)
        w = weights[b, t, j].to(dtype)[:, None]
        dout = g[b, t] * w
        da = F.linear(dout, down[e].t())
        (dh,) = torch.autograd.grad(a, h, grad_outputs=da)
        left_gate_up[b, t, e] = dh
        left_down[b, t, j, e] = dout
        right_down[b, t, j] = a.detach()
    terms: dict[str, Term] = {}
    if module.gate_up_proj.requires_grad:
        terms["gate_up_proj"] = OuterTerm(left=left_gate_up.reshape(batch, tokens, num_experts * two_i),
                                          right=x)
    if module.down_proj.requires_grad:
        terms["down_proj"] = OuterTerm(left=left_down.reshape(batch, tokens * k, num_experts * d),
                                       right=right_down.reshape(batch, tokens * k, inter))
    return terms


def _register() -> None:
    import importlib

    for prefix, module_name in _MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover -- a transformers without this family
            continue
        for suffix, rule in (("TopKRouter", _router), ("Experts", _experts)):
            layer_type = getattr(module, prefix + suffix, None)
            if layer_type is not None:
                register_grad_rule(layer_type)(rule)


_register()


@register_module_validator(nn.Module)
def _experts_form(name: str, module: nn.Module, options: ValidationOptions) -> list[ModuleProblem]:
    """A trainable experts module is checked when the engine attaches (layout and forward, once per class)."""
    if not is_experts(module) or not any(p.requires_grad for p in module.parameters(recurse=False)):
        return []
    problem = check_experts_forward(module)
    if problem is None:
        return []
    return [ModuleProblem(name,
                          f"{type(module).__name__}: {problem}, so its per-example gradient is unknown.",
                          "freeze it (requires_grad_(False) on gate_up_proj and down_proj), or train with "
                          "LoRA on the attention layers; set experts_implementation='eager' if another "
                          "kernel is selected.")]


# ------------------------------------------------------------------------------------ the engine's hooks
def recorded_output(module: nn.Module, output: object) -> object:
    """The tensor whose gradient a call's rule needs: a router returns (logits, weights, indices), its
    logits."""
    if isinstance(output, tuple) and output and is_router(module):
        return output[0]
    return output


def experts_verdict(tracer: BatchAxisTracer, module: nn.Module, inputs: tuple, output: torch.Tensor) -> str:
    """MERGED when the experts' tokens and routing share one traced token axis and the forward is row-wise
    (then the output carries that axis too); otherwise why not."""
    tags = [tracer.tag_of(t) for t in inputs[:3]]
    if len(tags) < 3 or tags[0] is None or tags[0][0] != 0 or tags[0][1] < 1:
        return "derives from the batch but lost its batch axis (flattened, reduced or mixed across examples)"
    if tags[1] != tags[0] or tags[2] != tags[0]:
        return (
            "is routed by indices or weights that do not carry the tokens' own axis (a router choosing "
            "tokens per expert over the batch, with a capacity limit or token dropping, makes one example's "
            "routing depend on the others)"
        )
    problem = check_experts_forward(module)
    if problem is not None:
        return f"is an experts module whose per-token form is not known: {problem}"
    tracer.tag(output, *tags[0])
    return MERGED if tags[0][1] > 1 else BATCH
