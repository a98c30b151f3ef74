"""Fewer kernels per step without changing what is clipped: layers that read the same input are fused, and
same-shape layers are stacked into one batched product (hf_dpfilter.engine.blocks: ``OuterBlock``).

A fused layer's squared norm is the sum of its parameters' squared norms, and a stacked block is L layers
computed as L times more rows, so per-example norms and weighted sums must equal the one-example-at-a-time
float64 reference with and without stacking, the clip must still hold under bf16, and with stacking the
number of operators in the norm and sum stage must not grow with the number of layers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import PadCollator, make_examples
from models import VOCAB, tiny_decoder, tiny_gpt2, tiny_roberta
from test_exactness import _lora_roberta
from test_precision import _adversarial_batch, _exact_norms
from transformers import RobertaConfig, RobertaForSequenceClassification

from hf_dpfilter.engine import GhostClippingEngine
from hf_dpfilter.engine import per_example as engine_module
from hf_dpfilter.losses.tasks import per_example_loss

MODELS = {
    "roberta": (tiny_roberta, False, 1),
    "gpt2_tied": (tiny_gpt2, True, 0),
    "llama": (lambda: tiny_decoder("llama"), True, 0),
    "roberta_lora": (_lora_roberta, False, 1),
}


def _batch(causal: bool, pad_id: int, n: int = 5):
    examples = make_examples(n, VOCAB, causal=causal, seed=3)
    return examples, PadCollator(pad_id)(examples)


def _losses(model, batch, causal):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return per_example_loss(out.logits, batch["labels"], causal_lm=causal)


def _engine_grads(model, batch, causal, stack: bool | None):
    engine = GhostClippingEngine(model, verify_first_backward=False, stack_layers=stack)
    with engine.record(batch_size=batch["input_ids"].shape[0]):
        losses = _losses(model, batch, causal)
    return engine, engine.per_example_gradients(losses)


def _reference(model, examples, causal):
    """Per-example gradients, one example at a time without padding: {param: (B, *shape)}."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = []
    for e in examples:
        ids = e["input_ids"].unsqueeze(0)
        labels = e["labels"].unsqueeze(0) if causal else torch.tensor([e["labels"]])
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        loss = per_example_loss(out.logits, labels, causal_lm=causal).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        per_example.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    return {p: torch.stack([g[k] for g in per_example]) for k, p in enumerate(params)}


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_and_stacked_layers_equal_the_per_example_reference(name, stack):
    build, causal, pad_id = MODELS[name]
    model = build()
    examples, batch = _batch(causal, pad_id)
    reference = _reference(model, examples, causal)
    _, grads = _engine_grads(model, batch, causal, stack)
    expected_norms = torch.sqrt(sum(g.reshape(len(examples), -1).pow(2).sum(dim=1)
                                    for g in reference.values()))
    torch.testing.assert_close(grads.norms(), expected_norms, rtol=1e-10, atol=1e-12)
    assert bool((grads.clipping_norms() >= expected_norms).all())
    coefficients = torch.linspace(-1.0, 2.0, len(examples), dtype=torch.float64)
    sums = grads.weighted_sum(coefficients, release=True)
    for param, per_example in reference.items():
        expected = torch.einsum("b,b...->...", coefficients, per_example)
        torch.testing.assert_close(sums[param], expected, rtol=1e-10, atol=1e-12)
        assert sums[param].shape == param.shape


def _block_of(engine, grads, suffix: str):
    name_of = {p: engine.parameter_name(p) for p in engine.trainable_parameters}
    for block in grads._blocks:
        names = [name_of[p] for p in block.params]
        if any(n.endswith(suffix) for n in names):
            return names
    raise AssertionError(f"no block holds *{suffix}")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp64", "bf16-autocast"])
