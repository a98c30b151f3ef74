"""transformers' ``EncoderDecoderModel`` warm-started from two BERTs (the packaged MiniLM on both sides, as
``recipes/table2text_seq2seq.py --model packaged-minilm2minilm`` builds it), exact per example.

The decoder is a ``BertLMHeadModel`` with ``is_decoder`` and ``add_cross_attention``: causal self-attention,
cross-attention on the encoder's states (masked by the encoder's attention mask), BERT's absolute positions
and token types (tables on ``arange(T)`` and on a zero buffer), and an output layer tied to the decoder's word
embeddings with ``cls.predictions.bias`` tied to its bias. One DPTrainer step at noise 0 in float64 (q = 1,
SGD lr 1, micro-batches of 2, right padding, some examples clipped and some not) equals the per-example
reference (each example collated alone, its clipped gradient summed). With the config's dropout on (the
packaged MiniLM's 0.1 in attention and hidden states, both sides), a step trains and refuses nothing.
"""

from __future__ import annotations

import torch
from helpers import ListDataset, flat, make_examples
from models import VOCAB
from test_model_families import Seq2SeqCollator, _args, _reference

from hf_dpfilter import DPTrainer


def bert2bert(dropout: float = 0.0, dtype: torch.dtype = torch.float64):
    """A tiny BERT encoder and BERT decoder (cross-attention) under EncoderDecoderModel."""
    from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=24, max_position_embeddings=64, pad_token_id=0,
                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    encoder = BertConfig(**common)
    decoder = BertConfig(**common, is_decoder=True, add_cross_attention=True)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    model = EncoderDecoderModel(config=config).to(dtype).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero output bias: its gradient is checked too
        model.decoder.cls.predictions.bias.normal_(0, 0.1)
    return model


def max_relative_error(model, tmp_path) -> float:
    examples = make_examples(5, VOCAB, causal=True, seed=3)
    collator = Seq2SeqCollator(0)
    clip = float(_reference(model, examples, collator, None).median())  # some examples clipped, some not
    expected = _reference(model, examples, collator, clip)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    DPTrainer(model=model, args=_args(tmp_path, 5, clip), train_dataset=ListDataset(examples),
              data_collator=collator).train()
    got = -len(examples) * flat([p.detach() - b for p, b in zip(params, before)])
    return ((got - expected).norm() / expected.norm()).item()


def test_the_tiny_model_has_the_structure_of_the_warm_started_one():
    model = bert2bert()
    decoder = model.decoder
    assert type(decoder).__name__ == "BertLMHeadModel" and decoder.config.is_decoder
    assert decoder.cls.predictions.decoder.weight is decoder.bert.embeddings.word_embeddings.weight
    assert all(layer.crossattention is not None for layer in decoder.bert.encoder.layer)


def test_one_step_equals_the_per_example_reference(tmp_path):
    assert max_relative_error(bert2bert(), tmp_path) <= 1e-9


def test_trains_with_the_configs_dropout_on(tmp_path):
    model = bert2bert(dropout=0.1, dtype=torch.float32).train()
    trainer = DPTrainer(model=model, args=_args(tmp_path, 6), data_collator=Seq2SeqCollator(0),
                        train_dataset=ListDataset(make_examples(6, VOCAB, causal=True, seed=4)))
    trainer.train()
    assert trainer.accountant.steps == 1
