"""DP supervised fine-tuning through TRL: DPSFTTrainer / DPSFTConfig (hf_dpfilter.trainers.sft).

A tiny Llama built from a config and the offline byte-level chat tokenizer (recipes.common.offline_chat), on
conversational data with assistant-only loss and packing after sampling. Per-example references in float64
(each example alone, ordinary autograd, on the tokens TRL prepared), sensitivity in float32 (remove one
example:
the pre-noise aggregate moves by at most C), the refusals and their fixes.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import flat

if os.environ.get("HF_DPFILTER_NO_SKIP") == "1":
    import trl  # noqa: F401  - `make test` installs the test extra, which holds trl: a missing trl fails there
else:
    pytest.importorskip("trl")

import datasets  # noqa: E402
from transformers import TrainingArguments  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_dpfilter import DPSFTConfig, DPSFTTrainer  # noqa: E402
from hf_dpfilter.losses.tasks import per_example_loss  # noqa: E402
from hf_dpfilter.run.training_fields import TrainingFieldError  # noqa: E402
from hf_dpfilter.trainers.sft.config import SFT_FIELD_POLICIES  # noqa: E402
from hf_dpfilter.trainers.sft.packing import best_fit_decreasing, micro_batch_bins  # noqa: E402
from recipes.common.offline_chat import byte_level_chat_tokenizer, small_llama  # noqa: E402

WORDS = "the cafe serves cheap italian food near riverside family friendly rated high low price range".split()


def chat_rows(n: int, seed: int = 0, user_ids: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        if user_ids:
            row["user_id"] = i % 3
        rows.append(row)
    return rows


def config(tmp_path, n: int, **kw) -> DPSFTConfig:
    base = dict(
        output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=1.0, logical_batch_size=n,
        per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", dp_seed=0, bf16=False,
        gradient_checkpointing=False, assistant_only_loss=True, packing=True, max_length=64, logging_steps=1,
    )
    base.update(kw)
    return DPSFTConfig(**base)


def trainer_for(tmp_path, rows, dtype=torch.float64, **kw):
    tokenizer = byte_level_chat_tokenizer()
    model = small_llama(tokenizer, hidden_size=16, heads=4, max_positions=128, dtype=dtype)
    return DPSFTTrainer(model=model, args=config(tmp_path, len(rows), **kw),
                        train_dataset=datasets.Dataset.from_list(
        rows), processing_class=tokenizer)


def alone_gradient(model, input_ids, labels, params):
    ids = torch.tensor([input_ids])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = per_example_loss(logits, torch.tensor([labels]), causal_lm=True)
    grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


# --------------------------------------------------------------------------------------------- the switch
def test_exports_and_the_import_error_without_trl_names_the_extra():
    import hf_dpfilter

    assert {"DPSFTTrainer", "DPSFTConfig"} <= set(hf_dpfilter.__all__)
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "try:\n    from hf_dpfilter import DPSFTTrainer\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert "ERR" in out.stdout and "hf_dpfilter[trl]" in out.stdout, out.stdout + out.stderr


def test_config_keeps_sftconfig_defaults_and_is_both_classes(tmp_path):
    c = DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True, report_to=[])
    s = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert isinstance(c, SFTConfig) and isinstance(c, TrainingArguments)
    for name in ("learning_rate", "gradient_checkpointing", "logging_steps", "max_length", "packing", "bf16"):
        assert getattr(c, name) == getattr(s, name), name
    assert c.max_grad_norm == 0.0 and "dp_seed" not in c.to_dict()  # the DP fields' behaviour, inherited


def test_every_sft_field_has_a_dp_status():
    added = {f.name for f in dataclasses.fields(SFTConfig)} - {f.name
                                                               for f in dataclasses.fields(TrainingArguments)}
    missing = sorted(added - set(SFT_FIELD_POLICIES))
    assert not missing, f"SFTConfig fields without a DP status in SFT_FIELD_POLICIES: {missing}"


def test_two_class_switch_on_a_conversational_dataset(tmp_path):
    """SFTTrainer/SFTConfig -> DPSFTTrainer/DPSFTConfig with the same data and options trains privately; the
    training set is not packed by TRL (one example per row), and a user id column survives its preparation."""
    rows = chat_rows(24, seed=1, user_ids=True)
    trainer = trainer_for(tmp_path, rows, dtype=torch.float32, noise_multiplier=1.0, logical_batch_size=6,
                          max_steps=2, learning_rate=1e-3, optim="adamw_torch", gradient_checkpointing=True)
    assert len(trainer.train_dataset) == len(rows) and "seq_lengths" not in trainer.train_dataset.column_names
    assert "user_id" in trainer.train_dataset.column_names
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == 2 and 0 < report["epsilon"] < float("inf")
    assert report["num_train_examples"] == len(rows)
    assert not any("mean_token_accuracy" in entry or "num_tokens" in entry
                   for entry in trainer.state.log_history)


def test_user_level_sft_publishes_no_example_or_token_count(tmp_path):
    """DPSFTTrainer at privacy_unit='user', epoch-based, with an evaluation: neither the Trainer's speed (its
    examples x epochs) nor TRL's token counts (num_tokens; eval_num_tokens counts the training tokens) is in
    train()'s metrics, evaluate()'s or the log history (the DPTrainer side:
    tests/run/test_published_counts.py)."""
    rows = chat_rows(14, seed=2)
    for i, row in enumerate(rows):
        row["user_id"] = min(i // 3, 3)  # 4 users of 3, 3, 3 and 5 examples
    trainer = DPSFTTrainer(
        model=small_llama(byte_level_chat_tokenizer(), hidden_size=16, heads=4, max_positions=128,
                          dtype=torch.float32),
        args=config(tmp_path, 2, noise_multiplier=1.0, max_steps=-1, num_train_epochs=2, privacy_unit="user",
                    user_id_column="user_id", max_examples_per_user=3),
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(chat_rows(3, seed=9)),
        processing_class=byte_level_chat_tokenizer())
    train_metrics = trainer.train().metrics
    eval_metrics = trainer.evaluate()
    published = [train_metrics, eval_metrics, *trainer.state.log_history]
    found = [(k, v) for entry in published for k, v in entry.items()
             if "tokens" in k or ("samples" in k and k.startswith("train"))]
    assert not found, found
    # the evaluation set's own (public) count: its rows as TRL packed them
    counted = eval_metrics["eval_samples_per_second"] * eval_metrics["eval_runtime"]
    assert counted == pytest.approx(len(trainer.eval_dataset), abs=0.05), counted


# ------------------------------------------------------------------------------ packing after sampling
def test_best_fit_decreasing_bins():
    rng = random.Random(0)
    lengths = [rng.randint(1, 20) for _ in range(50)] + [30]
    bins = best_fit_decreasing(lengths, 20)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 20 or len(b) == 1 for b in bins)
    assert len(bins) <= 1 + (sum(lengths) * 11) // (9 * 20) + 1  # BFD uses at most 11/9 OPT + 1 bins
    groups = micro_batch_bins(lengths, 20, 3)
    assert sorted(i for g in groups for b in g for i in b) == list(range(len(lengths)))
    assert all(len(g) <= 3 for g in groups) and sum(len(g) for g in groups) == len(bins)


def _sample_batch(trainer, indices):
    collator = trainer._padding_collator
    return dict(trainer._prepare_inputs(collator([collator.dataset[i] for i in indices])))


def test_each_step_sample_is_packed_best_fit_into_micro_batches(tmp_path):
    rows = chat_rows(12, seed=2)
    trainer = trainer_for(tmp_path, rows, per_device_train_batch_size=2, max_length=64)
    trainer.get_train_dataloader()
    batch = _sample_batch(trainer, range(len(rows)))
    num = batch.pop("_dp_num_examples")
    raw = batch.pop("_dp_raw_examples")  # the collated rows, for the per-example checks
    labels = batch.pop("labels")
    micro = list(trainer._micro_batches(batch, labels, num))
    lengths = [len(trainer.train_dataset[i]["input_ids"]) for i in range(len(rows))]
    # each micro-batch knows exactly which examples it holds (the bins, in the packed order): the example
    # re-collated alone from its raw row has the tokens of its segment
    with_members = trainer._micro_batches_with_members(batch, labels, num)
    assert [m for _,
            m in with_members] == [tuple(i for b in bins for i in b)
                                   for bins in micro_batch_bins(lengths, 64, 2)]
    for (inputs, _, layout), members in with_members:
        for k, (row, start, _stop) in enumerate(layout.spans):
            alone, _, alone_layout = trainer._alone(raw[members[k]])
            assert alone_layout.num_examples == 1
            width = alone["input_ids"].shape[1]
            assert torch.equal(inputs["input_ids"][row, start : start + width], alone["input_ids"][0])
    assert sum(m[2].num_examples for m in micro) == len(rows)
    plan = micro_batch_bins(lengths, 64, 2)
    assert len(micro) == len(plan)
    for (inputs, micro_labels, layout), bins in zip(micro, plan):
        assert layout.rows == len(bins) <= 2 and layout.length <= 64  # one row per bin of max_length tokens
        assert "attention_mask" not in inputs  # examples kept apart by the position_ids restarts
        assert inputs["cu_seq_lens_q"].tolist() == [0] + [r * layout.length + stop for r, _,
                                                          stop in layout.spans]
        assert layout.num_examples == sum(len(b) for b in bins)
        # padding joins a row's last example, label -100
        for k, (row, start, stop) in enumerate(layout.spans):
            real = lengths[[i for b in bins for i in b][k]]
            assert stop - start >= real and bool((micro_labels[row, start + real : stop] == -100).all())


def test_packed_chat_rows_per_example_gradients_equal_each_example_alone_fp64(tmp_path):
    """Engine per-example gradient norms (and gradients) on the trainer's packed micro-batches of chat rows
    with assistant-only loss, against autograd on each example alone, in float64."""
    rows = chat_rows(7, seed=3)
    trainer = trainer_for(tmp_path, rows, per_device_train_batch_size=3)
    model, engine = trainer.model, trainer.engine
    model.eval()
    trainer.get_train_dataloader()
    data = trainer.train_dataset
    batch = _sample_batch(trainer, range(len(rows)))
    num = batch.pop("_dp_num_examples")
    batch.pop("_dp_raw_examples")
    labels = batch.pop("labels")
    params = engine.trainable_parameters
    checked = 0
    for inputs, micro_labels, layout in trainer._micro_batches(batch, labels, num):
        inputs = {**inputs, "use_cache": False}
        with trainer._packed(layout), engine.record(batch_size=layout.num_examples):
            losses = trainer.compute_per_example_loss(model, inputs, micro_labels)
        with engine.packed(layout):
            grads = engine.per_example_gradients(losses)
        norms = grads.norms()
        for k, (row, start, stop) in enumerate(layout.spans):
            ids = inputs["input_ids"][row, start:stop].tolist()  # the example, then the row's padding if last
            index = next(i for i in range(len(data))
                         if data[i]["input_ids"] == ids[: len(data[i]["input_ids"])])
            ids = data[index]["input_ids"]
            example_labels = data[index]["labels"]
            # assistant only
            assert any(t != -100 for t in example_labels) and any(t == -100 for t in example_labels)
            reference = alone_gradient(model, ids, example_labels, params)
            ref_norm = flat(reference).norm()
            assert abs(norms[k] - ref_norm) <= 1e-6 * ref_norm, (index, float(norms[k]), float(ref_norm))
            indicator = torch.zeros(layout.num_examples, dtype=torch.float64)
            indicator[k] = 1.0
            mine = grads.weighted_sum(indicator)
            assert (flat([mine[p] for p in params]) - flat(reference)).norm() <= 1e-6 * ref_norm
            checked += 1
    assert checked == len(rows)


def _pre_noise_aggregate(tmp_path, rows, clip):
    trainer = trainer_for(tmp_path, rows, dtype=torch.float32, per_sample_max_grad_norm=clip,
                          per_device_train_batch_size=2, logical_batch_size=4)
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    trainer.training_step(trainer.model, _sample_batch(trainer, range(len(rows))))
    optimizer = trainer.dp_optimizer
    local = optimizer._local_sums()
    return [local[p].detach().double() for p in optimizer.params], optimizer.sensitivity()


def test_example_level_sensitivity_with_packing(tmp_path):
    """Remove one example (the longest, packed with others): the pre-noise aggregate moves by at most C."""
    rows = chat_rows(9, seed=4)
    removed = max(range(len(rows)), key=lambda i: len(str(rows[i])))
    clip = 1e-3  # every example clipped: each contributes a vector of norm C exactly
    with_all, delta = _pre_noise_aggregate(tmp_path / "a", rows, clip)
    without, delta_without = _pre_noise_aggregate(tmp_path / "b", rows[:removed] + rows[removed + 1:], clip)
    assert delta == delta_without == clip
    moved = sum(float((a - b).pow(2).sum()) for a, b in zip(with_all, without)) ** 0.5
    assert moved <= delta * (1 + 1e-5), f"aggregate moved by {moved:.6g} > C = {delta:.6g}"
    assert moved > 0.5 * delta


def test_dp_step_equals_the_clipped_per_example_reference(tmp_path):
    """One DPSFTTrainer step (q = 1, noise 0, SGD lr 1, packed micro-batches) moves the parameters by
    -(1/B) sum_i clip(g_i), with g_i each example's own gradient alone (float64)."""
    rows = chat_rows(6, seed=5)
    trainer = trainer_for(tmp_path, rows, per_device_train_batch_size=2)
    model = trainer.model
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    data = trainer.train_dataset
    grads = [alone_gradient(model, data[i]["input_ids"], data[i]["labels"], params) for i in range(len(rows))]
    norms = torch.stack([flat(g).norm() for g in grads])
    clip = float(norms.median())
    trainer = trainer_for(tmp_path, rows, per_device_train_batch_size=2, per_sample_max_grad_norm=clip)
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    expected = sum(flat(g) * min(1.0, clip / float(n)) for g, n in zip(grads, norms)) * (-1.0 / len(rows))
    trainer.train()
    got = flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-6