def test_layers_reading_one_input_are_fused(autocast):
    examples, batch = _batch(False, 1)
    model = tiny_roberta(dtype=torch.float32 if autocast else torch.float64)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu",
                                                                                          enabled=False)
    engine = GhostClippingEngine(model, verify_first_backward=False)
    engine.stack_layers = False
    with context, engine.record(batch_size=len(examples)):
        losses = _losses(model, batch, False)
    grads = engine.per_example_gradients(losses.float() if autocast else losses)
    # under autocast each projection casts its input to bf16: the engine keeps one cast for the three
    names = _block_of(engine, grads, "layer.0.attention.self.query.weight")
    assert sorted(n.rsplit(".", 2)[-2] for n in names) == ["key", "query", "value"]
    # per layer: q/k/v fused, attention output, intermediate, output; then the classifier's dense and out_proj
    assert len(grads._blocks) == 2 * 4 + 2

    decoder = tiny_decoder("llama")
    engine, grads = _engine_grads(decoder, _batch(True, 0)[1], True, stack=False)
    assert sorted(n.rsplit(".", 2)[-2]
                  for n in _block_of(engine, grads, "layers.0.self_attn.q_proj.weight")) == [
        "k_proj", "q_proj", "v_proj"]
    assert sorted(n.rsplit(".", 2)[-2] for n in _block_of(engine, grads, "layers.0.mlp.up_proj.weight")) == [
        "gate_proj", "up_proj"]


def _roberta(layers: int) -> RobertaForSequenceClassification:
    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=40, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return RobertaForSequenceClassification(config).double()


_VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::narrow", "aten::slice",
          "aten::select",
          "aten::transpose", "aten::t", "aten::unsqueeze", "aten::squeeze", "aten::expand",
          "aten::as_strided",
          "aten::detach", "aten::alias", "aten::split", "aten::split_with_sizes", "aten::empty",
          "aten::lift_fresh",
          "aten::resolve_conj", "aten::resolve_neg", "aten::result_type"}


def _operators_of_norms_and_sums(layers: int, stack: bool) -> int:
    """Operators (views excluded) run by the norms and the clipped sum of one batch."""
    model = _roberta(layers)
    _, grads = _engine_grads(model, _batch(False, 1)[1], False, stack)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads.clipping_norms()
        grads.weighted_sum(torch.ones(grads.batch_size, dtype=torch.float64), release=True)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in _VIEWS
               and not e.key.startswith("aten::to") and not e.key.startswith("aten::_to_copy"))


def test_stacking_makes_the_operator_count_independent_of_depth():
    shallow, deep = _operators_of_norms_and_sums(2, True), _operators_of_norms_and_sums(6, True)
    assert shallow == deep, (shallow, deep)
    # without stacking the count grows with the layers (so the count above measures something)
    assert _operators_of_norms_and_sums(6, False) > _operators_of_norms_and_sums(2, False) + 50


def test_stacks_respect_the_memory_budget(monkeypatch):
    examples, batch = _batch(False, 1)
    reference = _engine_grads(_roberta(4), batch, False, stack=False)[1]
    unstacked = len(reference._blocks)
    monkeypatch.setattr(engine_module, "_STACK_MIN_BYTES", 1)
    monkeypatch.setattr(engine_module, "_STACK_SHARE", 0.0)
    _, grads = _engine_grads(_roberta(4), batch, False, stack=True)
    assert len(grads._blocks) == unstacked  # a budget below one layer stacks nothing
    monkeypatch.setattr(engine_module, "_STACK_SHARE", 1.0)
    _, grads = _engine_grads(_roberta(4), batch, False, stack=True)
    # one stack per layer shape (q/k/v, attention output, up, down); classifier
    assert len(grads._blocks) == 4 + 2
    assert max(b.left.shape[0] for b in grads._blocks) == 4
    torch.testing.assert_close(grads.norms(), reference.norms(), rtol=1e-12, atol=0)


def test_dropped_examples_are_zero_in_stacked_blocks():
    examples, batch = _batch(False, 1)
    model = _roberta(3)
    reference = _reference(model, examples, False)
    _, grads = _engine_grads(model, batch, False, stack=True)
    grads.norms()  # the narrow layers are materialized here; zeroing must reach them too
    drop = torch.tensor([False, True, False, False, True])
    grads.zero_examples(drop)
    assert grads.norms()[drop].abs().max() == 0
    sums = grads.weighted_sum(torch.ones(len(examples), dtype=torch.float64))
    for param, per_example in reference.items():
        torch.testing.assert_close(sums[param], per_example[~drop].sum(dim=0), rtol=1e-10, atol=1e-12)


