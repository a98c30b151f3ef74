"""The privacy plan, the method registry, and the secrecy of the randomness (noise and batch membership)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert

from hf_dpfilter import DPTrainer, DPTrainingArguments, PrivacyPlan, make_dp_optimizer
from hf_dpfilter.factory import make_optimizer, make_sampler
from hf_dpfilter.optimizers.registry import METHOD_NAMES, method_names, method_spec
from hf_dpfilter.randomness.sampling import PoissonBatchSampler
from hf_dpfilter.randomness.secure_rng import derive_seed
from hf_dpfilter.trainers.arguments import DP_METHODS


def _args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                remove_unused_columns=False,
                noise_multiplier=1.0, logical_batch_size=4, max_steps=3, accountant="rdp", optim="sgd",
                learning_rate=0.1, logging_steps=1)
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, **kw) -> DPTrainer:
    examples = make_examples(24, VOCAB, causal=False, seed=1)
    return DPTrainer(model=tiny_bert(), args=_args(tmp_path, **kw), train_dataset=ListDataset(examples),
                     data_collator=PadCollator(0))


# ------------------------------------------------------------------------------ secret sampling
def _batches(plan: PrivacyPlan, epochs: int = 2) -> list[list[int]]:
    sampler = make_sampler(plan)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += list(sampler)
    return out


def test_secure_runs_with_the_same_seeds_draw_different_batches():
    common = dict(num_examples=400, logical_batch_size=40, epochs=2, noise_multiplier=1.0, seed=42)
    a = _batches(PrivacyPlan.create(secure_rng=True, **common))
    b = _batches(PrivacyPlan.create(secure_rng=True, **common))
    assert a != b
    sizes = [len(x) for x in a]
    assert 20 < sum(sizes) / len(sizes) < 60  # still Poisson with q = 0.1
    # seeded plans are reproducible from the (secret) seed, and only from it
    assert _batches(PrivacyPlan.create(**common)) == _batches(PrivacyPlan.create(**common))


def test_trainer_with_secure_rng_samples_from_the_os(tmp_path):
    trainers = [_trainer(tmp_path / str(i), secure_rng=True, dp_seed=7, seed=7) for i in range(2)]
    batches = []
    for trainer in trainers:
        sampler = trainer.get_train_dataloader().batch_sampler
        assert isinstance(sampler, PoissonBatchSampler) and sampler.secure
        batches.append([list(b) for b in sampler])
    assert batches[0] != batches[1]


@pytest.mark.parametrize("seed", [0, 1, 42, 2**40])
def test_sampler_and_noise_never_share_a_generator_state(seed):
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, noise_multiplier=1.0,
                              seed=seed)
    optimizer = make_optimizer(plan, [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    noise_state = optimizer._generator(torch.device("cpu")).get_state()
    sampler = make_sampler(plan)
    for epoch in range(5):
        sampler.set_epoch(epoch)
        assert not torch.equal(sampler.generator().get_state(), noise_state)
        assert derive_seed(seed, "poisson-sampler", epoch) != derive_seed(seed, "gaussian-noise")
    # and neither is torch's default generator seeded with the same value (dp_seed=0 used to collide)
    assert not torch.equal(torch.Generator().manual_seed(seed).get_state(), noise_state)


def test_dp_seed_defaults_to_a_fresh_secret_and_is_never_reported(tmp_path):
    a, b = _trainer(tmp_path / "a", seed=3), _trainer(tmp_path / "b", seed=3)
    assert a.privacy_plan.seed != b.privacy_plan.seed  # not derived from the published `seed`
    report = a.privacy_report()
    assert "secret" in report["randomness"] and "seed" not in json.dumps(a.privacy_plan.summary()).replace(
        "seeded generators", "").replace("DP seed", "").replace("the seed stays", "")
    assert str(a.privacy_plan.seed) not in json.dumps(report, default=str)
    assert "seed=" not in repr(a.privacy_plan)
    secure = _trainer(tmp_path / "c", secure_rng=True).privacy_report()
    assert "CSPRNG" in secure["randomness"]


# --------------------------------------------------------------------------------------- the plan
def test_the_trainer_reads_everything_from_one_frozen_plan(tmp_path):
    trainer = _trainer(tmp_path, dp_method="disk", target_epsilon=4.0, noise_multiplier=None,
                       dp_method_args={"kappa": 0.5}, num_train_epochs=2, max_steps=-1)
    plan = trainer.privacy_plan
    assert (trainer.planned_steps, trainer.sample_rate, trainer.noise_multiplier) == (plan.steps, 4 / 24,
                                                                                     plan.noise_multiplier)
    assert plan.steps == 2 * 6 and plan.config.kappa == 0.5
    assert plan.epsilon() <= 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps = 3
    trainer.train()
    assert trainer.dp_optimizer.plan is plan and trainer.accountant.steps == plan.steps
    assert trainer.privacy_report()["epsilon"] == pytest.approx(plan.epsilon(), rel=1e-6)


def test_the_null_plan_is_not_a_branch(tmp_path):
    trainer = _trainer(tmp_path, dp_method="none", noise_multiplier=None)
    assert not trainer.privacy_plan.is_private and trainer.engine is None
    assert trainer.privacy_plan.epsilon() == float("inf") and trainer.privacy_plan.history() == []
    trainer.train()
    assert trainer.dp_optimizer.method_name == "none" and trainer.accountant.steps == 0
    assert trainer.privacy_report()["epsilon"] == float("inf")


def test_dicesgd_counts_logical_steps_everywhere(tmp_path):
    trainer = _trainer(tmp_path, dp_method="dicesgd", max_steps=7,
                       dp_method_args={"error_max_grad_norm": 0.01})
    trainer.train()
    with open(tmp_path / "privacy_ledger.json") as f:
        ledger = json.load(f)
    assert ledger["steps"] == trainer.accountant.steps == trainer.privacy_report()["steps"] == 7
    assert sum(n for _, q, n in trainer.accountant.history if q == 1.0) == 7  # the two mechanisms, 7 each


# ------------------------------------------------------------------------------------ the registry
def test_one_list_of_methods():
    assert tuple(DP_METHODS) == METHOD_NAMES == tuple(method_names())
    field = {f.name: f for f in dataclasses.fields(DPTrainingArguments)}["dp_method"]
    assert tuple(field.metadata["choices"]) == METHOD_NAMES
    for name in METHOD_NAMES:
        spec = method_spec(name)
        assert spec.config_class.name == name == spec.optimizer_class.method_name


def test_the_clipping_norm_has_one_name_in_the_plan_the_optimizer_and_the_report():
    """``per_sample_max_grad_norm`` everywhere a user sees C (DPTrainingArguments' name); the plan's and the
    optimizer's retired ``max_grad_norm=`` is refused with it, never mapped."""
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, noise_multiplier=1.0,
                              per_sample_max_grad_norm=0.5, seed=0)
    assert plan.summary()["per_sample_max_grad_norm"] == 0.5 and "max_grad_norm" not in plan.summary()
    for build, where in ((lambda **kw: PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1,
                                                          noise_multiplier=1.0, **kw), "PrivacyPlan.create"),
                         (lambda **kw: PrivacyPlan.for_optimizer(noise_multiplier=1.0, sample_rate=0.1, **kw),
                          "PrivacyPlan.for_optimizer"),
                         (lambda **kw: make_dp_optimizer([torch.nn.Parameter(torch.zeros(2))], lr=0.1,
                                                         noise_multiplier=1.0, expected_batch_size=4, **kw),
                          "make_dp_optimizer")):
        with pytest.raises(ValueError, match=rf"{where}: 'max_grad_norm' was renamed "
                                             r"'per_sample_max_grad_norm'.*use per_sample_max_grad_norm="):
            build(max_grad_norm=0.5)
        build(per_sample_max_grad_norm=0.5)  # the fix the message names is accepted
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_grad_nrom'"):
        PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, noise_multiplier=1.0,
                           max_grad_nrom=0.5)


