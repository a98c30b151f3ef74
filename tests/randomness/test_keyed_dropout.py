"""Dropout keyed to each example (hf_dpfilter/randomness/example_keys.py), through DPTrainer.

* Neighbouring data sets at noise 0 and a fixed secret seed: D and D' = [x] + D, where x's labels are all -100
  (no gradient of its own). x shifts every other example's place in the stream, its micro-batch and its padded
  width; with each family's dropout on, the clipped sum moves by <= 1e-10 C (float64), with the length
  grouping on and off, at q = 1 and q < 1. With labels, the move is <= C (1 + 1e-4) in float32. Drawn from the
  global stream (before), the unlabeled x moved GPT-2's sum by 1.5-7 C.
* The masks are secret: two runs with the same public ``seed`` and no ``dp_seed`` draw different masks; two
  with the same ``dp_seed`` are bit-identical; the key reaches no file of the run's output directory.
* A dropout whose leading axis is not the examples (a (T, B, d) activation) is refused by the proving step; an
  nn.Dropout on a tensor every example shares (DeBERTa-v2's relative-position table) draws one mask for the
  step; a mask is the same in the batch and alone (right and left padding).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import LeftPadCollator, ListDataset, PadCollator, flat, make_examples, noise_free_args
from models import VOCAB
from test_model_families import Seq2SeqCollator, _config, _head, family, lora
from torch import nn

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.randomness.example_keys import (
    ExampleRandomness,
    KeyedRandomnessError,
    example_digest,
    keyed_mask,
)

#: the clipping norm: small enough that every example is clipped (LoRA's gradients are small at init)
CLIP = 1e-3
#: name -> (build(dtype) -> model, head)
MODELS = {
    "gpt2": (lambda dtype: family("gpt2", 0.1, dtype=dtype), "lm"),
    "bert": (lambda dtype: family("bert", 0.1, dtype=dtype), "cls"),
    "roberta": (lambda dtype: family("roberta", 0.1, dtype=dtype), "cls"),
    "llama": (lambda dtype: family("llama", 0.1, dtype=dtype), "lm"),
    "bart": (lambda dtype: _built("bart", "s2s", dtype, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                  decoder_ffn_dim=24, decoder_start_token_id=2, forced_eos_token_id=None),
                                  "s2s"),
    "t5": (lambda dtype: _built("t5", "s2s", dtype, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                decoder_start_token_id=0), "s2s"),
    "lora-bert": (lambda dtype: lora("bert", 0.1, dtype=dtype), "cls"),
    # pos_dropout on its relative-position table, which every example shares: one mask for the step's forwards
    "deberta-v2": (lambda dtype: _deberta(dtype), "cls"),
}


def _deberta(dtype):
    return _built("deberta-v2", "cls", dtype, relative_attention=True, position_buckets=8,
                  max_relative_positions=16,
                  pos_att_type=["p2c", "c2p"])


def _built(model_type: str, head: str, dtype, **extra):
    torch.manual_seed(0)
    return _head(head).from_config(_config(model_type, extra, 0.1)).to(dtype)


def _args(tmp_path, n: int, **kw) -> DPTrainingArguments:
    return noise_free_args(tmp_path, n, CLIP, micro=3, **kw)


def _examples(head: str, n: int, seed: int = 5) -> list[dict]:
    return make_examples(n, VOCAB, causal=head != "cls", seed=seed, min_len=2, max_len=12)


def _unlabeled(example: dict) -> dict:
    labels = example["labels"]
    return {**example, "labels": torch.full_like(labels, -100) if isinstance(labels, torch.Tensor) else -100}


def _clipped_sum(tmp_path, model, examples, head: str, collator=None, **kw) -> torch.Tensor:
    """One logical batch of ``examples`` through the training collator and ``training_step`` (noise 0): the
    pre-noise clipped sum, flat, in float64."""
    pad = getattr(model.config, "pad_token_id", None) or 0
    collator = collator or (Seq2SeqCollator(pad) if head == "s2s" else PadCollator(pad))
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples), **kw),
                        train_dataset=ListDataset(examples),
                        data_collator=collator)
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn  # attaches the raw rows
    trainer.training_step(trainer.model, collate(examples))
    local = trainer.dp_optimizer._local_sums()
    return flat([local[p].detach().double() for p in trainer.model.parameters() if p in local])


@pytest.mark.parametrize("grouping", [True, False], ids=["grouped", "sampled-order"])
@pytest.mark.parametrize("name", list(MODELS))
def test_an_example_without_labels_moves_no_other_examples_dropout(name, grouping, tmp_path):
    build, head = MODELS[name]
    data = _examples(head, 7)
    x = _unlabeled(_examples(head, 1, seed=11)[0])  # long (the first example of make_examples is max_len)
    for q, size in (("q1", None), ("q-lt-1", 4)):
        kw = dict(dp_group_by_length=grouping, dp_verify_first_step=False)
        without = _clipped_sum(tmp_path / f"{q}D", build(torch.float64), data, head, **kw)
        kw_with = dict(kw, logical_batch_size=size) if size else kw
        with_x = _clipped_sum(tmp_path / f"{q}Dx", build(torch.float64), [x, *data], head, **kw_with)
        assert without.norm() > 0.5 * CLIP
        ratio = float((with_x - without).norm()) / CLIP
        assert ratio <= 1e-10, (name, q, ratio)  # exact in float64 (the acceptance bound is 1e-6)


@pytest.mark.parametrize("name", ["gpt2", "bert", "lora-bert"])
def test_an_added_example_moves_the_sum_by_at_most_c_in_float32(name, tmp_path):
    build, head = MODELS[name]
    data = _examples(head, 7)
    x = _examples(head, 1, seed=11)[0]
    without = _clipped_sum(tmp_path / "D", build(torch.float32), data, head)
    with_x = _clipped_sum(tmp_path / "Dx", build(torch.float32), [x, *data], head)
    ratio = float((with_x - without).norm()) / CLIP
    assert 0.05 < ratio <= 1.0 + 1e-4, ratio


def test_left_padded_rows_keep_their_masks_whatever_the_width(tmp_path):
    build, head = MODELS["gpt2"]
    data = _examples(head, 7)
    x = _unlabeled(_examples(head, 1, seed=11)[0])
    collator = LeftPadCollator(0)
    collator.padding_side = "left"  # declared, as a tokenizer's padding_side
    kw = dict(dp_verify_first_step=False)
    without = _clipped_sum(tmp_path / "D", build(torch.float64), data, head, collator=collator, **kw)
    with_x = _clipped_sum(tmp_path / "Dx", build(torch.float64), [x, *data], head, collator=collator, **kw)
    assert float((with_x - without).norm()) <= 1e-6 * CLIP


def test_left_padding_that_is_not_declared_is_not_keyed(tmp_path):
    build, head = MODELS["gpt2"]
    data = _examples(head, 6)
    with pytest.raises(KeyedRandomnessError, match="padded on the left while the collator declares"):
        _clipped_sum(tmp_path, build(torch.float64), data, head, collator=LeftPadCollator(0),
                     dp_verify_first_step=False)


def test_dropout_draws_differ_between_runs_unless_dp_seed_is_set(tmp_path):
    build, head = MODELS["bert"]
    data = _examples(head, 6)
    sums = {}
    for run, dp_seed in (("a", None), ("b", None), ("c", 7), ("d", 7)):
        sums[run] = _clipped_sum(tmp_path / run, build(torch.float64), data, head, dp_seed=dp_seed, seed=42,
                                 dp_verify_first_step=False)
    assert not torch.equal(sums["a"], sums["b"])  # the same public seed, no dp_seed: fresh secret keys
    assert torch.equal(sums["c"], sums["d"])  # the same dp_seed: bit-identical


def test_the_key_reaches_no_file_of_the_run(tmp_path):
    build, head = MODELS["bert"]
    data = _examples(head, 8)
    args = _args(tmp_path, 4, max_steps=2, save_strategy="steps", save_steps=1, dp_seed=None, secure_rng=True)
    trainer = DPTrainer(model=build(torch.float32), args=args, train_dataset=ListDataset(data),
                        data_collator=PadCollator(0))
    trainer.train()
    trainer.save_model()
    key = trainer.dp_optimizer.example_randomness._key
    assert len(key) == 32
    for root, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert key not in f.read(), name
    with pytest.raises(TypeError, match="never pickled"):
        import pickle

        pickle.dumps(trainer.dp_optimizer.example_randomness)


class _SequenceFirstDropout(nn.Module):
    """A classifier whose dropout runs on a (T, B, d) activation: its leading axis is not the examples."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(pad_token_id=0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None, **_):
        h = self.drop(self.embed(input_ids).transpose(0, 1))  # (T, B, 8)
        h = h.transpose(0, 1) * attention_mask.unsqueeze(-1)
        return {"logits": self.head(h.sum(1))}


