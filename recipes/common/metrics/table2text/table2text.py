"""The E2E / DART generation metrics (BLEU, NIST, METEOR, ROUGE-L, CIDEr) as an offline ``evaluate`` metric.

A thin wrapper: ``_compute`` calls :func:`recipes.common.generation_metrics.compute_generation_metrics`,
the exact offline implementations (``e2e-metrics`` conventions and scales; see that module for the
tokenization of each metric and the METEOR caveat). Shipped with the recipes; load it with
``recipes.common.metrics.load("table2text")`` or
``evaluate.load(recipes.common.metrics.module_path("table2text"))``. Nothing is fetched from the Hub.
"""

import datasets
import evaluate

from recipes.common.generation_metrics import compute_generation_metrics

_DESCRIPTION = """
The five metrics of the E2E NLG challenge script (e2e-metrics, measure_scores.py), each against all
references of an input, as reported for DP fine-tuning on E2E and DART: BLEU (0-1), NIST (0 to ~15),
METEOR (0-1; an offline approximation without synonyms unless official_meteor=True), ROUGE-L (0-1)
and CIDEr (0-10). Computed by recipes.common.generation_metrics.compute_generation_metrics.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): one generated text per input.
    references (list of list of str): all reference texts of each input (a single str per input is
        taken as one reference).
    official_meteor (bool, default False): METEOR 1.5 (needs Java and pycocoevalcap) instead of the
        pure-Python approximation.
Returns:
    bleu, nist, meteor, rouge_l, cider (float).
Example:
    >>> import recipes.common.metrics
    >>> table2text = recipes.common.metrics.load("table2text")
    >>> scores = table2text.compute(predictions=["the cat sat"], references=[["the cat sat", "a cat sat"]])
    >>> sorted(scores)
    ['bleu', 'cider', 'meteor', 'nist', 'rouge_l']
"""

_CITATION = """
Dusek, Novikova and Rieser (2020), Evaluating the state-of-the-art of End-to-End Natural Language
Generation: The E2E NLG challenge. Computer Speech & Language 59.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Table2Text(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string"),
                        "references": datasets.Sequence(datasets.Value("string")),
                    }
                ),
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
                ),
            ],
            codebase_urls=["https://github.com/tuetschek/e2e-metrics"],
        )

    def _compute(self, predictions, references, official_meteor=False):
        references = [[refs] if isinstance(refs, str) else list(refs) for refs in references]
        return compute_generation_metrics(list(predictions), references, official_meteor=official_meteor)