class _TwoSquareLayers(torch.nn.Module):
    """Two same-shape projections (stacked together) and a scalar head, per-token signs as in the bf16
    tests."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(width, width)
        self.second = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(torch.tanh(self.first(x)))).squeeze(-1)


def test_bf16_clip_holds_for_stacked_layers_adversarial():
    x, signs = _adversarial_batch()
    model = _TwoSquareLayers(x.shape[2])
    engine = GhostClippingEngine(model, verify_first_backward=False)
    engine.stack_layers = True
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.record(batch_size=x.shape[0]):
        losses = (model(x) * signs).sum(dim=1)
    grads = engine.per_example_gradients(losses.float())
    assert any(b.left is not None and b.left.shape[0] == 2 and b.left.dtype == torch.bfloat16
               for b in grads._blocks)
    exact = _exact_norms(grads)
    assert bool((grads.clipping_norms().double() >= exact).all())


def test_autocast_inputs_are_held_once_and_outputs_unchanged():
    """Under autocast a Linear's input is cast once, before the layer: autograd saves that cast and the engine
    keeps the same tensor (no second copy), the q/k/v projections share it, and the outputs are
    bit-identical."""
    examples, batch = _batch(False, 1)
    model = tiny_roberta(dtype=torch.float32)

    def forward(engine=None):
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        recording = engine.record(batch_size=len(examples)) if engine else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack,
                lambda t: t):
            with recording:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits, saved

    plain_logits, plain_saved = forward()
    engine = GhostClippingEngine(model, verify_first_backward=False)
    logits, saved = forward(engine)
    assert torch.equal(logits, plain_logits)
    kept = {r.activations.untyped_storage().data_ptr() for r in engine._records
            if r.activations.is_floating_point()}
    assert kept <= set(saved), "the engine keeps an input that autograd does not save (a second copy)"
    assert sum(saved.values()) < sum(plain_saved.values())  # one cast for q, k and v instead of three


def test_trainer_passes_dp_stack_layers_to_the_engine(tmp_path):
    from helpers import ListDataset

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    for stack in (None, True, False):
        args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=4,
                                   per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to=[],
                                   dp_stack_layers=stack)
        trainer = DPTrainer(model=tiny_roberta(), args=args,
                            train_dataset=ListDataset(make_examples(8, VOCAB, False)),
                            data_collator=PadCollator(1))
        assert trainer.engine.stack_layers is stack


class _SharedInputs(torch.nn.Module):
    """Two GPT-2 Conv1D layers reading one input (fused on their left side, column blocks) and a Linear
    reading the same input (its input is on the right side: not fused with them)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.first = Conv1D(6, 8)
        self.second = Conv1D(5, 8)
        self.linear = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(15, 2)

    def forward(self, input_ids, attention_mask=None):
        from types import SimpleNamespace

        x = self.embed(input_ids)
        h = torch.cat([torch.tanh(self.first(x)), self.second(x), self.linear(x)], dim=-1)
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return SimpleNamespace(logits=self.head((h * mask).sum(1) / mask.sum(1)))


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_conv1d_layers_sharing_their_input_are_fused_by_columns(stack):
    model = _SharedInputs().double()
    examples, batch = _batch(False, 1)
    reference = _reference(model, examples, False)
    engine, grads = _engine_grads(model, batch, False, stack)
    fused = _block_of(engine, grads, "first.weight")
    assert sorted(fused) == ["first.weight", "second.weight"]
    assert _block_of(engine, grads, "linear.weight") == ["linear.weight"]
    expected_norms = torch.sqrt(sum(g.reshape(len(examples), -1).pow(2).sum(dim=1)
                                    for g in reference.values()))
    torch.testing.assert_close(grads.norms(), expected_norms, rtol=1e-10, atol=1e-12)
    coefficients = torch.linspace(0.5, 1.5, len(examples), dtype=torch.float64)
    sums = grads.weighted_sum(coefficients, release=True)
    for param, per_example in reference.items():
        torch.testing.assert_close(sums[param], torch.einsum("b,b...->...", coefficients, per_example),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(stack):
    """Sensitivity with fused and stacked layers: the clipped sum with and without example j differs by <=
    C."""
    from hf_dpfilter.optimizers.clipping import clip_factors

    max_grad_norm = 1e-3  # below every example's norm: each one is clipped
    examples, batch = _batch(False, 1)
    model = _roberta(3)
    sums = []
    for drop_index in (None, 2):
        _, grads = _engine_grads(model, batch, False, stack)
        if drop_index is not None:
            grads.zero_examples(torch.arange(len(examples)) == drop_index)
        factors = clip_factors(grads.clipping_norms(), max_grad_norm)
        sums.append(grads.weighted_sum(factors, release=True))
    moved = torch.sqrt(sum((sums[0][p] - sums[1][p]).pow(2).sum() for p in sums[0]))
    assert max_grad_norm * 0.99 < moved <= max_grad_norm * (1 + 1e-9)
