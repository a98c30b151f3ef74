"""Packed rows (padding-free batches): each example packed in a row is clipped and counted as its own example.

``transformers.DataCollatorWithFlattening`` concatenates the sampled examples into one row whose
``position_ids`` restart at every example. Per-example references in float64 (each example alone, ordinary
autograd), a DPTrainer step equal to ``-(1/B) sum_i clip(g_i)``, sensitivity in float32 (one example more
moves the pre-noise aggregate by at most C), micro-batches cut at example boundaries, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, flat, make_examples, reference_clipped_sum
from models import VOCAB, tiny_bert, tiny_decoder, tiny_gpt2
from transformers import DataCollatorWithFlattening

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.data.packing import PackedLayout, PackingError, packed_token_mean_loss
from hf_dpfilter.factory import make_private
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.proofs.batch_structure import probe_batch_structure
from hf_dpfilter.proofs.first_step_check import PerExampleCheckError

MODELS = {"gpt2": tiny_gpt2, "llama": lambda dtype=torch.float64: tiny_decoder("llama", dtype=dtype)}
# Llama computes its rotary tables in float32 inside a float64 model: an example alone and packed get them by
# differently shaped float32 kernels (~1e-8 relative). GPT-2 is float64 throughout.
ALONE_TOL = {"gpt2": 1e-10, "llama": 1e-6, "llama_lora": 1e-6}


def _llama_lora():
    from test_llama_family import lora_decoder

    return lora_decoder("llama")


def _alone_gradient(model, example, params):
    ids = example["input_ids"].unsqueeze(0)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = per_example_loss(logits, example["labels"].unsqueeze(0), causal_lm=True)
    grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def test_layout_is_the_collators_boundaries():
    examples = make_examples(4, VOCAB, causal=True, seed=2, min_len=1, max_len=6)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    layout = PackedLayout.from_position_ids(batch["position_ids"])
    assert layout.lengths == [len(e["input_ids"]) for e in examples]
    layout.check_flash_boundaries(batch)
    grouped = layout.regroup(batch["input_ids"].unsqueeze(-1)).squeeze(-1)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        assert torch.equal(grouped[i, :n], e["input_ids"]) and bool((grouped[i, n:] == 0).all())
    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, 3, int(batch["input_ids"].shape[1])], dtype=torch.int32))
    with pytest.raises(PackingError, match="cu_seq_lens_q"):
        layout.check_flash_boundaries(bad)


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_per_example_gradients_equal_each_example_alone_fp64(name):
    model = MODELS[name]()
    model.eval()
    examples = make_examples(5, VOCAB, causal=True, seed=1)
    batch = DataCollatorWithFlattening()(examples)
    layout = PackedLayout.from_position_ids(batch["position_ids"])
    engine = GhostClippingEngine(model)
    with engine.packed(layout), engine.record(batch_size=layout.num_examples):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        losses = packed_token_mean_loss(logits, batch["labels"], layout, shift=True)
    with engine.packed(layout):
        grads = engine.per_example_gradients(losses)
    params = engine.trainable_parameters
    norms = grads.norms()
    for i, example in enumerate(examples):
        reference = _alone_gradient(model, example, params)
        ref_norm = flat(reference).norm()
        assert abs(norms[i] - ref_norm) <= ALONE_TOL[name] * ref_norm, (name, i)
        indicator = torch.zeros(len(examples), dtype=torch.float64)
        indicator[i] = 1.0
        mine = grads.weighted_sum(indicator)
        got = flat([mine[p] for p in params])
        assert (got - flat(reference)).norm() <= ALONE_TOL[name] * ref_norm, (name, i)


def _args(tmp_path, n, micro=2, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=n, per_device_train_batch_size=micro, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


@pytest.mark.parametrize("name", [*MODELS, "llama_lora", "llama_flash_kwargs"])
def test_dptrainer_step_with_flattening_collator_equals_per_example_reference(name, tmp_path):
    """One DPTrainer step (q = 1, noise 0, micro-batches of 2 examples) on DataCollatorWithFlattening batches
    (with FlashAttention's boundary arguments and seq_idx too, recomputed per micro-batch)."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) if (
        name == "llama_flash_kwargs") else DataCollatorWithFlattening()
    name = "llama" if name == "llama_flash_kwargs" else name
    model = _llama_lora() if name == "llama_lora" else MODELS[name]()
    model.eval()
    examples = make_examples(5, VOCAB, causal=True, seed=3)
    _, norms = reference_clipped_sum(model, examples, True, max_grad_norm=1.0)
    clip = float(norms.median())  # some examples clipped, some not
    reference, _ = reference_clipped_sum(model, examples, True, clip)
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples), per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(examples), data_collator=collator)
    assert trainer._training_batch_structure().packed
    before = {p: p.detach().clone() for p in model.parameters() if p.requires_grad}
    trainer.train()
    expected = flat([-reference[p] / len(examples) for p in before])
    got = flat([p.detach() - before[p] for p in before])
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= ALONE_TOL[name], f"{name}: relative error {rel:.3e}"
    assert trainer.privacy_report()["steps"] == 1