def test_a_dropout_over_another_leading_axis_is_refused(tmp_path):
    # T = 3 = micro-batch
    data = [{"input_ids": torch.randint(3, VOCAB, (3,)), "labels": i % 2} for i in range(6)]
    with pytest.raises(KeyedRandomnessError, match="leading axis"):
        _clipped_sum(tmp_path, _SequenceFirstDropout(), data, "cls", dp_verify_first_step=False)


def test_a_rows_mask_is_its_own_in_the_batch_and_alone():
    randomness = ExampleRandomness.for_plan(False, 3)
    digests = [example_digest({"input_ids": [5, 6, 7]}), example_digest({"input_ids": [8, 9]})]
    seeds = randomness.row_seeds(0, "dropout", digests)
    for from_end in (False, True):
        batch = keyed_mask((2, 7, 5), seeds, 123, 0.3, from_end, torch.device("cpu"))
        alone = keyed_mask((1, 2, 5), seeds[1:], 123, 0.3, from_end, torch.device("cpu"))
        assert torch.equal(batch[1, -2:] if from_end else batch[1, :2], alone[0])
    many = keyed_mask((64, 64, 64), torch.arange(64), 9, 0.1, False, torch.device("cpu")).float()
    assert abs(float(many.mean()) - 0.9) < 0.005


