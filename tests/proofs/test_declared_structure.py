"""Engine side: which modules may mix examples or write state, and which tensors carry the batch
axis, are declared or proven, never guessed.

* the module-validator registry refuses, at attach, every module that mixes examples or writes state from the
  data (BatchNorm of every kind, InstanceNorm with running stats, Embedding(max_norm), PEFT variants), with
  one error naming each module and its fix; frozen BatchNorms can be held in eval mode through an option;
* the first recorded step refuses any parameter or buffer written by the forward (before anything is
  released), and any trainable parameter whose module was never called;
* the batch axis of each layer call is traced from the model's inputs: a shared table (``pos_emb(arange(T))``,
  T5's relative attention bias) is exact and within sensitivity when trainable (its output is shared
  by every example, hf_dpfilter.engine.shared_outputs), with T == B and T != B; the (1, T) broadcast stays
  exact;
* PEFT: PEANuT, aLoRA, VeLoRA and DoRA with a trainable magnitude are refused before the first step with the
  method, module and fix named; DoRA with a frozen magnitude is exact.

Sensitivity tests compare neighbouring batches D and D' = D plus one example at noise 0 in float32: the
clipped sum may move by at most C. Exactness tests compare with per-example gradients in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dpfilter import GhostClippingEngine, ModuleValidationError, register_module_validator
from hf_dpfilter.engine import UnsupportedLayerError
from hf_dpfilter.factory import make_engine, make_optimizer
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.proofs.validators import ModuleProblem, StateWrittenError

C = 0.05  # small enough that every example is clipped: the sums depend on every per-example norm


# ------------------------------------------------------------------------------------------------ helpers
def clipped_sum(model: nn.Module, forward, inputs: dict, labels: torch.Tensor,
                **engine_kwargs) -> list[torch.Tensor]:
    """The pre-noise sum of clipped per-example gradients (noise 0), on a copy of ``model``."""
    model = copy.deepcopy(model)
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=len(labels), epochs=1,
                              noise_multiplier=0.0,
                              per_sample_max_grad_norm=C, seed=0)
    engine = make_engine(plan, model, **engine_kwargs)
    optimizer = make_optimizer(plan, [p for p in model.parameters() if p.requires_grad], base=torch.optim.SGD,
                               lr=0.0)

    def loss_fn(values):
        out = forward(model, inputs) if not values else forward(lambda **kw: engine.call_model(values, **kw),
                                                                inputs)
        return F.cross_entropy(out, labels, reduction="none")

    optimizer.accumulate(engine, loss_fn, batch_size=len(labels))
    sums = optimizer._local_sums()
    engine.detach()
    return [sums[p].detach() for p in model.parameters() if p.requires_grad]


def reference_sum(model: nn.Module, forward, inputs: dict, labels: torch.Tensor) -> list[torch.Tensor]:
    """The same sum, one example at a time with autograd (the ground truth)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(labels)):
        one = {k: v[i : i + 1] for k, v in inputs.items()}
        loss = F.cross_entropy(forward(model, one), labels[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        factor = clip_factors(norm.reshape(1), C, "abadi")[0]
        for t, g in zip(total, grads):
            t += factor * g
    return total


def relative_error(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(ours, reference)) ** 0.5
    den = sum(float(b.double().norm()) ** 2 for b in reference) ** 0.5
    return num / den


def sensitivity_ratio(model: nn.Module, forward, inputs: dict, labels: torch.Tensor, extra: dict, extra_label,
                      **engine_kwargs) -> float:
    """||S(D') - S(D)|| / C for D' = D plus one example (add/remove neighbours)."""
    bigger = {k: torch.cat([v, extra[k]]) for k, v in inputs.items()}
    s = clipped_sum(model, forward, inputs, labels, **engine_kwargs)
    s2 = clipped_sum(model, forward, bigger, torch.cat([labels, extra_label]), **engine_kwargs)
    return sum(float((a - b).double().norm()) ** 2 for a, b in zip(s, s2)) ** 0.5 / C


def ids_batch(batch: int, length: int, vocab: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g), torch.randint(0, 2, (batch,), generator=g)


# --------------------------------------------------------------------------------------- static validators
class _Convolutional(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = norm
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.BatchNorm1d(4),
        lambda: nn.BatchNorm1d(4).requires_grad_(False),
        lambda: nn.BatchNorm1d(4, affine=False),
        lambda: nn.SyncBatchNorm(4),
        lambda: nn.LazyBatchNorm1d(),
    ],
    ids=["trainable", "frozen", "affine_false", "sync", "lazy"],
)
def test_batchnorm_is_refused_at_attach_with_the_fix(norm):
    with pytest.raises(ModuleValidationError, match=r"(?s)'norm'.*GroupNorm") as info:
        GhostClippingEngine(_Convolutional(norm()))
    assert [p.module_name for p in info.value.problems] == ["norm"]


def test_instance_norm_with_running_stats_and_embedding_max_norm_are_refused_in_one_error():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.InstanceNorm1d(4, track_running_stats=True),
                          nn.Linear(4, 2))
    with pytest.raises(ModuleValidationError) as info:
        GhostClippingEngine(model)
    message = str(info.value)
    assert "'0'" in message and "max_norm=None" in message
    assert "'1'" in message and "track_running_stats=False" in message
    # per-instance statistics and no renormalisation are fine
    GhostClippingEngine(nn.Sequential(nn.Embedding(10, 4), nn.InstanceNorm1d(4), nn.Linear(4, 2)))


