"""Per-layer rules for per-example gradients: the registry every layer type goes through.

A *rule* turns what a forward hook saw (the layer input ``A``) and what the backward produced (the gradient
``B`` of the layer output) into one :class:`Term` per parameter. A term is a compact description of the
per-example gradient of that parameter, from which the engine computes per-example norms (by the ghost
identity or by materializing, whichever is cheaper for this batch) and the weighted sum
``sum_i c_i * grad_i`` (book-keeping, so no second backward is needed).

Three kinds of term cover the layers real language models use:

* :class:`OuterTerm` -- ``G_i = sum_t left[i, t] (outer) right[i, t]``: ``nn.Linear`` (left = output
  gradient, right = input), GPT-2 ``Conv1D`` (the transpose: left = input, right = output gradient).
* :class:`IndexTerm` -- ``G_i = sum_t onehot(ids[i, t]) (outer) right[i, t]``: ``nn.Embedding``; rows equal
  to ``padding_idx`` are zeroed as PyTorch does.
* :class:`DenseTerm` -- the materialized per-example gradient ``(B, *param.shape)``: biases, LayerNorm,
  RMSNorm.

Tied weights (GPT-2's ``wte``/``lm_head``) are one parameter with an ``IndexTerm`` and an ``OuterTerm``;
the engine computes the cross term between them exactly.

Add a layer type with :func:`register_grad_rule`::

    @register_grad_rule(MyLayer)
    def _my_layer(module, activations, grad_output) -> dict[str, Term]:
        ...  # keys are the names of module's own (non-recursive) parameters
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DenseTerm",
    "IndexTerm",
    "OuterTerm",
    "Term",
    "UnsupportedLayerError",
    "find_grad_rule",
    "register_grad_rule",
    "registered_layer_types",
]


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives in a module type that has no per-example gradient rule."""


@dataclass
class OuterTerm:
    """Per-example gradient ``G_i = sum_t left[i,t] ⊗ right[i,t]``; left (B,T,P), right (B,T,Q)."""

    left: torch.Tensor
    right: torch.Tensor


@dataclass
class IndexTerm:
    """Per-example gradient ``G_i = sum_t e_{ids[i,t]} ⊗ right[i,t]``; ids (B,T) long, right (B,T,Q).

    ``num_rows`` is the number of rows of the parameter (the vocabulary size).
    """

    ids: torch.Tensor
    right: torch.Tensor
    num_rows: int


@dataclass
class DenseTerm:
    """Materialized per-example gradient of shape ``(B, *param.shape)``."""

    grad: torch.Tensor


Term = OuterTerm | IndexTerm | DenseTerm
GradRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, Term]]

_GRAD_RULES: dict[type, GradRule] = {}


def register_grad_rule(*layer_types: type) -> Callable[[GradRule], GradRule]:
    """Register a per-example gradient rule for one or more module types (decorator)."""

    def decorator(rule: GradRule) -> GradRule:
        for layer_type in layer_types:
            _GRAD_RULES[layer_type] = rule
        return rule

    return decorator


def find_grad_rule(module: nn.Module) -> GradRule | None:
    """The rule for ``module``'s exact type, else from a structural check (see "structural checks" below),
    else for the nearest registered base class, else None."""
    cls = type(module)
    if cls in _GRAD_RULES:
        return _GRAD_RULES[cls]
    decided, rule = _structural_rule(module)
    if decided:
        return rule
    for base in cls.__mro__[1:]:
        if base in _GRAD_RULES:
            return _GRAD_RULES[base]
    return None


