"""Mixtral and Qwen2-MoE full fine-tuning: routers, 3-D experts, the load-balancing loss.

Tiny configs (hidden 16, 2 layers, 4 experts, top-2; Qwen2-MoE with its shared expert and sigmoid gate). One
DPTrainer step at noise 0 in float64 equals the per-example reference (each example alone, its gradient
clipped, summed), padded on the right and on the left; with the load-balancing loss on, the reference is the
model's own ``outputs.loss`` (cross-entropy plus ``coef`` times its aux loss) for each example alone. The
experts' routing must carry the tokens' own axis: a routing weight normalised over the batch is refused by
name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import LeftPadCollator, ListDataset, PadCollator, flat, make_examples
from models import VOCAB
from test_model_families import COMMON, GQA, _args, _relative_error
from torch import nn

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.losses.router import add_router_aux_loss
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors

MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                      shared_expert_intermediate_size=20, decoder_sparse_step=1),
}


def moe_model(kind: str, dtype=torch.float64, experts: str | None = "eager", **overrides):
    """A tiny MoE causal LM; the eager experts run in float64 (the grouped-matmul kernel takes no float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **{**COMMON, **GQA, **MOE[kind], **overrides})
    if experts is not None:
        config._experts_implementation = experts
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


CASES = [(kind, side) for kind in MOE for side in ("right", "left")]