def test_trainable_batchnorm_stays_refused_with_batchnorm_eval():
    with pytest.raises(ModuleValidationError, match="trainable"):
        GhostClippingEngine(_Convolutional(nn.BatchNorm1d(4)), batchnorm_eval=True)


def test_register_module_validator_is_public_and_runs_over_frozen_modules():
    class Counter(nn.Module):
        def forward(self, x):
            return x

    @register_module_validator(Counter)
    def _counter(name, module, options):
        return [ModuleProblem(name, "counts its inputs.", "remove it.")]

    model = nn.Sequential(nn.Linear(3, 3), Counter())
    with pytest.raises(ModuleValidationError, match=r"'1': counts its inputs. Fix: remove it."):
        GhostClippingEngine(model)


def _bn_forward(model, inputs):
    return model(inputs["x"])


def test_frozen_batchnorm_in_eval_mode_is_exact_and_writes_nothing():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4).requires_grad_(False)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    model = _Convolutional(norm).double()
    model.train()  # as the Trainer leaves it: the engine's record() puts the BatchNorm back in eval mode
    x = torch.randn(6, 4, dtype=torch.float64)
    labels = torch.randint(0, 2, (6,))
    before = norm.running_mean.clone()
    ours = clipped_sum(model, _bn_forward, {"x": x}, labels, batchnorm_eval=True)
    reference_model = copy.deepcopy(model).eval()
    assert relative_error(ours, reference_sum(reference_model, _bn_forward, {"x": x}, labels)) <= 1e-10
    assert torch.equal(norm.running_mean, before)
    ratio = sensitivity_ratio(model.float(), _bn_forward, {"x": x.float()}, labels, {"x": torch.randn(1, 4)},
                              torch.tensor([1]), batchnorm_eval=True)
    assert ratio <= 1.0


# ------------------------------------------------------------------------------ state written at run time
class _WritesBuffer(nn.Module):
    """A module no validator knows that keeps a running mean of its inputs."""

    def __init__(self, replace: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.replace = replace
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        if self.replace:
            self.seen = x.detach().mean(0)
        else:
            self.seen.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.proj(x)


@pytest.mark.parametrize("replace", [False, True], ids=["in_place", "replaced"])
def test_a_buffer_written_by_the_forward_is_refused_before_release(replace):
    model = nn.Sequential(_WritesBuffer(replace))
    with pytest.raises(StateWrittenError, match=r"'0.seen' \(module '0'\)"):
        clipped_sum(model, _bn_forward, {"x": torch.randn(4, 3)}, torch.randint(0, 2, (4,)))


class _WeightOutsideItsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.side = nn.Linear(3, 3)  # its weight is used by this module's forward, the Linear is never called

    def forward(self, x):
        return self.used(x @ self.side.weight)


def test_a_trainable_parameter_whose_module_is_never_called_is_refused_by_name():
    with pytest.raises(UnsupportedLayerError, match=r"(?s)'side.weight' \(module 'side'\).*Fix: freeze"):
        clipped_sum(_WeightOutsideItsModule(), _bn_forward, {"x": torch.randn(4, 3)},
                    torch.randint(0, 2, (4,)))


# ------------------------------------------------------------------------------------ batch axis, traced
class _PositionalModel(nn.Module):
    """Token embedding plus a learned positional table looked up with torch.arange(T) (shape (T,) or (1,
    T))."""

    def __init__(self, broadcast: bool, vocab: int = 20, dim: int = 8, max_len: int = 16) -> None:
        super().__init__()
        self.broadcast = broadcast
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])
        if self.broadcast:
            positions = positions.unsqueeze(0)
        return self.head(torch.tanh(self.tok(input_ids) + self.pos(positions)).mean(1))