@pytest.mark.parametrize("method", ["disk", "dicesgd"])
def test_other_methods_train_on_packed_rows(method, tmp_path):
    """Methods with several gradient points (DiSK: a functional call at other values) and DiceSGD on packed
    rows."""
    model = tiny_gpt2(dtype=torch.float32)
    examples = make_examples(8, VOCAB, causal=True, seed=6)
    trainer = DPTrainer(model=model,
                        args=_args(tmp_path, 4, dp_method=method, max_steps=2, noise_multiplier=0.5),
                        train_dataset=ListDataset(examples), data_collator=DataCollatorWithFlattening())
    trainer.train()
    assert trainer.accountant.steps == 2


def _packed_aggregate(examples, clip=0.5):
    """Pre-noise aggregate of one packed batch (float32 GPT-2, noise 0), through the DP optimizer."""
    model = tiny_gpt2(dtype=torch.float32)
    plan = PrivacyPlan.for_optimizer(method="dpsgd", method_args={}, noise_multiplier=0.0, per_sample_max_grad_norm=clip,
                                     expected_batch_size=4.0, sample_rate=0.5, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=0.5,
                                        verify_first_backward=False)
    batch = DataCollatorWithFlattening()(examples)
    layout = PackedLayout.from_position_ids(batch["position_ids"])

    def loss_fn(values):
        logits = engine.call_model(values, input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   use_cache=False).logits
        return packed_token_mean_loss(logits, batch["labels"], layout, shift=True) * 50.0  # clipping active

    with engine.packed(layout):
        optimizer.accumulate(engine, loss_fn, batch_size=layout.num_examples)
    local = optimizer._local_sums()
    return [local[p].detach().double() for p in optimizer.params], optimizer.sensitivity()


@pytest.mark.parametrize("where", ["end", "middle"])
def test_packed_sensitivity_one_example_moves_the_aggregate_by_at_most_c(where):
    examples = make_examples(6, VOCAB, causal=True, seed=5)
    extreme = make_examples(1, VOCAB, causal=True, seed=99, max_len=12)[0]
    with_x = examples + [extreme] if where == "end" else examples[:3] + [extreme] + examples[3:]
    without, delta = _packed_aggregate(examples)
    with_, delta_with = _packed_aggregate(with_x)
    assert delta == delta_with
    moved = sum(float((a - b).pow(2).sum()) for a, b in zip(with_, without)) ** 0.5
    # float32: the other examples' clipped sums are computed in differently shaped products (rounding ~1e-7)
    assert moved <= delta * (1 + 1e-5), f"aggregate moved by {moved:.6g} > C = {delta:.6g}"
    assert moved > 0.5 * delta  # the extreme example is clipped at (close to) C


def test_micro_batches_cut_at_example_boundaries_with_flash_kwargs():
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    examples = make_examples(5, VOCAB, causal=True, seed=4)
    structure = probe_batch_structure(collator, examples[0])
    assert structure.packed and {"input_ids", "labels", "position_ids"} <= structure.per_token
    assert structure.boundaries == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                                    "seq_idx"}
    batch = collator(examples)
    labels = batch.pop("labels")
    micro = structure.micro_batches(batch, labels, size=2, num_examples=5)
    assert [m[2].num_examples for m in micro] == [2, 2, 1]
    for k, (inputs, micro_labels, _layout) in enumerate(micro):
        expected = collator(examples[2 * k : 2 * k + 2])  # each micro-batch is what the collator packs for it
        assert torch.equal(micro_labels, expected["labels"])
        for key in expected:
            if key != "labels":
                got, want = inputs[key], expected[key]
                assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), key
    with pytest.raises(PackingError, match="given 4 examples"):
        structure.micro_batches(batch, labels, size=2, num_examples=4)


