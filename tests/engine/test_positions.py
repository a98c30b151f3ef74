"""Shared outputs and tied output biases: BART, T5 and masked-LM heads, exact per example.

* BART's ``BartLearnedPositionalEmbedding`` reads only the shape of its input and T5's
  ``relative_attention_bias`` runs on bucketed ``arange`` positions: the trace proves that their outputs
  derive from no batch tensor (SHARED), and each example's gradient of the shared output gives its own
  gradient of the table (hf_dpfilter.engine.shared_outputs). BART classification and seq2seq, T5 seq2seq: one
  DPTrainer step at noise 0 equals the float64 per-example reference (each example alone, decoder labels
  padded with -100) within 1e-6.
* BERT's ``cls.predictions.bias`` and RoBERTa's ``lm_head.bias`` are the decoder's bias (tied): the decoder's
  rule covers them, used only inside it (checked on the proving forward); BERT and RoBERTa MLM exact.
* A leaf module adding or multiplying its one vector parameter (``x + v``, a layer scale ``x * v``, as
  DINOv2's ``Dinov2LayerScale``) gets that form's rule from a structural probe (at a random ``v``); another
  form is refused by name.
* A shared table evaluated at several parameter points (``call_model``, as DiSK/PMLF/DIFF2 do): each example's
  combination equals the one-example-at-a-time reference.
* A module whose untagged output was built from values of the batch read into Python is refused by name; a
  module using a tied parameter outside the sub-module whose rule covers it is refused by name. (Tables on
  ``arange(T)`` exact and within sensitivity, T5's bias too: tests/proofs/test_declared_structure.py.)
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB
from test_model_families import Seq2SeqCollator, _args, _config, _head, _reference
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from hf_dpfilter import DPTrainer
from hf_dpfilter.engine.rules import UnsupportedLayerError

TINY = dict(d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64, decoder_start_token_id=2)
#: name -> (model_type, head, config)
CASES = {
    "bart-cls": ("bart", "cls", TINY),
    "bart-s2s": ("bart", "s2s", TINY),
    "t5-s2s": ("t5", "s2s",
               dict(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, decoder_start_token_id=0,
                                  relative_attention_num_buckets=8, relative_attention_max_distance=16)),
    "bert-mlm": ("bert", "mlm", {}),
    "roberta-mlm": ("roberta", "mlm", {"pad_token_id": 1}),
}


def _model(name: str) -> nn.Module:
    import transformers

    model_type, head, extra = CASES[name]
    torch.manual_seed(0)
    config = _config(model_type, extra, dropout=0.0)
    cls = transformers.AutoModelForMaskedLM if head == "mlm" else _head(head)
    return cls.from_config(config).double().eval()


def _max_difference(model, tmp_path, head: str, collator) -> float:
    """max |one DPTrainer step's clipped sum - the per-example reference| (q = 1, noise 0, SGD lr 1)."""
    examples = make_examples(4, VOCAB, causal=head != "cls", seed=3)
    if head == "cls":  # BART's classification head reads each example's last <eos> (id 2)
        examples = [{**e, "input_ids": torch.cat([e["input_ids"], torch.tensor([2])])} for e in examples]
    clip = float(_reference(model, examples, collator, None).median())  # some examples clipped, some not
    expected = _reference(model, examples, collator, clip)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    DPTrainer(model=model, args=_args(tmp_path, 4, clip), train_dataset=ListDataset(examples),
              data_collator=collator).train()
    got = -len(examples) * flat([p.detach() - b for p, b in zip(params, before)])
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_one_step_equals_the_per_example_reference(name, tmp_path):
    model = _model(name)
    head = CASES[name][1]
    pad = model.config.pad_token_id or 0
    collator = Seq2SeqCollator(pad) if head == "s2s" else PadCollator(pad)
    difference = _max_difference(model, tmp_path, head, collator)
    print(f"{name}: max |difference| {difference:.1e}")
    assert difference <= 1e-6


# ------------------------------------------------------------------------------------------------ refusals
class _Classifier(nn.Module):
    """Token embedding plus ``self.pos(input_ids)``, mean-pooled into a linear head."""

    def __init__(self, pos: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos, self.head = nn.Embedding(VOCAB, 8), pos, nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask, **kwargs):
        h = self.embed(input_ids) + self.pos(input_ids)
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return SequenceClassifierOutput(logits=self.head((h * mask).sum(1) / mask.sum(1)))


