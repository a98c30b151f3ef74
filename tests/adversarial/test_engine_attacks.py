"""Adversarial review of issues 21 (engine side) and 22 (the run), through the public API only.

Each test is an attack that found a hole (now closed) or that adds coverage the other files lack:

* functional calls that mix the examples with no module to validate (``F.batch_norm`` in training,
  ``F.normalize`` over the batch, ``group_norm`` on a non-leading batch axis, ``cdist``/einsum pairings of two
  batch-derived tensors) are refused by the batch-axis tracer before release;
* PEFT tuners other than LoRA/DoRA/PEANuT/aLoRA/VeLoRA are refused by the trainable parameter's name (LoRA
  through ``target_parameters`` used to fail with "Nothing was recorded"); ``modules_to_save`` stays exact;
* a forward that writes state only on some steps (after the first, proving, step): every recorded step
  compares buffer and parameter identities and versions before its backward, so the write is refused before
  that step releases anything; transformers' dynamic rotary embeddings (which replace ``inv_freq`` from the
  longest position of the batch) and LongRoPE ones other than transformers' are refused at attach by a
  validator (transformers' LongRoPE is checked on each micro-batch instead); so is a trainable
  ``Embedding(scale_grad_by_freq=True)``;
* a module called once per forward in the proving step and, later, also on ``arange(T)`` with T == B no longer
  inherits the proven verdict;
* the run: a given ``dp_seed`` with a ClearML logger (it reads the fields one by one), a branch resumed into
  another ``output_dir`` (its ledger continues the origin's), a checkpoint without the DP optimizer's state
  (``save_only_model``), ``srun`` tasks without a process group, the training's memory metrics, and a new
  ``DPTrainer`` on parameters an earlier DP run of the process trained.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dpfilter import GhostClippingEngine, ModuleValidationError
from hf_dpfilter.factory import make_engine, make_optimizer
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.proofs.batch_axis import BATCH, SHARED
from hf_dpfilter.proofs.validators import StateWrittenError


# --------------------------------------------------------------------- state written after the first step
class _WritesLater(nn.Module):
    """Writes a buffer from the data only when an input is large: never on the first (proving) step."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.how = how
        self.register_buffer("peak", torch.zeros(3))

    def forward(self, x):
        if bool(x.abs().max() > 10):
            if self.how == "replaced":
                self.peak = x.detach().amax(0)
            elif self.how == "in_place":
                self.peak.copy_(x.detach().amax(0))
            else:  # through .data: its own version counter, the buffer's does not move
                self.peak.data.copy_(x.detach().amax(0))
        return self.proj(x)


@pytest.mark.parametrize("replace", ["in_place", "replaced", "through .data"])
def test_state_written_on_a_later_step_is_refused_before_that_step_releases(replace):
    torch.manual_seed(0)
    model = _WritesLater(replace)
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=0.0,
                              per_sample_max_grad_norm=1.0, seed=0)
    engine = make_engine(plan, model)
    optimizer = make_optimizer(plan, list(model.parameters()), base=torch.optim.SGD, lr=0.0)
    labels = torch.tensor([0, 1, 0, 1])

    def step(x):
        optimizer.accumulate(engine, lambda values: F.cross_entropy(model(x), labels, reduction="none"),
                             batch_size=4)

    step(torch.randn(4, 3))  # the proving step: nothing written
    optimizer.zero_grad()
    sums_before = {p: s.clone() for p, s in optimizer._local_sums().items()}
    outlier = torch.randn(4, 3)
    outlier[2, 1] = 50.0  # one private example large enough to make the forward write
    with pytest.raises(StateWrittenError, match=r"'peak'"):
        step(outlier)
    after = optimizer._local_sums()
    # nothing of that step entered the sums
    assert all(torch.equal(after[p], s) for p, s in sums_before.items())


def test_a_model_writing_no_state_passes_every_step():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = GhostClippingEngine(model)
    for seed in range(3):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
        with engine.record():
            loss = F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long), reduction="none")
        engine.per_example_gradients(loss)


