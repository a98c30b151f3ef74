"""Layers called on a batch merged with another axis: exact when the merge is traced, refused when it mixes
examples.

OPT's decoder layer flattens its hidden states to ``(B*T, d)`` before ``final_layer_norm``, ``fc1`` and
``fc2``; BLOOM runs attention on ``(B*H, T, D)`` (``baddbmm``/``bmm``) before its output projection. The
batch-axis tracer follows those views, so each row is proven to belong to example ``r // k`` and the layers
train exactly: one DPTrainer step at noise 0 equals the one-example-at-a-time float64 reference
(classification and causal LM, right and left padding; both families are declared ``"mask"`` in
``POSITION_SCHEMES``). BLOOM left-padded is NaN in float64 (its float64 mask overflows to -inf in the float32
softmax on the pads' fully masked rows): checked in float32, the precision its softmax computes in anyway. A
view that puts two examples in one row, or one of the same ``(B*T, d)`` shape whose rows interleave the
examples, is refused by name before anything is released.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LeftPadCollator, PadCollator
from models import VOCAB
from test_model_families import _args, _config, _head, _relative_error, _train
from torch import nn

from hf_dpfilter import DPTrainer
from hf_dpfilter.proofs.batch_axis import LOST, BatchAxisTracer
from hf_dpfilter.proofs.padding import POSITION_SCHEMES

FAMILIES = {"opt": dict(ffn_dim=24, word_embed_proj_dim=16), "bloom": dict(n_layer=2, n_head=2)}
#: (family, head, padding side, dtype)
CASES = [(f, h, s, torch.float32 if (f, s) == ("bloom", "left") else torch.float64)
         for f in FAMILIES for h in ("cls", "lm") for s in ("right", "left")]


def _model(name: str, head: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return _head(head).from_config(_config(name, FAMILIES[name], 0.0)).to(dtype)


@pytest.mark.parametrize(("name", "head", "side", "dtype"), CASES,
                         ids=[f"{f}-{h}-{s}" for f, h, s, _ in CASES])
def test_one_step_equals_the_per_example_reference(name, head, side, dtype, tmp_path):
    assert POSITION_SCHEMES[name].kind == "mask"  # positions (OPT) and ALiBi (BLOOM) counted over the mask
    model = _model(name, head, dtype)
    pad = model.config.pad_token_id or 0
    collator = LeftPadCollator(pad) if side == "left" else PadCollator(pad)
    error = _relative_error(model, tmp_path, head, collator)
    assert error <= (1e-6 if dtype == torch.float64 else 1e-4), error


# ----------------------------------------------------------------------------- the tracer on merged axes
def _heads(x):  # (B, T, H*D) -> (B*H, T, D) as BLOOM does: row r of the merged dimension is example r // H
    return x.view(2, 3, 2, 2).transpose(1, 2).reshape(4, 3, 2)


LOST_TAG = (LOST, 1)
TRACED = {  # x: (B=2, T=3, d=4) batch-first -> the tag of the result
    "flatten (B*T, d)": (lambda x: x.reshape(-1, 4), (0, 3)),
    "flatten and back": (lambda x: x.reshape(-1, 4).view(2, 3, 4), (0, 1)),
    "interleaved (T*B, d)": (lambda x: x.transpose(0, 1).reshape(-1, 4), LOST_TAG),
    "merged, summed over rows": (lambda x: x.reshape(-1, 4).sum(0), LOST_TAG),
    "merged, transposed": (lambda x: x.reshape(-1, 4).t(), (1, 3)),
    "bmm on (B*H, T, D)": (lambda x: torch.bmm(_heads(x), _heads(x).transpose(1, 2)), (0, 2)),
    "matmul on (B*H, T, D) (DeBERTa's q @ k^T)": (lambda x: torch.matmul(_heads(x),
                                                                         _heads(x).transpose(-1, -2) / 2),
                                                 (0, 2)),
    "bmm, batch on a matrix dim": (lambda x: torch.bmm(_heads(x).transpose(0, 1),
                                                       _heads(x).transpose(0, 1).mT),
                                   LOST_TAG),
    "baddbmm (ALiBi)": (lambda x: _heads(x)[:, :1, :1].expand(4, 3, 3).baddbmm(
        batch1=_heads(x), batch2=_heads(x).transpose(1, 2)), (0, 2)),
    "addbmm sums the examples": (lambda x: torch.addbmm(torch.zeros(3, 3), _heads(x),
                                                        _heads(x).transpose(1, 2)),
                                 LOST_TAG),
}


@pytest.mark.parametrize("case", list(TRACED))
def test_the_tracer_follows_a_merged_batch(case):
    function, expected = TRACED[case]
    x = torch.randn(2, 3, 4)
    with BatchAxisTracer(2) as tracer:
        tracer.tag(x, 0)
        out = function(x)
        assert tracer.tag_of(out) == expected


# ----------------------------------------------------------------------------- views that mix examples
class _Mixer(nn.Module):
    """Token embeddings, a view of them that is NOT per example, a trainable layer on it, then per-example
    logits.

    ``pairs``: the pooled ``(B, d)`` viewed as ``(B/2, 2d)``, two examples in each row, under a Linear.
    ``interleaved``: ``(B, T, d)`` -> ``(T, B, d)`` -> ``(T*B, d)``, OPT's shape with row r of example r % B,
    under a LayerNorm (the shape alone cannot tell it from OPT's ``(B*T, d)``)."""

    def __init__(self, kind: str) -> None:
        from transformers import PretrainedConfig

        super().__init__()
        torch.manual_seed(0)
        self.config = PretrainedConfig()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, 8)
        self.pair = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask, **kwargs):
        h = self.embed(input_ids)
        batch, length, width = h.shape
        if self.kind == "pairs":
            pooled = (h * attention_mask.unsqueeze(-1)).sum(1)
            return {"logits": self.pair(pooled.reshape(batch // 2, 2 * width)).reshape(batch, 2)}
        rows = self.norm(h.transpose(0, 1).reshape(length * batch, width))
        h = rows.reshape(length, batch, width).transpose(0, 1)
        return {"logits": self.head((h * attention_mask.unsqueeze(-1)).sum(1))}


@pytest.mark.parametrize(("kind", "module", "fix"),
                         [("pairs", "pair", "Linear"), ("interleaved", "norm", "LayerNorm")])
def test_a_view_that_mixes_examples_is_refused_by_name(kind, module, fix, tmp_path):
    model = _Mixer(kind)
    if kind == "pairs":
        for param in [*model.norm.parameters(), *model.head.parameters()]:
            param.requires_grad_(False)
    else:
        model.pair.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"(?s)Module '{module}' \({fix}.*lost its batch axis.*rows stay "
                                           r"per example.*Nothing was released"):
        _train(model, tmp_path, "cls", n=4)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_an_embedding_on_lost_ids_keeps_the_ids_fix(tmp_path):
    """The fix named for a table on ids stays the ids one (shaped (B, T), or broadcast as (1, T))."""

    class Table(_Mixer):
        def forward(self, input_ids, attention_mask, **kwargs):
            h = self.embed(input_ids.transpose(0, 1).reshape(-1))  # ids interleaved across examples
            h = h.reshape(input_ids.shape[1], input_ids.shape[0], -1).transpose(0, 1)
            return {"logits": self.head((h * attention_mask.unsqueeze(-1)).sum(1))}

    model = Table("ids")
    model.pair.requires_grad_(False)
    model.norm.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"(?s)Module 'embed' \(Embedding.*call it on ids derived from the "
                                           r"batch"):
        DPTrainer(model=model, args=_args(tmp_path, 4), train_dataset=_dataset(4),
                  data_collator=PadCollator(0)).train()


def _dataset(n: int):
    from helpers import ListDataset, make_examples

    return ListDataset(make_examples(n, VOCAB, causal=False, seed=3))


class _FlattenedFeedForward(nn.Module):
    """An embedding, then a Linear on the tokens merged with the batch (OPT's ``reshape(-1, d)``), then a
    head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, position_ids=None, **_):
        h = self.embed(input_ids)
        h = self.mid(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return self.head(h)


def test_merged_batch_axis_on_packed_rows_is_refused_by_name():
    """On packed rows the engine regroups one token axis per packed example; which axes the batch was merged
    with (OPT's tokens, BLOOM's heads, which a head count equal to the row length would pass for tokens) is
    not recorded, so a call on a merged batch is refused by name, with the fix, before any gradient is
    formed."""
    from helpers import make_examples
    from transformers import DataCollatorWithFlattening

    from hf_dpfilter import GhostClippingEngine
    from hf_dpfilter.data.packing import PackedLayout, PackingError

    model = _FlattenedFeedForward()
    batch = DataCollatorWithFlattening()(make_examples(3, VOCAB, causal=True))
    layout = PackedLayout.from_position_ids(batch["position_ids"])
    engine = GhostClippingEngine(model, verify_first_backward=False)
    with pytest.raises(PackingError, match="'mid'.*merged with other axes.*padding collator"):
        with engine.packed(layout), engine.record(batch_size=layout.num_examples):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])


def test_user_level_units_on_padded_rows_clip_each_users_merged_rows_together(tmp_path):
    """privacy_unit='user' with OPT (fc1/fc2 on (B*T, d)) on padded rows: the merged call is viewed per row
    and a user's rows concatenated, so one step at noise 0 equals the float64 per-user reference (it was
    refused as "packed rows" although every example had its own row)."""
    from helpers import ListDataset, flat
    from test_units import _args as _user_args
    from test_units import _per_user_reference, _user_data

    model = _model("opt", "lm", torch.float64).eval()
    data = _user_data()
    params = [p for p in model.parameters() if p.requires_grad]
    clip, expected = _per_user_reference(model, data, params)
    before = [p.detach().clone() for p in params]
    DPTrainer(model=model, args=_user_args(tmp_path, per_sample_max_grad_norm=clip),
              train_dataset=ListDataset(data),
              data_collator=PadCollator(model.config.pad_token_id)).train()
    got = flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10
