"""Per-example classification loss: torch's cross-entropy in value, its gradient precise for confident
examples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_dpfilter.losses.tasks import confident_cross_entropy, sequence_classification_loss


@pytest.mark.parametrize("num_labels", [2, 5])
def test_it_is_the_cross_entropy_with_its_gradient_in_float64(num_labels):
    generator = torch.Generator().manual_seed(0)
    logits = (8 * torch.randn(64, num_labels, generator=generator, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, num_labels, (64,), generator=generator)
    ours = confident_cross_entropy(logits, labels)
    reference = F.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    ours_grad, = torch.autograd.grad(ours.sum(), logits)
    reference_grad, = torch.autograd.grad(reference.sum(), logits)
    torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("margin", [12.0, 15.0])
def test_a_confident_examples_gradient_keeps_its_direction_in_float32(margin):
    """What clipping releases is the gradient's direction: torch's softmax - onehot cancels to the loss and
    turns its direction by about an ulp of 1 over the loss (4e-3 to 8e-2 at these margins)."""
    logits64 = torch.tensor([[margin / 2, -margin / 2, -margin / 2 - 1.0]], dtype=torch.float64,
                            requires_grad=True)
    labels = torch.tensor([0])
    exact, = torch.autograd.grad(F.cross_entropy(logits64, labels), logits64)
    exact = exact / exact.norm()
    worst = {"ours": 0.0, "torch": 0.0}
    generator = torch.Generator().manual_seed(1)
    for _ in range(100):  # the same logits up to float32 rounding, as two batch shapes compute them
        logits = (logits64.detach().float() + 1e-6 * torch.randn(1, 3, generator=generator)).requires_grad_()
        for name, loss in (("ours", confident_cross_entropy(logits, labels)),
                           ("torch", F.cross_entropy(logits, labels, reduction="none"))):
            grad, = torch.autograd.grad(loss.sum(), logits)
            worst[name] = max(worst[name], float((grad.double() / grad.double().norm() - exact).norm()))
    assert worst["ours"] < 1e-5 < 1e-3 < worst["torch"]


def test_smoothing_and_ignored_rows_keep_torchs_loss():
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, -100, 1])
    torch.testing.assert_close(sequence_classification_loss(logits, labels),
                               F.cross_entropy(logits, labels, reduction="none"))
    smoothed = sequence_classification_loss(logits, labels.clamp_min(0), label_smoothing=0.1)
    torch.testing.assert_close(smoothed, F.cross_entropy(logits, labels.clamp_min(0), reduction="none",
                                                         label_smoothing=0.1))


def test_a_rows_loss_never_depends_on_the_other_rows_of_the_micro_batch():
    """An ignored row, or any other row, never switches another row's loss to another formula: each row's
    loss and gradient are bit-identical in the micro-batch and alone (the re-check compares exactly that)."""
    generator = torch.Generator().manual_seed(2)
    logits = (10 * torch.randn(5, 3, generator=generator)).requires_grad_()
    labels = torch.tensor([0, 2, -100, 1, 0])
    together = sequence_classification_loss(logits, labels)
    grad_together, = torch.autograd.grad(together.sum(), logits)
    assert together[2] == 0 and torch.equal(grad_together[2], torch.zeros(3))
    for row in (0, 1, 3, 4):
        alone = sequence_classification_loss(logits[row : row + 1], labels[row : row + 1])
        grad_alone, = torch.autograd.grad(alone.sum(), logits)
        assert torch.equal(alone[0], together[row]) and torch.equal(grad_alone[row], grad_together[row])


@pytest.mark.parametrize("num_labels", [2, 4])
def test_a_confident_examples_loss_keeps_its_relative_precision_in_float32(num_labels):
    """The re-check compares an example's loss in its micro-batch and alone within 1e-4 relative: a loss that
    rounds by an ulp of 1 (a log-sum-exp over [0, d]) misses that by orders of magnitude below 1e-3 and is 0
    below 6e-8; this one stays within a few ulps of itself at every margin, misclassified examples included."""
    margins = torch.tensor([-30.0, -3.0, 0.0, 2.0, 9.0, 15.0, 30.0, 60.0, 80.0])
    logits = torch.zeros(len(margins), num_labels)
    logits[:, 0] = margins  # the true class 0 ahead of the others by the margin
    labels = torch.zeros(len(margins), dtype=torch.long)
    ours = confident_cross_entropy(logits, labels).double()
    # exact in float64 (F.cross_entropy there loses the loss to an ulp of the logit too, past a margin of 40)
    others = logits.double()[:, 1:] - logits.double()[:, :1]
    top = others.amax(dim=1).clamp_min(0)
    exact = top + torch.log1p(torch.expm1(-top) + torch.exp(others - top[:, None]).sum(dim=1))
    assert bool((exact > 0).all())
    relative = ((ours - exact).abs() / exact).max()
    assert relative < 1e-6, relative
    old_way = torch.logsumexp(torch.cat([torch.zeros(len(margins), 1), logits[:, 1:] - logits[:, :1]], 1), 1)
    assert float(((old_way.double() - exact).abs() / exact).max()) > 1e-2  # what the re-check used to see


def test_an_ignored_row_moves_nothing_even_with_extreme_logits():
    """A row labelled -100 (an added example with no label) has loss 0 and an exactly zero, finite gradient,
    whatever its logits, and every row's loss and gradient are bit-identical alone and in the micro-batch."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3) * 40
    logits[2] = torch.tensor([1e30, -1e30, 0.0])
    logits[3] = torch.tensor([-1e30, 1e30, 0.0])
    labels = torch.tensor([0, 1, -100, -100, 2, 0])
    logits.requires_grad_(True)
    together = sequence_classification_loss(logits, labels)
    grad_together, = torch.autograd.grad(together.sum(), logits)
    assert together[2:4].tolist() == [0.0, 0.0]
    assert bool((grad_together[2:4] == 0).all()) and bool(torch.isfinite(grad_together).all())
    for row in range(len(labels)):
        alone = sequence_classification_loss(logits[row : row + 1], labels[row : row + 1])
        grad_alone, = torch.autograd.grad(alone.sum(), logits)
        assert torch.equal(alone[0], together[row]) and torch.equal(grad_alone[row], grad_together[row])
