"""Scripts in the style of the stack's fine-tuning examples run private with the two-class swap and DP flags.

Each script under tests/scripts/ follows its upstream example's pattern (HfArgumentParser/TrlParser over its
dataclasses, its preprocessing, collator, Trainer class and loss) with only the swap; the DP settings are
flags. They run in-process (``main(argv)``) on tiny models saved once per module (hidden 16, 2 layers, a
word-level tokenizer) and a handful of local examples, one private step each at noise 1, and each must release
that step with a moved parameter.

MLM trains BERT's tied ``cls.predictions.bias`` and summarization fully fine-tunes T5 (relative position bias
included): the scripts' ``--freeze`` and ``--lora_r`` stay available but the tests pass neither.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from models import WORDS, tiny_t5, tiny_tokenizer

#: nothing frozen: BERT's MLM head bias is delegated to its decoder's rule (engine/proving.py, _delegate)
MLM_FREEZE: list[str] = []
#: full fine-tuning: T5's relative position bias is a shared output (engine/shared_outputs.py)
SUMMARIZATION_LORA: list[str] = []


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """Tiny BERT, GPT-2 and T5 checkpoints sharing one tokenizer, and the local data files of every script."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("upstream")
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(0)
    models = {
        "bert": BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                                           num_attention_heads=2,
                                           intermediate_size=24, max_position_embeddings=64, pad_token_id=0)),
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                           bos_token_id=2, eos_token_id=3, pad_token_id=0)),
        "t5": tiny_t5(lora=False, vocab_size=vocab),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rng = random.Random(0)

    def write(name: str, rows: list) -> str:
        path = root / name
        path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
        return str(path)

    files = {
        "glue_train": write("glue_train.json",
                            [{"sentence": _sentence(rng, 4 + i % 4), "label": i % 2} for i in range(6)]),
        "glue_dev": write("glue_dev.json",
                          [{"sentence": _sentence(rng, 5), "label": i % 2} for i in range(2)]),
        "text": write("text.txt", [_sentence(rng, 5 + i % 6) for i in range(8)]),
        "ner": write("ner.json", [{"tokens": (w := _sentence(rng, 3 + i % 3).split()),
                                   "ner_tags": ["B-X" if t in ("cat", "dog", "bird") else "O" for t in w]}
                                  for i in range(6)]),
        "summ_train": write("summ_train.json",
                            [{"text": _sentence(rng, 6 + i % 3), "summary": _sentence(rng, 2)}
                                                for i in range(6)]),
        "summ_dev": write("summ_dev.json",
                          [{"text": _sentence(rng, 7), "summary": _sentence(rng, 2)} for _ in range(2)]),
    }
    qa = []
    for i in range(8):
        context = _sentence(rng, 8 + i % 4)
        words = context.split()
        answer = words[2 + i % 3]
        start = len(" ".join(words[: 2 + i % 3])) + 1
        qa.append({"id": str(i), "question": _sentence(rng, 3), "context": context,
                   "answers": {"text": [answer], "answer_start": [start]}})
    files["qa_train"], files["qa_dev"] = write("qa_train.json", qa[:6]), write("qa_dev.json", qa[6:])
    sft_dir = root / "sft_data"
    sft_dir.mkdir()
    (sft_dir / "train.jsonl").write_text("\n".join(json.dumps({"text": _sentence(rng, 6 + i % 4)})
                                                   for i in range(6)))
    files["sft"] = str(sft_dir)
    return root, files


def _dp_flags(out) -> list[str]:
    return ["--output_dir", str(out), "--noise_multiplier", "1.0", "--logical_batch_size", "4",
            "--per_device_train_batch_size", "2", "--max_steps", "1", "--learning_rate", "1e-3",
            "--report_to", "none",
            "--use_cpu", "--save_strategy", "no", "--dp_seed", "0"]


def _released_one_step(trainer, before: dict) -> None:
    assert trainer.accountant.steps == 1
    assert 0 < trainer.privacy_report()["epsilon"] < float("inf")
    model = trainer.model
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters() if n in before)