# ------------------------------------------------------------------------------ data-dependent RoPE
def _llama(rope_type: str):
    import transformers

    params = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0, 1.0], long_factor=[2.0, 2.0], original_max_position_embeddings=8)
    config = transformers.LlamaConfig(
        vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=8, rope_parameters=params,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_data_dependent_rope_is_refused_at_attach_with_the_fix():
    with pytest.raises(ModuleValidationError, match=r"(?s)'model.rotary_emb'.*'dynamic'.*Fix: use a static"):
        GhostClippingEngine(_llama("dynamic"))


def test_a_longrope_embedding_other_than_transformers_is_refused_at_attach():
    """transformers' LongRoPE is accepted (each recorded micro-batch is checked against its original length,
    see tests/engine/test_llama_family.py); a module declaring rope_type 'longrope' whose forward is not
    transformers' update, so whose dependence on the batch is not known, stays refused."""

    class OwnLongRope(nn.Module):
        rope_type = "longrope"

        def forward(self, x, position_ids):
            return x

    model = nn.Sequential(nn.Linear(3, 3))
    model.add_module("rotary", OwnLongRope())
    with pytest.raises(ModuleValidationError, match=r"(?s)'rotary'.*'longrope'.*Fix: use a static"):
        GhostClippingEngine(model)


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "longrope"])
def test_static_rope_scalings_and_transformers_longrope_are_accepted_at_attach(rope_type):
    GhostClippingEngine(_llama(rope_type)).detach()


# ------------------------------------------------------------------- the seed through a field-by-field logger
def _trainer(out, callbacks=(), **extra):
    from helpers import ListDataset, PadCollator, make_examples
    from models import VOCAB, tiny_roberta

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    base = dict(
        output_dir=str(out), noise_multiplier=0.8, per_sample_max_grad_norm=0.5, logical_batch_size=4,
        per_device_train_batch_size=4, max_steps=2, optim="adamw_torch", learning_rate=0.01,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        accountant="rdp", remove_unused_columns=False, seed=7,
    )
    base.update(extra)
    return DPTrainer(model=tiny_roberta(), args=DPTrainingArguments(**base),
                     train_dataset=ListDataset(make_examples(16, VOCAB, causal=False, seed=11)),
                     data_collator=PadCollator(1), callbacks=list(callbacks))


def _clearml_callback():
    from transformers.integrations import ClearMLCallback

    # its __init__ needs clearml installed; its setup is below
    return ClearMLCallback.__new__(ClearMLCallback)


def test_clearml_reads_the_fields_one_by_one_so_a_given_dp_seed_is_refused(tmp_path):
    from dataclasses import fields

    from transformers.integrations import ClearMLCallback

    # What ClearMLCallback._copy_training_args_as_hparams uploads: every init field read with getattr.
    trainer = _trainer(tmp_path)
    hparams = {f.name: getattr(trainer.args, f.name) for f in fields(trainer.args) if f.init}
    assert "dp_seed" in hparams  # to_dict() drops it; a field-by-field copy does not
    assert ("fields(training_args)" in __import__("inspect").getsource(ClearMLCallback._copy_training_args_as_hparams))
    with pytest.raises(ValueError, match=r"(?s)ClearML.*dp_seed.*Leave dp_seed unset"):
        _trainer(tmp_path, callbacks=[_clearml_callback()], dp_seed=12345)
    # no seed
    _trainer(tmp_path, callbacks=[_clearml_callback()]).callback_handler.pop_callback(ClearMLCallback)


def test_a_clearml_callback_added_after_creation_is_refused_at_train(tmp_path):
    trainer = _trainer(tmp_path, dp_seed=12345)
    trainer.add_callback(_clearml_callback())
    with pytest.raises(ValueError, match=r"ClearML"):
        trainer.train()