def test_fp16_sft_gets_the_dp_loss_scaler_and_refuses_a_stateful_method(tmp_path):
    """DPSFTConfig(fp16=True): SFTConfig's bf16 default yields, the DP loss scaler (not Accelerate's
    GradScaler) scales the step, and a method whose state a skipped step would desynchronise is refused with
    the config."""
    with pytest.raises(ValueError, match="fp16=True is supported with dp_method in"):
        config(tmp_path, 4, fp16=True, dp_method="disk", noise_multiplier=1.0)
    trainer = trainer_for(tmp_path, chat_rows(4), fp16=True, bf16=None, dp_fp16_loss_scale=2.0**12)
    assert trainer.args.fp16 and not trainer.args.bf16
    trainer.train()
    assert trainer.engine.loss_scale == 2.0**12 and trainer.accelerator.scaler is None


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("options", "fix"), [
    ({"packing_strategy": "wrapped"}, "packing_strategy='bfd'"),
    ({"packing_strategy": "bfd_split"}, "packing_strategy='bfd'"),
    ({"loss_type": "dft"}, "loss_type='nll'"),
    ({"activation_offloading": True}, "activation_offloading=False"),
])
def test_sft_options_that_couple_examples_are_refused_with_the_fix(tmp_path, options, fix):
    with pytest.raises(TrainingFieldError, match=fix.replace("(", r"\(")):
        config(tmp_path, 4, **options)


