"""fp16 loss scaling (hf_dpfilter/trainers/loss_scaling.py) and what a swapped script shows at the start of
training.

* Scaling: the engine's backward on ``S * sum_i loss_i`` with S = 2^k gives, after S is divided out, the very
  norms and clipped sums of the unscaled run (bitwise in float64 and float32: scaling by 2^k commutes with
  every rounding); under fp16 autocast it recovers gradients that underflow unscaled; DPTrainer(fp16=True)
  equals the float64 per-example reference.
* Overflow: an example whose gradient overflows is zeroed per example, so whether the step is applied and the
  next scale are the same with and without it (neighbouring data sets); the scaler reads the noised gradient
  only, and a step it skips is still accounted.
* The start of training (hf_dpfilter/run/start_report.py): the plan's epsilon, delta, sigma, q and steps
  printed once; one warning when the learning rate or schedule is the non-private script's; one warning when
  the rows are fixed-length blocks of concatenated text (the unit is then a block, not a document).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples, reference_clipped_sum
from models import VOCAB, tiny_gpt2, tiny_roberta, tiny_tokenizer

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.factory import make_engine, make_optimizer
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.run.start_report import (
    announce_start,
    fixed_length_blocks,
    learning_rate_problems,
    plan_banner,
)
from hf_dpfilter.trainers.loss_scaling import DPLossScaler

LABELS = torch.tensor([0, 1, 1, 0])


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))


def _grads(model, ids, scale, autocast=False, loss_factor=1.0):
    engine = GhostClippingEngine(model, verify_first_backward=False)
    engine.loss_scale = scale
    ctx = torch.autocast("cpu", dtype=torch.float16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx, engine.record(batch_size=ids.shape[0]):
        losses = per_example_loss(model(input_ids=ids).logits, LABELS, causal_lm=False) * loss_factor
    grads = engine.per_example_gradients(losses)
    engine.detach()
    return grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scaled_norms_and_clipped_sums_equal_the_unscaled_ones_exactly(ids, dtype):
    model = tiny_roberta(dtype=dtype)
    plain, scaled = _grads(model, ids, 1.0), _grads(model, ids, 2.0**12)
    assert torch.equal(plain.clipping_norms(), scaled.clipping_norms())
    factors = (0.05 / plain.clipping_norms()).clamp(max=1.0)
    a, b = plain.weighted_sum(factors), scaled.weighted_sum(factors)
    assert all(torch.equal(a[p], b[p]) for p in a)


class _ArangePositions(torch.nn.Module):
    """A positional table on torch.arange(T): its output is SHARED by every example
    (engine/shared_outputs.py)."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Embedding(16,
                8), torch.nn.Linear(8, 2)

    def forward(self, input_ids):
        hidden = torch.tanh(self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1])))
        return type("Output", (), {"logits": self.head(hidden.mean(1))})


def test_scaled_shared_outputs_equal_the_unscaled_ones_exactly(ids):
    """The shared outputs' per-example terms are of S * g_i like every other term (S divided out once)."""
    torch.manual_seed(0)
    model = _ArangePositions().double()
    plain, scaled = _grads(model, ids, 1.0), _grads(model, ids, 2.0**12)
    assert torch.equal(plain.clipping_norms(), scaled.clipping_norms())
    a, b = plain.weighted_sum(torch.ones(4, dtype=torch.float64)), scaled.weighted_sum(torch.ones(4,
            dtype=torch.float64))
    assert all(torch.equal(a[p], b[p]) for p in a) and a[model.pos.weight].abs().sum() > 0


def test_a_scale_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        DPLossScaler(scale=1000.0)
    with pytest.raises(ValueError, match="power of two"):
        DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, fp16=True, dp_fp16_loss_scale=3.0,
                            use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="65504"):  # a power of two that makes a logit gradient of 1 overflow
        DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, fp16=True, dp_fp16_loss_scale=2.0**16,
                            use_cpu=True, report_to=[])


def test_fp16_with_a_stateful_method_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="desynchronise"):
        DPTrainingArguments(output_dir="unused", noise_multiplier=1.0, fp16=True, dp_method="disk",
                            use_cpu=True,
                            report_to=[])


