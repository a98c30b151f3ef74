"""Per-example losses: one loss per example, never a mean over the batch.

* ``tasks``: :func:`per_example_loss` for token, sequence and seq2seq heads, and its dispatch.
* ``question_answering``: span (start/end) losses of extractive QA heads.
* ``router``: the auxiliary router losses of mixture-of-experts models, per example.
"""