def test_batch_level_loss_is_refused_with_the_fix(tmp_path):
    from hf_dpfilter.proofs.loss_policy import LossPolicyError

    def batch_loss(outputs, labels, num_items_in_batch=None):
        return outputs.logits.mean()

    tokenizer = byte_level_chat_tokenizer()
    with pytest.raises(LossPolicyError, match="compute_per_example_loss"):
        DPSFTTrainer(model=small_llama(tokenizer, hidden_size=16), args=config(tmp_path, 4),
                     train_dataset=datasets.Dataset.from_list(chat_rows(4)), processing_class=tokenizer,
                     compute_loss_func=batch_loss)


def test_prepacked_dataset_and_sftconfig_are_refused(tmp_path):
    tokenizer = byte_level_chat_tokenizer()
    packed = datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8], "seq_lengths": [2, 2]}])
    with pytest.raises(ValueError, match="unpacked data set"):
        DPSFTTrainer(model=small_llama(tokenizer, hidden_size=16), args=config(tmp_path, 1),
                     train_dataset=packed, processing_class=tokenizer)
    with pytest.raises(TypeError, match="DPSFTConfig"):
        DPSFTTrainer(model=small_llama(tokenizer, hidden_size=16),
                     args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
                     train_dataset=packed, processing_class=tokenizer)