def _run(script: str, argv: list[str]):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    captured = {}
    original = module.__dict__.get("Trainer") or module.__dict__.get("Seq2SeqTrainer") or module.SFTTrainer

    class Recording(original):  # the script's own class, recording the trainable values before training
        def train(self, *args, **kwargs):
            captured["before"] = {n: p.detach().clone() for n,
                                  p in self.model.named_parameters() if p.requires_grad}
            return super().train(*args, **kwargs)

    name = next(k for k in ("Trainer", "Seq2SeqTrainer", "SFTTrainer") if k in module.__dict__)
    setattr(module, name, Recording)
    try:
        trainer = module.main(argv)
    finally:
        setattr(module, name, original)
    _released_one_step(trainer, captured["before"])
    return trainer


def test_run_glue(stage, tmp_path):
    root, files = stage
    trainer = _run("run_glue",
                   ["--model_name_or_path", str(root / "bert"), "--train_file", files["glue_train"],
                                "--validation_file", files["glue_dev"], "--do_train", "--do_eval",
                                *_dp_flags(tmp_path)])
    assert "eval_accuracy" in trainer.state.log_history[-1]


def test_run_clm(stage, tmp_path):
    root, files = stage
    _run("run_clm", ["--model_name_or_path", str(root / "gpt2"), "--train_file", files["text"], "--do_train",
                     "--block_size", "8", *_dp_flags(tmp_path)])


def test_run_mlm(stage, tmp_path):
    root, files = stage
    _run("run_mlm", ["--model_name_or_path", str(root / "bert"), "--train_file", files["text"],
                     "--mlm_probability", "0.3", *MLM_FREEZE, *_dp_flags(tmp_path)])


def test_run_ner(stage, tmp_path):
    root, files = stage
    _run("run_ner",
         ["--model_name_or_path", str(root / "bert"), "--train_file", files["ner"], *_dp_flags(tmp_path)])


def test_run_qa(stage, tmp_path):
    root, files = stage
    trainer = _run("run_qa", ["--model_name_or_path", str(root / "bert"), "--train_file", files["qa_train"],
                              "--validation_file", files["qa_dev"], "--do_eval", *_dp_flags(tmp_path)])
    assert trainer.args.remove_unused_columns  # the Trainer's default: nothing to change for QA
    assert "eval_loss" in trainer.state.log_history[-1]


def test_run_qa_features_of_one_example_as_one_unit(stage, tmp_path):
    """Long contexts split into several features (max_seq_length 12, doc_stride 4): with each feature's
    example id as the user, an example's features are one unit (N counts examples, not features)."""
    root, files = stage
    trainer = _run("run_qa", ["--model_name_or_path", str(root / "bert"), "--train_file", files["qa_train"],
                              "--max_seq_length", "12", "--doc_stride", "4", "--keep_example_id",
                              "--privacy_unit",
                              "user", "--user_id_column", "example_id", "--max_examples_per_user", "4",
                              *_dp_flags(tmp_path)])
    assert len(trainer.train_dataset) > trainer.privacy_plan.num_examples == 6  # 6 examples, more features


def test_run_summarization(stage, tmp_path):
    root, files = stage
    trainer = _run("run_summarization", [
        "--model_name_or_path", str(root / "t5"), "--train_file", files["summ_train"], "--validation_file",
        files["summ_dev"], "--do_eval", "--predict_with_generate", "--generation_max_length", "6",
        "--generation_num_beams", "1", *SUMMARIZATION_LORA, *_dp_flags(tmp_path)])
    assert "eval_gen_len" in trainer.state.log_history[-1]


def test_trl_sft(stage, tmp_path):
    root, files = stage
    _run("sft",
         ["--model_name_or_path", str(root / "gpt2"), "--dataset_name", files["sft"], "--max_length", "32",
                 "--use_peft", "--lora_r", "4", "--lora_target_modules", ".*c_attn",
                 "--gradient_checkpointing", "false",
                 *_dp_flags(tmp_path)])


def test_peft_lora(stage, tmp_path):
    root, files = stage
    _run("peft_lora",
         ["--model_name_or_path", str(root / "gpt2"), "--train_file", files["text"], "--lora_r", "4",
                       *_dp_flags(tmp_path)])
