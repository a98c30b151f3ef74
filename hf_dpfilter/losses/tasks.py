"""Per-example losses: each example's loss depends on that example only.

Hugging Face models average the loss over all tokens of the batch (and the Trainer rescales it by
``num_items_in_batch``), which couples examples: one long example would change everyone's weight. DP needs
one loss per example, so hf_dpfilter computes:

* sequence classification: the cross-entropy of the example (MSE for regression, mean binary
  cross-entropy over labels for multi-label problems);
* causal language modelling: the mean token cross-entropy over the example's own non-ignored label
  tokens, with the shift done inside the example (logits at t predict label t+1);
* token-level tasks without shift (token classification, masked LM): the mean over the example's own
  non-ignored tokens.

An example whose labels are all ``ignore_index`` has loss 0 (it contributes a zero gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def check_token_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse logits and labels that do not have one prediction per label token (never reshape them).

    PEFT's prompt tuning / P-tuning prepend virtual tokens to the logits of a causal LM but not to the labels:
    a reshape would pair each label with another position's prediction, a meaningless loss.
    """
    if logits.dim() != labels.dim() + 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"Per-example token loss: logits of shape {tuple(logits.shape)} and labels of shape "
            f"{tuple(labels.shape)} "
            "do not have one prediction per label token (the model adds or drops positions, as PEFT's prompt "
            "tuning / P-tuning prepend virtual tokens to the logits only). Pad the labels to the logits' "
            "length with -100 in an override of DPTrainer.compute_per_example_loss, or train without virtual "
            "tokens."
        )


def token_mean_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shift: bool,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy over each example's own valid tokens; logits (B,T,V), labels (B,T) -> (B,).

    ``label_smoothing`` is the Trainer's ``label_smoothing_factor`` (the smoothed cross-entropy of
    ``transformers.trainer_pt_utils.LabelSmoother``, token by token), averaged over the example's own tokens.
    """
    check_token_shapes(logits, labels)
    if shift:
        # Shift the labels, not the logits (the last position gets ignore_index): slicing or transposing the
        # (B, T, V) logits would copy them and run log-softmax over a strided axis, several times slower.
        labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # the loss in fp32 under bf16 autocast
    batch, steps = labels.shape
    token_losses = F.cross_entropy(
        logits.reshape(batch * steps, -1), labels.reshape(-1), ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing,
    ).view(batch, steps)
    valid = (labels != ignore_index).to(token_losses.dtype)
    return token_losses.sum(dim=1) / valid.sum(dim=1).clamp_min(1.0)


def confident_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy log(1 + sum_{j != y} exp(z_j - z_y)), whose value and gradient keep their
    relative precision when the example is classified confidently.

    The gradient: ``F.cross_entropy``'s gradient for the true class is softmax(z)_y - 1: for a loss L it
    cancels to about L and carries an error of an ulp of 1 (6e-8 in float32), so its direction is off by
    about 6e-8 / L (4e-3 at L = 6e-6, measured). Clipping normalises that gradient to norm C, so the error
    reaches the released contribution. Here the true class is not among the differences ``d_j = z_j - z_y``
    (no gradient path), so its gradient is -sum_{j != y} softmax_j, a sum of small positive terms: the
    direction stays within about 1e-7 however confident the example.

    The value: a log-sum-exp over ``[0, d]`` rounds ``1 + sum_j exp(d_j)`` to float32 first, an absolute
    error of an ulp of 1 (a relative one of about 6e-8 / L, the whole loss below 6e-8), so the same example's
    loss in two batch shapes differed by far more than the re-check's relative tolerance and only its
    gradient argument could pass it. Here ``L = m + log1p(expm1(-m) + sum_j exp(d_j - m))`` with the shift
    ``m = max(0, max_j d_j)`` (a constant: no gradient, as in any log-sum-exp): for a correctly classified
    example (``m = 0``) that is ``log1p(sum_j exp(d_j))``, exact to a few ulps of L however small. Equal to
    ``F.cross_entropy`` in exact arithmetic."""
    true_class = F.one_hot(labels, logits.shape[-1]).bool()
    differences = (logits - logits.gather(-1, labels[:, None])).masked_fill(true_class, float("-inf"))
    shift = differences.detach().amax(dim=-1).clamp_min(0.0)
    total = torch.exp(differences - shift[:, None]).sum(dim=-1)
    return shift + torch.log1p(torch.expm1(-shift) + total)


def sequence_classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None = None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-example loss for sequence classification/regression; logits (B,C) -> (B,)."""
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"Logits of shape {tuple(logits.shape)} and labels of shape {tuple(labels.shape)}: "
                         "one label per example is needed.")
    num_labels = logits.shape[-1]
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if label_smoothing and problem_type != "single_label_classification":
        raise ValueError(
            f"label_smoothing_factor={label_smoothing} applies to classification and token losses, not to "
            f"{problem_type} (the Trainer itself disables it for multi-label problems). Set "
            "label_smoothing_factor=0."
        )
    if problem_type == "regression":
        return (logits.squeeze(-1) - labels.to(logits.dtype).reshape(logits.shape[0])) ** 2
    if problem_type == "single_label_classification":
        flat_logits, flat_labels = logits.reshape(-1, num_labels), labels.reshape(-1)
        if label_smoothing:  # a run's setting, never the data's
            return F.cross_entropy(flat_logits, flat_labels, reduction="none",
                                   label_smoothing=label_smoothing)
        # row by row, never chosen by the other rows of the micro-batch: an ignored row has loss 0 and no
        # gradient, the others their own loss (in float32 under autocast: a scaled fp16 loss overflows); any
        # other label out of range is refused by one_hot
        ignored = flat_labels == IGNORE_INDEX
        if flat_logits.dtype in (torch.float16, torch.bfloat16):
            flat_logits = flat_logits.float()
        losses = confident_cross_entropy(flat_logits, torch.where(ignored, 0, flat_labels))
        return torch.where(ignored, torch.zeros_like(losses), losses)
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                                  reduction="none").mean(dim=-1)
    raise ValueError(f"Unknown problem_type {problem_type!r}.")


def per_example_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    causal_lm: bool,
    problem_type: str | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Dispatch on the shape of the logits: (B, C) sequence-level, (B, T, V) token-level."""
    if logits.dim() == 2:
        return sequence_classification_loss(logits, labels, problem_type, label_smoothing=label_smoothing)
    if logits.dim() == 3:
        return token_mean_loss(logits, labels, shift=causal_lm, label_smoothing=label_smoothing)
    raise ValueError(f"Cannot derive a per-example loss from logits of shape {tuple(logits.shape)}.")