def test_the_scale_recovers_fp16_gradients_that_underflow(ids):
    model = tiny_roberta(dtype=torch.float32)
    tiny = 2.0**-24  # a loss this small: its output gradients underflow in fp16 (below 2^-24) unscaled
    reference = _grads(model, ids, 1.0, autocast=False, loss_factor=tiny).norms() / tiny
    unscaled = _grads(model, ids, 1.0, autocast=True, loss_factor=tiny).norms() / tiny
    scaled = _grads(model, ids, 2.0**24, autocast=True, loss_factor=tiny).norms() / tiny
    assert ((unscaled - reference).abs() / reference).max() > 0.5  # lost to underflow (measured: all of it)
    assert ((scaled - reference).abs() / reference).max() < 5e-3  # fp16 rounding only (measured 4.1e-4)


def test_dptrainer_fp16_step_equals_the_per_example_reference(tmp_path):
    model = tiny_roberta()  # float64: the scaled path is exact, so the float64 tolerance applies
    model.eval()
    examples = make_examples(6, VOCAB, causal=False, seed=3)
    _, norms = reference_clipped_sum(model, examples, False, max_grad_norm=1.0)
    clip = float(norms.median())
    reference, _ = reference_clipped_sum(model, examples, False, clip)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=clip, logical_batch_size=6,
        per_device_train_batch_size=3, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        dp_seed=0,
        fp16=True, dp_fp16_loss_scale=2.0**12,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(1))
    before = {p: p.detach().clone() for p in model.parameters() if p.requires_grad}
    trainer.train()
    assert trainer.engine.loss_scale == 2.0**12 and trainer.accelerator.scaler is None
    got = flat([p.detach() - before[p] for p in before])
    expected = flat([-reference[p] / len(examples) for p in before])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-6
    assert trainer.privacy_report()["steps"] == 1