def test_packed_batch_with_attention_mask_is_refused():
    def collate(examples):
        batch = DataCollatorWithFlattening()(examples)
        # would make every example see the others
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    examples = make_examples(3, VOCAB, causal=True)
    structure = probe_batch_structure(collate, examples[0])
    batch = collate(examples)
    labels = batch.pop("labels")
    with pytest.raises(PackingError, match="attention_mask"):
        structure.micro_batches(batch, labels, size=2)


def test_packed_batch_without_position_ids_is_refused():
    collator = DataCollatorWithFlattening(return_position_ids=False)
    examples = make_examples(3, VOCAB, causal=True)
    structure = probe_batch_structure(collator, examples[0])
    batch = collator(examples)
    labels = batch.pop("labels")
    with pytest.raises(PackingError, match="position_ids"):
        structure.micro_batches(batch, labels, size=2)


def test_module_that_is_not_token_wise_on_packed_rows_is_refused():
    """BERT's pooler (and a classification head) sees one vector per row, not per token: refused by name."""
    model = tiny_bert()
    examples = make_examples(3, VOCAB, causal=True)
    batch = DataCollatorWithFlattening()(examples)
    layout = PackedLayout.from_position_ids(batch["position_ids"])
    engine = GhostClippingEngine(model, verify_first_backward=False)
    with engine.packed(layout), engine.record(batch_size=layout.num_examples):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        losses = logits.sum() * torch.ones(layout.num_examples, dtype=logits.dtype)
    with engine.packed(layout), pytest.raises(PackingError, match="'bert.pooler.dense'.*not token-wise"):
        engine.per_example_gradients(losses)
    with pytest.raises(PackingError, match="sequence-classification head"):
        packed_token_mean_loss(logits, batch["labels"], layout, shift=True)


@pytest.mark.parametrize("case", ["no cache", "synthetic probe", "per-example check"])
def test_attention_across_packed_examples_is_refused_before_the_first_step(case, tmp_path):
    """transformers keeps packed examples apart only without a cache; a forward that creates one
    (TrainingArguments(use_cache=True)) lets every example attend to those before it in the row. DPTrainer
    passes use_cache=False with packed rows. With that removed, the attention is caught before anything is
    released:
    first by the probe on synthetic tokens, and, with the probe removed too, by the per-example first-step
    check."""

    class LeakyTrainer(DPTrainer):
        def _no_cache_when_packed(self, micro_batch):
            return micro_batch  # the model then creates a cache (config.use_cache=True): attention crosses

    class LeakyUnprobedTrainer(LeakyTrainer):
        def _check_packed_attention(self, model):
            pass

    model = tiny_decoder("llama")
    examples = make_examples(4, VOCAB, causal=True, seed=3)
    cls = {"no cache": DPTrainer, "synthetic probe": LeakyTrainer,
           "per-example check": LeakyUnprobedTrainer}[case]
    trainer = cls(model=model, args=_args(tmp_path, len(examples), micro=4, use_cache=True),
                  train_dataset=ListDataset(examples), data_collator=DataCollatorWithFlattening())
    assert model.config.use_cache
    before = [p.detach().clone() for p in model.parameters()]
    if case == "no cache":
        trainer.train()
        assert trainer.accountant.steps == 1
        return
    error, match = (PackingError, "does not keep packed examples apart") if case == "synthetic probe" else (
        PerExampleCheckError, "couples examples")
    with pytest.raises(error, match=match):
        trainer.train()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert trainer.accountant.steps == 0