class _LengthFromValues(nn.Embedding):
    """A positional table whose positions count the batch's non-pad tokens, read into Python (``int(...)``):
    its output carries no batch axis but depends on the data of every example."""

    def forward(self, input_ids):
        real = int((input_ids != 0).sum(-1).max())
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).clamp(max=real - 1)
        return super().forward(positions)


class _TiedBiasOutsideDecoder(nn.Module):
    """A head whose own bias is its decoder's (tied, as BERT's) and is also added once more outside the
    decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 8)
        self.bias = self.decoder.bias

    def forward(self, h):
        return self.decoder(h) + self.bias


def _train_classifier(model, tmp_path) -> None:
    examples = make_examples(4, VOCAB, causal=False, seed=3)
    DPTrainer(model=model, args=_args(tmp_path, 4), train_dataset=ListDataset(examples),
              data_collator=PadCollator(0)).train()


def test_positions_built_from_values_of_the_batch_are_refused_by_name(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)Module 'pos' \(_LengthFromValues.*read values of the batch"):
        _train_classifier(_Classifier(_LengthFromValues(16, 8)), tmp_path)


def test_a_tied_parameter_used_outside_the_covering_rule_is_refused_by_name(tmp_path):
    model = _Classifier(nn.Embedding(VOCAB, 8))
    model.head = nn.Sequential(_TiedBiasOutsideDecoder(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match=r"(?s)'head.0.bias'.*'head.0.decoder'.*also used in "
                                                    r"'head.0'"):
        _train_classifier(model, tmp_path)


class _ArangeTable(nn.Embedding):
    """A learned positional table that reads only the shape of its input (as BART's does)."""

    def forward(self, input_ids):
        return super().forward(torch.arange(input_ids.shape[1], device=input_ids.device))


class _ScoreModel(nn.Module):
    """Token embedding plus the shared positional table, mean-pooled to one score per example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos, self.head = nn.Embedding(VOCAB, 8), _ArangeTable(16, 8), nn.Linear(8, 1)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids) + self.pos(input_ids)).mean(1))


def test_a_shared_table_at_several_parameter_points_is_exact():
    """DiSK/PMLF/DIFF2 evaluate the model at other values of the parameters (``call_model``): the shared
    table's per-example gradient is taken at the values its forward used, each example's combination as the
    reference's."""
    from test_points import _loss_fn
    from test_points import _reference as points_reference

    from hf_dpfilter.engine import GhostClippingEngine, per_example_combination

    model = _ScoreModel().double()
    engine = GhostClippingEngine(model)
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    other = {p: p.detach() * 0.5 + 0.1 + (p - p.detach()) for p in params}
    points = [(1.0, None), (-0.5, other)]
    grads, _, _ = per_example_combination(engine, _loss_fn(engine, ids), points, len(ids), params)
    torch.testing.assert_close(grads.norms(), points_reference(model, ids, points, 0), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------- a vector added or multiplied
class _LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        return x * self.gamma


class _AddedBias(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        # zero at first: the probe uses a random value, not this one
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x + self.shift


class _ShiftedScale(_AddedBias):
    def forward(self, x):
        return x * self.shift + 1.0  # neither form


class _VectorModel(_Classifier):
    def __init__(self, vector: nn.Module) -> None:
        super().__init__(_ArangeTable(16, 8))
        self.vector = vector

    def forward(self, input_ids, attention_mask, **kwargs):
        h = torch.tanh(self.vector(self.embed(input_ids) + self.pos(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return SequenceClassifierOutput(logits=self.head((h * mask).sum(1) / mask.sum(1)))


@pytest.mark.parametrize("vector", [_LayerScale, _AddedBias], ids=["scale", "bias"])
def test_a_vector_added_or_multiplied_in_a_leaf_forward_is_exact(vector, tmp_path):
    model = _VectorModel(vector(8)).double()
    assert _max_difference(model, tmp_path, "cls", PadCollator(0)) <= 1e-6


def test_a_vector_in_another_form_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedLayerError, match=r"'vector.shift'.*_ShiftedScale"):
        _train_classifier(_VectorModel(_ShiftedScale(8)), tmp_path)