def _ids_forward(model, inputs):
    return model(input_ids=inputs["input_ids"])


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("length", [4, 6], ids=["T==B", "T!=B"])
def test_a_positional_table_on_arange_is_exact_and_within_sensitivity(length, frozen):
    torch.manual_seed(0)
    model = _PositionalModel(broadcast=False)
    model.pos.requires_grad_(not frozen)
    ids, labels = ids_batch(4, length)
    ours = clipped_sum(model.double(), _ids_forward, {"input_ids": ids}, labels)
    assert relative_error(ours, reference_sum(model, _ids_forward, {"input_ids": ids}, labels)) <= 1e-10
    extra, extra_label = ids_batch(1, length, seed=1)
    assert sensitivity_ratio(model.float(), _ids_forward, {"input_ids": ids}, labels, {"input_ids": extra},
                             extra_label) <= 1.0


@pytest.mark.parametrize("length", [4, 6], ids=["T==B", "T!=B"])
def test_broadcast_positions_1_by_T_stay_exact_and_within_sensitivity(length):
    torch.manual_seed(0)
    model = _PositionalModel(broadcast=True).double()
    ids, labels = ids_batch(4, length)
    ours = clipped_sum(model, _ids_forward, {"input_ids": ids}, labels)
    assert relative_error(ours, reference_sum(model, _ids_forward, {"input_ids": ids}, labels)) <= 1e-10
    extra, extra_label = ids_batch(1, length, seed=1)
    # D' has 5 examples: with length 4 the table's output (1, 4, d) never equals the batch by accident either
    assert sensitivity_ratio(model.float(), _ids_forward, {"input_ids": ids}, labels, {"input_ids": extra},
                             extra_label) <= 1.0


def test_proven_verdicts_are_reused_on_later_steps():
    torch.manual_seed(0)
    model = _PositionalModel(broadcast=True).double()
    engine = GhostClippingEngine(model)
    for seed in range(3):
        ids, labels = ids_batch(4, 5, seed=seed)
        with engine.record(batch_size=4):
            losses = F.cross_entropy(model(ids), labels, reduction="none")
        engine.per_example_gradients(losses)
        assert engine._axis_verdicts is not None and engine._tracer is None


# ----------------------------------------------------------------------------------------------------- T5
def _tiny_t5_classifier(freeze_relative_bias: bool):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      feed_forward_proj="relu", pad_token_id=0, decoder_start_token_id=0)
    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = T5EncoderModel(config)
            self.head = nn.Linear(config.d_model, 2)

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.head(hidden.mean(1))

    model = Classifier()
    for name, param in model.named_parameters():
        # T5LayerNorm computes its variance in float32 even in a float64 model, which the structural RMSNorm
        # rule only matches to float32 accuracy: frozen here, so the float64 check is about the batch axes
        if "layer_norm" in name or (freeze_relative_bias and "relative_attention_bias" in name):
            param.requires_grad_(False)
    return model


def _t5_forward(model, inputs):
    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("length", [4, 6], ids=["T==B", "T!=B"])