# ------------------------------------------------------------------ a branch resumed into another output_dir
def test_a_branch_resumed_into_another_output_dir_counts_the_origin_ledger(tmp_path):
    import json

    origin, other = tmp_path / "a", tmp_path / "b"
    _trainer(origin, max_steps=6, save_strategy="steps", save_steps=2).train()
    branch = _trainer(other, max_steps=6, save_strategy="steps", save_steps=2)
    branch.train(resume_from_checkpoint=str(origin / "checkpoint-2"))
    # both models are released from the same data: the branch counts the origin's 6 steps and its own 4
    assert branch.accountant.steps == 6 + 4
    ledger = json.loads((other / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 10
    assert [s["steps_released"] for s in ledger["sessions"]] == [6, 4]
    assert ledger["continued_from"] == [str(origin / "privacy_ledger.json")]


# ------------------------------------------------------------ a checkpoint without the DP optimizer's state
def test_resuming_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    """``save_only_model=True`` (or a deleted optimizer.pt): the Trainer resumes the model and the step count
    but silently skips the optimizer, so the DP accountant would restart at 0 and leave the checkpoint's steps
    out."""
    _trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_only_model=True).train()
    assert not (tmp_path / "checkpoint-2" / "optimizer.pt").exists()
    trainer = _trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_only_model=True)
    with pytest.raises(ValueError, match=r"(?s)checkpoint.*step 2.*optimizer.pt.*save_only_model"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.dp_optimizer.dp_steps == 0  # nothing released


# ------------------------------------------------------------------------------- SLURM's srun as the launcher
def test_srun_tasks_without_a_process_group_are_refused_and_a_batch_script_is_not():
    from hf_dpfilter.distributed.processes import check_one_dp_run

    srun_task = {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    with pytest.raises(RuntimeError, match=r"(?s)launcher started 2 processes.*SLURM.*srun"):
        check_one_dp_run(1, srun_task, group_size=None)
    check_one_dp_run(2, srun_task, group_size=2)  # srun tasks joined in one group (WORLD_SIZE exported)
    # the batch script of `sbatch --ntasks 4` runs once: SLURM_NTASKS alone announces no processes
    check_one_dp_run(1, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, group_size=None)
    # srun starting one torchrun per node: the group is torchrun's (WORLD_SIZE), larger than the step's tasks
    check_one_dp_run(8, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "WORLD_SIZE": "8", "RANK": "5"},
                     group_size=8)


# ------------------------------------------------------------------------------- PEFT tuners (peft 0.21)
def _peft_configs():
    import peft

    query_value = ["query", "value"]
    return {
        "LoHa": lambda: peft.LoHaConfig(r=4, target_modules=query_value, init_weights=False),
        "LoKr": lambda: peft.LoKrConfig(r=4, target_modules=query_value, init_weights=False),
        "IA3": lambda: peft.IA3Config(target_modules=["query", "output.dense"],
                                      feedforward_modules=["output.dense"]),
        "OFT": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=query_value, init_weights=False),
        "BOFT": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=query_value, init_weights=False),
        "FourierFT": lambda: peft.FourierFTConfig(n_frequency=10, target_modules=query_value),
        "VeRA": lambda: peft.VeraConfig(r=4, target_modules=query_value),
        "AdaLoRA": lambda: peft.AdaLoraConfig(r=4, target_modules=query_value, total_step=10),
        "TrainableTokens": lambda: peft.TrainableTokensConfig(target_modules=["word_embeddings"],
                                                              token_indices=[3, 5]),
        "LoRA+trainable_token_indices": lambda: peft.LoraConfig(
            r=4, target_modules=query_value, trainable_token_indices={"word_embeddings": [3, 5]}),
        "LoRA on an Embedding": lambda: peft.LoraConfig(r=4, target_modules=["word_embeddings", "query"]),
        "LoRA target_parameters": lambda: peft.LoraConfig(
            r=4, target_modules=[], target_parameters=["attention.self.query.weight"]),
    }


@pytest.mark.parametrize("tuner", list(_peft_configs()))
def test_peft_tuners_without_a_per_example_rule_are_refused_by_name(tuner):
    """Each tuner keeps its trainable weights where no per-example rule reaches them (ParameterDicts of the
    layer, weights used by a parametrization): refused by the parameter's name, before anything is
    released."""
    from models import tiny_bert
    from peft import get_peft_model

    from hf_dpfilter.engine import UnsupportedLayerError

    model = get_peft_model(tiny_bert(dtype=torch.float32), _peft_configs()[tuner]())
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=0.0,
                              per_sample_max_grad_norm=1.0, seed=0)
    ids = torch.randint(1, 90, (4, 5))
    labels = torch.tensor([0, 1, 0, 1])
    with pytest.raises((UnsupportedLayerError, ModuleValidationError)) as refused:
        engine = make_engine(plan, model)
        optimizer = make_optimizer(plan, [p for p in model.parameters() if p.requires_grad],
                                   base=torch.optim.SGD,
                                        lr=0.0)
        optimizer.accumulate(engine, lambda values: F.cross_entropy(
            model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, labels, reduction="none"),
            batch_size=4)
    message = str(refused.value)
    assert "Trainable parameter" in message and "reeze" in message, message


