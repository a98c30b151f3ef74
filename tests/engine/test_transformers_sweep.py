"""A sweep of transformers' text model types: each family's one DPTrainer step at noise 0 is exact
against the float64 per-example reference, or refused by name before any step, never a crash inside
torch/transformers.

A few representatives of the sweep's table (docs/large_models.md, "Architectures swept"): families exact
through the generic rules and structural checks, Helium and Gemma 4 whose RMSNorm multiplies in float32
(``w.float() * n(x)``: a float32 term, where the input-dtype scale form's float64 term failed the first-step
check in float64), Cohere's float32 LayerNorm without bias and MobileBERT's ``NoNorm`` (``x * w + b``), each
with its own rule, and layers without a rule refused by name (DeBERTa v1's LayerNorm, DiffLlama's attention
with its own parameters).
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import _config, _head, _relative_error, _train

from hf_dpfilter import UnsupportedLayerError

TINY = dict(num_key_value_heads=2, head_dim=8)
#: model type -> extra config (on top of test_model_families.COMMON)
EXACT = {
    "helium": TINY,
    "gemma4_text": dict(TINY, num_key_value_heads=1, num_global_key_value_heads=1, global_head_dim=8,
                        hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=8),
    "biogpt": {},
    "ernie4_5": TINY,
    "eurobert": TINY,
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=8, num_feedforward_networks=1),  # NoNorm
    "cohere": dict(TINY, use_qk_norm=True),  # CohereLayerNorm: (d,) and per-head (heads, head_dim) weights
}
REFUSED = {
    "deberta": ({}, "DebertaLayerNorm"),
    "diffllama": (TINY, "lambda_q1"),
}


def _model(model_type: str, extra: dict, head: str, dtype=torch.float64):
    torch.manual_seed(0)
    return _head(head).from_config(_config(model_type, extra, 0.0)).to(dtype)


@pytest.mark.parametrize("model_type", list(EXACT))
def test_swept_family_is_exact(model_type, tmp_path):
    from helpers import PadCollator

    head = "cls" if model_type in ("eurobert", "mobilebert") else "lm"
    model = _model(model_type, EXACT[model_type], head)
    # a float32 product (Helium's, Gemma 4's RMSNorm) rounds its term to float32: ~1e-8 relative
    assert _relative_error(model, tmp_path, head, PadCollator(model.config.pad_token_id or 0)) <= 1e-6


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_swept_family_is_refused_by_name(model_type, tmp_path):
    extra, name = REFUSED[model_type]
    with pytest.raises(UnsupportedLayerError, match=name):
        head = "cls" if model_type == "deberta" else "lm"
        _train(_model(model_type, extra, head, torch.float32), tmp_path, head)
