"""The run attacked through the public API: hooks registered while a forward runs, evaluation sets
that repeat training rows in another form, what a run writes to the files a user publishes.

Each test is a way in that failed before its fix, or one no other test covers; the negative controls train.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_bert, tiny_gpt2

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.proofs.hooks import GradientHookError
from hf_dpfilter.run.eval_overlap import overlapping_rows
from hf_dpfilter.run.training_fields import TrainingFieldError


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=6, per_device_train_batch_size=6, max_steps=2, optim="sgd", learning_rate=0.5,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, dp_seed=0,
        logging_steps=1,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


def _trainer(tmp_path, model=None, train=None, **kw):
    args_kw = {k: kw.pop(k) for k in list(kw) if k not in ("eval_dataset", "callbacks")}
    return DPTrainer(model=model if model is not None else tiny_bert(dtype=torch.float32),
                     args=_args(tmp_path, **args_kw),
                     train_dataset=train if train is not None
                     else ListDataset(make_examples(6, VOCAB, False)),
                     data_collator=PadCollator(0), **kw)


# ------------------------------------------------------------------ hooks registered while a forward runs
@pytest.mark.parametrize("kind", ["parameter", "module"])
def test_gradient_hook_registered_inside_a_forward_is_refused_before_any_backward(tmp_path, kind):
    """A forward hook that hooks a gradient while the first forward runs: the check before the step saw no
    hook, and the first backward (the engine's check, the first-step check) reached the parameter unclipped,
    one example at a time (old code: 5 gradients seen, step 1 released, refused only at step 2)."""
    model = tiny_bert(dtype=torch.float32)
    seen = []

    def register(module, inputs, output):
        if kind == "parameter" and not model.classifier.weight._backward_hooks:
            model.classifier.weight.register_hook(lambda grad: seen.append(grad.clone()))
        if kind == "module" and not model.classifier._backward_hooks:
            model.classifier.register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].clone()))

    # before the head runs: a hook on it takes this forward
    model.bert.embeddings.register_forward_hook(register)
    trainer = _trainer(tmp_path, model=model)
    with pytest.raises(GradientHookError, match="classifier"):
        trainer.train()
    assert seen == [] and trainer.accountant.steps == 0


# ------------------------------------------------------------------ evaluation on training rows, padded again
def _padded(examples, length=12, left=False):
    rows = []
    for e in examples:
        ids, pad = e["input_ids"].tolist(), length - len(e["input_ids"])
        mask = [0] * pad + [1] * len(ids) if left else [1] * len(ids) + [0] * pad
        rows.append({"input_ids": [0] * pad + ids if left else ids + [0] * pad, "attention_mask": mask,
                     "labels": e["labels"]})
    return rows


@pytest.mark.parametrize("form", ["datasets-right", "datasets-left", "torch-right"])
def test_training_rows_tokenized_again_with_padding_are_refused(tmp_path, form):
    """The training rows tokenized again with ``padding="max_length"`` (the masked tokens, the loss and
    metrics are the training rows'): old code compared the padded ``input_ids`` and evaluated them as a
    held-out set."""
    examples = make_examples(6, VOCAB, False)
    train = datasets.Dataset.from_list([{"input_ids": e["input_ids"].tolist(), "labels": e["labels"]}
                                        for e in examples])
    rows = _padded(examples[4:5], left=form.endswith("left"))
    if form.startswith("torch"):
        rows = ListDataset([{**r, "input_ids": torch.tensor(r["input_ids"])} for r in rows])
    held_out = _padded(make_examples(3, VOCAB, False, seed=7))
    trainer = _trainer(tmp_path, train=train)
    assert overlapping_rows(train,
                            rows if form.startswith("torch") else datasets.Dataset.from_list(rows)) == 1
    with pytest.raises(TrainingFieldError, match="shares at least one identical row"):
        trainer.evaluate(rows if form.startswith("torch") else datasets.Dataset.from_list(rows))
    # negative control: a padded held-out set shares no row and is compared, not refused
    assert overlapping_rows(train, datasets.Dataset.from_list(held_out)) == 0
    trainer._run_guard.check_eval_set(trainer, datasets.Dataset.from_list(held_out), "held-out")


# ------------------------------------------------------------------ files a user publishes
def _dropout_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0))


def _saved_rng(tmp_path, examples, name, **kw):
    trainer = _trainer(tmp_path / name, model=_dropout_bert(), train=ListDataset(examples),
                       noise_multiplier=1.0,
                       logical_batch_size=4, per_device_train_batch_size=2, save_strategy="steps",
                       save_steps=2,
                       seed=1, dp_seed=5, disable_tqdm=True, **kw)
    trainer.train()
    return torch.load(tmp_path / name / "checkpoint-2" / "rng_state.pth", weights_only=False)


def test_checkpoint_rng_state_says_nothing_of_the_batches(tmp_path):
    """rng_state.pth holds the global generators, advanced by every dropout draw: one per activation element
    of each secret micro-batch. Old code: replacing one example by a longer one changed the saved state (with
    the public seed, a noiseless function of the batches); now it is the public seed's and the step's
    alone."""
    examples = make_examples(8, VOCAB, False, min_len=3, max_len=6)
    replaced = [*examples[:-1], dict(examples[-1], input_ids=torch.arange(3, 23))]
    a, b = _saved_rng(tmp_path, examples, "a"), _saved_rng(tmp_path, replaced, "b")
    assert torch.equal(a["cpu"], b["cpu"]) and a["python"] == b["python"]
    assert all((x == y).all() for x, y in zip(a["numpy"][1:2], b["numpy"][1:2]))


# ------------------------------------------------------------------ the ledger and the unit, through
# DPSFTTrainer
def test_dpsfttrainer_resume_that_declares_users_is_refused_before_a_step(tmp_path):
    """Steps released per example, resumed by DPSFTTrainer (TRL's preparation of the rows in between) as a
    user-level run: refused before its first step, the ledger untouched."""
    from test_sft import chat_rows, trainer_for

    from hf_dpfilter.data.user_ids import PrivacyUnitError

    kw = dict(save_strategy="steps", save_steps=2, max_steps=2, noise_multiplier=1.0)
    trainer_for(tmp_path, chat_rows(6, user_ids=True), **kw).train()
    ledger = (tmp_path / "privacy_ledger.json").read_text()
    resumed = trainer_for(tmp_path, chat_rows(6, user_ids=True), **dict(kw, max_steps=4), privacy_unit="user",
                          user_id_column="user_id", max_examples_per_user=2, logical_batch_size=2)
    with pytest.raises(PrivacyUnitError, match="privacy_unit='example', but this run declares "
                                               "privacy_unit='user'"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.dp_optimizer.dp_steps == 2 and (tmp_path / "privacy_ledger.json").read_text() == ledger


# ------------------------------------------------------------------ train() again after a refusal mid-step
def test_train_again_after_a_refusal_mid_step_releases_no_stale_clipped_sums(tmp_path):
    """A refusal in the third micro-batch of step 1 (here a hook a forward hook registers late) left the
    clipped sums of the first two in the DP optimizer, and no step was released, so train() may run again once
    the hook is removed: old code added those sums to its first step (another Poisson sample inside one
    released step, an example sampled in both counted twice). At noise 0 the step now equals a fresh
    trainer's."""
    examples = ListDataset(make_examples(12, VOCAB, False))
    model, calls, handles = tiny_bert(dtype=torch.float32), [0], []

    def late_hook(module, inputs, output):
        calls[0] += 1
        if calls[0] == 8 and not handles:
            handles.append(model.classifier.weight.register_hook(lambda grad: None))

    forward = model.bert.embeddings.register_forward_hook(late_hook)
    kw = dict(per_device_train_batch_size=2, max_steps=1, disable_tqdm=True)
    trainer = _trainer(tmp_path / "a", model=model, train=examples, **kw)
    with pytest.raises(GradientHookError):
        trainer.train()
    assert trainer.accountant.steps == 0 and trainer.dp_optimizer._sums  # refused part-way through the step
    handles[0].remove()
    forward.remove()
    trainer.train()
    fresh = _trainer(tmp_path / "b", train=examples, **kw)
    fresh.train()
    for (name, p), q in zip(model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name


def test_a_shape_refused_by_a_recheck_is_checked_again_in_the_next_attempt(tmp_path):
    """The micro-batch-normalised loss of tests/proofs/test_separation.py (case 4), refused by the re-check of
    a new shape; nothing was released, so the step (or train()) may be run again: old code had marked the
    shape as seen before checking it, so with dp_recheck_rate=0 the same micro-batch was then accumulated
    unchecked."""
    from test_separation import _args as recheck_args
    from test_separation import _example, _MeanCountLoss, _step

    from hf_dpfilter.proofs.separation import SeparationError

    batch = [_example(6, 1, causal=True), _example(6, 2, causal=True), _example(3, 3, causal=True),
             _example(30, 4, causal=True)]
    trainer = _MeanCountLoss(model=tiny_gpt2(torch.float32), data_collator=PadCollator(0),
                             args=recheck_args(tmp_path, per_sample_max_grad_norm=2.0, dp_recheck_rate=0.0,
                                               dp_group_by_length=False),  # micro-batch 2 as laid out
                             train_dataset=ListDataset(batch))
    for _ in range(2):
        with pytest.raises(SeparationError, match="Re-check \\(a new shape\\)"):
            _step(trainer, batch)


def test_an_eval_set_changed_in_place_after_its_verdict_is_checked_again(tmp_path):
    """The verdict of an eval set is kept per trainer; a torch data set (a list behind it) can be changed in
    place after it evaluated: old code kept the held-out verdict and evaluated the training row now in it."""
    examples = make_examples(9, VOCAB, False)
    trainer = _trainer(tmp_path, train=ListDataset(examples[:6]))
    held_out = ListDataset(examples[6:9])
    trainer.evaluate(held_out)  # held out: evaluates
    held_out.examples[1] = examples[2]  # one training row, in place
    with pytest.raises(TrainingFieldError, match="shares at least one identical row"):
        trainer.evaluate(held_out)


def test_the_trainers_hub_uploads_skip_the_private_underscore_files():
    """The user partition's digest lives in ``output_dir/_privacy_unit_partitions.json`` (and the ledger's
    lock beside it) on the claim that the Trainer's uploads skip root files starting with ``_``: true of the
    installed transformers (both uploads of output_dir pass ``ignore_patterns=["_*", "checkpoint-*"]``) and of
    huggingface_hub's matching; a file in a subfolder would not be skipped."""
    import inspect

    from huggingface_hub.utils import filter_repo_objects
    from transformers import Trainer

    from hf_dpfilter.run.ledger import LOCK_FILE
    from hf_dpfilter.run.unit_identity import PARTITIONS_FILE

    for method in (Trainer.push_to_hub, Trainer._push_from_checkpoint):
        assert 'ignore_patterns=["_*", f"{PREFIX_CHECKPOINT_DIR}-*"]' in inspect.getsource(method)
    files = [PARTITIONS_FILE, LOCK_FILE, "privacy_ledger.json", "README.md", "checkpoint-2/optimizer.pt"]
    kept = list(filter_repo_objects(files, ignore_patterns=["_*", "checkpoint-*"]))
    assert kept == ["privacy_ledger.json", "README.md"]
    assert list(filter_repo_objects([f"sub/{PARTITIONS_FILE}"], ignore_patterns=["_*"]))  # the root only