# -------------------------------------------------------------------- functional ops that mix the examples
class _FunctionalMixer(nn.Module):
    """No BatchNorm module, no buffer: the examples are mixed by a functional call inside a forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.enc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.pair = nn.Linear(1, 2)

    def forward(self, x):
        h = self.enc(x)
        if self.kind == "F.batch_norm":
            return self.head(F.batch_norm(h, None, None, training=True))
        if self.kind == "torch.batch_norm":
            return self.head(torch.batch_norm(h, None, None, None, None, True, 0.1, 1e-5, False))
        if self.kind == "F.normalize(dim=0)":
            return self.head(F.normalize(h, dim=0))
        if self.kind == "F.group_norm on (T, B, C)":
            return self.head(F.group_norm(h.unsqueeze(0), 2).squeeze(0))
        if self.kind == "cdist (minibatch discrimination)":
            nearest = torch.cdist(h, h).topk(2, dim=1, largest=False).values[:, 1:]
            return self.head(h) + self.pair(nearest)
        if self.kind == "einsum bd,cd->bc":
            return self.head(h) + self.pair(torch.einsum("bd,cd->bc", h, h).amax(dim=1, keepdim=True))
        raise AssertionError(self.kind)


_MIXERS = ["F.batch_norm", "torch.batch_norm", "F.normalize(dim=0)", "F.group_norm on (T, B, C)",
           "cdist (minibatch discrimination)", "einsum bd,cd->bc"]


@pytest.mark.parametrize("kind", _MIXERS)
def test_functional_ops_that_mix_examples_are_refused_before_release(kind):
    """F.batch_norm in training moved the clipped sum by 1.23 C when one example was added (F.normalize over
    the batch: 1.10 C); cdist/einsum pairings coupled the examples. The tracer now marks their batch axis
    lost."""
    torch.manual_seed(0)
    model = _FunctionalMixer(kind)
    if "cdist" not in kind and "einsum" not in kind:
        model.pair.requires_grad_(False)
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=0.0,
                              per_sample_max_grad_norm=0.05, seed=0)
    engine = make_engine(plan, model)
    optimizer = make_optimizer(plan, [p for p in model.parameters() if p.requires_grad], base=torch.optim.SGD,
                               lr=0.0)
    x, labels = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.raises(RuntimeError, match=r"lost its batch axis.*Nothing was released"):
        optimizer.accumulate(engine, lambda values: F.cross_entropy(model(x), labels, reduction="none"),
                             batch_size=4)
    assert all(float(s.abs().sum()) == 0 for s in optimizer._local_sums().values())


def test_per_example_norms_and_products_stay_accepted():
    """Negative controls: statistics over each example's own features, eval-mode batch norm with stored
    statistics, attention-style products whose batch axes line up."""

    class PerExample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(3, 4)
            self.head = nn.Linear(4, 2)
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            h = self.enc(x)
            h = F.normalize(h, dim=-1) + F.layer_norm(h, (4,)) + F.group_norm(h, 2)
            h = h + F.batch_norm(h, self.mean, self.var, training=False)
            scores = (h.unsqueeze(1) @ h.unsqueeze(2)).squeeze(-1)  # (B, 1, 4) @ (B, 4, 1): per example
            return self.head(h * scores)

    model = PerExample()
    engine = GhostClippingEngine(model)
    x = torch.randn(4, 3)
    with engine.record():
        loss = F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1]), reduction="none")
    engine.per_example_gradients(loss)


# --------------------------------------------------------------------------- memory metrics of the training
def test_memory_metrics_are_not_published_without_the_opt_in(tmp_path):
    """skip_memory_metrics=False: the training's memory peaks grow with the longest padded Poisson micro-batch
    (one long example moves them): a noiseless statistic of the private batches, like total_flos."""
    import json

    trainer = _trainer(tmp_path, skip_memory_metrics=False)
    metrics = trainer.train().metrics
    assert not [k for k in metrics if "_mem_" in k], metrics
    trainer.save_state()  # output_dir/trainer_state.json, with the final metrics line
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["log_history"] and not [k for entry in state["log_history"] for k in entry if "_mem_" in k]
    opted_in = _trainer(tmp_path / "opt_in", skip_memory_metrics=False, dp_log_nonprivate_metrics=True)
    assert [k for k in opted_in.train().metrics if "_mem_" in k]


def test_embedding_scaling_gradients_by_batch_frequency_is_refused_at_attach():
    """scale_grad_by_freq=True: each row's gradient is divided by the token's count in the whole micro-batch
    (examples coupled); it used to stop at the first step with an unrelated "path the hooks do not see"
    error."""
    model = nn.Sequential(nn.Embedding(20, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(20, 2))
    with pytest.raises(ModuleValidationError, match=r"(?s)'0'.*scale_grad_by_freq=True.*Fix: build it with"):
        GhostClippingEngine(model)
    model[0].requires_grad_(False)  # frozen: its gradient is never used
    GhostClippingEngine(model).detach()


# ----------------------------------------------------------------- a second DPTrainer on an already DP model
def test_a_new_dptrainer_on_parameters_of_an_earlier_run_is_refused(tmp_path):
    """train() twice on one trainer is refused (run_guard); a NEW DPTrainer on the same model object used to
    run a fresh accountant: its epsilon left out the first run's steps, which the released model holds."""
    from helpers import ListDataset, PadCollator, make_examples
    from models import VOCAB

    from hf_dpfilter import DPTrainer

    first = _trainer(tmp_path / "one")
    first.train()
    second = DPTrainer(model=first.model, args=_trainer(tmp_path / "two").args,
                       train_dataset=ListDataset(make_examples(16, VOCAB, causal=False, seed=11)),
                       data_collator=PadCollator(1))
    with pytest.raises(ValueError, match=r"(?s)already received noisy steps from another DP run.*resum"):
        second.train()
    assert second.accountant.steps == 0
    for p in first.model.parameters():  # the documented opt-out for disjoint data accounted by hand
        p.__dict__.pop(DPTrainer.RELEASED_BY_ATTRIBUTE, None)
    third = DPTrainer(model=first.model, args=_trainer(tmp_path / "three").args,
                      train_dataset=ListDataset(make_examples(16, VOCAB, causal=False, seed=11)),
                      data_collator=PadCollator(1))
    third.train()
    assert third.accountant.steps == 2