def test_t5_relative_bias_is_exact_and_within_sensitivity(length, frozen):
    model = _tiny_t5_classifier(frozen).double()
    ids, labels = ids_batch(4, length)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    ours = clipped_sum(model, _t5_forward, inputs, labels)
    assert relative_error(ours, reference_sum(model, _t5_forward, inputs, labels)) <= 1e-10
    extra, extra_label = ids_batch(1, length, seed=1)
    ratio = sensitivity_ratio(model.float(), _t5_forward, {k: v for k, v in inputs.items()}, labels,
                              {"input_ids": extra, "attention_mask": torch.ones_like(extra)}, extra_label)
    assert ratio <= 1.0


# --------------------------------------------------------------------------------------------------- PEFT
def _bert_forward(model, inputs):
    return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


def _bert_inputs(batch: int, length: int, seed: int = 0):
    ids, labels = ids_batch(batch, length, vocab=90, seed=seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


def _peft_bert(config):
    from models import tiny_bert
    from peft import get_peft_model

    return get_peft_model(tiny_bert(dtype=torch.float64), config)


def test_peanut_is_refused_at_attach_naming_the_method_and_the_fix():
    from peft import PeanutConfig

    model = _peft_bert(PeanutConfig(r=4, target_modules=["query", "value"]))
    with pytest.raises(ModuleValidationError, match=r"(?s)attention.self.query'.*PEANuT.*weight matrix.*Fix: "
                                                    r"use LoRA"):
        GhostClippingEngine(model)


def test_velora_is_refused_at_attach_naming_the_method_and_the_fix():
    from peft import LoraConfig, VeloraConfig

    model = _peft_bert(LoraConfig(r=4, target_modules=["query", "value"],
                                  velora_config=VeloraConfig(num_groups=2)))
    with pytest.raises(ModuleValidationError, match=r"(?s)VeLoRA.*lora_velora_embed.*Fix: use plain LoRA"):
        GhostClippingEngine(model)


def test_alora_is_refused_at_attach_naming_the_method_and_the_fix():
    from models import tiny_gpt2
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["c_attn"], alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM")
    model = get_peft_model(tiny_gpt2(), config)
    with pytest.raises(ModuleValidationError, match=r"(?s)c_attn'.*aLoRA.*flattened.*Fix: use plain LoRA"):
        GhostClippingEngine(model)


def test_dora_with_a_trainable_magnitude_is_refused_naming_the_fix():
    from peft import LoraConfig

    model = _peft_bert(LoraConfig(r=4, target_modules=["query", "value"], use_dora=True))
    with pytest.raises(ModuleValidationError, match=r"(?s)lora_magnitude_vector.default'.*DoRA.*freeze the "
                                                    r"magnitude"):
        GhostClippingEngine(model)


@pytest.mark.parametrize("length", [4, 6], ids=["T==B", "T!=B"])
def test_dora_with_a_frozen_magnitude_is_exact_and_within_sensitivity(length):
    """DoRA's weight-norm path calls lora_A/lora_B on an identity matrix (no batch axis), but detached: it
    carries no gradient, so only the per-example calls count."""
    from peft import LoraConfig

    model = _peft_bert(LoraConfig(r=4, target_modules=["query", "value"], use_dora=True, lora_dropout=0.0,
                                  init_lora_weights=False))
    for name, param in model.named_parameters():
        if "lora_magnitude_vector" in name:
            param.requires_grad_(False)
    inputs, labels = _bert_inputs(4, length)
    ours = clipped_sum(model, _bert_forward, inputs, labels)
    assert relative_error(ours, reference_sum(model, _bert_forward, inputs, labels)) <= 1e-10
    extra, extra_label = _bert_inputs(1, length, seed=1)
    assert sensitivity_ratio(model.float(), _bert_forward, inputs, labels, extra, extra_label) <= 1.0


def test_plain_lora_stays_exact():
    from peft import LoraConfig

    model = _peft_bert(LoraConfig(r=4, target_modules=["query", "value"], lora_dropout=0.0,
                                  init_lora_weights=False))
    inputs, labels = _bert_inputs(4, 4)
    ours = clipped_sum(model, _bert_forward, inputs, labels)
    assert relative_error(ours, reference_sum(model, _bert_forward, inputs, labels)) <= 1e-10


def test_without_the_peft_validators_the_runtime_proof_still_refuses(monkeypatch):
    """Defence in depth: with the PEFT validators removed, the first recorded step still refuses VeLoRA (its
    buffer is written) and PEANuT at a micro-batch equal to the layer width (peanut_A is never called)."""
    from peft import LoraConfig, PeanutConfig, VeloraConfig

    import hf_dpfilter.proofs.validators as validators

    monkeypatch.setattr(validators, "_PEFT_REGISTERED", True)
    monkeypatch.setattr(validators, "_VALIDATORS", {
        k: v for k, v in validators._VALIDATORS.items() if not k.__module__.startswith("peft")})
    inputs, labels = _bert_inputs(16, 5)  # 16 == hidden size: rows of the weight would look like examples
    velora = _peft_bert(LoraConfig(r=4, target_modules=["query"], velora_config=VeloraConfig(num_groups=2)))
    with pytest.raises(StateWrittenError, match=r"lora_velora_embed.default' \(module "
                                                r"'.*query.lora_velora_embed'\)"):
        clipped_sum(velora, _bert_forward, inputs, labels)
    peanut = _peft_bert(PeanutConfig(r=4, target_modules=["query"]))
    with pytest.raises(UnsupportedLayerError, match=r"peanut_A.default.weight"):
        clipped_sum(peanut, _bert_forward, inputs, labels)


# ------------------------------------------------------------------------ DPTrainer: no state outside the
# step
class _PooledWithBatchNorm(nn.Module):
    """Embedding, mean pool, a frozen BatchNorm1d (with running stats) and a classifier, returning logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(90, 8)
        self.norm = nn.BatchNorm1d(8).requires_grad_(False)
        self.norm.running_mean.normal_()
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None):
        # pooled over the example's own tokens: a mean over the padded row would depend on the batch's longest
        # example
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        weights = mask.unsqueeze(-1).to(torch.float32)
        pooled = (self.embed(input_ids) * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return {"logits": self.head(self.norm(pooled))}


def _trainer(tmp_path, model, **overrides):
    from helpers import ListDataset, PadCollator, make_examples

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=0.5, logical_batch_size=4,
        per_device_train_batch_size=2, max_steps=3, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dp_seed=0,
        **overrides,
    )
    examples = make_examples(8, 90, causal=False, seed=3)
    return DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                     data_collator=PadCollator(0))


def test_dptrainer_refuses_batchnorm_unless_frozen_in_eval_mode(tmp_path):
    with pytest.raises(ModuleValidationError, match="dp_batchnorm_eval=True"):
        _trainer(tmp_path, _PooledWithBatchNorm())


def test_dptrainer_changes_no_parameter_or_buffer_outside_the_optimizer_step(tmp_path):
    """Snapshots at every step boundary: the forward/backward of a step writes nothing; the DP optimizer's
    step changes only the trainable parameters; nothing changes between steps."""
    from transformers import TrainerCallback

    model = _PooledWithBatchNorm()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    events = []

    def state():
        return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def changed(before):
        return {name for name, t in state().items() if not torch.equal(t, before[name])}

    class Watch(TrainerCallback):
        snapshot = None

        def on_step_begin(self, args, state_, control, **kwargs):
            if self.snapshot is not None:
                events.append(("between steps", changed(self.snapshot)))
            self.snapshot = state()

        def on_pre_optimizer_step(self, args, state_, control, **kwargs):
            events.append(("forward and backward", changed(self.snapshot)))

        def on_optimizer_step(self, args, state_, control, **kwargs):
            events.append(("optimizer step", changed(self.snapshot)))
            self.snapshot = state()

    trainer = _trainer(tmp_path, model, dp_batchnorm_eval=True)
    trainer.add_callback(Watch())
    trainer.train()
    assert sum(1 for what, _ in events if what == "optimizer step") == 3
    for what, names in events:
        if what == "optimizer step":
            assert names <= trainable and names, names  # the step moves trainable parameters only
        else:
            assert names == set(), (what, names)
    assert not model.norm.training  # held in eval mode although the Trainer calls model.train()


def test_a_first_step_of_one_example_does_not_fix_the_verdicts():
    """With batch 1 an explicit (1, T) position_ids input is indistinguishable from a batch input: the next
    step, with more examples, proves the axes again (and the broadcast is expanded, exactly)."""

    class ExplicitPositions(_PositionalModel):
        def forward(self, input_ids, position_ids):
            return self.head(torch.tanh(self.tok(input_ids) + self.pos(position_ids)).mean(1))

    torch.manual_seed(0)
    model = ExplicitPositions(broadcast=True).double()
    engine = GhostClippingEngine(model)
    for batch in (1, 4, 4):
        ids, labels = ids_batch(batch, 5, seed=batch)
        with engine.record(batch_size=batch):
            losses = F.cross_entropy(model(ids, torch.arange(5)[None]), labels, reduction="none")
        engine.per_example_gradients(losses)
    assert engine._axis_verdicts is not None


def _tiny_t5_seq2seq(freeze_relative_bias: bool):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1,
                      num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      feed_forward_proj="relu", pad_token_id=0, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    for name, param in model.named_parameters():
        if "layer_norm" in name or (freeze_relative_bias and "relative_attention_bias" in name):
            param.requires_grad_(False)  # layer norms: see _tiny_t5_classifier
    return model


def _seq2seq_forward(model, inputs):
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                decoder_input_ids=inputs["decoder_input_ids"])
    return out.logits[:, :, :2].mean(1)  # a per-example two-way score from the decoder's logits


def _seq2seq_inputs(batch: int, length: int, seed: int = 0):
    ids, labels = ids_batch(batch, length, seed=seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "decoder_input_ids": ids.flip(1)}, labels


@pytest.mark.parametrize("length", [4, 6], ids=["T==B", "T!=B"])
def test_t5_seq2seq_relative_bias_exact_when_trainable_and_when_frozen(length):
    inputs, labels = _seq2seq_inputs(4, length)
    for frozen in (False, True):
        model = _tiny_t5_seq2seq(frozen).double()
        ours = clipped_sum(model, _seq2seq_forward, inputs, labels)
        assert relative_error(ours, reference_sum(model, _seq2seq_forward, inputs, labels)) <= 1e-10
        extra, extra_label = _seq2seq_inputs(1, length, seed=1)
        assert sensitivity_ratio(model.float(), _seq2seq_forward, inputs, labels, extra, extra_label) <= 1.0


def test_a_head_on_each_examples_last_token_is_proven_per_example():
    """``hidden[torch.arange(B), lengths - 1]`` picks one row per example, in order: the head after it is per
    example (checked on the index values on the first step)."""

    class LastToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, input_ids, attention_mask):
            hidden = torch.tanh(self.tok(input_ids))
            last = attention_mask.sum(1) - 1
            return self.head(hidden[torch.arange(input_ids.shape[0]), last])

    torch.manual_seed(0)
    model = LastToken().double()
    ids, labels = ids_batch(4, 4)
    mask = torch.ones_like(ids)
    mask[2, -1] = 0
    forward = lambda m, inputs: m(inputs["input_ids"], inputs["attention_mask"])  # noqa: E731
    ours = clipped_sum(model, forward, {"input_ids": ids, "attention_mask": mask}, labels)
    assert relative_error(ours,
            reference_sum(model, forward, {"input_ids": ids, "attention_mask": mask}, labels)) <= 1e-10


@pytest.mark.parametrize("kind", ["batchnorm", "embedding_max_norm"])
def test_without_any_validator_the_first_step_still_refuses_the_written_state(monkeypatch, kind):
    """Defence in depth: with the registry emptied, the running statistics of a BatchNorm in train mode and
    the in-place renormalisation of Embedding(max_norm) are caught by the first step's version check."""
    import hf_dpfilter.proofs.validators as validators

    monkeypatch.setattr(validators, "_VALIDATORS", {})
    monkeypatch.setattr(validators, "_PEFT_REGISTERED", True)
    if kind == "batchnorm":
        model, inputs = _Convolutional(nn.BatchNorm1d(4).requires_grad_(False)), {"x": torch.randn(4, 4)}
        expected = r"'norm.running_mean' \(module 'norm'\) was written in place"  # by the kernel: no version
        forward = _bn_forward
    else:
        model = _PositionalModel(broadcast=True)
        model.tok = nn.Embedding(20, 8, max_norm=0.5)
        inputs, expected, forward = {"input_ids": ids_batch(4,
                5)[0]}, r"'tok.weight' \(module 'tok'\)", _ids_forward
    with pytest.raises(StateWrittenError, match=expected):
        clipped_sum(model, forward, inputs, torch.randint(0, 2, (4,)))


def test_a_broadcast_output_used_along_the_batch_axis_is_refused():
    """``pos(arange(T)[None])[0]`` picks the first copy of the expanded output: its gradient would all land on
    example 0. The first step sees the batch axis dropped from the expanded output and refuses the table."""

    class FirstCopy(_PositionalModel):
        def forward(self, input_ids):
            positions = self.pos(torch.arange(input_ids.shape[1]).unsqueeze(0))[0]
            return self.head(torch.tanh(self.tok(input_ids) + positions).mean(1))

    ids, labels = ids_batch(4, 5)
    with pytest.raises(RuntimeError, match=r"(?s)broadcast output of 'pos'.*Fix: freeze"):
        clipped_sum(FirstCopy(broadcast=True), _ids_forward, {"input_ids": ids}, labels)


def test_a_call_the_proving_step_did_not_see_is_refused_and_proven_on_the_next_step():
    """Verdicts are kept per module and call. A module proven with two kinds of call (a detached call on its
    own weight, as DoRA's weight norm makes, then the batch) that is called a third time later has no verdict
    for that call: refused by name (nothing released), and the next step proves again."""

    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)
            self.head = nn.Linear(3, 2)
            self.again = False

        def forward(self, x):
            scale = self.layer(self.layer.weight).detach().norm()  # no batch axis, no gradient
            h = self.layer(x) / scale
            if self.again:
                h = self.layer(h)
            return self.head(h)

    model = Repeated().double()
    engine = GhostClippingEngine(model, verify_first_backward=False)

    def step():
        x, labels = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
        with engine.record(batch_size=4):
            losses = F.cross_entropy(model(x), labels, reduction="none")
        return engine.per_example_gradients(losses)

    step()
    model.again = True
    with pytest.raises(RuntimeError, match=r"Module 'layer'.*was not seen by the step that proved"):
        step()
    assert step().squared_norms().shape == (4,)  # proven again, with the third call
    assert engine._axis_verdicts is not None and len(engine._axis_verdicts[id(model.layer)]) == 3