def test_encoder_whose_attention_ignores_packing_is_refused(tmp_path):
    """BERT's bidirectional mask ignores position_ids restarts: packed examples would attend to each other."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=40, pad_token_id=0,
                        hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForMaskedLM(config).double()
    model.cls.predictions.bias.requires_grad_(False)  # a bare bias parameter of the head has no rule
    examples = make_examples(4, VOCAB, causal=True, seed=3)
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples)), train_dataset=ListDataset(examples),
                        data_collator=DataCollatorWithFlattening())
    with pytest.raises(PackingError, match="does not keep packed examples apart.*padding collator"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_no_parameter_or_buffer_changes_outside_the_step(tmp_path):
    """The attention probe and the per-example check run forwards of their own: with learning rate 0 and noise
    0, nothing in the model (parameters, buffers) changes over a packed step."""
    model = tiny_decoder("llama")
    examples = make_examples(4, VOCAB, causal=True, seed=3)
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples), learning_rate=0.0),
                        train_dataset=ListDataset(examples), data_collator=DataCollatorWithFlattening())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.train()
    assert trainer.accountant.steps == 1 and trainer._per_example_checked and trainer._packing_checked
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", ["dpsgd", "disk", "doppler", "pmlf", "dicesgd", "diff2"])
def test_every_method_on_packed_rows_equals_the_padded_run(method, tmp_path):
    """Three steps of every method (noise 0, float64) on DataCollatorWithFlattening batches end at the same
    weights as on padded batches of the same examples: packed rows inherit each method's per-example
    sensitivity (DiSK/PMLF's functional calls at other weights, DiceSGD's feedback, DIFF2's differences across
    steps). The packed row (6 examples, 43 tokens) is longer than GPT-2's 40 positions while each example
    fits: it trains."""
    from helpers import PadCollator

    examples = make_examples(6, VOCAB, causal=True, seed=3)
    assert sum(len(e["input_ids"]) for e in examples) > 40 >= max(len(e["input_ids"]) for e in examples)
    weights = []
    for collator in (PadCollator(0), DataCollatorWithFlattening()):
        model = tiny_gpt2()
        args = _args(tmp_path, len(examples), micro=4, dp_method=method, max_steps=3,
                     per_sample_max_grad_norm=0.3,
                     learning_rate=0.5,
                     dp_method_args={"restart_every": 2, "difference_max_grad_norm": 2.0} if method == "diff2"
                     else None)
        DPTrainer(model=model, args=args, train_dataset=ListDataset(examples), data_collator=collator).train()
        weights.append(flat([p.detach() for p in model.parameters()]))
    padded, packed = weights
    assert (packed - padded).norm() <= 1e-10 * padded.norm()


def test_packed_example_longer_than_the_positions_is_refused(tmp_path):
    examples = make_examples(3, VOCAB, causal=True, seed=3, min_len=41, max_len=41)
    trainer = DPTrainer(model=tiny_gpt2(), args=_args(tmp_path, len(examples)),
                        train_dataset=ListDataset(examples),
                        data_collator=DataCollatorWithFlattening())
    with pytest.raises(ValueError, match="sequences of length 41, longer than the model's maximum of 40"):
        trainer.train()


class RowMixingForCausalLM(torch.nn.Module):
    """A custom causal LM (no config, no get_input_embeddings) whose token t reads the running mean of the
    whole row up to t, ignoring the position_ids restarts: each packed example reads the examples before
    it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, position_ids=None, **kwargs):
        hidden = self.embed(input_ids)
        steps = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
        return {"logits": self.head(hidden.cumsum(dim=1) / steps)}


@pytest.mark.parametrize("verify", [True, False])
def test_custom_model_the_attention_probe_cannot_run_on(tmp_path, verify):
    """The synthetic-token probe needs a vocabulary size; without one it used to pass silently, and with
    dp_verify_first_step=False nothing showed that the model mixes the examples of a row. Now: caught by the
    per-example check, or refused when that check is off."""
    examples = make_examples(4, VOCAB, causal=True, seed=3)
    trainer = DPTrainer(model=RowMixingForCausalLM(),
                        args=_args(tmp_path, 4, micro=4, dp_verify_first_step=verify),
                        train_dataset=ListDataset(examples), data_collator=DataCollatorWithFlattening())
    error, match = (PerExampleCheckError, "couples examples") if verify else (PackingError,
                                                                              "probe cannot run")
    with pytest.raises(error, match=match):
        trainer.train()
    assert trainer.accountant.steps == 0