def registered_layer_types() -> list[type]:
    return list(_GRAD_RULES)


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """View (B, d) as (B, 1, d) and (B, d1, ..., dk, d) as (B, T, d): every position counts as a token."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() > 3:
        return x.reshape(x.shape[0], -1, x.shape[-1])
    return x


@register_grad_rule(nn.Linear)
def _linear(module: nn.Linear, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    a = _as_tokens(activations)
    b = _as_tokens(grad_output)
    terms: dict[str, Term] = {}
    if module.weight.requires_grad:
        terms["weight"] = OuterTerm(left=b, right=a)
    if module.bias is not None and module.bias.requires_grad:
        terms["bias"] = DenseTerm(b.sum(dim=1))
    return terms


def _conv1d(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # transformers' Conv1D computes x @ W + b with W of shape (in, out): the transpose of nn.Linear.
    a = _as_tokens(activations)
    b = _as_tokens(grad_output)
    terms: dict[str, Term] = {}
    if module.weight.requires_grad:
        terms["weight"] = OuterTerm(left=a, right=b)
    if module.bias is not None and module.bias.requires_grad:
        terms["bias"] = DenseTerm(b.sum(dim=1))
    return terms


try:  # transformers is a dependency, but keep the registry importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D

    register_grad_rule(_HFConv1D)(_conv1d)
except ImportError:  # pragma: no cover
    pass


@register_grad_rule(nn.Embedding)
def _embedding(module: nn.Embedding, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    if not module.weight.requires_grad:
        return {}
    ids = activations.reshape(activations.shape[0], -1)
    right = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1])
    if module.padding_idx is not None:
        # PyTorch never updates the padding row; neither do we.
        right = right * (ids != module.padding_idx).unsqueeze(-1).to(right.dtype)
    return {"weight": IndexTerm(ids=ids, right=right, num_rows=module.num_embeddings)}


@register_grad_rule(nn.LayerNorm)
def _layer_norm(module: nn.LayerNorm, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
                                                                                                    Term]:
    terms: dict[str, Term] = {}
    batch = activations.shape[0]
    reduce_dims = tuple(range(1, activations.dim() - len(module.normalized_shape)))
    if module.weight is not None and module.weight.requires_grad:
        normalized = F.layer_norm(activations, module.normalized_shape, eps=module.eps)
        grad = (grad_output * normalized).sum(dim=reduce_dims) if reduce_dims else grad_output * normalized
        terms["weight"] = DenseTerm(grad.reshape(batch, *module.weight.shape))
    if module.bias is not None and module.bias.requires_grad:
        grad = grad_output.sum(dim=reduce_dims) if reduce_dims else grad_output
        terms["bias"] = DenseTerm(grad.reshape(batch, *module.bias.shape))
    return terms


# ------------------------------------------------------------------------------------------------ RMSNorm
# Every RMSNorm computes y = n(x) * s(w) with n(x) = x / sqrt(mean(x^2) + eps) over the last dimension(s), and
# either s(w) = w (torch.nn.RMSNorm, Llama, Mistral, Qwen2/3, Phi-3: "scale" form) or s(w) = 1 + w (Gemma,
# Gemma2: "offset" form). Both have the per-example weight gradient sum_t B_t * n(x_t). The rules recompute
# n(x) from the hooked input exactly as each forward does (transformers normalizes in float32 whatever the
# input dtype; the scale form casts n(x) back to the input dtype before the product, the offset form
# multiplies in float32), so the per-example sums add up to autograd's gradient to the last bit.


def _tokens_and_features(grad: torch.Tensor, batch: int, weight: torch.Tensor) -> torch.Tensor:
    """Sum ``grad`` (B, ..., *weight.shape) over every dimension between the batch and the weight's."""
    return grad.reshape(batch, -1, weight.numel()).sum(dim=1).reshape(batch, *weight.shape)


