"""The MoE load-balancing loss per example: each example's own router probabilities and expert counts.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE; Switch Transformer eqs. 4-6) adds
``coef · E · sum_e f_e · P_e`` to the loss when ``output_router_logits`` is on, with ``f_e`` the share of the
batch's (unpadded) token routes that go to expert ``e`` and ``P_e`` its mean router probability, both over all
the tokens of the batch and all MoE layers: a batch statistic, through which one example would move every
other example's loss. The DPTrainer's losses are per example, so it computes the same formula per example,
over that example's own real tokens (its attention mask), and adds it to that example's loss: example ``i``'s
loss then depends on example ``i`` alone, and an example trained alone gets exactly the model's own loss
(its ``outputs.loss`` with labels and the router logits, which is how ``tests/engine/test_moe.py`` checks it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["add_router_aux_loss", "router_aux_loss_head"]


def router_aux_loss_head(model: nn.Module, coef: float | None = None) -> nn.Module | None:
    """The module that adds the load-balancing loss (it keeps ``router_aux_loss_coef``, ``num_experts`` and
    ``num_experts_per_tok``, as ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` do), if the loss is on: the
    config's ``output_router_logits`` and a non-zero coefficient (``coef`` if given, else the model's)."""
    for module in model.modules():
        if all(hasattr(module, name)
               for name in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")):
            config = getattr(module, "config", None)
            weight = module.router_aux_loss_coef if coef is None else coef
            return module if bool(getattr(config, "output_router_logits", False)) and bool(weight) else None
    return None


def add_router_aux_loss(model: nn.Module, outputs: Any, inputs: dict[str, Any], losses: torch.Tensor,
                        coef: float | None = None) -> torch.Tensor:
    """``losses`` (B,) plus each example's own load-balancing loss times ``coef`` (None: the model's
    coefficient, as its own forward uses; TRL's SFTTrainer passes its ``router_aux_loss_coef``), when the loss
    is on."""
    head = router_aux_loss_head(model, coef)
    router_logits = outputs.get("router_logits") if hasattr(outputs, "get") else None
    if head is None or not router_logits:
        return losses
    batch = losses.shape[0]
    mask = inputs.get("attention_mask")
    num_experts, top_k = int(head.num_experts), int(head.num_experts_per_tok)
    counts = probs_sum = rows = None
    for layer_logits in router_logits:  # each (B·T, E), the batch the major part of its rows
        logits = layer_logits.reshape(batch, -1, num_experts)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).sum(dim=-2).to(probs.dtype)
        real = torch.ones(logits.shape[:2], dtype=probs.dtype, device=probs.device) if mask is None else (
            mask.reshape(batch, -1).to(device=probs.device, dtype=probs.dtype))
        layer_counts = (chosen * real[..., None]).sum(dim=1)  # (B, E): this example's routes per expert
        layer_probs = (probs * real[..., None]).sum(dim=1)  # (B, E): its summed router probabilities
        layer_rows = real.sum(dim=1)  # (B,): its real tokens
        counts = layer_counts if counts is None else counts + layer_counts
        probs_sum = layer_probs if probs_sum is None else probs_sum + layer_probs
        rows = layer_rows if rows is None else rows + layer_rows
    rows = rows.clamp_min(1.0)  # an example without real tokens has no routes: its term is 0
    aux = (counts / rows[:, None] * (probs_sum / rows[:, None])).sum(dim=-1) * num_experts
    weight = head.router_aux_loss_coef if coef is None else coef
    return losses + float(weight) * aux.to(losses.dtype)
