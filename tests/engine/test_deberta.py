"""DeBERTa-v2/v3 exact: the relative-position table every example shares gets each example's own gradient.

DeBERTa reads ``encoder.rel_embeddings.weight`` directly, normalises it with ``encoder.LayerNorm`` and
projects the same rows in every attention layer (``query_proj``/``key_proj`` with ``share_att_key``, else
``pos_key_proj``/ ``pos_query_proj``), then reshapes the projection by its own shape and repeats it over the
batch; its attention runs on ``(B·heads, T, D)``. One DPTrainer step at noise 0 (float64, right padding)
equals the one-example-at-a-time clipped sum, for full fine-tuning (sequence and token classification, both
projection layouts) and for LoRA on ``query_proj``/``value_proj`` (hf_dpfilter.engine.shared_tables,
hf_dpfilter.engine.shared_outputs). A module whose batch-free output the model uses by its own shape, outside
a declared encoder, is refused by name before anything is released, never a torch error.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB
from test_declared_structure import ids_batch, sensitivity_ratio
from test_model_families import _args, _head, _relative_error
from torch import nn

from hf_dpfilter import DPTrainer, UnsupportedLayerError

#: DeBERTa-v3's layout (relative attention, log buckets, LayerNorm on the table, c2p and p2c), tiny
V3 = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
          max_position_embeddings=64, pad_token_id=0, relative_attention=True, position_buckets=8,
          max_relative_positions=-1,
          norm_rel_ebd="layer_norm", pos_att_type=["p2c", "c2p"], position_biased_input=False,
          hidden_dropout_prob=0.0,
          attention_probs_dropout_prob=0.0)


def deberta(head: str, share_att_key: bool = True, num_labels: int = 2):
    from transformers import AutoConfig

    config = AutoConfig.for_model("deberta-v2", **V3, share_att_key=share_att_key, num_labels=num_labels)
    torch.manual_seed(0)
    return _head(head).from_config(config).to(torch.float64)


def deberta_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(deberta("cls"),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["query_proj", "value_proj"]))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero, which would make A's gradient vanish
            param.data.normal_(0, 0.1)
    return model


def deberta_absolute():
    """DebertaV2Config's defaults: absolute position embeddings, no relative attention (no shared table)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("deberta-v2", **{k: v for k, v in V3.items() if k not in (
        "relative_attention", "position_buckets", "max_relative_positions", "norm_rel_ebd", "pos_att_type",
        "position_biased_input")})
    torch.manual_seed(0)
    return _head("cls").from_config(config).to(torch.float64)


CASES = {
    "cls-shared-keys": lambda: (deberta("cls"), "cls"),
    "tok-own-position-projections": lambda: (deberta("tok", share_att_key=False, num_labels=3), "tok"),
    "lora-query-value": lambda: (deberta_lora(), "cls"),
    "cls-absolute-positions": lambda: (deberta_absolute(), "cls"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_equals_the_per_example_reference(case, tmp_path):
    model, head = CASES[case]()
    if case.startswith(("cls-shared", "tok-")):  # the whole relative-position path trains
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert {"deberta.encoder.rel_embeddings.weight", "deberta.encoder.LayerNorm.weight"} <= trainable
    assert _relative_error(model, tmp_path, head, PadCollator(0)) <= 1e-9


def test_shared_table_step_stays_within_the_sensitivity():
    """float32, noise 0: one example added moves the clipped sum (the shared table's rows included) by at most
    C."""
    model = deberta("cls").float()
    ids, labels = ids_batch(4, 6, vocab=VOCAB)
    extra, extra_label = ids_batch(1, 6, vocab=VOCAB, seed=1)
    ratio = sensitivity_ratio(model, lambda m, inputs: m(**inputs).logits, {"input_ids": ids}, labels,
                              {"input_ids": extra}, extra_label)
    assert 0.5 < ratio <= 1 + 1e-4


class _ReshapesItsTable(nn.Module):
    """An odd model outside any declared encoder: a layer called on a batch-free table (output (1, 4, 8))
    whose output the forward reshapes by its own shape, which the engine's per-example expansion breaks."""

    def __init__(self):
        from transformers import PretrainedConfig

        super().__init__()
        torch.manual_seed(0)
        self.config = PretrainedConfig()
        self.embed = nn.Embedding(VOCAB, 8)
        self.register_buffer("table", torch.randn(4, 8))
        self.table_proj = nn.Linear(8, 8)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask, **kwargs):
        rel = self.table_proj(self.table.unsqueeze(0))
        rel = rel.view(rel.shape[1], -1)  # (4, 8), by its own shape
        scores = self.embed(input_ids) @ rel.T  # (B, T, 4)
        mask = attention_mask.unsqueeze(-1).to(scores.dtype)
        return {"logits": self.head((scores * mask).sum(1) / mask.sum(1))}


def test_a_batch_free_output_used_by_its_shape_is_refused_by_name(tmp_path):
    examples = make_examples(4, VOCAB, causal=False, seed=3)
    trainer = DPTrainer(model=_ReshapesItsTable(), args=_args(tmp_path, 4),
                        train_dataset=ListDataset(examples),
                        data_collator=PadCollator(0))
    with pytest.raises(UnsupportedLayerError, match="(?s)'table_proj' \\(Linear\\).*Fix: freeze the module"):
        trainer.train()


def test_per_example_output_grads_in_lanes(monkeypatch):
    """The batched backward, run a few examples at a time, gives each example's own gradient of a shared
    value."""
    from hf_dpfilter.engine import shared_outputs

    monkeypatch.setattr(shared_outputs, "LANES", 2)
    table = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    unused = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64)
    loss = ((x @ table.T) ** 2).sum(1)  # loss_i = ||table x_i||^2
    grads = shared_outputs.per_example_grads(loss, [table, unused])
    expected = torch.stack([torch.autograd.grad(loss[i], table, retain_graph=True)[0] for i in range(5)])
    assert grads[1] is None and torch.allclose(grads[0], expected, rtol=1e-12, atol=0)