# ------------------------------------------------------------------------------------------------- overflow
class _Example(torch.nn.Module):
    """A linear model over one feature vector per example (exact per-example gradients, tiny)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x)


def _release(xs: torch.Tensor, overflow: list[int], noised_nonfinite: bool = False):
    """One DP step (sigma 1, the same secret seed) on the rows ``xs``; rows in ``overflow`` have an fp32 loss
    whose scaled gradient is inf. Returns (parameters after, applied?, next scale, accounted steps, seen)."""
    model = _Example()
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=1.0,
                              per_sample_max_grad_norm=1.0, seed=7)
    engine = make_engine(plan, model, verify_first_backward=False)
    optimizer = make_optimizer(plan, list(model.parameters()), base=torch.optim.SGD, lr=1.0)
    seen: list[dict] = []

    class Spy(DPLossScaler):
        def after_noise(self, noised):
            seen.append({p: g.clone() for p, g in noised.items()})
            if noised_nonfinite:
                noised = {p: g * float("inf") for p, g in noised.items()}
            return super().after_noise(noised)

    optimizer.loss_scaler = Spy(scale=2.0**10)
    weights = torch.ones(xs.shape[0])
    weights[overflow] = 1e36  # x S = inf in fp32: this example's scaled backward overflows
    labels = torch.zeros(xs.shape[0], dtype=torch.long)

    def loss_fn(values):
        out = engine.call_model(values, xs) if values else model(xs)
        return torch.nn.functional.cross_entropy(out, labels, reduction="none") * weights

    optimizer.accumulate(engine, loss_fn, batch_size=xs.shape[0])
    before = flat([p.detach().clone() for p in model.parameters()])
    optimizer.step()
    after = flat([p.detach() for p in model.parameters()])
    applied = not torch.equal(before, after)
    return after, applied, optimizer.loss_scaler.scale, optimizer.accountant.steps, seen, before


def test_an_overflowing_example_does_not_decide_whether_the_step_is_released():
    xs = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    without = _release(xs[:4], overflow=[])
    with_it = _release(xs, overflow=[4])  # the neighbouring data set: one more example, which overflows
    assert without[1] and with_it[1]  # applied in both
    assert without[2] == with_it[2] == 2.0**10  # the same next scale
    assert torch.equal(without[0], with_it[0])  # zeroed per example: the same released update
    assert without[3] == with_it[3] == 1


def test_the_scaler_reads_the_noised_gradient_and_a_skipped_step_is_accounted():
    xs = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    after, applied, scale, steps, seen, before = _release(xs, overflow=[])
    # what the scaler read is what SGD (lr 1) applied: the noised gradient, not the clipped sum
    assert torch.allclose(after, before - flat(list(seen[0].values())), atol=1e-6)
    after, applied, scale, steps, seen, before = _release(xs, overflow=[], noised_nonfinite=True)
    assert not applied and scale == 2.0**9  # a non-finite noised gradient: not applied, scale halved
    assert steps == 1  # released, so accounted
    assert torch.equal(after, before)


def test_the_loss_scale_is_kept_in_the_optimizer_checkpoint():
    model = _Example()
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=1.0,
                              per_sample_max_grad_norm=1.0, seed=7)
    optimizer = make_optimizer(plan, list(model.parameters()), base=torch.optim.SGD, lr=1.0)
    optimizer.loss_scaler = DPLossScaler(scale=2.0**8)
    state = optimizer.state_dict()
    other = make_optimizer(plan, list(model.parameters()), base=torch.optim.SGD, lr=1.0)
    other.loss_scaler = DPLossScaler()
    other.load_state_dict(state)
    assert other.loss_scaler.scale == 2.0**8



# ------------------------------------------------------------------------------------- the start of training
def _swapped_args(tmp_path, **overrides):
    """A non-private script's arguments after the swap: Trainer's defaults (adamw, lr 5e-5, linear) + DP
    flags."""
    settings = dict(output_dir=str(tmp_path), noise_multiplier=1.0, logical_batch_size=4,
                    per_device_train_batch_size=4,
                    accountant="rdp",
                    max_steps=2, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
                    dp_seed=0)
    settings.update(overrides)
    return DPTrainingArguments(**settings)


def _group_texts(documents: list[list[int]], block_size: int) -> dict:
    """run_clm's group_texts: concatenate the documents, cut the stream into blocks, labels = inputs."""
    stream = [t for doc in documents for t in doc]
    blocks = [stream[i:i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
            "labels": [list(b) for b in blocks]}


def test_a_swapped_clm_script_shows_the_plan_and_warns_once_for_the_lr_and_the_block_unit(tmp_path, caplog):
    import datasets
    from transformers import default_data_collator

    g = torch.Generator().manual_seed(5)
    documents = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
                 for n in torch.randint(5, 20, (8,), generator=g)]
    train = datasets.Dataset.from_dict(_group_texts(documents, block_size=8)).with_format("torch")
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=_swapped_args(tmp_path),
                        train_dataset=train, data_collator=default_data_collator)  # run_clm's
    with caplog.at_level(logging.WARNING,
                         logger="hf_dpfilter"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    banners = [r for r in caplog.records if "***** Differential privacy" in r.getMessage()]
    assert len(banners) == 1 and banners[0].levelno == logging.WARNING
    plan = trainer.privacy_plan
    for text in (f"epsilon = {plan.epsilon():.4g}", f"delta = {plan.delta:.3g}",
                 f"sigma = {plan.noise_multiplier:.4g}",
                 f"q = {plan.sample_rate:.4g}", "for 2 steps", "protected unit: one example"):
        assert text in banners[0].getMessage(), (text, banners[0].getMessage())
    lr = [str(w.message) for w in caught if "Settings left from a non-private script" in str(w.message)]
    assert len(lr) == 1 and "learning_rate=5e-05" in lr[0]
    blocks = [str(w.message) for w in caught if "fixed-length blocks" in str(w.message)]
    # no length read from the rows (a document's, when not blocks)
    assert len(blocks) == 1 and "8" not in blocks[0]


@pytest.mark.parametrize("verify", [True, False])
def test_the_banner_says_when_the_per_example_checks_are_off(verify, tmp_path):
    """dp_verify_first_step=False turns the first-step check and the re-checks off: the start banner says so,
    and what still holds (it was said nowhere at the start of such a run)."""
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                               logical_batch_size=4, per_device_train_batch_size=2, max_steps=2, report_to=[],
                               use_cpu=True, save_strategy="no", dp_verify_first_step=verify)
    trainer = DPTrainer(model=tiny_roberta(), args=args,
                        train_dataset=ListDataset(make_examples(8, VOCAB, False)),
                        data_collator=PadCollator(1))
    banner = plan_banner(trainer)
    assert ("per-example checks: off (dp_verify_first_step=False" in banner) is not verify, banner
    assert "protected unit: one example" in banner