def test_a_shared_tables_mask_is_not_keyed_to_rows_when_its_size_is_a_multiple_of_them(tmp_path):
    """DeBERTa-v2's (16, d) relative-position table in micro-batches of 4 or 8 rows: its size is a multiple of
    the rows, but the proof says it derives from no example, so it gets the step's one mask, not the rows'
    seeds."""
    data = _examples("cls", 8)
    x = _unlabeled(_examples("cls", 1, seed=11)[0])
    for size in (4, 8):
        without = _clipped_sum(tmp_path / f"{size}D", _deberta(torch.float64), data, "cls",
                               per_device_train_batch_size=size)
        with_x = _clipped_sum(tmp_path / f"{size}Dx", _deberta(torch.float64), [x, *data], "cls",
                              per_device_train_batch_size=size)
        assert float((with_x - without).norm()) <= 1e-10 * CLIP, size  # keyed to rows: 1.5e-7 C


@pytest.mark.parametrize("method", ["dpsgd", "disk"])
def test_checkpointed_layers_recompute_the_same_keyed_masks(method):
    """Non-reentrant gradient checkpointing recomputes each layer inside the backward, where autograd runs
    without the forward's function modes: the engine's checkpoint wrapper re-enters the keyed dropout, and the
    restored generator gives each call its forward's nonce, so the clipped sum equals the one without
    checkpointing (DiSK's two points too). Before, the recomputation drew native masks (SDPA: a metadata
    error)."""
    from hf_dpfilter import PrivacyPlan
    from hf_dpfilter.factory import make_engine, make_optimizer
    from hf_dpfilter.losses.tasks import per_example_loss

    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    sums = []
    for checkpointing in (False, True):
        model = family("gpt2", 0.1, dtype=torch.float64)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plan = PrivacyPlan.create(num_examples=100, logical_batch_size=2, epochs=1, noise_multiplier=0.0,
                                  per_sample_max_grad_norm=1e3, seed=0, method=method)
        engine = make_engine(plan, model)
        optimizer = make_optimizer(plan, [p for p in model.parameters() if p.requires_grad],
                                   base=torch.optim.SGD,
                                   lr=0.0)

        def loss_fn(values, engine=engine):
            logits = engine.call_model(values, input_ids=ids, attention_mask=mask).logits
            return per_example_loss(logits, labels, causal_lm=True)

        optimizer.accumulate(engine, loss_fn, 2, example_keys=[[5, 6, 7, 8, 9], [10, 11, 12]])
        sums.append(flat([s for s in optimizer._local_sums().values()]))
    assert float((sums[0] - sums[1]).norm() / sums[0].norm()) <= 1e-12