def test_nonprivate_sft_trainer_still_runs_on_the_same_data(tmp_path):
    """The baseline of the benchmark and the recipe: TRL's own SFTTrainer on the same rows and tokenizer."""
    tokenizer = byte_level_chat_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
                     bf16=False,
                     report_to=[], save_strategy="no", assistant_only_loss=True, packing=True, max_length=64,
                     gradient_checkpointing=False)
    SFTTrainer(model=small_llama(tokenizer, hidden_size=16), args=args,
               train_dataset=datasets.Dataset.from_list(chat_rows(8)), processing_class=tokenizer).train()


# ------------------------------------------------------------------------------------------------ recipe
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared", "data"))
needs_e2e = pytest.mark.skipif(not os.path.exists(os.path.join(DATA, "e2e", "devset.csv"))
                               and os.environ.get("HF_DPFILTER_NO_SKIP") != "1", reason="no E2E")


def _sft_recipe():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import sft

    return sft


@needs_e2e
@pytest.mark.parametrize("unit", ["example", "user"])
def test_sft_recipe_runs_on_a_tiny_model(tmp_path, unit, capsys):
    import json

    out = tmp_path / unit
    _sft_recipe().main([
        "--data_dir", os.path.join(DATA, "e2e"), "--max_train_samples", "48", "--max_eval_samples", "3",
        "--max_steps", "2", "--num_evals", "1", "--logical_batch_size", "6", "--per_device_train_batch_size",
        "4",
        "--offline_hidden_size", "16", "--offline_layers", "1", "--num_beams", "1", "--max_generation_length",
        "6",
        "--privacy_unit", unit, "--max_examples_per_user", "3", "--use_cpu", "--no_plots", "--output_dir",
        str(out),
    ])
    with open(out / "results.json") as f:
        results = json.load(f)
    assert results["steps"] == 2 and 0 < results["epsilon"] < 100
    assert results["settings"]["privacy_unit"] == unit and results["settings"]["packing"] is True
    for name in ("bleu", "nist", "meteor", "rouge_l", "cider"):
        assert results["metrics"][f"eval_{name}"] >= 0
    assert results["baseline"]["metric"] == "eval_bleu" and results["baseline"]["value"] > 0
    printed = capsys.readouterr().out
    if unit == "user":  # the number of examples is private at user level: neither printed nor written
        assert "n_train_examples" not in results["settings"] and "examples=" not in printed
        assert "train_samples_per_second" not in json.dumps(results) and "tokens" not in json.dumps(results)
        assert results["settings"]["n_units"] < 48
    else:
        assert results["settings"]["n_train_examples"] == 48 and "examples=48" in printed