@pytest.mark.parametrize(("overrides", "expected"), [
    (dict(learning_rate=1e-3, lr_scheduler_type="constant"), []),  # the measured DP settings: nothing to say
    (dict(learning_rate=1e-2, optim="sgd"), []),  # SGD's lr goes with C: not judged
    (dict(learning_rate=2e-5), ["learning_rate=2e-05"]),  # SFTConfig's default
    (dict(learning_rate=1e-3, warmup_steps=0.5), ["warmup of 50 of the 100"]),
])
def test_learning_rate_warning_only_for_non_private_settings(tmp_path, overrides, expected):
    problems = learning_rate_problems(_swapped_args(tmp_path, **overrides), steps=100)
    assert len(problems) == len(expected) and all(e in p for e, p in zip(expected, problems)), problems



def test_learning_rate_warning_judges_the_optimizer_the_run_uses(tmp_path):
    """A script's own optimizer (``optimizers=`` or ``optimizer_cls_and_kwargs``) runs at its own rate, not at
    ``args.learning_rate`` (Trainer's 5e-5 left as is): judged from the optimizer built, named as torch names
    it."""
    model = tiny_roberta(dtype=torch.float32)
    args = _swapped_args(tmp_path, lr_scheduler_type="constant")
    trainer = DPTrainer(model=model, args=args,
                        train_dataset=ListDataset(make_examples(4, VOCAB, causal=False)),
                        data_collator=PadCollator(1),
                        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-3), None))
    trainer.create_optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        announce_start(trainer)
    assert not caught, [str(w.message) for w in caught]
    problems = learning_rate_problems(args, 100, torch.optim.AdamW(model.parameters(), lr=2e-5))
    assert len(problems) == 1 and "learning_rate=2e-05 with adamw:" in problems[0], problems
    # args.optim's value, not the enum's name
    assert "optimizernames" not in learning_rate_problems(args, 100)[0]