@pytest.mark.parametrize(("kind", "side"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_full_fine_tuning_step_equals_the_per_example_reference(kind, side, tmp_path):
    model = moe_model(kind)
    collator = LeftPadCollator(0) if side == "left" else PadCollator(0)
    assert _relative_error(model, tmp_path, "lm", collator) <= 1e-9


def test_default_experts_kernel_in_float32(tmp_path):
    """The experts kernel transformers selects by default (grouped matmuls where available) computes the same
    token-wise sum: its forward passes the engine's probe, and the step matches at float32's tolerance."""
    model = moe_model("mixtral", dtype=torch.float32, experts=None)
    assert _relative_error(model, tmp_path, "lm", PadCollator(0)) <= 1e-4


# ------------------------------------------------------------------------------------ load-balancing loss
def _model_loss_reference(model, examples, clip: float):
    """Each example alone through the model's own loss (cross-entropy + coef * load_balancing_loss_func)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for example in examples:
        batch = PadCollator(0)([example])
        loss = model(**batch).loss
        grads.append(flat(torch.autograd.grad(loss, params)))
    factors = clip_factors(torch.stack([g.norm() for g in grads]), clip)
    return sum(g * f for g, f in zip(grads, factors))


@pytest.mark.parametrize("kind", list(MOE))
def test_load_balancing_loss_is_computed_per_example(kind, tmp_path):
    model = moe_model(kind, output_router_logits=True, router_aux_loss_coef=0.5)
    examples = make_examples(5, VOCAB, causal=True, seed=3)
    # the per-example aux loss of an example alone is the model's own aux loss; in a padded batch, unchanged
    batch = PadCollator(0)(examples[:3])
    with torch.no_grad():
        together = add_router_aux_loss(model, model(**batch), batch, torch.zeros(3, dtype=torch.float64))
        for i, example in enumerate(examples[:3]):
            alone = model(**PadCollator(0)([example]))
            assert abs(float(together[i]) - 0.5 * float(alone.aux_loss)) <= 1e-7 * float(alone.aux_loss)
    expected = _model_loss_reference(model, examples, clip=0.5)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    DPTrainer(model=model, args=_args(tmp_path, 5, 0.5), train_dataset=ListDataset(examples),
              data_collator=LeftPadCollator(0)).train()
    got = -len(examples) * flat([p.detach() - b for p, b in zip(params, before)])
    assert float((got - expected).abs().max()) <= 1e-6
    assert float((got - expected).norm() / expected.norm()) <= 1e-6  # the model sums its aux loss in float32


# --------------------------------------------------------------------------------------- refused routing
class _BatchNormalisedRouting(nn.Module):
    """Mixtral's experts routed with weights normalised over all the tokens of the batch (as a capacity limit
    makes one token's routing depend on the others): the routing weights lose the tokens' axis."""

    def __init__(self, config):
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = MixtralExperts(config)
        nn.init.normal_(self.experts.gate_up_proj, std=0.1)
        nn.init.normal_(self.experts.down_proj, std=0.1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.embed(input_ids)
        flat_h = h.view(-1, 16)
        probs = F.softmax(self.gate(flat_h), dim=-1)
        weights, index = torch.topk(probs, 2, dim=-1)
        weights = weights.softmax(dim=0)  # over the batch's tokens
        out = self.experts(flat_h, index, weights).view_as(h)
        return {"logits": self.head(h + out)}


def test_routing_that_mixes_the_batch_is_refused_by_name(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("mixtral", **{**COMMON, **GQA, **MOE["mixtral"]})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = _BatchNormalisedRouting(config)
    examples = make_examples(4, VOCAB, causal=True, seed=3)
    trainer = DPTrainer(model=model, args=_args(tmp_path, 4), train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    with pytest.raises(RuntimeError, match=r"(?s)Module 'experts'.*routed by indices or weights that do not "
                                           r"carry"):
        trainer.train()


def test_trl_sft_on_mixtral_trains_with_trls_load_balancing_loss(tmp_path):
    """TRL turns the load-balancing loss on for MoE models (``router_aux_loss_coef`` unset: the model's own):
    the DPSFTTrainer trains it per example, with the DPSFTConfig's coefficient when given (before:
    refused)."""
    pytest.importorskip("trl")
    import datasets
    from test_sft import chat_rows, config
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dpfilter import DPSFTTrainer
    from recipes.common.offline_chat import byte_level_chat_tokenizer

    tokenizer = byte_level_chat_tokenizer()
    model_config = AutoConfig.for_model("mixtral",
                                        **{**COMMON, **GQA, **MOE["mixtral"], "vocab_size": len(tokenizer),
                                                     "pad_token_id": tokenizer.pad_token_id})
    model_config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config).double()
    trainer = DPSFTTrainer(model=model, args=config(tmp_path, 4, packing=False, router_aux_loss_coef=0.25),
                           train_dataset=datasets.Dataset.from_list(chat_rows(4)), processing_class=tokenizer)
    assert model.config.output_router_logits and trainer.router_aux_loss_coef == 0.25
    batch = PadCollator(tokenizer.pad_token_id)([{"input_ids": torch.tensor(trainer.train_dataset[0]["input_ids"]),
                                                  "labels": torch.tensor(trainer.train_dataset[0]["input_ids"])}])
    labels = batch.pop("labels")
    with torch.no_grad():
        alone = model(**batch)
        loss = trainer.compute_per_example_loss(model, batch, labels)
    expected = per_example_loss(alone.logits, labels, causal_lm=True) + 0.25 * alone.aux_loss
    assert abs(float(loss[0]) - float(expected[0])) <= 1e-6  # transformers sums the aux loss in float32
    trainer.train()
    assert trainer.accountant.steps == 1


def test_add_remove_sensitivity_of_the_clipped_sum(tmp_path):
    """float32, noise 0: adding one example moves the pre-noise clipped sum by at most C (routing per
    token)."""
    from test_declared_structure import ids_batch, sensitivity_ratio
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("mixtral", **{**COMMON, **GQA, **MOE["mixtral"], "num_labels": 2})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    ids, labels = ids_batch(4, 6, vocab=VOCAB)
    extra, extra_label = ids_batch(1, 6, vocab=VOCAB, seed=1)
    ratio = sensitivity_ratio(model, lambda m, inputs: m(**inputs).logits, {"input_ids": ids}, labels,
                              {"input_ids": extra}, extra_label)
    assert 0.5 < ratio <= 1.0 + 1e-4


def test_user_level_units_on_padded_rows_with_the_load_balancing_loss(tmp_path):
    """privacy_unit='user' (a user's rows concatenated per unit: the router on (B*T, d), the experts' routed
    tokens regrouped, zero past a unit's end): one step at noise 0, left padding, the aux loss on, equals each
    user's clipped sum of the model's own losses of its examples alone (it was refused as "packed rows")."""
    from test_units import _args as _user_args
    from test_units import _user_data

    model = moe_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    data = _user_data(n_users=3, per_user=(2, 1, 2))
    params = [p for p in model.parameters() if p.requires_grad]
    per_user: dict[str, torch.Tensor] = {}
    for e in data:
        loss = model(**PadCollator(0)([{k: v for k, v in e.items() if k != "user"}])).loss
        per_user[e["user"]] = per_user.get(e["user"], 0) + flat(torch.autograd.grad(loss, params))
    clip = float(torch.stack([v.norm() for v in per_user.values()]).median())
    expected = -sum(clip_factors(v.norm().reshape(1), clip)[0] * v for v in per_user.values()) / 3
    before = [p.detach().clone() for p in params]
    args = _user_args(tmp_path, per_sample_max_grad_norm=clip, logical_batch_size=3)
    DPTrainer(model=model, args=args, train_dataset=ListDataset(data),
              data_collator=LeftPadCollator(0)).train()
    got = flat([p.detach() - b for p, b in zip(params, before)])
    assert float((got - expected).norm() / expected.norm()) <= 1e-6  # the model sums its aux loss in float32


def test_diff2_difference_round_on_float32_experts_telescopes_to_gradient_descent(tmp_path):
    """DIFF2 records a float32 model's difference round in float64: the experts' rule recomputes in the
    recorded dtype (it crashed inside torch, float64 tokens against float32 experts). Noise 0, no clipping, q
    = 1, two micro-batches per step: restart then difference round equals two DP-SGD steps (the telescoping
    sum)."""
    import copy

    examples = make_examples(4, VOCAB, causal=True, seed=3)
    model = moe_model("mixtral", dtype=torch.float32, output_router_logits=True, router_aux_loss_coef=0.1)
    runs = []
    for method, extra in (("dpsgd", {}), ("diff2", {"dp_method_args": {"difference_max_grad_norm": 1e9}})):
        run = copy.deepcopy(model)
        args = DPTrainingArguments(
            output_dir=str(tmp_path), dp_method=method, noise_multiplier=0.0, per_sample_max_grad_norm=1e9,
            logical_batch_size=4, per_device_train_batch_size=2, max_steps=2, optim="sgd", learning_rate=0.1,
            lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
            remove_unused_columns=False, dp_seed=0, **extra)
        DPTrainer(model=run, args=args, train_dataset=ListDataset(examples),
                  data_collator=PadCollator(0)).train()
        runs.append(flat([p.detach() for p in run.parameters()]))
    start = flat([p.detach() for p in model.parameters()])
    assert float((runs[1] - runs[0]).norm() / (runs[0] - start).norm()) <= 1e-4
