"""Classification accuracy as an offline ``evaluate`` metric (the GLUE recipe's ``compute_metrics``).

Shipped with the recipes; load it with ``recipes.common.metrics.load("accuracy")`` or
``evaluate.load(recipes.common.metrics.module_path("accuracy"))``. Nothing is fetched from the Hub.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy: the share of predictions equal to their reference label, mean(predictions == references),
computed with numpy. With sample_weight, the weighted share sum(w * (p == r)) / sum(w).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list or array of int): predicted labels (e.g. argmax of the logits).
    references (list or array of int): true labels.
    sample_weight (list or array of float, optional): per-example weights.
Returns:
    accuracy (float): in [0, 1].
Example:
    >>> import recipes.common.metrics
    >>> accuracy = recipes.common.metrics.load("accuracy")
    >>> accuracy.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            format="numpy",
        )

    def _compute(self, predictions, references, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        if sample_weight is None:
            return {"accuracy": float(correct.mean())}
        weights = np.asarray(sample_weight, dtype=np.float64)
        if weights.shape != correct.shape:
            raise ValueError(f"sample_weight has shape {weights.shape}, predictions {correct.shape}")
        return {"accuracy": float((weights * correct).sum() / weights.sum())}