def test_fixed_length_blocks_read_from_the_collator_only(tmp_path):
    """The block warning is decided by the script's code (a causal LM's collator that cannot pad: run_clm's
    default_data_collator), never by the rows, so whether it prints is no function of the private data."""
    from transformers import DataCollatorWithPadding, DefaultDataCollator, default_data_collator

    assert fixed_length_blocks(default_data_collator, causal_lm=True)
    assert fixed_length_blocks(DefaultDataCollator(), causal_lm=True)
    assert not fixed_length_blocks(default_data_collator, causal_lm=False)
    # pads: documents
    assert not fixed_length_blocks(DataCollatorWithPadding(tiny_tokenizer()), causal_lm=True)
    trainer = DPTrainer(model=tiny_roberta(dtype=torch.float32),
                        args=_swapped_args(tmp_path, learning_rate=1e-3),
                        train_dataset=ListDataset(make_examples(4, VOCAB, causal=False)),
                        data_collator=PadCollator(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        announce_start(trainer)  # DP settings and classification rows: nothing to warn about
    assert not caught, [str(w.message) for w in caught]


def test_add_remove_sensitivity_of_the_scaled_fp16_clipped_sum(ids):
    """float32 weights, fp16 autocast, S = 2^10, noise 0: removing one example moves the clipped sum by <=
    C."""
    model = tiny_roberta(dtype=torch.float32)
    clip = 1e-2

    def clipped_sum(rows):
        engine = GhostClippingEngine(model, verify_first_backward=False)
        engine.loss_scale = 2.0**10
        with torch.autocast("cpu", dtype=torch.float16), engine.record(batch_size=len(rows)):
            losses = per_example_loss(model(input_ids=ids[rows]).logits, LABELS[rows], causal_lm=False)
        grads = engine.per_example_gradients(losses)
        engine.detach()
        sums = grads.weighted_sum((clip / (grads.clipping_norms() + 1e-6)).clamp(max=1.0))
        return flat([sums[p].double() for p in model.parameters()])

    full = clipped_sum([0, 1, 2, 3])
    for removed in range(4):
        rest = clipped_sum([i for i in range(4) if i != removed])
        assert (full - rest).norm().item() / clip <= 1 + 1e-4, removed


# ------------------------------------------------------------------------------ fp16 asked for another way
def test_accelerate_fp16_environment_is_the_fp16_run(tmp_path, monkeypatch):
    """`accelerate launch --mixed_precision fp16` (ACCELERATE_MIXED_PRECISION=fp16) without fp16=True: the
    method check applies, and the run gets the DP loss scaler in place of Accelerate's GradScaler (put back
    here as Accelerate does on CUDA: kept, its step wrapper reads the empty p.grad and fails inside torch)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION=fp16"):
        _swapped_args(tmp_path, dp_method="disk")
    args = _swapped_args(tmp_path, learning_rate=1e-3, max_steps=1)
    assert args.fp16
    model = tiny_roberta(dtype=torch.float32)
    trainer = DPTrainer(model=model, args=args,
                        train_dataset=ListDataset(make_examples(4, VOCAB, causal=False)),
                        data_collator=PadCollator(1))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    before = flat([p.detach().clone() for p in model.parameters()])
    trainer.train()
    assert trainer.accelerator.scaler is None and trainer.dp_optimizer.loss_scaler.scale == 2.0**10
    assert not torch.equal(before, flat([p.detach() for p in model.parameters()]))


def test_fp16_set_after_the_arguments_is_checked_before_any_step(tmp_path):
    """``args.fp16 = True`` after construction (a script's ``if cuda: args.fp16 = True``) with a stateful
    method:
    refused when the optimizer is built, before any step, not given a loss scaler that could skip its
    steps."""
    args = _swapped_args(tmp_path, dp_method="disk", learning_rate=1e-3)
    trainer = DPTrainer(model=tiny_roberta(dtype=torch.float32), args=args,
                        train_dataset=ListDataset(make_examples(4, VOCAB, causal=False)),
                        data_collator=PadCollator(1))
    args.fp16 = True
    with pytest.raises(ValueError, match="is supported with dp_method in"):
        trainer.create_optimizer()


def test_an_overflowing_example_changes_nothing_the_trainer_shows(tmp_path):
    """DPTrainer(fp16=True), D and D' differing in one example whose forward overflows (a token embedded at
    1e38:
    inf logits, NaN loss): on the first micro-batch, so the first-step check sees it too. It is zeroed; the
    run is not refused, and the logs, warnings, privacy report and loss scale are those of D'."""

    def run(poisoned: bool, out: str):
        model = tiny_roberta(dtype=torch.float32)
        with torch.no_grad():
            model.roberta.embeddings.word_embeddings.weight[3] = 1e38
        rows = make_examples(4, VOCAB, causal=False, seed=3)
        for row in rows:
            row["input_ids"] = torch.where(torch.as_tensor(row["input_ids"]) == 3, 4,
                                           torch.as_tensor(row["input_ids"]))
        rows[1]["input_ids"][1] = 3 if poisoned else 4
        trainer = DPTrainer(model=model,
                            args=_swapped_args(tmp_path / out, max_steps=1, learning_rate=1e-3, fp16=True,
                                                            lr_scheduler_type="constant", logging_steps=1),
                            train_dataset=ListDataset(rows), data_collator=PadCollator(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        logs = [{k: v for k, v in log.items() if "runtime" not in k and "per_second" not in k}
                for log in trainer.state.log_history]
        shown = (logs, sorted(str(w.message) for w in caught), trainer.privacy_report(),
                 trainer.dp_optimizer.loss_scaler.state_dict())
        return shown, trainer.dp_optimizer.nonfinite_examples

    (clean, none), (poisoned, zeroed) = run(False, "clean"), run(True, "poisoned")
    assert (none, zeroed) == (0, 1) and clean == poisoned