@pytest.mark.parametrize("reorder", ["flip", "index_select", "roll"])
def test_examples_reordered_before_a_trainable_layer_are_refused(reorder):
    """Rows reordered along the batch axis no longer match the examples: a layer after them is refused (its
    rows would be attributed to the wrong examples, splitting one example's gradient over several units)."""

    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            h = self.first(x)
            if reorder == "flip":
                h = h.flip(0)
            elif reorder == "index_select":
                h = h.index_select(0, torch.tensor([1, 0, 3, 2]))
            else:
                h = torch.roll(h, 1, 0)
            return self.head(h)

    with pytest.raises(RuntimeError, match=r"Module 'head'.*lost its batch axis"):
        clipped_sum(Reordered(), _bn_forward, {"x": torch.randn(4, 3)}, torch.randint(0, 2, (4,)))


@pytest.mark.parametrize("mix", ["matmul", "einsum"])
def test_a_product_summing_over_the_examples_loses_the_batch_axis_even_when_sizes_coincide(mix):
    """``h.T @ h`` and ``einsum('bd,be->de')`` sum over the examples; with d == B their result looks
    batch-first by shape. The trace follows the contracted axis, so the layer fed with it is refused. (A
    result like this added back to per-example rows keeps their batch axis: whether a computation couples
    examples is the validators' and the per-example independence check's business, not the axis trace's.)"""

    class Gram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = self.first(x)
            gram = h.T @ h if mix == "matmul" else torch.einsum("bd,be->de", h, h)
            return self.head(gram)  # (4, 4): the same shape as the batch

    with pytest.raises(RuntimeError, match=r"Module 'head'"):
        clipped_sum(Gram(), _bn_forward, {"x": torch.randn(4, 4)}, torch.randint(0, 2, (4,)))
