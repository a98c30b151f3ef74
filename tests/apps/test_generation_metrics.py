"""Tests for recipes.common.generation_metrics.

Every metric is checked against a value obtained independently of the implementation under
test: hand arithmetic written out in the test, another library (nltk, sacreBLEU,
rouge_score) or, when installed, the COCO caption toolkit (``pycocoevalcap``) that the
official ``e2e-metrics`` script uses.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from recipes.common import generation_metrics as gm

# E2E-style sample: 6 hypotheses with 2-3 references each (ASCII only, so sacreBLEU's
# Unicode lowercasing equals mteval's ASCII lowercasing).
HYPS = [
    "The Eagle is a coffee shop near Burger King in the riverside area.",
    "Blue Spice is a cheap pub in the city centre. It is family friendly.",
    "The Rice Boat serves Italian food and has a high customer rating.",
    "Zizzi is a restaurant with a price range of more than 30 pounds.",
    "Near the Crowne Plaza Hotel there is a coffee shop called Browns Cambridge.",
    "The Punter is a kid friendly fast food place near Cafe Sicilia.",
]
REFS = [
    [
        "The Eagle coffee shop is near Burger King by the riverside.",
        "Near Burger King in the riverside area is a coffee shop called The Eagle.",
        "The Eagle is a coffee shop in the riverside area, near Burger King.",
    ],
    [
        "Blue Spice is a family friendly pub in the city centre with low prices.",
        "In the city centre there is a cheap, family friendly pub called Blue Spice.",
    ],
    [
        "The Rice Boat serves Italian food and is highly rated by customers.",
        "The Rice Boat is an Italian place with a high customer rating.",
        "Highly rated by customers, The Rice Boat offers Italian food.",
    ],
    [
        "Zizzi is a restaurant with prices over 30 pounds.",
        "Zizzi, a high priced restaurant, costs more than 30 pounds.",
    ],
    [
        "Browns Cambridge is a coffee shop near the Crowne Plaza Hotel.",
        "There is a coffee shop called Browns Cambridge close to Crowne Plaza Hotel.",
        "Near Crowne Plaza Hotel you will find the coffee shop Browns Cambridge.",
    ],
    [
        "The Punter is a fast food place near Cafe Sicilia that is kid friendly.",
        "Near Cafe Sicilia, The Punter serves fast food and welcomes kids.",
    ],
]

HAS_COCO = importlib.util.find_spec("pycocoevalcap") is not None
HAS_JAVA = shutil.which("java") is not None


def _data_dir() -> Path | None:
    candidates = [
        os.environ.get("HF_DPFILTER_DATA_DIR"),
        # the documented default: ../shared/data beside the checkout
        Path(__file__).resolve().parents[3] / "shared" / "data",
    ]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    return None


DATA = _data_dir()
E2E_TEST = DATA / "e2e" / "testset_w_refs.csv" if DATA else None
DART_DEV = DATA / "dart" / "dart-v1.1.1-full-dev.json" if DATA else None


def _need(path: Path | None) -> Path:
    if path is None or not path.is_file():
        pytest.skip(f"official data file not found ({path}); set HF_DPFILTER_DATA_DIR")
    return path


# ----------------------------------------------------------------------------- tokenizers


def test_mteval_tokenize_13a_ascii_lowercase() -> None:
    assert gm.mteval_tokenize("Blue Spice, a pub (cheap) costs £20-25.") == [
        "blue", "spice", ",", "a", "pub", "(", "cheap", ")", "costs", "£20", "-", "25", ".",
    ]  # fmt: skip
    # mteval-v13a.pl lowercases with tr/[A-Z]/[a-z]/: non-ASCII capitals stay as they are.
    assert gm.mteval_tokenize("CAFÉ Émile") == ["cafÉ", "Émile"]


# Expected token lists are the output of Stanford CoreNLP 3.4.1 `PTBTokenizer -preserveLines
# -lowerCase` (the COCO toolkit's tokenizer) with the toolkit's punctuation list removed.
PTB_CASES = [
    (
        "The Eagle is a cheap coffee shop (£20-25). It's near Burger King.",
        "the eagle is a cheap coffee shop -lrb- # 20-25 -rrb- it 's near burger king",
    ),
    (
        "Blue Spice isn't family-friendly; prices are high... Customers rate it 5 out of 5!",
        "blue spice is n't family-friendly prices are high customers rate it 5 out of 5",
    ),
    (
        "Near the Rainbow Vegetarian Café in the U.S. is 'The Punter' \u2013 a pub.",
        "near the rainbow vegetarian café in the u.s. is the punter a pub",
    ),
]


@pytest.mark.parametrize(("text", "expected"), PTB_CASES)
def test_coco_tokenize_matches_stanford_ptb(text: str, expected: str) -> None:
    assert gm.coco_tokenize(text) == expected.split()


@pytest.mark.skipif(not (HAS_COCO and HAS_JAVA), reason="needs pycocoevalcap and java")
def test_coco_tokenize_matches_java_ptb_on_sample() -> None:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    texts = HYPS + [r for rs in REFS for r in rs] + [t for t, _ in PTB_CASES]
    out = PTBTokenizer().tokenize({i: [{"caption": t}] for i, t in enumerate(texts)})
    for i, t in enumerate(texts):
        assert gm.coco_tokenize(t) == out[i][0].split(), t


# ----------------------------------------------------------------------------------- BLEU


def _ref_streams(refs: list[list[str]]) -> list[list[str | None]]:
    n = max(len(r) for r in refs)
    return [[r[k] if k < len(r) else None for r in refs] for k in range(n)]


def test_bleu_matches_sacrebleu_13a_lowercase() -> None:
    import sacrebleu

    expected = sacrebleu.corpus_bleu(HYPS, _ref_streams(REFS), tokenize="13a", lowercase=True)
    assert gm.corpus_bleu(HYPS, REFS) == pytest.approx(expected.score / 100, abs=1e-6)


def test_bleu_matches_nltk_on_same_tokens() -> None:
    from nltk.translate.bleu_score import corpus_bleu as nltk_corpus_bleu

    hyp_tok = [gm.mteval_tokenize(h) for h in HYPS]
    ref_tok = [[gm.mteval_tokenize(r) for r in rs] for rs in REFS]
    expected = nltk_corpus_bleu(ref_tok, hyp_tok)  # BLEU-4, closest ref length, no smoothing
    assert 0.2 < expected < 0.9
    assert gm.corpus_bleu(HYPS, REFS) == pytest.approx(expected, abs=1e-6)


def test_bleu_hand_computed_brevity_penalty() -> None:
    # hyp "a b c d e" (5 tokens) vs refs "a b c d e f g" (7) and "a b c d e f g h i" (9):
    # all n-gram precisions are 1, closest ref length 7 -> BLEU = exp(1 - 7/5).
    value = gm.corpus_bleu(["a b c d e"], [["a b c d e f g", "a b c d e f g h i"]])
    assert value == pytest.approx(math.exp(1 - 7 / 5), abs=1e-9)


# ----------------------------------------------------------------------------------- NIST

NIST_BETA = -math.log(0.5) / math.log(1.5) ** 2


def test_nist_hand_computed() -> None:
    # One input, hyp "the cat", refs "the cat sat" and "the dog".
    # Reference statistics: 5 words; counts the:2 cat:1 sat:1 dog:1, "the cat":1 ...
    # Info(the) = log2(5/2), Info(cat) = log2(5/1), Info(the cat) = log2(count(the)/1) = 1.
    # 1-grams: (log2 2.5 + log2 5) / 2 hyp unigrams; 2-grams: 1 / 1 hyp bigram;
    # 3..5-grams: no hyp n-grams -> 0.
    # Length penalty: L_sys = 2, L_ref = mean(3, 2) = 2.5, ratio 0.8:
    #   exp(-beta * ln(0.8)^2), beta = -ln(0.5) / ln(1.5)^2.
    expected = ((math.log2(2.5) + math.log2(5)) / 2 + 1.0) * math.exp(-NIST_BETA * math.log(0.8) ** 2)
    assert expected == pytest.approx(2.2875, abs=1e-4)
    assert gm.corpus_nist(["the cat"], [["the cat sat", "the dog"]]) == pytest.approx(expected, abs=1e-12)


def test_nist_matches_nltk_with_single_references() -> None:
    from nltk.translate.nist_score import corpus_nist as nltk_corpus_nist

    single = [[rs[0]] for rs in REFS]
    hyp_tok = [gm.mteval_tokenize(h) for h in HYPS]
    ref_tok = [[gm.mteval_tokenize(rs[0])] for rs in REFS]
    expected = nltk_corpus_nist(ref_tok, hyp_tok, n=5)
    assert gm.corpus_nist(HYPS, single) == pytest.approx(expected, abs=1e-9)


def test_nist_multi_reference_clips_by_max_count() -> None:
    # hyp "a a" vs refs ["a b", "a a"]: clipping uses the max count over refs (2), so both
    # "a" match; Info(a) = log2(4 words / 3 a's), Info("a a") = log2(3 / 1).
    # L_sys = 2 = mean ref length -> no penalty.
    expected = (2 * math.log2(4 / 3)) / 2 + math.log2(3) / 1
    assert gm.corpus_nist(["a a"], [["a b", "a a"]]) == pytest.approx(expected, abs=1e-12)


# -------------------------------------------------------------------------------- ROUGE-L


def test_rouge_l_hand_computed_single_reference() -> None:
    # hyp "the cat sat on the mat" (6), ref "the cat is on the mat today" (7):
    # LCS = "the cat on the mat" = 5, P = 5/6, R = 5/7,
    # F = (1 + 1.2^2) P R / (R + 1.2^2 P) = 2.44 * (25/42) / (5/7 + 1.2) = 0.758706...
    p, r = 5 / 6, 5 / 7
    expected = 2.44 * p * r / (r + 1.44 * p)
    assert expected == pytest.approx(0.758706, abs=1e-6)
    value = gm.rouge_l(["the cat sat on the mat"], [["the cat is on the mat today"]])
    assert value == pytest.approx(expected, abs=1e-12)


def test_rouge_l_hand_computed_multi_reference_takes_max_p_and_max_r() -> None:
    # Adding ref "the cat sat" (LCS 3: P = 3/6, R = 3/3) to the case above: the COCO scorer
    # takes P = max(5/6, 1/2) = 5/6 and R = max(5/7, 1) = 1 separately:
    # F = 2.44 * (5/6) * 1 / (1 + 1.44 * 5/6) = 2.0333... / 2.2 = 0.924242...
    # (the max of the per-reference F values would be 0.758706).
    expected = 2.44 * (5 / 6) / (1 + 1.44 * 5 / 6)
    assert expected == pytest.approx(0.924242, abs=1e-6)
    value = gm.rouge_l(["the cat sat on the mat"], [["the cat is on the mat today", "the cat sat"]])
    assert value == pytest.approx(expected, abs=1e-12)


class _WhitespaceTokenizer:
    @staticmethod
    def tokenize(text: str) -> list[str]:
        return text.split()


def test_rouge_l_matches_rouge_score_lcs_single_reference() -> None:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer())
    hyp_tok = [" ".join(gm.coco_tokenize(h)) for h in HYPS]
    ref_tok = [" ".join(gm.coco_tokenize(rs[0])) for rs in REFS]
    fs = []
    for h, r in zip(hyp_tok, ref_tok):
        s = scorer.score(r, h)["rougeL"]  # score(target, prediction)
        fs.append(2.44 * s.precision * s.recall / (s.recall + 1.44 * s.precision))
    expected = sum(fs) / len(fs)
    assert gm.rouge_l(HYPS, [[rs[0]] for rs in REFS]) == pytest.approx(expected, abs=1e-9)


# ---------------------------------------------------------------------------------- CIDEr


def test_cider_identical_is_maximum_ten() -> None:
    # Two inputs with disjoint vocabularies, every reference equal to the hypothesis: each
    # n-gram order has cosine 1 and no length penalty -> 10 per input.
    hyps = ["red fox jumps high", "blue whale swims deep"]
    refs = [[hyps[0], hyps[0]], [hyps[1], hyps[1]]]
    assert gm.cider(hyps, refs) == pytest.approx(10.0, abs=1e-12)
    worse = gm.cider(["red fox jumps", "blue whale swims deep"], refs)
    assert worse < 10.0


def test_cider_hand_computed_two_sentence_corpus() -> None:
    # N = 2 inputs. refs: ["x y"] and ["x z"]; hyps: "x y" and "z".
    # df: x -> 2, y, z, "x y", "x z" -> 1. Weight of an n-gram: tf * ln(N / df),
    # so x has weight 0 and the others ln 2.
    # Input 1: unigram vectors (x:0, y:ln2) for hyp and ref -> cosine 1; bigram "x y" -> 1;
    #   no 3-/4-grams -> 0; equal lengths -> no penalty. CIDEr = 10 * (1+1+0+0)/4 = 5.
    # Input 2: hyp unigrams (z:ln2), ref (x:0, z:ln2): clipped dot ln2^2 / (ln2 * ln2) = 1;
    #   hyp has no bigram -> 0. Length penalty exp(-(1-2)^2 / (2 * 6^2)) = exp(-1/72).
    #   CIDEr = 10 * exp(-1/72) / 4 = 2.5 exp(-1/72).
    # Corpus: (5 + 2.5 exp(-1/72)) / 2 = 3.732758...
    expected = (5.0 + 2.5 * math.exp(-1 / 72)) / 2
    assert expected == pytest.approx(3.732759, abs=1e-6)
    assert gm.cider(["x y", "z"], [["x y"], ["x z"]]) == pytest.approx(expected, abs=1e-12)


def test_cider_single_input_is_zero() -> None:
    # With one input every idf is ln(1/1) = 0 (the COCO scorer behaves the same).
    assert gm.cider([HYPS[0]], [REFS[0]]) == 0.0


@pytest.mark.skipif(not HAS_COCO, reason="pycocoevalcap not installed")
def test_cider_and_rouge_match_pycocoevalcap() -> None:
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    hyp_tok = [" ".join(gm.coco_tokenize(h)) for h in HYPS]
    ref_tok = [[" ".join(gm.coco_tokenize(r)) for r in rs] for rs in REFS]
    gts = {i: rs for i, rs in enumerate(ref_tok)}
    res = {i: [h] for i, h in enumerate(hyp_tok)}
    cider_ref, _ = Cider().compute_score(gts, res)
    rouge_ref, _ = Rouge().compute_score(gts, res)
    assert gm.cider(HYPS, REFS) == pytest.approx(cider_ref, abs=1e-6)
    assert gm.rouge_l(HYPS, REFS) == pytest.approx(rouge_ref, abs=1e-6)


# --------------------------------------------------------------------------------- METEOR


def test_meteor_identical_is_one_minus_fragmentation_penalty() -> None:
    # n = 6 matched tokens in one chunk: Fmean = 1, Pen = 0.5 * (1/6)^3.
    text = "the cat sat on the mat"
    assert gm.meteor([text], [[text]]) == pytest.approx(1 - 0.5 / 6**3, abs=1e-12)
    long = "blue spice is a family friendly coffee shop in the city centre near the rice boat"
    n = len(long.split())
    assert gm.meteor([long], [[long]]) == pytest.approx(1 - 0.5 / n**3, abs=1e-12)
    assert gm.meteor([long], [[long]]) > 0.9998


def test_meteor_hand_computed_exact_and_stem() -> None:
    # hyp "the dogs were barking" (4), ref "the dog was barking loudly" (5).
    # Exact: the, barking. Porter stem: dogs -> dog = dog ("were"/"was" do not match;
    # there are no synonyms). m = 3, P = 3/4, R = 3/5,
    # Fmean = P R / (0.9 P + 0.1 R) = 0.45 / 0.735.
    # Alignment (hyp->ref) 0->0, 1->1, 3->3: chunks "the dogs" + "barking" = 2,
    # Pen = 0.5 * (2/3)^3 = 4/27. METEOR = (1 - 4/27) * 0.45 / 0.735 = 0.521542...
    expected = (1 - 4 / 27) * 0.45 / 0.735
    assert expected == pytest.approx(0.521542, abs=1e-6)
    value = gm.meteor(["the dogs were barking"], [["the dog was barking loudly"]])
    assert value == pytest.approx(expected, abs=1e-12)


def test_meteor_multi_reference_is_max_then_mean() -> None:
    hyps = ["the dogs were barking", "the cat sat on the mat"]
    refs = [["a bird sang", "the dog was barking loudly"], ["the cat sat on the mat"]]
    expected = ((1 - 4 / 27) * 0.45 / 0.735 + (1 - 0.5 / 6**3)) / 2
    assert gm.meteor(hyps, refs) == pytest.approx(expected, abs=1e-12)


@pytest.mark.slow  # starts a JVM and loads METEOR's paraphrase table (~7-15 s)
@pytest.mark.skipif(not (HAS_COCO and HAS_JAVA), reason="needs pycocoevalcap and java")
def test_official_meteor15_identical_is_one() -> None:
    # METEOR 1.5 gives exactly 1 for a perfect match (no fragmentation penalty then).
    refs = [[rs[0]] for rs in REFS]
    out = gm.compute_generation_metrics([rs[0] for rs in REFS], refs, official_meteor=True)
    assert out["meteor"] == pytest.approx(1.0, abs=1e-9)


def test_meteor15_reports_missing_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gm, "meteor15_available", lambda: False)
    with pytest.raises(RuntimeError, match="pycocoevalcap"):
        gm.meteor15(HYPS, REFS)


# ---------------------------------------------------------------------------------- bundle


def test_compute_generation_metrics_bundle() -> None:
    out = gm.compute_generation_metrics(HYPS, REFS)
    assert set(out) == {"bleu", "nist", "meteor", "rouge_l", "cider"}
    assert out["bleu"] == pytest.approx(gm.corpus_bleu(HYPS, REFS), abs=1e-12)
    assert out["nist"] == pytest.approx(gm.corpus_nist(HYPS, REFS), abs=1e-12)
    assert out["meteor"] == pytest.approx(gm.meteor(HYPS, REFS), abs=1e-12)
    assert out["rouge_l"] == pytest.approx(gm.rouge_l(HYPS, REFS), abs=1e-12)
    assert out["cider"] == pytest.approx(gm.cider(HYPS, REFS), abs=1e-12)
    for key in ("bleu", "meteor", "rouge_l"):
        assert 0.0 < out[key] < 1.0
    assert 0.0 < out["cider"] < 10.0 and out["nist"] > 1.0


def test_empty_or_punctuation_only_predictions_score_zero() -> None:
    out = gm.compute_generation_metrics(["", "..."], [["a cat"], ["the cat sat"]])
    assert out == {"bleu": 0.0, "nist": 0.0, "meteor": 0.0, "rouge_l": 0.0, "cider": 0.0}


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="predictions"):
        gm.compute_generation_metrics(HYPS[:2], REFS)
    with pytest.raises(ValueError, match="empty"):
        gm.corpus_bleu(["a"], [[]])
    with pytest.raises(TypeError):
        gm.rouge_l(["a"], ["a"])  # type: ignore[list-item]


# -------------------------------------------------------------------------------- loaders


def test_load_e2e_csv_groups_in_first_appearance_order(tmp_path: Path) -> None:
    path = tmp_path / "mini.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerows([["mr", "ref"], ["B", "b1"], ["A", "a1"], ["B", "b2, with comma"], ["A", "a2"]])
    assert gm.load_e2e_csv(path) == [("B", ["b1", "b2, with comma"]), ("A", ["a1", "a2"])]


def test_load_dart_json_small(tmp_path: Path) -> None:
    path = tmp_path / "mini.json"
    entries = [
        {"tripleset": [["S", "P", "O"]], "annotations": [{"source": "x", "text": "S P O."}]},
        {"tripleset": [["A", "B", "C"], ["A", "D", "E"]], "annotations": []},
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")
    assert gm.load_dart_json(path) == [
        ([["S", "P", "O"]], ["S P O."]),
        ([["A", "B", "C"], ["A", "D", "E"]], []),
    ]


def test_load_e2e_csv_official_testset() -> None:
    data = gm.load_e2e_csv(_need(E2E_TEST))
    assert len(data) == 630
    assert sum(len(refs) for _, refs in data) == 4693
    assert len({mr for mr, _ in data}) == 630
    mr, refs = data[0]
    assert mr == "name[Blue Spice], eatType[coffee shop], area[city centre]"
    assert refs == [
        "A coffee shop in the city centre area called Blue Spice.",
        "Blue Spice is a coffee shop in city centre.",
    ]


def test_load_dart_json_official_dev() -> None:
    data = gm.load_dart_json(_need(DART_DEV))
    assert len(data) == 2768
    tripleset, texts = data[0]
    assert tripleset == [
        ["Mars Hill College", "JOINED", "1973"],
        ["Mars Hill College", "LOCATION", "Mars Hill, North Carolina"],
    ]
    assert texts == ["A school from Mars Hill, North Carolina, joined in 1973."]
    assert all(len(t) == 3 for ts, _ in data for t in ts)


def test_e2e_testset_leave_one_out_matches_reference_implementations() -> None:
    """First 150 test-set MRs with >= 2 references: score each MR's first reference
    against its other references.

    Reference values were computed independently (not with this module): Stanford
    PTBTokenizer (Java) + pycocoevalcap 1.2 for ROUGE-L and CIDEr, nltk's corpus_bleu on
    mteval-13a tokens for BLEU, a transcription of e2e-metrics' pymteval NIST for NIST, and
    METEOR 1.5 (Java) = 0.450466 for the record.
    """
    data = [(mr, refs) for mr, refs in gm.load_e2e_csv(_need(E2E_TEST)) if len(refs) >= 2]
    data = data[:150]
    hyps = [refs[0] for _, refs in data]
    refs = [refs[1:] for _, refs in data]
    out = gm.compute_generation_metrics(hyps, refs)
    assert out["bleu"] == pytest.approx(0.6110692217014649, abs=1e-9)
    assert out["nist"] == pytest.approx(8.382792453319839, abs=1e-9)
    assert out["rouge_l"] == pytest.approx(0.6609823807503606, abs=1e-9)
    assert out["cider"] == pytest.approx(2.3521775024608353, abs=1e-9)
    # The pure-Python METEOR is not METEOR 1.5 (0.450 here): it comes out much higher.
    assert out["meteor"] == pytest.approx(0.7970515207112766, abs=1e-9)