def test_no_top_level_fields_per_method_and_the_retired_names_are_refused_with_the_new_field(tmp_path):
    names = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    assert not any(n.startswith(("disk_", "doppler_", "pmlf_", "dice_", "diff2_")) for n in names)
    assert "secure_rng" in names and "secure_noise" not in names
    with pytest.raises(ValueError, match=r"'disk_kappa' is no longer "
                                         r"accepted.*dp_method='disk'.*dp_method_args=\{'kappa'"):
        _args(tmp_path, dp_method="disk", disk_kappa=0.6)
    with pytest.raises(ValueError, match=r"'disk_kappa' is no longer accepted.*dp_method='disk'"):
        _args(tmp_path, dp_method="dpsgd", disk_kappa=0.6)
    with pytest.raises(ValueError, match=r"'dice_accounting' is no longer "
                                         r"accepted.*dp_method_args=\{'accounting'"):
        _args(tmp_path, dp_method="dicesgd", dice_accounting="paper")
    with pytest.raises(ValueError, match=r"DPTrainingArguments: 'secure_noise' was renamed 'secure_rng'"):
        _args(tmp_path, secure_noise=True)
    with pytest.raises(ValueError, match="not a setting of dp_method='disk'"):
        # inside dp_method_args: field names
        _args(tmp_path, dp_method="disk", dp_method_args={"disk_kappa": 0.6})
    with pytest.raises(ValueError, match="not a setting of dp_method='disk'"):
        _args(tmp_path, dp_method="disk", dp_method_args={"kapa": 0.6})
    json_args = _args(tmp_path, dp_method="diff2", dp_method_args='{"restart_every": 4, '
        '"difference_max_grad_norm": 1}')
    assert json_args.dp_method_args == {"restart_every": 4, "difference_max_grad_norm": 1}


def test_methods_declare_their_mechanisms_as_data():
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=10, max_steps=25, method="diff2",
                              method_args={"restart_every": 5, "difference_max_grad_norm": 1.0},
                              target_epsilon=3.0)
    z1, z2 = plan.noise_multiplier, plan.noise.get("difference_noise_multiplier")
    assert [m.noise_multiplier for m in plan.mechanisms(0)] == [z1]
    assert [m.noise_multiplier for m in plan.mechanisms(3)] == [z2]
    assert sorted(plan.history()) == sorted([(z1, 0.1, 5), (z2, 0.1, 20)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = make_dp_optimizer([torch.nn.Parameter(torch.zeros(2))], method="dicesgd", lr=0.1,
                                      noise_multiplier=2.0, per_sample_max_grad_norm=1.0, expected_batch_size=4,
                                      sample_rate=0.1)
    assert len(optimizer.next_step_history()) == 2  # the clipped sum and the error feedback