@register_grad_rule(nn.RMSNorm)
def _torch_rms_norm(module: nn.RMSNorm, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
                                                                                                      Term]:
    if module.weight is None or not module.weight.requires_grad:
        return {}
    normalized = F.rms_norm(activations, module.normalized_shape, None, module.eps)
    grad = grad_output * normalized
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _hf_rms_normalized(module: nn.Module, activations: torch.Tensor) -> torch.Tensor:
    """transformers' ``n(x)``, computed in float32 as its forwards do (the eps attribute name varies)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = module.eps
    x = activations.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _hf_scale_rms_norm(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
                                                                                                        Term]:
    # forward: weight * n(x).to(input_dtype)
    if not module.weight.requires_grad:
        return {}
    normalized = _hf_rms_normalized(module, activations).to(activations.dtype)
    grad = grad_output * normalized
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _hf_float32_scale_rms_norm(module: nn.Module, activations: torch.Tensor,
                               grad_output: torch.Tensor) -> dict[str, Term]:
    # forward: (n(x) * weight.float()).type_as(x) (Gemma 4): the product and its gradient are float32, so the
    # term stays float32 as in the offset form (a float64 term would be more accurate than autograd's own
    # gradient).
    if not module.weight.requires_grad:
        return {}
    grad = grad_output.to(torch.float32) * _hf_rms_normalized(module, activations)
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _hf_offset_rms_norm(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
        Term]:
    # forward: (n(x) * (1 + weight.float())).type_as(x): the product and its gradient are float32.
    if not module.weight.requires_grad:
        return {}
    # The term stays float32, the precision this forward gives the gradient (the engine's first-step check
    # compares at that precision).
    grad = grad_output.to(torch.float32) * _hf_rms_normalized(module, activations)
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _t5_rms_norm(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # forward: weight * (x * rsqrt(mean(x.float()^2) + eps)): only the statistic is float32, the product is in
    # x's dtype (float64 stays float64), so the scale form's all-float32 n(x) would be off by float32
    # rounding.
    if not module.weight.requires_grad:
        return {}
    variance = activations.to(torch.float32).pow(2).mean(-1, keepdim=True)
    grad = grad_output * (activations * torch.rsqrt(variance + module.variance_epsilon))
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _cohere_layer_norm(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
                                                                                                        Term]:
    # forward: (weight.float() * (x - mean(x)) * rsqrt(var(x) + eps)).to(input_dtype), all in float32, no
    # bias; the weight is (d,) or (heads, head_dim) for the QK norms, normalized over the last axis either
    # way. The term stays float32, the precision this forward gives the gradient.
    if not module.weight.requires_grad:
        return {}
    x = activations.to(torch.float32)
    centered = x - x.mean(-1, keepdim=True)
    normalized = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    grad = grad_output.to(torch.float32) * normalized
    return {"weight": DenseTerm(_tokens_and_features(grad, activations.shape[0], module.weight))}


def _no_norm(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # forward: x * weight + bias (MobileBERT's NoNorm), elementwise over the last axis.
    batch, terms = activations.shape[0], {}
    if module.weight.requires_grad:
        terms["weight"] = DenseTerm(_tokens_and_features(grad_output * activations, batch, module.weight))
    if module.bias.requires_grad:
        terms["bias"] = DenseTerm(_tokens_and_features(grad_output, batch, module.bias))
    return terms


def _register_importable(rule: GradRule, *qualified_names: str) -> None:
    """Register ``rule`` for each ``module.Class`` that this transformers version has (others are skipped)."""
    import importlib

    for qualified in qualified_names:
        module_name, _, class_name = qualified.rpartition(".")
        try:
            layer_type = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        register_grad_rule(layer_type)(rule)


_SCALE_FORM_RMS_NORMS = (
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm",
)
_OFFSET_FORM_RMS_NORMS = (
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm",
)
_T5_FORM_RMS_NORMS = (
    "transformers.models.t5.modeling_t5.T5LayerNorm",
    "transformers.models.mt5.modeling_mt5.MT5LayerNorm",
    "transformers.models.umt5.modeling_umt5.UMT5LayerNorm",
    "transformers.models.longt5.modeling_longt5.LongT5LayerNorm",
)
_register_importable(_hf_scale_rms_norm, *_SCALE_FORM_RMS_NORMS)
_register_importable(_t5_rms_norm, *_T5_FORM_RMS_NORMS)
_register_importable(_hf_offset_rms_norm, *_OFFSET_FORM_RMS_NORMS)
_register_importable(_cohere_layer_norm, "transformers.models.cohere.modeling_cohere.CohereLayerNorm",
                     "transformers.models.cohere2.modeling_cohere2.Cohere2LayerNorm")
_register_importable(_no_norm, "transformers.models.mobilebert.modeling_mobilebert.NoNorm")


# ------------------------------------------------------------------------------------ structural checks
# Layer classes are many (transformers has ~180 RMSNorm classes and ~36 scaled embeddings, one per model
# family) but their forwards are few. A module whose type has no rule gets one from a *structural check* when
# its parameters AND its forward match a known form:
#
# * RMSNorm-like: exactly one trainable parameter, a 1-D ``weight``, an ``eps`` or ``variance_epsilon``
#   attribute, and ``module.forward`` on a probe input equals the scale form ``w * n(x)`` or the offset form
#   ``n(x) * (1 + w)`` (checked once per class, on float64 copies of the probe and the module's weight);
# * scaled word embedding: an ``nn.Embedding`` subclass with an ``embed_scale`` attribute whose forward
#   equals ``embedding(ids) * embed_scale`` on a probe (Gemma's ``sqrt(hidden)``, BART's, ...);
# * added or multiplied vector: a leaf module with one 1-D parameter ``v`` whose forward equals ``x + v`` or
#   ``x * v`` on a probe, bit for bit (a layer scale, a learned bias added on its own).
#
# Anything else stays without a rule, and the engine refuses it (UnsupportedLayerError) rather than train it
# with a guessed gradient.


def _probe_rms_norm_form(module: nn.Module) -> tuple[bool, GradRule | None]:
    own = list(module.named_parameters(recurse=False))
    if len(own) != 1 or own[0][0] != "weight" or own[0][1].dim() != 1:
        return False, None
    if not isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float):
        return False, None
    weight = own[0][1]
    if weight.device.type == "meta":
        return False, None
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(2, 3, weight.shape[0], generator=generator).to(device=weight.device,
                                                                       dtype=weight.dtype)
    try:
        with torch.no_grad():
            out = module.forward(probe).to(torch.float32)
    except Exception:  # noqa: BLE001 -- a forward that fails on the probe is not a form we know
        return False, None
    normalized = _hf_rms_normalized(module, probe)
    w = weight.detach().to(torch.float32)
    low = weight.dtype in (torch.float16, torch.bfloat16)
    tolerance = {"rtol": 2e-2, "atol": 1e-2} if low else {"rtol": 1e-5, "atol": 1e-6}
    scale_form = out.shape == normalized.shape and torch.allclose(out, normalized * w, **tolerance)
    offset_form = out.shape == normalized.shape and torch.allclose(out, normalized * (1.0 + w), **tolerance)
    if scale_form == offset_form:  # neither form (both cannot hold: w and 1 + w differ by 1 everywhere)
        return False, None
    if not scale_form:
        return True, _hf_offset_rms_norm
    return True, _hf_float32_scale_rms_norm if _multiplies_in_float32(module) else _hf_scale_rms_norm


def _multiplies_in_float32(module: nn.Module) -> bool:
    """Whether a scale-form norm's product ``n(x) * w`` is float32 (``w.float()``, Gemma 4) rather than in the
    input's dtype (Llama): told apart, whatever the model's dtype, on a float64 copy with a weight that
    float32 does not represent, where the two products differ. A forward that fails on the copy keeps the
    input-dtype form (the first-step check then compares at float64 precision and refuses a float32 product by
    name)."""
    import copy

    generator = torch.Generator().manual_seed(1)
    try:
        probe_module = copy.deepcopy(module).to(torch.float64)
        dim = probe_module.weight.shape[0]
        with torch.no_grad():
            probe_module.weight.copy_(1.0 + torch.randn(dim, generator=generator, dtype=torch.float64) / 3)
            probe = torch.randn(2, 3, dim, generator=generator, dtype=torch.float64)
            out = probe_module.forward(probe)
    except Exception:  # noqa: BLE001 -- see the docstring
        return False
    normalized = _hf_rms_normalized(probe_module, probe)
    w = probe_module.weight.detach()
    in_float32 = (normalized * w.to(torch.float32)).to(torch.float64)
    in_input_dtype = normalized.to(torch.float64) * w
    return bool((out - in_float32).abs().max() < (out - in_input_dtype).abs().max())


def _scaled_embedding(module: nn.Embedding, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
        Term]:
    # forward: embedding(ids) * embed_scale, so d out / d row = embed_scale (in the weight's dtype, as there).
    scale = module.embed_scale
    scale = scale.to(module.weight.dtype) if isinstance(scale, torch.Tensor) else float(scale)
    return _embedding(module, activations, grad_output * scale)


def _probe_scaled_embedding(module: nn.Module) -> tuple[bool, GradRule | None]:
    """An ``nn.Embedding`` subclass with ``embed_scale`` is decided here: the scaled rule, or no rule at all
    (never ``nn.Embedding``'s, which would be off by the scale)."""
    if not isinstance(module, nn.Embedding) or not hasattr(module, "embed_scale"):
        return False, None
    ids = torch.arange(min(5, module.num_embeddings), device=module.weight.device).reshape(1, -1)
    try:
        with torch.no_grad():
            out = module.forward(ids)
            scale = module.embed_scale
            scale = scale.to(module.weight.dtype) if isinstance(scale, torch.Tensor) else float(scale)
            expected = F.embedding(ids, module.weight, module.padding_idx) * scale
        matches = out.shape == expected.shape and bool(torch.equal(out, expected))
    except Exception:  # noqa: BLE001 -- a forward that fails on the probe is not a form we know
        matches = False
    return True, (_scaled_embedding if matches else None)


def _own_vector(module: nn.Module) -> tuple[str, nn.Parameter] | None:
    """The module's one parameter (trainable or not) when it is 1-D, and the module has no sub-modules."""
    own = list(module.named_parameters(recurse=False))
    if len(own) != 1 or own[0][1].dim() != 1 or next(module.children(), None) is not None:
        return None
    return own[0]


def _added_vector(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str, Term]:
    # forward: x + v (v along the last dimension): d out / d v = 1 at every position
    name, param = _own_vector(module)
    if not param.requires_grad:
        return {}
    return {name: DenseTerm(_tokens_and_features(grad_output, grad_output.shape[0], param))}


def _scaled_by_vector(module: nn.Module, activations: torch.Tensor, grad_output: torch.Tensor) -> dict[str,
                                                                                                       Term]:
    # forward: x * v (a layer scale, v along the last dimension): d out / d v = x at every position
    name, param = _own_vector(module)
    if not param.requires_grad:
        return {}
    return {name: DenseTerm(_tokens_and_features(grad_output * activations, grad_output.shape[0], param))}


def _probe_added_or_scaled(module: nn.Module) -> tuple[bool, GradRule | None]:
    """A leaf module with one 1-D parameter ``v`` whose ``forward(x)`` equals ``x + v`` or ``x * v`` on a
    probe (a layer scale such as DINOv2's ``x * lambda1``, a learned bias added on its own): that form's rule;
    otherwise not decided (the module stays without a rule unless another check or a base class gives one)."""
    own = _own_vector(module)
    # a module with buffers is not probed: its forward might write them (running statistics) from the probe
    if (own is None or own[1].device.type == "meta" or not own[1].is_floating_point()
            or next(module.buffers(recurse=False), None) is not None):
        return False, None
    name, param = own
    generator = torch.Generator().manual_seed(0)
    probe, value = (torch.randn(*shape, generator=generator).to(device=param.device, dtype=param.dtype)
                    for shape in ((2, 3, param.shape[0]), (param.shape[0],)))
    try:  # at a random value of v (not the module's own, which may be 0 or 1): the form, not a coincidence
        with torch.no_grad():
            out = torch.func.functional_call(module, {name: value}, (probe,))
    except Exception:  # noqa: BLE001 -- a forward that fails on the probe is not a form we know
        return False, None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape or out.dtype != probe.dtype:
        return False, None
    if torch.equal(out, probe + value):
        return True, _added_vector
    if torch.equal(out, probe * value):
        return True, _scaled_by_vector
    return False, None


def vector_form(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> x + v`` or ``x -> x * v`` when ``module``'s rule is the added or multiplied vector's, else None
    (the engine checks each call's output against it: the probe shows the form of one call, not of every
    call)."""
    rule = find_grad_rule(module)
    if rule is not _added_vector and rule is not _scaled_by_vector:
        return None
    _, param = _own_vector(module)
    return (lambda x: x + param) if rule is _added_vector else (lambda x: x * param)


_STRUCTURAL_CHECKS = (_probe_scaled_embedding, _probe_rms_norm_form, _probe_added_or_scaled)
# per class, once matched: the forms are properties of the forward
_STRUCTURAL_RULES: dict[type, GradRule] = {}


def _structural_rule(module: nn.Module) -> tuple[bool, GradRule | None]:
    """(decided, rule): whether a structural check recognised ``module``'s kind, and the rule it found."""
    cls = type(module)
    if cls in _STRUCTURAL_RULES:
        return True, _STRUCTURAL_RULES[cls]
    for check in _STRUCTURAL_CHECKS:
        decided, rule = check(module)
        if decided:
            if rule is not None:
                _STRUCTURAL_RULES[cls] = rule
            return True, rule
    return False, None