# ---------------------------------------------------------- a call the proving step did not see, T == B
class _ExtraCallLater(nn.Module):
    """Calls its positional table on the batch's ids; when an id is 0 also on arange(T) (shared by every
    example).

    (A branch on the values: a branch on the shape is traced on its own step, the verdicts are kept per input
    shape.)"""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        h = self.pos(ids)
        if bool((ids == 0).any()):
            h = h + self.pos(torch.arange(ids.shape[1]))  # (T, 4): rows are positions, not examples
        return self.head(h.mean(1))


def test_an_extra_call_within_a_forward_does_not_inherit_the_proven_verdict_when_T_equals_B():
    torch.manual_seed(0)
    model = _ExtraCallLater()
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=0.0,
                              per_sample_max_grad_norm=1.0, seed=0)
    engine = make_engine(plan, model)
    optimizer = make_optimizer(plan, list(model.parameters()), base=torch.optim.SGD, lr=0.0)
    labels = torch.tensor([0, 1, 0, 1])

    def step(ids):
        optimizer.accumulate(engine, lambda values: F.cross_entropy(model(ids), labels, reduction="none"),
                             batch_size=4)

    step(torch.randint(1, 16, (4, 4)))  # proving step: one call of pos, on the batch ids
    optimizer.zero_grad()
    with_zero = torch.randint(1, 16, (4, 4))
    with_zero[1, 2] = 0
    with pytest.raises(RuntimeError, match=r"(?s)Module 'pos'.*was not seen by the step that proved"):
        step(with_zero)  # T == B == 4: the (T, 4) output looks batch-first
    assert all(float(s.abs().sum()) == 0 for s in optimizer._local_sums().values())
    optimizer.zero_grad()
    step(with_zero)  # proven again: the arange call's output is shared by every example (exact)
    assert engine._axis_verdicts[id(model.pos)] == [BATCH, SHARED]