def test_synthetic_users_are_skewed_and_seeded():
    sft = _sft_recipe()
    users = sft.synthetic_users(2000, zipf_a=1.5, max_size=200, seed=0)
    assert users == sft.synthetic_users(2000, zipf_a=1.5, max_size=200, seed=0)
    sizes = sorted((users.count(u) for u in set(users)), reverse=True)
    assert len(users) == 2000 and max(sizes) <= 200
    assert sizes[0] >= 10 * sorted(sizes)[len(sizes) // 2]  # a few users hold many examples, most hold few


def test_sft_recipe_help_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "sft.py"), "--help"],
                         capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "--privacy_unit" in out.stdout and "synthetic" in out.stdout.lower()


def test_readme_shows_the_runnable_switch():
    """The README's TRL snippet is the body of examples/sft_quickstart.py, which its bash block runs."""
    with open(os.path.join(ROOT, "examples", "sft_quickstart.py")) as f:
        snippet = f.read().split("# --- README snippet begins\n")[1].split("# --- README snippet ends")[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "```python\n" + snippet + "```" in readme
    assert "DPSFTConfig(" in snippet and "messages" in snippet


def test_docs_table_of_sft_options_is_current():
    from hf_dpfilter.trainers.sft.config import render_markdown

    with open(os.path.join(ROOT, "docs", "sft.md")) as f:
        assert render_markdown() in f.read()


def _formatted_rows(kind: str, n: int) -> list[dict]:
    rows = chat_rows(n, seed=7)
    if kind == "prompt_completion":
        return [{"prompt": [r["messages"][0]], "completion": [r["messages"][1]]} for r in rows]
    if kind == "text_prompt_completion":
        return [{"prompt": r["messages"][0]["content"] + " ->",
                 "completion": " " + r["messages"][1]["content"]}
                for r in rows]
    return [{"text": r["messages"][0]["content"] + ": " + r["messages"][1]["content"]} for r in rows]


@pytest.mark.parametrize(("kind", "options"), [
    ("prompt_completion", {}),
    ("text_prompt_completion", {"padding_free": True, "packing": False, "max_length": None}),
    ("text", {"packing": False}),
    ("lora", {}),
])
def test_data_formats_and_options_train_privately(tmp_path, kind, options):
    """Prompt-completion (conversational and plain, completion-only loss by default), plain text, padding-free
    without packing, and a LoRA peft_config: one private step each, with the first-step per-example check."""
    rows = chat_rows(8, seed=7) if kind == "lora" else _formatted_rows(kind, 8)
    tokenizer = byte_level_chat_tokenizer()
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    args = config(tmp_path, 8, noise_multiplier=1.0, logical_batch_size=4, optim="adamw_torch",
                  learning_rate=1e-3,
                  assistant_only_loss=kind == "lora", **options)
    trainer = DPSFTTrainer(model=small_llama(tokenizer, hidden_size=16), args=args,
                           train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                           peft_config=peft_config)
    labels = trainer.train_dataset[0]["labels"]
    if kind != "text":  # completion-only / assistant-only: the prompt is masked
        assert labels[0] == -100 and any(t != -100 for t in labels)
    if kind == "lora":
        assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()
    assert trainer.privacy_report()["steps"] == 1


def test_throughput_benchmark_runs_interleaved():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sft_throughput

    result = sft_throughput.main(["--rounds", "2", "--steps", "1", "--examples", "24", "--batch", "6",
                                  "--max_length", "96", "--bins", "2", "--micro", "4", "--hidden", "16",
                                  "--layers", "1"])
    assert set(result["per_round"]) == {"dp_packed", "dp_unpacked", "nonprivate"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["per_round"].values())
    assert result["packed_over_unpacked"] > 0 and result["dp_over_nonprivate"] > 0
