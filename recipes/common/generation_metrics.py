"""Offline table-to-text generation metrics with multiple references (E2E / DART).

The DP fine-tuning literature (Li et al., 2022, "Large language models can be strong
differentially private learners"; the ``private-transformers`` code base) reports the five
metrics of the official E2E NLG challenge script ``e2e-metrics`` (``measure_scores.py``):
BLEU, NIST, METEOR, ROUGE-L and CIDEr, each against *all* references of an input.
This module re-implements them without any network access (no Hub metric scripts, no
``nltk.download``) and, except for the optional :func:`meteor15`, without Java.

Scales (the ``e2e-metrics`` conventions, *not* sacreBLEU's 0-100):

===========  ===========================================================
key          range
===========  ===========================================================
``bleu``     0-1 (sacreBLEU's 0-100 divided by 100)
``nist``     0 to ~15 (E2E test, a human reference vs the others: 8.90)
``meteor``   0-1
``rouge_l``  0-1
``cider``    0-10 (E2E test, a human reference vs the others: 1.86)
===========  ===========================================================

Tokenisation (follows what ``e2e-metrics`` feeds each metric):

* BLEU and NIST use the mteval-v13a tokenizer (the one ``mteval-v13a.pl`` and
  sacreBLEU's ``"13a"`` implement) after lowercasing ASCII letters, as ``mteval-v13a.pl``
  does without ``-c`` (its ``tr/[A-Z]/[a-z]/`` leaves non-ASCII letters unchanged).
* METEOR, ROUGE-L and CIDEr follow the MS-COCO caption toolkit used by ``e2e-metrics``:
  Stanford ``PTBTokenizer -lowerCase``, then the punctuation tokens
  ``'' ' `` ` . ? ! , : - -- ... ;`` are dropped. :func:`coco_tokenize` is a pure-Python
  re-implementation (nltk's Treebank tokenizer plus PTB's sentence-internal period
  splitting, ``£``->``#`` currency normalisation, dash and quote handling). On the 16,345
  E2E dev/test and DART dev references it produces exactly the same tokens as Stanford
  CoreNLP 3.4.1's PTBTokenizer for all E2E sentences and for 99.85% of all sentences.

Every metric function takes ``tokenize=False`` to skip this step and split the given
strings on whitespace instead (for pre-tokenized text, as the COCO scorers do).

Known deviations from the official script:

* METEOR: the official scorer is METEOR 1.5 (Java) with WordNet synonyms, paraphrase
  tables, function-word weighting and tuned parameters (alpha=0.85, beta=0.2, gamma=0.6).
  No PyPI package ships WordNet data usable offline by nltk, so :func:`meteor` is nltk's
  METEOR (Lavie & Agarwal 2007: alpha=0.9, beta=3, gamma=0.5) with exact and Porter-stem
  matching only, max over references, mean over predictions. Its values are NOT
  comparable to published METEOR numbers; they are much *higher*, because of the
  recall-heavy parameters and the weak fragmentation penalty (E2E test set, first
  reference of each MR scored against the others: 0.793 here vs 0.456 for METEOR 1.5).
  Use it only to compare runs scored by this module. Where Java and the PyPI package
  ``pycocoevalcap`` are installed, :func:`meteor15` returns the official METEOR 1.5
  value, and ``compute_generation_metrics(..., official_meteor=True)`` uses it.
* NIST with a variable number of references per input uses the per-input average
  reference length in the length penalty (as the Python ``pymteval`` of ``e2e-metrics``),
  since ``mteval-v13a.pl`` assumes a fixed number of references.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

__all__ = [
    "compute_generation_metrics",
    "corpus_bleu",
    "corpus_nist",
    "meteor",
    "meteor15",
    "meteor15_available",
    "rouge_l",
    "cider",
    "mteval_tokenize",
    "coco_tokenize",
    "load_e2e_csv",
    "load_dart_json",
]

Tokens = list[str]

# --------------------------------------------------------------------------- helpers


def _check_inputs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if isinstance(predictions, str):
        raise TypeError("predictions must be a list of strings, not a single string")
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions but {len(references)} reference lists")
    if len(predictions) == 0:
        raise ValueError("predictions is empty")
    for i, refs in enumerate(references):
        if isinstance(refs, str):
            raise TypeError(f"references[{i}] must be a list of strings, not a string")
        if len(refs) == 0:
            raise ValueError(f"references[{i}] is empty: every prediction needs >= 1 reference")


def _ngram_counts(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _all_ngram_counts(tokens: Sequence[str], max_order: int) -> Counter[tuple[str, ...]]:
    counts: Counter[tuple[str, ...]] = Counter()
    for n in range(1, max_order + 1):
        counts.update(_ngram_counts(tokens, n))
    return counts


def _tokenize_all(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    tokenizer: Callable[[str], Tokens],
) -> tuple[list[Tokens], list[list[Tokens]]]:
    hyps = [tokenizer(p) for p in predictions]
    refs = [[tokenizer(r) for r in rs] for rs in references]
    return hyps, refs


def _whitespace(text: str) -> Tokens:
    return text.split()


# ------------------------------------------------------------------------ tokenizers

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@lru_cache(maxsize=1)
def _tokenizer_13a() -> Callable[[str], str]:
    try:
        from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "recipes.common.generation_metrics needs sacrebleu: pip install sacrebleu nltk rouge-score"
        ) from e
    return Tokenizer13a()


def mteval_tokenize(text: str) -> Tokens:
    """Tokenize like ``mteval-v13a.pl`` without ``-c``: ASCII-lowercase, then the 13a rules."""
    return _tokenizer_13a()(text.translate(_ASCII_LOWER)).split()


# Punctuation tokens removed by the COCO caption toolkit after PTB tokenization. The toolkit
# lists "-LRB-" etc. in upper case, but compares them with *lower-cased* tokenizer output,
# so "-lrb-"/"-rrb-" survive; we keep that behaviour.
_COCO_PUNCT = frozenset(["''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"])
# Words after which PTB keeps a following period attached (abbreviations).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr no vs etc inc co ltd corp prof gen gov sen rep mt ft ave jan feb "
    "mar apr jun jul aug sep sept oct nov dec e.g i.e al ala ark ill adv calif mass penn wash "
    "fla tex".split()
)
_PERIOD_RE = re.compile(r"(\S+?)\.(?=\s|$|[\"')\]])")
_INITIALS_RE = re.compile(r"(?:[a-z]\.)*[a-z]")
_DIGIT_AHEAD_RE = re.compile(r"\s+\d")


def _split_period(m: re.Match[str]) -> str:
    word = m.group(1)
    if word.endswith("."):
        return m.group(0)
    rest = m.string[m.end() :]
    if word == "no" and not _DIGIT_AHEAD_RE.match(rest):
        return word + " ."
    if word in _ABBREVIATIONS or _INITIALS_RE.fullmatch(word):
        # PTB keeps "u.s." whole; at the very end it also emits a sentence-final ".".
        return word + ". ." if not rest.strip() else m.group(0)
    return word + " ."


@lru_cache(maxsize=1)
def _treebank() -> Any:
    try:
        from nltk.tokenize.treebank import TreebankWordTokenizer
    except ImportError as e:  # pragma: no cover
        raise ImportError(
            "recipes.common.generation_metrics needs nltk: pip install sacrebleu nltk rouge-score"
        ) from e
    return TreebankWordTokenizer()


def coco_tokenize(text: str) -> Tokens:
    """Approximate ``PTBTokenizer -lowerCase`` + punctuation removal of the COCO caption toolkit.

    Lowercases, splits punctuation and clitics PTB-style (``"it's" -> "it 's"``,
    ``"isn't" -> "is n't"``), maps ``£`` to ``#`` and ``(``/``)`` to ``-lrb-``/``-rrb-`` as
    PTB does, then drops the punctuation tokens the toolkit removes. Works offline (uses
    nltk's data-free Treebank tokenizer).
    """
    s = text.lower().replace("\n", " ")
    s = s.replace("&amp;", "&").replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
    s = s.replace("£", " # ").replace("€", " $ ")
    s = s.replace("\u2019", "'").replace("\u2018", "`")
    s = re.sub(r"[\u2013\u2014]", " -- ", s)
    s = re.sub(r"\.{2,}", " ... ", s)
    s = _PERIOD_RE.sub(_split_period, s)
    s = re.sub(r"(^|\s)\.(?=[a-z])", r"\1. ", s)  # ".blue" -> ". blue"
    s = re.sub(r"(?<=\w)-(?=\s|$)", " -", s)  # "non- smoking" -> "non - smoking"
    s = re.sub(r"(^|\s)-(?=[a-z])", r"\1- ", s)  # "-friendly" -> "- friendly"
    s = re.sub(r"(\d\.\d+)([a-z]+)\b", r"\1 \2", s)  # "1.8g" -> "1.8 g"
    s = re.sub(r"(?<=\w)'em\b", " 'em", s)
    s = re.sub(r"(^|\s)'(?=\w)(?!(?:n|em)'?(?:\s|$))", r"\1` ", s)  # opening single quote
    tokens = _treebank().tokenize(s, convert_parentheses=True)
    return [t.lower() for t in tokens if t.lower() not in _COCO_PUNCT]


# ----------------------------------------------------------------------------- BLEU


def corpus_bleu(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    tokenize: bool = True,
) -> float:
    """Corpus BLEU-4 with multiple references, as ``mteval-v13a.pl`` computes it; range 0-1.

    Clipped n-gram precisions (n=1..4) against the per-n-gram maximum count over the
    references, geometric mean, brevity penalty with the *closest* reference length (ties:
    the shorter), the mteval "exp" smoothing for an n-gram order without any match.
    Text is tokenized with :func:`mteval_tokenize` (``tokenize=False``: whitespace split,
    case kept). Computed with sacreBLEU and divided by 100. (Degenerate corpora without
    any 4-gram in any prediction score 0 here; mteval would count that precision as 1.)
    """
    _check_inputs(predictions, references)
    tok = mteval_tokenize if tokenize else _whitespace
    hyps, refs = _tokenize_all(predictions, references, tok)
    return _bleu_from_tokens(hyps, refs)


def _bleu_from_tokens(hyps: list[Tokens], refs: list[list[Tokens]]) -> float:
    from sacrebleu.metrics import BLEU

    n_streams = max(len(rs) for rs in refs)
    # sacreBLEU takes one stream per reference index; ``None`` marks a missing reference.
    streams = [[" ".join(rs[k]) if k < len(rs) else None for rs in refs] for k in range(n_streams)]
    scorer = BLEU(tokenize="none", lowercase=False, smooth_method="exp", force=True)
    return scorer.corpus_score([" ".join(h) for h in hyps], streams).score / 100.0


# ----------------------------------------------------------------------------- NIST

# Doddington (2002): beta makes the penalty 0.5 when the output is 2/3 of the reference length.
_NIST_BETA = -math.log(0.5) / math.log(1.5) ** 2


def _nist_length_penalty(ratio: float) -> float:
    if ratio >= 1.0:
        return 1.0
    if ratio <= 0.0:
        return 0.0
    return math.exp(-_NIST_BETA * math.log(ratio) ** 2)


def corpus_nist(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    max_order: int = 5,
    tokenize: bool = True,
) -> float:
    """Corpus NIST (n=1..5) with multiple references, following ``mteval-v13a.pl``.

    ``NIST = LP * sum_n [ sum_{matched n-grams g} Info(g) * clipped_count(g) / #n-grams(hyps) ]``
    with ``Info(w1..wn) = log2(count(w1..wn-1) / count(w1..wn))`` (``count(empty) =`` total
    reference words) over *all* references of the corpus, clipping by the maximum count in
    any single reference of that input, and
    ``LP = exp(-beta * log(min(1, L_sys / L_ref))**2)``, ``beta = -ln 0.5 / ln(1.5)**2``,
    where ``L_ref`` sums the *average* reference length of each input.

    This is not nltk's ``corpus_nist``: with several references nltk scores each input
    against its single best reference and uses that reference's length; with one
    reference per input the two coincide.
    """
    _check_inputs(predictions, references)
    tok = mteval_tokenize if tokenize else _whitespace
    hyps, refs = _tokenize_all(predictions, references, tok)
    return _nist_from_tokens(hyps, refs, max_order)


def _nist_from_tokens(hyps: list[Tokens], refs: list[list[Tokens]], max_order: int = 5) -> float:
    per_ref = [[_all_ngram_counts(r, max_order) for r in rs] for rs in refs]
    ref_counts: Counter[tuple[str, ...]] = Counter()
    for rcs in per_ref:
        for rc in rcs:
            ref_counts.update(rc)
    total_ref_words = sum(len(r) for rs in refs for r in rs)

    def info(g: tuple[str, ...]) -> float:
        prefix = ref_counts[g[:-1]] if len(g) > 1 else total_ref_words
        return math.log2(prefix / ref_counts[g])

    hit_info = [0.0] * max_order
    hyp_ngrams = [0] * max_order
    sys_len = 0
    ref_len = 0.0
    for h, rs, rcs in zip(hyps, refs, per_ref):
        max_ref: dict[tuple[str, ...], int] = {}
        for rc in rcs:
            for g, c in rc.items():
                if c > max_ref.get(g, 0):
                    max_ref[g] = c
        for g, c in _all_ngram_counts(h, max_order).items():
            if g in max_ref:
                hit_info[len(g) - 1] += info(g) * min(c, max_ref[g])
        for n in range(1, max_order + 1):
            hyp_ngrams[n - 1] += max(0, len(h) - n + 1)
        sys_len += len(h)
        ref_len += sum(len(r) for r in rs) / len(rs)
    score = sum(hi / max(cnt, 1) for hi, cnt in zip(hit_info, hyp_ngrams))
    return score * _nist_length_penalty(sys_len / ref_len if ref_len > 0 else 0.0)


# --------------------------------------------------------------------------- METEOR


class _NoSynonyms:
    """Stand-in for nltk's WordNet reader: no synsets, so METEOR does exact + stem matching."""

    @staticmethod
    def synsets(word: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


def meteor(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    alpha: float = 0.9,
    beta: float = 3.0,
    gamma: float = 0.5,
    tokenize: bool = True,
) -> float:
    """Mean sentence METEOR (exact + Porter-stem matching, **no synonyms**); range 0-1.

    Per reference: unigram alignment (exact matches first, then Porter-stem matches of
    the remaining words; nltk's greedy aligner), ``P = m / |hyp|``, ``R = m / |ref|``,
    ``Fmean = P R / (alpha P + (1 - alpha) R)``, ``Pen = gamma * (chunks / m) ** beta``,
    ``score = (1 - Pen) * Fmean`` (0 without matches). Multi-reference: the maximum over
    the references of each prediction, then the mean over predictions (nltk's behaviour).
    An exact copy of an ``n``-token reference scores ``1 - 0.5 / n**3``.

    WordNet synonym matching is absent (no PyPI package ships the data offline), and so
    are METEOR 1.5's paraphrase tables, function-word weighting and tuned parameters.
    The values are NOT comparable with the METEOR 1.5 numbers of ``e2e-metrics`` and the
    DP papers: on E2E they come out far *higher* (0.79 vs 0.46 for human references, see
    the module docstring) despite the missing synonyms. Use :func:`meteor15` for the
    official number. Text is tokenized with :func:`coco_tokenize`, like the COCO METEOR
    input.
    """
    _check_inputs(predictions, references)
    tok = coco_tokenize if tokenize else _whitespace
    hyps, refs = _tokenize_all(predictions, references, tok)
    return _meteor_from_tokens(hyps, refs, alpha=alpha, beta=beta, gamma=gamma)


def _meteor_from_tokens(
    hyps: list[Tokens],
    refs: list[list[Tokens]],
    *,
    alpha: float = 0.9,
    beta: float = 3.0,
    gamma: float = 0.5,
) -> float:
    from nltk.stem.porter import PorterStemmer
    from nltk.translate.meteor_score import meteor_score

    stemmer = PorterStemmer()
    wordnet = _NoSynonyms()
    total = 0.0
    for h, rs in zip(hyps, refs):
        total += meteor_score(rs, h, stemmer=stemmer, wordnet=wordnet, alpha=alpha, beta=beta, gamma=gamma)
    return total / len(hyps)


def meteor15_available() -> bool:
    """True if :func:`meteor15` can run: ``pycocoevalcap`` importable and ``java`` on PATH."""
    import importlib.util
    import shutil

    return importlib.util.find_spec("pycocoevalcap") is not None and shutil.which("java") is not None


def meteor15(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    tokenize: bool = True,
) -> float:
    """The official METEOR 1.5 score of ``e2e-metrics`` (optional; needs Java); range 0-1.

    Runs ``meteor-1.5.jar -l en -norm`` (WordNet synonyms, paraphrase table, tuned English
    parameters) through the COCO caption toolkit's wrapper shipped by the PyPI package
    ``pycocoevalcap`` (1.2; the jar and its data are inside the wheel, nothing is
    downloaded) and returns the corpus-level score the toolkit reports: METEOR computed
    from the sufficient statistics summed over all predictions, each scored against its
    best reference. Input is tokenized with :func:`coco_tokenize`, as the toolkit's PTB
    step does. Starting the JVM and loading the paraphrase table takes ~7 s.

    Raises ``RuntimeError`` when ``pycocoevalcap`` or ``java`` is missing; see
    :func:`meteor15_available`.
    """
    _check_inputs(predictions, references)
    if not meteor15_available():
        raise RuntimeError(
            "meteor15 needs the 'pycocoevalcap' package (pip install pycocoevalcap==1.2) "
            "and a Java runtime on PATH; use meteor() for the pure-Python approximation"
        )
    from pycocoevalcap.meteor.meteor import Meteor

    tok = coco_tokenize if tokenize else _whitespace

    def clean(text: str) -> str:  # "|||" is the field separator of the jar's stdio protocol
        return " ".join(tok(text)).replace("|||", " ")

    gts = {i: [clean(r) for r in rs] for i, rs in enumerate(references)}
    res = {i: [clean(p)] for i, p in enumerate(predictions)}
    scorer = Meteor()
    try:
        score, _ = scorer.compute_score(gts, res)
    finally:
        # Stop the JVM here rather than in the wrapper's __del__, which would block forever
        # on its lock if compute_score failed while holding it.
        proc = scorer.meteor_p
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
        proc.kill()
        proc.wait()
        if scorer.lock.locked():
            scorer.lock.release()
    return float(score)


# -------------------------------------------------------------------------- ROUGE-L


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _rouge_l_sentence(hyp: Tokens, refs: list[Tokens], beta: float) -> float:
    if not hyp:
        return 0.0
    precisions, recalls = [], []
    for r in refs:
        lcs = _lcs_length(r, hyp)
        precisions.append(lcs / len(hyp))
        recalls.append(lcs / len(r) if r else 0.0)
    p, r = max(precisions), max(recalls)
    if p == 0.0 or r == 0.0:
        return 0.0
    return (1 + beta**2) * p * r / (r + beta**2 * p)


def rouge_l(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    beta: float = 1.2,
    tokenize: bool = True,
) -> float:
    """ROUGE-L of the COCO caption toolkit (as in ``e2e-metrics``); range 0-1.

    Per prediction: ``P_j = LCS(hyp, ref_j) / |hyp|``, ``R_j = LCS / |ref_j|``; then
    ``P = max_j P_j`` and ``R = max_j R_j`` (maxima taken *separately*, which can combine
    two different references) and ``F = (1 + beta^2) P R / (R + beta^2 P)`` with
    ``beta = 1.2``; the corpus score is the mean of ``F`` over predictions. Text is
    tokenized with :func:`coco_tokenize`.
    """
    _check_inputs(predictions, references)
    tok = coco_tokenize if tokenize else _whitespace
    hyps, refs = _tokenize_all(predictions, references, tok)
    return _rouge_l_from_tokens(hyps, refs, beta)


def _rouge_l_from_tokens(hyps: list[Tokens], refs: list[list[Tokens]], beta: float = 1.2) -> float:
    return sum(_rouge_l_sentence(h, rs, beta) for h, rs in zip(hyps, refs)) / len(hyps)


# ---------------------------------------------------------------------------- CIDEr


def cider(
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
    *,
    max_order: int = 4,
    sigma: float = 6.0,
    tokenize: bool = True,
) -> float:
    """CIDEr-D (Vedantam et al., 2015), as scored by the COCO toolkit; range 0-10.

    For n = 1..4 each sentence becomes a tf-idf vector ``g_n`` over its n-grams,
    ``g_n(w) = count(w) * log(N / df(w))`` where ``N`` is the number of predictions and
    ``df(w)`` the number of predictions whose reference set contains ``w`` (so the idf
    statistics come from the references of the evaluated corpus only). Then

    ``CIDEr-D_n(c, S) = 10/m * sum_j exp(-(l_c - l_j)^2 / (2 sigma^2)) *
    sum_w min(g_n^c(w), g_n^j(w)) g_n^j(w) / (||g_n^c|| ||g_n^j||)``

    (a term whose norm is 0 counts as 0), ``CIDEr-D = mean_n CIDEr-D_n``, ``sigma = 6``,
    ``l`` = sentence length in tokens, and the corpus score is the mean over predictions.
    The maximum, 10, needs every reference of an input to equal the prediction. With a
    single prediction every idf is ``log 1 = 0`` and the score is 0. Text is tokenized
    with :func:`coco_tokenize`.
    """
    _check_inputs(predictions, references)
    tok = coco_tokenize if tokenize else _whitespace
    hyps, refs = _tokenize_all(predictions, references, tok)
    return _cider_from_tokens(hyps, refs, max_order, sigma)


def _tfidf(
    counts: Counter[tuple[str, ...]], idf: dict[tuple[str, ...], float], log_n: float, max_order: int
) -> tuple[list[dict[tuple[str, ...], float]], list[float]]:
    # idf(g) = log(N / max(1, df(g))); n-grams absent from every reference set get log N.
    vecs: list[dict[tuple[str, ...], float]] = [{} for _ in range(max_order)]
    norms = [0.0] * max_order
    for g, tf in counts.items():
        w = tf * idf.get(g, log_n)
        vecs[len(g) - 1][g] = w
        norms[len(g) - 1] += w * w
    return vecs, [math.sqrt(x) for x in norms]


def _cider_from_tokens(
    hyps: list[Tokens], refs: list[list[Tokens]], max_order: int = 4, sigma: float = 6.0
) -> float:
    ref_counts = [[_all_ngram_counts(r, max_order) for r in rs] for rs in refs]
    df: Counter[tuple[str, ...]] = Counter()
    for rcs in ref_counts:
        df.update({g for rc in rcs for g in rc})
    log_n = math.log(float(len(hyps)))
    idf = {g: log_n - math.log(c) for g, c in df.items()}
    total = 0.0
    for h, rs, rcs in zip(hyps, refs, ref_counts):
        hv, hn = _tfidf(_all_ngram_counts(h, max_order), idf, log_n, max_order)
        score = 0.0
        for r, rc in zip(rs, rcs):
            rv, rn = _tfidf(rc, idf, log_n, max_order)
            penalty = math.exp(-((len(h) - len(r)) ** 2) / (2 * sigma**2))
            for n in range(max_order):
                if hn[n] == 0.0 or rn[n] == 0.0:
                    continue
                rvn = rv[n]
                dot = 0.0
                for g, w in hv[n].items():
                    x = rvn.get(g)
                    if x:  # clipped: min(hyp weight, ref weight) * ref weight
                        dot += min(w, x) * x
                score += penalty * dot / (hn[n] * rn[n])
        total += 10.0 * score / (max_order * len(rs))
    return total / len(hyps)


# --------------------------------------------------------------------------- bundle


def compute_generation_metrics(
    predictions: list[str],
    references: list[list[str]],
    *,
    official_meteor: bool = False,
) -> dict[str, float]:
    """All five E2E-challenge metrics for ``predictions[i]`` against ``references[i]``.

    Returns ``{"bleu", "nist", "meteor", "rouge_l", "cider"}`` on the ``e2e-metrics``
    scales (BLEU, METEOR, ROUGE-L in 0-1; NIST unbounded, ~8 on E2E; CIDEr 0-10, ~2 on
    E2E). ``"meteor"`` is the pure-Python :func:`meteor` (exact + stem matching, nltk
    parameters; not comparable to published METEOR 1.5 values) unless
    ``official_meteor=True``, which uses :func:`meteor15` (needs Java + ``pycocoevalcap``).
    See the module docstring for the tokenization of each metric.
    """
    _check_inputs(predictions, references)
    mt_hyps, mt_refs = _tokenize_all(predictions, references, mteval_tokenize)
    co_hyps, co_refs = _tokenize_all(predictions, references, coco_tokenize)
    return {
        "bleu": _bleu_from_tokens(mt_hyps, mt_refs),
        "nist": _nist_from_tokens(mt_hyps, mt_refs),
        "meteor": (
            meteor15(predictions, references) if official_meteor else _meteor_from_tokens(co_hyps, co_refs)
        ),
        "rouge_l": _rouge_l_from_tokens(co_hyps, co_refs),
        "cider": _cider_from_tokens(co_hyps, co_refs),
    }


# -------------------------------------------------------------------------- loaders


def load_e2e_csv(path: str | os.PathLike[str]) -> list[tuple[str, list[str]]]:
    """Read an official E2E CSV (columns ``mr,ref``) as ``[(mr, [ref, ...]), ...]``.

    Rows are grouped by the exact ``mr`` string; groups keep the order in which each MR
    first appears and references keep file order (the official test set has 4,693 rows
    over 630 MRs).
    """
    groups: dict[str, list[str]] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = {"mr", "ref"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: expected columns 'mr' and 'ref', missing {sorted(missing)}")
        for row in reader:
            groups.setdefault(row["mr"], []).append(row["ref"])
    return list(groups.items())


def load_dart_json(path: str | os.PathLike[str]) -> list[tuple[list[list[str]], list[str]]]:
    """Read an official DART JSON file as ``[(tripleset, [reference text, ...]), ...]``.

    The file is a list of ``{"tripleset": [[subject, relation, object], ...],
    "annotations": [{"source": ..., "text": ...}, ...], ...}``; entries keep file order
    and references keep annotation order.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of DART entries")
    out: list[tuple[list[list[str]], list[str]]] = []
    for entry in data:
        tripleset = [list(t) for t in entry["tripleset"]]
        texts = [a["text"] for a in entry.get("annotations", [])]
        out.append((tripleset, texts))
    return out