def test_engine_bookkeeping_runs_outside_the_mode_and_no_forward_can():
    """The engine's hooks and norms run with the keyed mode paused (speed); a forward or an nn.Dropout run
    while it is paused is refused, so a paused region can never draw an unkeyed mask."""
    from hf_dpfilter.randomness.example_keys import active_keyed_mode, keyed_dispatch_paused, keyed_step

    class Engine:
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        dropout_verdicts = None

    engine = Engine()
    seen = []
    bookkeeping = keyed_dispatch_paused(lambda: seen.append(active_keyed_mode()))
    forward_while_paused = keyed_dispatch_paused(lambda: engine.model(torch.ones(2, 4)))
    dropout_while_paused = keyed_dispatch_paused(lambda: engine.model[1](torch.ones(2, 4)))
    with keyed_step(7, torch.tensor([1, 2]), engine=engine) as mode:
        bookkeeping()
        assert seen == [None] and active_keyed_mode() is mode  # paused inside, back afterwards
        engine.model(torch.ones(2, 4))  # a forward under the mode draws keyed masks
        assert mode.keyed_calls == 1
        with pytest.raises(KeyedRandomnessError, match="paused"):
            forward_while_paused()
        with pytest.raises(KeyedRandomnessError, match="paused"):
            dropout_while_paused()


def _two_step_sums(tmp_path, model, examples, **kw) -> torch.Tensor:
    """The pre-noise clipped sums of two logical steps (noise 0, the DP optimizer's step between them)."""
    # one expected batch for D and D' (the step divides by it): the models after step 1 are then the same
    trainer = DPTrainer(model=model, args=_args(tmp_path, len(examples), learning_rate=0.5, logical_batch_size=4,
                                                **kw),
                        train_dataset=ListDataset(examples),
                        data_collator=PadCollator(getattr(model.config, "pad_token_id", None) or 0))
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn
    sums = []
    for _ in range(2):
        trainer.training_step(trainer.model, collate(examples))
        local = trainer.dp_optimizer._local_sums()
        sums.append(flat([local[p].detach().double() for p in trainer.model.parameters() if p in local]))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
    return torch.cat(sums)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_an_unlabeled_example_moves_nothing_at_the_second_step_with_the_engine_paused(checkpointing, tmp_path):
    """The engine's bookkeeping runs with the keyed mode paused, its backward (where checkpointed layers are
    recomputed) too, and the later steps take the cheap state check: at step 2, with gradient checkpointing
    or not, GPT-2's default dropout on, an added example with every label -100 moves neither step's sum."""
    data = _examples("lm", 7)
    x = _unlabeled(_examples("lm", 1, seed=11)[0])

    def build():
        model = family("gpt2", 0.1, dtype=torch.float64)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    without = _two_step_sums(tmp_path / "D", build(), data)
    with_x = _two_step_sums(tmp_path / "Dx", build(), [x, *data])
    half = without.numel() // 2
    assert without[half:].norm() > 0.5 * CLIP and not torch.equal(without[:half], without[half:])
    assert float((with_x - without).norm()) / CLIP <= 1e-10
