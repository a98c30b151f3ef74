"""The papers' own SST-2 claims, as presets, at the scale a 2-core CPU allows, with seeds and fair tuning.

    python -m benchmarks utility                      # every protocol (resumes; finished runs are kept)
    python -m benchmarks utility --protocols doppler pmlf
    python -m benchmarks utility --report             # only rewrite docs/results.md and the plots

Each protocol pits a method against the baseline its paper compares with, in the regime the paper claims a
gain (``PROTOCOLS``), scaled down:

* ``head`` scale: a linear classifier on the frozen pretrained MiniLM's mean-pooled sentence embeddings
  (``recipes.common.models.MeanPooledClassifier``), 20,000 SST-2 training examples. Used where the claim is
  about the optimizer (DOPPLER, DP-PMLF, DiceSGD) or needs full batches (DIFF2).
* ``top`` scale: the top two transformer layers of MiniLM fine-tuned (every weight, or LoRA r = 16 on
  query/key/value/output) plus the classifier, on the frozen bottom four layers' outputs (computed once: a
  public function of each example), 6,000 training examples. Used for DiSK's full and LoRA claims.

Fair tuning: every method of a protocol gets the same grid (learning rates, and for DiceSGD its C2 against
DP-Adam's C), one run per grid point on a validation split carved from the SST-2 training set (disjoint from
the training examples; the dev set is never read while tuning). The best point is then run with seeds 0, 1, 2
(model initialization and data order; the DP noise stays a fresh secret per run) and evaluated on the SST-2
dev set (872 examples). Differences are paired by seed. Results: ``benchmarks/results/paper_protocols.json``,
the tables in ``docs/results.md`` and the plots in ``docs/img/``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import minilm_path, read_glue_tsv, sst2_dir

VALIDATION_SIZE = 5000
TOP_LAYERS = 2

# The positive controls' noise: the effective noise multiplier of the authors' released code over the stated
# sigma, a key of benchmarks/authors_noise.py's results (measured on their per-step arithmetic, not assumed)
DISK_RELEASE = "disk_kappa0.7_gamma0.5"
PMLF_RELEASE = "pmlf_k2"
# DP-PMLF's positive control (at the noise its released code adds: k = 2 clipped sums noised once) and the
# low-pass filter alone on DP-SGD at DP-SGD's learning rate (k = 1: no per-sample momentum, PMLF's filter b =
# [0.1], a = [-0.9] applied to the privatized gradient, i.e. DOPPLER with that filter)
PMLF_REFERENCES: dict[str, dict[str, Any]] = {
    "DP-PMLF (authors' released noise, σ/2)": {"from": "DP-PMLF", "noise_from": PMLF_RELEASE},
    "DP-SGD + low-pass filter": {"from": "DP-PMLF", "dp_method_args": {"k": 1}, "point_from": "DP-SGD"},
}
PMLF_VERDICT = {"control": "DP-PMLF (authors' released noise, σ/2)",
                "compare": {"DP-SGD + low-pass filter": "DP-SGD"}}
NO_CONTROL = "none: the released code's noise was not measured"

# One protocol per paper claim. "claims": the paper's reported (method - baseline) accuracy gain on SST-2, in
# points, per epsilon (None: the paper reports no SST-2 number for this comparison).
PROTOCOLS: dict[str, dict[str, Any]] = {
    "disk_lora": {
        "paper": "DiSK (Zhang et al.), Table 3: LoRA r = 16, DP-AdamW base, kappa 0.7, gamma 0.5",
        "scale": "top", "train": "lora16", "epsilons": [1.0, 6.7], "claims": {1.0: 2.0, 6.7: 1.6},
        "tune_epsilon": 1.0,
        "common": {"clipping_fn": "automatic", "max_grad_norm": 1.0, "batch": 500, "epochs": 3,
                   "schedule": "linear", "optim": "adamw_torch"},
        "grid": {"learning_rate": [1e-2, 3e-2, 1e-1]},
        "methods": {"DP-AdamW": {"dp_method": "dpsgd"},
                    "DiSK": {"dp_method": "disk", "dp_method_args": {"kappa": 0.7, "gamma": 0.5}}},
        "seeds": [0, 1, 2, 3, 4],
        # the positive control: DiSK and its baseline at the noise the authors' released code adds (the stated
        # sigma times the fraction benchmarks/authors_noise.py measures on their arithmetic), and DiSK with
        # Adam's step length matched, at DP-AdamW's learning rate (both methods on one grid point)
        "reference": {"DiSK (authors' released noise, σ/7)": {"from": "DiSK", "noise_from": DISK_RELEASE},
                      # at DiSK's chosen point: DP-AdamW's own (3e-2, chosen at sigma) diverges at a seventh
                      # of the noise (collapsed to the majority class on 2 of 3 seeds, measured 2026-12-03)
                      "DP-AdamW (σ/7)": {"from": "DP-AdamW", "noise_from": DISK_RELEASE, "point_from": "DiSK"},
                      "DiSK (step-matched)": {"from": "DiSK", "dp_method_args": {"adam_step_match": True},
                                              "point_from": "DP-AdamW"}},
        "verdict": {"control": "DiSK (authors' released noise, σ/7)", "control_baseline": "DP-AdamW (σ/7)",
                    "compare": {"DiSK (step-matched)": "DP-AdamW"}},
    },
    "disk_full": {
        "paper": "DiSK (Zhang et al.), Table 1: full fine-tuning, DP-AdamW base, kappa 0.7, gamma 0.5",
        "scale": "top", "train": "full", "epsilons": [1.0, 6.7], "claims": {1.0: 0.1, 6.7: 1.3},
        "tune_epsilon": 1.0,
        "common": {"clipping_fn": "automatic", "max_grad_norm": 1.0, "batch": 500, "epochs": 3,
                   "schedule": "linear", "optim": "adamw_torch"},
        "grid": {"learning_rate": [2.5e-4, 5e-4, 1e-3]},
        "methods": {"DP-AdamW": {"dp_method": "dpsgd"},
                    "DiSK": {"dp_method": "disk", "dp_method_args": {"kappa": 0.7, "gamma": 0.5}}},
    },
    "pmlf_lora": {
        "paper": "DP-PMLF (Xu et al.), Table 2 (RoBERTa-base fine-tuning), on the LoRA scale: DP-SGD base, k "
                 "= 2, beta = 0.1, filter b = [0.1], a = [-0.9]",
        "scale": "top", "train": "lora16", "epsilons": [1.0], "claims": {1.0: 1.88}, "tune_epsilon": 1.0,
        "common": {"clipping_fn": "abadi", "max_grad_norm": 1.0, "batch": 500, "epochs": 3,
                   "schedule": "constant", "optim": "sgd"},
        "grid": {"learning_rate": [1.0, 2.0, 4.0]},
        "methods": {"DP-SGD": {"dp_method": "dpsgd"},
                    "DP-PMLF": {"dp_method": "pmlf",
                                "dp_method_args": {"k": 2, "beta": 0.1, "preset": "pmlf_mnist"}}},
        "seeds": [0, 1, 2, 3, 4],
        "reference": PMLF_REFERENCES,
        "verdict": PMLF_VERDICT,
    },
    "minilm_full": {
        "paper": "DP full fine-tuning, the DP fine-tuning literature's recipe: large logical batches, few "
                 "epochs, Adam, a small clipping norm that clips every example; every weight of the packaged "
                 "MiniLM on all of SST-2, against the non-private fine-tune (3 epochs)",
        "scale": "full", "epsilons": [8.0, 3.0], "claims": {8.0: None, 3.0: None}, "tune_epsilon": 8.0,
        # batch 2048 for 6 epochs (168 steps on the tuning split, 192 on all of SST-2): at epsilon 8 sigma
        # rises only from 0.56 to 0.68 for twice the batch and the epochs, so the noise on the mean gradient
        # is 0.61x that of batch 1024 for 3 epochs at the same number of steps; at lr 2e-3 it scored 82.8% on
        # the validation split against 81.8% (those rows, and their dev seeds: minilm_full_batch1024_epochs3).
        # 1 epoch (65 steps of 1024) scored 80.5 +- 0.5% on dev (minilm_full_1epoch). Dropout off: at lr 2e-3
        # it scored 84.5% on an earlier validation split against 83.3% with the config's 0.1 (those rows:
        # minilm_full_dropout0.1), and a step costs about a quarter less CPU (no masks to draw per example)
        "common": {"clipping_fn": "abadi", "max_grad_norm": 0.1, "batch": 2048, "epochs": 6,
                   "schedule": "linear", "optim": "adamw_torch", "dropout": 0.0},
        # a grid point is added past an edge that scores best on the validation split
        "grid": {"learning_rate": [1e-3, 2e-3, 4e-3]},
        # the non-private fine-tune: its own batch and learning rates. Batch 256 (681 steps on the tuning
        # split, 789 on all of SST-2), not the usual 32, so that each step's rows are grouped by length as the
        # DP runs' are: at 32 a run was estimated at about 90 CPU minutes at one thread; at 256 a tuning run
        # measured 36-38 CPU minutes at one thread, 1.2x a DP run of batch 1024 x 3 epochs
        # (1e-3: the edge rule's next point, as 3e-4 scored best of the first three on the sentence split;
        # it diverged, 52.8%)
        "method_grids": {"Non-private AdamW": {"learning_rate": [3e-5, 1e-4, 3e-4, 1e-3]}},
        # the non-private fine-tune keeps the config's dropout, as non-private fine-tuning does, and its 3
        # epochs (DP-AdamW's 6 buy a larger batch at the same steps; a non-private run has no noise to
        # average down)
        "methods": {"DP-AdamW": {"dp_method": "dpsgd"},
                    "Non-private AdamW": {"dp_method": "none", "batch": 256, "epochs": 3, "dropout": 0.1}},
    },
    "disk_head": {
        "paper": "DiSK (Zhang et al.), Tables 1/3, the optimizer alone: kappa 0.7, gamma 0.5, DP-AdamW base, "
                 "on the head",
        "scale": "head", "epsilons": [1.0, 6.7], "claims": {1.0: 0.1, 6.7: 1.3},
        "common": {"clipping_fn": "automatic", "max_grad_norm": 1.0, "batch": 1000, "epochs": 5,
                   "schedule": "linear", "optim": "adamw_torch"},
        "grid": {"learning_rate": [3e-3, 1e-2, 3e-2]},
        "methods": {"DP-AdamW": {"dp_method": "dpsgd"},
                    "DiSK": {"dp_method": "disk", "dp_method_args": {"kappa": 0.7, "gamma": 0.5}}},
        "verdict": {"control_note": "on the LoRA scale (disk_lora)"},
    },
    "doppler": {
        "paper": "DOPPLER (Zhang et al.), Table 3: LP-DPAdamBC against DP-Adam (filter not stated: "
                 "first_order_v1)",
        "scale": "head", "epsilons": [3.0, 8.0], "claims": {3.0: -0.15, 8.0: -0.27},
        "common": {"clipping_fn": "abadi", "max_grad_norm": 1.0, "batch": 1000, "epochs": 5,
                   "schedule": "constant"},
        "grid": {"learning_rate": [3e-3, 1e-2, 3e-2]},
        "methods": {"DP-Adam": {"dp_method": "dpsgd", "optim": "adamw_torch"},
                    "LP-DPAdamBC": {"dp_method": "doppler", "optim": "sgd",
                                    "dp_method_args": {"base": "adam_bc"}}},
        "verdict": {"control_note": NO_CONTROL},
    },
    "pmlf": {
        "paper": "DP-PMLF (Xu et al.), Table 2: DP-SGD base, k = 2, beta = 0.1, filter b = [0.1], a = [-0.9]",
        "scale": "head", "epsilons": [1.0, 8.0], "claims": {1.0: 1.88, 8.0: -0.44},
        "common": {"clipping_fn": "abadi", "max_grad_norm": 1.0, "batch": 1000, "epochs": 5,
                   "schedule": "constant", "optim": "sgd"},
        "grid": {"learning_rate": [0.5, 2.0, 8.0]},
        "methods": {"DP-SGD": {"dp_method": "dpsgd"},
                    "DP-PMLF": {"dp_method": "pmlf",
                                "dp_method_args": {"k": 2, "beta": 0.1, "preset": "pmlf_mnist"}}},
        "reference": PMLF_REFERENCES,
        "verdict": PMLF_VERDICT,
    },
    "diff2": {
        "paper": "DIFF2 (Murata & Suzuki): DIFF2-GD against DP-GD, full batch (the paper: tabular tasks, eps "
                 "3 and 5)",
        "scale": "head", "epsilons": [3.0, 5.0], "claims": {3.0: None, 5.0: None}, "train_samples": 4000,
        "common": {"clipping_fn": "abadi", "max_grad_norm": 1.0, "batch": "full", "epochs": 100,
                   "schedule": "constant", "optim": "sgd"},
        "grid": {"learning_rate": [0.5, 2.0, 8.0]},
        # the same 6-point budget: DP-GD searches (lr, C1), DIFF2-GD searches (lr, C2, the coefficient of the
        # difference threshold C2 ||x_{r-1} - x_{r-2}||; the paper says C2 must be tuned)
        "method_grids": {"DP-GD": {"max_grad_norm": [0.3, 1.0]},
                         "DIFF2-GD": {"difference_max_grad_norm": [2.0, 10.0]}},
        "methods": {"DP-GD": {"dp_method": "dpsgd"},
                    "DIFF2-GD": {"dp_method": "diff2", "dp_method_args": {"restart_every": 10}}},
        # measured before the C2 search, with lr searched and the rule C2 = C1 / (first movement), the library's
        # default then (removed: C2 is required)
        "extra_labels": ["DIFF2-GD (old default C2 rule)"],
        "verdict": {"control_note": NO_CONTROL},
    },
    "dicesgd": {
        "paper": "DiceSGD (Zhang et al.): no GLUE result (its language results are GPT-2 on E2E); best "
                 "utility under the library's sound accounting, AdamW base as in its experiments",
        "scale": "head", "epsilons": [8.0], "claims": {8.0: None},
        "common": {"clipping_fn": "abadi", "max_grad_norm": 1.0, "batch": 1000, "epochs": 5,
                   "schedule": "constant", "optim": "adamw_torch"},
        # the same 6-point budget: DP-Adam searches (lr, C), DiceSGD searches (lr, C2 as a fraction of C1 / B)
        "grid": {"learning_rate": [3e-3, 1e-2, 3e-2]},
        "method_grids": {"DP-Adam": {"max_grad_norm": [0.3, 1.0]},
                         "DiceSGD": {"error_fraction": [0.25, 1.0]}},
        "methods": {"DP-Adam": {"dp_method": "dpsgd"}, "DiceSGD": {"dp_method": "dicesgd"}},
        "reference": {"DiceSGD (paper's accounting)": {"from": "DiceSGD",
                                                       "dp_method_args": {"accounting": "paper"}},
                      # the library's defaults at DiceSGD's chosen lr, paired by seed: the default C2 (no
                      # error_fraction: the library chooses, C1 / B) and the earlier default C2 = C1
                      # (error_fraction = B = 1000: C2 = B x C1 / B)
                      "DiceSGD (default C2 = C1/B)": {"from": "DiceSGD", "dp_method_args": {},
                                                      "point": {"error_fraction": None}},
                      "DiceSGD (old default C2 = C1)": {"from": "DiceSGD", "dp_method_args": {},
                                                        "point": {"error_fraction": 1000.0}}},
        "verdict": {"control_note": NO_CONTROL, "compare": {"DiceSGD (default C2 = C1/B)": "DP-Adam"}},
    },
}


# ----------------------------------------------------------------------------------------------- data
class TopLayersClassifier(nn.Module):
    """The top transformer layers of a BERT encoder + mean pooling + a linear classifier, fed the bottom
    layers' outputs (``hidden_states``, computed once by the frozen bottom of the encoder)."""

    def __init__(self, encoder: nn.Module, first_layer: int, num_labels: int = 2) -> None:
        super().__init__()
        from recipes.common.models import MeanPooledClassifier

        self.config = encoder.config
        self.layers = nn.ModuleList(encoder.encoder.layer[first_layer:])
        self.head = MeanPooledClassifier(encoder.config.hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        # position_ids: the trainer passes them to every BERT-configured model; the bottom layers already
        # added each example's position embeddings (computed alone, right-padded), so the top layers ignore
        # them
        from transformers.masking_utils import create_bidirectional_mask

        from recipes.common.models import mean_pool

        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                         attention_mask=attention_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        return self.head(sentence_embedding=mean_pool(hidden_states, attention_mask), labels=labels)


class HiddenStates(torch.utils.data.Dataset):
    def __init__(self, states: list[torch.Tensor], labels: np.ndarray) -> None:
        self.states, self.labels = states, labels

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"hidden_states": self.states[i], "labels": int(self.labels[i])}


def pad_hidden_states(rows: list[dict]) -> dict[str, torch.Tensor]:
    length = max(r["hidden_states"].shape[0] for r in rows)
    hidden = torch.zeros(len(rows), length, rows[0]["hidden_states"].shape[1])
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        hidden[i, : r["hidden_states"].shape[0]] = r["hidden_states"]
        mask[i, : r["hidden_states"].shape[0]] = 1
    return {"hidden_states": hidden, "attention_mask": mask,
            "labels": torch.tensor([r["labels"] for r in rows])}


def splits(args: argparse.Namespace) -> dict[str, tuple[list[str], np.ndarray]]:
    texts, labels = read_glue_tsv(os.path.join(args.data_dir, "train.tsv"))
    order = np.random.default_rng(0).permutation(len(texts))
    dev_texts, dev_labels = read_glue_tsv(os.path.join(args.data_dir, "dev.tsv"))
    pick = lambda rows: ([texts[i] for i in rows], np.array([labels[i] for i in rows]))  # noqa: E731
    return {"train": pick(order[: args.train_samples]), "validation": pick(order[-VALIDATION_SIZE:]),
            "dev": (dev_texts, np.array(dev_labels))}


def top_splits(split: dict[str, tuple[list[str], np.ndarray]],
               args: argparse.Namespace) -> dict[str, tuple[list[str], np.ndarray]]:
    """The top scale's splits: the first ``top_train_samples`` training examples, the first
    ``top_validation_samples`` validation examples whose text no training example has (SST-2 repeats phrases:
    an identical row would score the training set, and the trainer refuses to evaluate on training rows), the
    dev set."""
    train_texts, train_labels = split["train"]
    train = (train_texts[: args.top_train_samples], train_labels[: args.top_train_samples])
    seen = set(train[0])
    texts, labels = split["validation"]
    keep = [i for i, text in enumerate(texts) if text not in seen][: args.top_validation_samples]
    return {"train": train, "validation": ([texts[i] for i in keep], labels[keep]), "dev": split["dev"]}


def scale_data(scale: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per split: the inputs of the scale's model, computed once with the frozen encoder and cached on
    disk."""
    if scale == "full":
        return full_scale_data(args)
    sizes = "" if scale == "head" else f"_{args.top_train_samples}_{args.top_validation_samples}"
    cache = os.path.join(args.work_dir, f"{scale}_inputs{sizes}.pt")  # per size: another size never reads it
    if os.path.isfile(cache):
        return torch.load(cache, weights_only=False)  # our own cache file (numpy label arrays)
    from transformers import AutoModel, AutoTokenizer

    from recipes.common.models import mean_pooled_embeddings

    tokenizer, encoder = (AutoTokenizer.from_pretrained(minilm_path()),
                          AutoModel.from_pretrained(minilm_path()))
    encoder.eval()
    data = {}
    for split, (texts,
                labels) in (splits(args) if scale == "head" else top_splits(splits(args), args)).items():
        if scale == "head":
            data[split] = (mean_pooled_embeddings(encoder, tokenizer, texts, 64), labels)
            continue
        states = []
        with torch.inference_mode():
            for start in range(0, len(texts), 128):
                batch = tokenizer(texts[start : start + 128], truncation=True, max_length=64, padding=True,
                                  return_tensors="pt")
                hidden = encoder(**batch, output_hidden_states=True).hidden_states[-1 - TOP_LAYERS]
                for row, mask in zip(hidden, batch["attention_mask"]):
                    states.append(row[: int(mask.sum())].clone())
        data[split] = (states, labels)
    os.makedirs(args.work_dir, exist_ok=True)
    torch.save(data, cache)
    return data


FULL_VALIDATION_SENTENCES = 1000


def token_sub_sequences(row: tuple[int, ...], pool: set[tuple[int, ...]], lengths: set[int]) -> set[tuple[int, ...]]:
    """The contiguous sub-sequences of ``row`` (itself included) that are members of ``pool``, whose members'
    lengths are ``lengths``."""
    return {row[a : a + n] for n in lengths if n <= len(row) for a in range(len(row) - n + 1)
            if row[a : a + n] in pool}


def full_scale_data(args: argparse.Namespace) -> dict[str, Any]:
    """The full scale's token ids: tuning trains on the SST-2 training set less the validation split and scores
    the validation split; the seeds train on all 67,349 training examples (``train_all``) and score the dev set.

    The validation split is held out by sentence, as SST-2's own dev set is. SST-2's training set is its
    training sentences together with every phrase of their parse trees, each phrase a row with its own label;
    the sentences are the rows that no other row contains (6,886, as long as the dev set's sentences: 25
    tokens on average). ``FULL_VALIDATION_SENTENCES`` of them, drawn in a fixed random order, are the
    validation split, and the tuning runs' training set loses each of them with every row that is a
    contiguous token sub-sequence of a held-out sentence and of no kept one: the phrases that only the held-out
    sentences put there. A split of random rows scores phrases (1 epoch: 84.3% on such a split, 80.5% on dev),
    and sentence-like rows held out alone leave their own sub-phrases in training (the longest such training
    row covers a median 88% of the sentence, and rewards memorising); held out this way the longest covers a
    median 10%, as for the dev set. Compared by token ids (without the special tokens), not text: the uncased
    tokenizer maps texts that differ in case to one row."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts, labels = read_glue_tsv(os.path.join(args.data_dir, "train.tsv"))
    ids = tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    bodies = [tuple(row[1:-1]) for row in ids]
    rows = set(bodies)
    lengths = {len(row) for row in rows}
    contained = set().union(*(token_sub_sequences(row, rows, lengths - {len(row)}) for row in rows))
    sentences = sorted(rows - contained)
    order = np.random.default_rng(0).permutation(len(sentences))
    held = {sentences[i] for i in order[:FULL_VALIDATION_SENTENCES]}
    kept_phrases = set().union(*(token_sub_sequences(sentences[i], rows, lengths)
                                 for i in order[FULL_VALIDATION_SENTENCES:]))
    removed = set().union(*(token_sub_sequences(row, rows, lengths) for row in held)) - kept_phrases
    # one row per held-out sentence (the first of its copies), in the fixed random order
    first = {}
    for i, row in enumerate(bodies):
        first.setdefault(row, i)
    validation = [first[sentences[i]] for i in order[:FULL_VALIDATION_SENTENCES]]
    tune = [i for i, row in enumerate(bodies) if row not in removed]
    dev_texts, dev_labels = read_glue_tsv(os.path.join(args.data_dir, "dev.tsv"))
    dev_ids = tokenizer(dev_texts, truncation=True, max_length=64)["input_ids"]
    pick = lambda rows: ([ids[i] for i in rows], np.asarray([labels[i] for i in rows]))  # noqa: E731
    return {"train": pick(tune), "validation": pick(validation), "train_all": (ids, np.asarray(labels)),
            "dev": (dev_ids, np.asarray(dev_labels))}


# ------------------------------------------------------------------------------------------------ runs
#: settings (in a protocol's ``common`` or a grid point) that shape the full scale's model rather than its
#: training: the encoder's dropout probability (hidden and attention; absent: the config's 0.1) and whether its
#: word-embedding table is frozen
MODEL_KEYS = ("dropout", "freeze_word_embeddings")


def build_model(protocol: dict[str, Any], seed: int, point: dict[str, float] | None = None,
                method: dict[str, Any] | None = None) -> nn.Module:
    torch.manual_seed(seed)
    from transformers import AutoModel

    from recipes.common.models import MeanPooledClassifier, encoder_dropout

    # the model settings of the protocol, then the method's, then the grid point's
    point = {**{k: v for source in (protocol.get("common", {}), method or {}) for k, v in source.items()
                if k in MODEL_KEYS}, **(point or {})}
    if protocol["scale"] == "head":
        return MeanPooledClassifier(384, num_labels=2)
    if protocol["scale"] == "full":  # every weight, dropout (keyed to each example) on unless the point says
        dropout = {} if "dropout" not in point else encoder_dropout(point["dropout"])
        model = MeanPooledClassifier(384, num_labels=2,
                                     encoder=AutoModel.from_pretrained(minilm_path(), **dropout))
        if point.get("freeze_word_embeddings"):
            model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
        return model

    model = TopLayersClassifier(AutoModel.from_pretrained(minilm_path()), first_layer=6 - TOP_LAYERS)
    if protocol["train"] == "lora16":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                          target_modules=["query", "key", "value", "attention.output.dense"],
                          modules_to_save=["head"])
        model = get_peft_model(model, lora)
    return model


def run_point(protocol: dict[str, Any], method: dict[str, Any], point: dict[str, float], epsilon: float,
              seed: int,
              evaluate_on: str, data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    from transformers import default_data_collator

    from hf_dpfilter import DPTrainer, DPTrainingArguments

    common = {**protocol["common"], **{k: v for k, v in method.items() if k in ("optim", "batch", "epochs")}}
    # the full scale's seeds train on every training example (tuning held the validation split out)
    train_x, train_y = data["train_all" if evaluate_on == "dev" and "train_all" in data else "train"]
    n = min(len(train_y), protocol.get("train_samples", len(train_y)))  # full batches: a smaller training set
    train_x, train_y = train_x[:n], train_y[:n]
    if protocol["scale"] == "head":
        train = datasets.Dataset.from_dict({"sentence_embedding": train_x.numpy(), "labels": train_y})
        evaluation = datasets.Dataset.from_dict({"sentence_embedding": data[evaluate_on][0].numpy(),
                                                 "labels": data[evaluate_on][1]})
        train.set_format("torch")  # rows as tensors: collating thousands of 384-float lists is the bottleneck
        evaluation.set_format("torch")
        collator, micro = default_data_collator, n
    elif protocol["scale"] == "full":
        from transformers import AutoTokenizer, DataCollatorWithPadding

        train = datasets.Dataset.from_dict({"input_ids": train_x, "labels": train_y})
        evaluation = datasets.Dataset.from_dict({"input_ids": data[evaluate_on][0], "labels": data[evaluate_on][1]})
        collator, micro = DataCollatorWithPadding(AutoTokenizer.from_pretrained(minilm_path())), 64
    else:
        train, evaluation = HiddenStates(train_x, train_y), HiddenStates(*data[evaluate_on])
        collator, micro = pad_hidden_states, 100
    batch = n if common["batch"] == "full" else common["batch"]
    max_grad_norm = point.get("max_grad_norm", common["max_grad_norm"])
    method_args = dict(method.get("dp_method_args", {}))
    if "error_fraction" in point:  # DiceSGD's C2 on the mean scale, as a fraction of C1 / B
        method_args["error_max_grad_norm"] = point["error_fraction"] * max_grad_norm / batch
    if "difference_max_grad_norm" in point:  # DIFF2's C2
        method_args["difference_max_grad_norm"] = point["difference_max_grad_norm"]
    noise = noise_arguments(method, method_args, epsilon, len(train), batch, common["epochs"])
    training_args = DPTrainingArguments(
        output_dir=os.path.join(args.work_dir, f"run{os.getpid()}"), dp_method=method["dp_method"],
        target_epsilon=noise["target_epsilon"], noise_multiplier=noise.get("noise_multiplier"),
        dp_method_args=method_args or None, per_sample_max_grad_norm=max_grad_norm,
        clipping_fn=common["clipping_fn"], logical_batch_size=batch,
        per_device_train_batch_size=min(batch, micro),
        per_device_eval_batch_size=500, num_train_epochs=common["epochs"],
        learning_rate=point["learning_rate"],
        lr_scheduler_type=common["schedule"], optim=common.get("optim", "adamw_torch"), weight_decay=0.0,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=seed, disable_tqdm=True,
        logging_strategy="no",
        remove_unused_columns=protocol["scale"] != "top", label_names=["labels"],
    )
    model = build_model(protocol, seed, point, method)
    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                        data_collator=collator,
                        compute_metrics=lambda p: {"accuracy": float((p[0].argmax(-1) == p[1]).mean())})
    start, cpu_start = time.time(), time.process_time()
    trainer.train()
    accuracy = float(trainer.evaluate()["eval_accuracy"])
    report = trainer.privacy_report()
    row = {"accuracy": accuracy, "seconds": round(time.time() - start, 1),
           "cpu_seconds": round(time.process_time() - cpu_start, 1), "threads": torch.get_num_threads(),
           "epsilon": report.get("epsilon", float("inf")), "noise_multiplier": report.get("noise_multiplier") or 0.0,
           # a non-private run's privacy report counts no DP steps: its optimizer steps are the trainer's
           "steps": trainer.state.global_step if method["dp_method"] == "none" else report.get(
               "steps", trainer.state.global_step)}
    if "epsilon_paper_claim" in report:
        row["epsilon_paper_claim"] = report["epsilon_paper_claim"]
    if "noise_multiplier" in noise:  # a control at a scaled noise: its true epsilon above, the claimed here
        row.update(epsilon_claimed=epsilon, noise_scale=method["noise_scale"],
                   stated_noise_multiplier=noise["stated_noise_multiplier"])
    return row


def noise_arguments(method: dict[str, Any], method_args: dict[str, Any], epsilon: float, num_examples: int,
                    batch: int, epochs: float) -> dict[str, Any]:
    """The noise settings of a run: ``target_epsilon`` (the library calibrates sigma), none for a non-private
    method, or, for a control with ``noise_scale``, the sigma the library calibrates for ``epsilon`` on this
    run's plan (``stated_noise_multiplier``) times ``noise_scale`` as a fixed ``noise_multiplier`` (the run
    then reports the epsilon it really spends)."""
    if method["dp_method"] == "none":
        return {"target_epsilon": None}
    if method.get("noise_scale") is None:
        return {"target_epsilon": epsilon}
    from hf_dpfilter import PrivacyPlan

    # the plan DPTrainer makes for this run (seed 0: the DP seed plays no part in the calibration)
    stated = PrivacyPlan.create(num_examples=num_examples, logical_batch_size=batch, epochs=epochs,
                                method=method["dp_method"], method_args=method_args or None,
                                target_epsilon=epsilon, seed=0).noise_multiplier
    return {"target_epsilon": None, "noise_multiplier": stated * method["noise_scale"],
            "stated_noise_multiplier": stated}


def grid_points(protocol: dict[str, Any], label: str) -> list[dict[str, float]]:
    grid = {**protocol["grid"], **protocol.get("method_grids", {}).get(label, {})}
    points: list[dict[str, float]] = [{}]
    for key, values in grid.items():
        points = [{**p, key: v} for p in points for v in values]
    return points


def point_key(point: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(point.items()))


class Store:
    """The JSON file of finished runs, re-read under a lock so that concurrent invocations never drop rows."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> dict[str, Any]:
        return json.load(open(self.path)) if os.path.exists(self.path) else {}

    def save(self, key: str, row: dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            results = self.load()
            results[key] = row
            with open(self.path + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(self.path + ".tmp", self.path)


def finished_or_run(store: Store, key: str, *run_point_args: Any, may_fail: bool = False) -> dict[str, Any]:
    """The stored row of ``key``; else ``run_point(*run_point_args)``'s row with its grid point, saved as soon
    as it ends (an interrupted sweep resumes where it stopped). ``may_fail`` (grid points): a run the trainer
    stops is saved as failed, with the error's first line, and scores no accuracy."""
    row = store.load().get(key)
    if row is None:
        start, cpu_start = time.time(), time.process_time()
        try:
            row = {**run_point(*run_point_args), "point": run_point_args[2]}
        # the trainer's refusals (a re-check's mismatch in a diverging run) included
        except RuntimeError as error:
            if not may_fail:
                raise
            row = {"accuracy": None, "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                   "seconds": round(time.time() - start, 1),
                   "cpu_seconds": round(time.process_time() - cpu_start, 1),
                   "threads": torch.get_num_threads(), "point": run_point_args[2]}
        store.save(key, row)
        print(key, row, flush=True)
    return row


def run_protocol(name: str, args: argparse.Namespace, store: Store) -> None:
    """Per epsilon: each method's grid on the validation split (at ``tune_epsilon`` when the protocol names
    one: then tuned once for every epsilon), the chosen point with every seed on the dev set, then the
    reference rows. ``args.methods``: only these labels (their tuning, seeds and reference rows), so that a
    long sweep can run the rows it needs first."""
    protocol = PROTOCOLS[name]
    wanted = getattr(args, "methods", None)
    seeded = set(protocol["methods"])  # the methods whose seeds run
    if wanted:
        # a method's label: its tuning, seeds and reference rows; a reference row's label: that row alone (the
        # methods it reads the point or the settings of are tuned, which finds their finished grid points)
        references = {label: ref for label, ref in protocol.get("reference", {}).items()
                      if label in wanted or ref["from"] in wanted}
        needed = set(wanted) | {ref["from"] for ref in references.values()} | {
            ref.get("point_from", ref["from"]) for ref in references.values()}
        protocol = {**protocol, "reference": references,
                    "methods": {label: m for label, m in protocol["methods"].items() if label in needed}}
        seeded = set(wanted)
    data = scale_data(protocol["scale"], args)
    for epsilon in protocol["epsilons"]:
        if args.epsilons and epsilon not in args.epsilons:
            continue
        tune_epsilon = protocol.get("tune_epsilon", epsilon)
        chosen: dict[str, dict[str, float]] = {}
        for label, method in protocol["methods"].items():
            scores = {}
            for point in grid_points(protocol, label):
                key = f"{name}|{label}|eps={tune_epsilon:g}|tune|{point_key(point)}"
                row = finished_or_run(store, key, protocol, method, point, tune_epsilon, args.tuning_seed,
                                      "validation",
                                      data, args, may_fail=True)
                scores[key] = (-1.0 if row["accuracy"] is None else row["accuracy"], point)
            chosen[label] = max(scores.values(), key=lambda score: score[0])[1]  # the first of equals
        runs = [(label, method, chosen[label]) for label, method in protocol["methods"].items()
                if label in seeded]
        for label, reference in protocol.get("reference", {}).items():
            runs.append((label, *reference_run(reference, protocol, chosen)))
        for label, method, point in runs:
            for seed in args.seeds:
                finished_or_run(store, f"{name}|{label}|eps={run_epsilon(name, label, epsilon):g}|seed={seed}",
                                protocol, method, point,
                                epsilon,
                                seed, "dev", data, args)


def reference_run(reference: dict[str, Any], protocol: dict[str, Any],
                  chosen: dict[str, dict[str, float]]) -> tuple[dict[str, Any], dict[str, float]]:
    """(method, point) of a reference row: the ``from`` method with ``dp_method_args`` merged in, at the point
    the validation grid chose for ``point_from`` (default: ``from``) with ``point``'s settings replacing it
    (None: dropped, the library's default decides); ``noise_from``: run at the stated sigma times the
    effective noise fraction benchmarks/authors_noise.py measured for that released code (``noise_scale``)."""
    from benchmarks.authors_noise import effective_noise_ratio

    base = protocol["methods"][reference["from"]]
    method = {**base, "dp_method_args": {**base.get("dp_method_args", {}),
                                         **reference.get("dp_method_args", {})}}
    if "noise_from" in reference:
        method["noise_scale"] = effective_noise_ratio(reference["noise_from"])
    point = {**chosen[reference.get("point_from", reference["from"])], **reference.get("point", {})}
    return method, {k: v for k, v in point.items() if v is not None}


# --------------------------------------------------------------------------------------------- report
T_QUANTILE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def run_epsilon(name: str, label: str, epsilon: float) -> float:
    """The epsilon a method's seed runs are keyed at: a non-private method spends none, so its seeds run once,
    at the protocol's first epsilon, and stand beside every epsilon's DP rows."""
    protocol = PROTOCOLS[name]
    method = {**protocol["methods"], **protocol.get("reference", {})}.get(label, {})
    return protocol["epsilons"][0] if method.get("dp_method") == "none" else epsilon


def seed_rows(results: dict[str, Any], name: str, label: str, epsilon: float) -> dict[int, dict[str, Any]]:
    prefix = f"{name}|{label}|eps={run_epsilon(name, label, epsilon):g}|seed="
    return {int(k[len(prefix):]): v for k, v in results.items() if k.startswith(prefix)}


def cpu_minutes(rows: Any) -> str:
    """The median CPU minutes of the rows that recorded them."""
    recorded = [r["cpu_seconds"] / 60 for r in rows if "cpu_seconds" in r]
    return f"{np.median(recorded):.1f}" if recorded else "–"


def mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")


def interval(diffs: list[float]) -> tuple[float, float, float, float]:
    """(mean, std, low, high): the paired differences' mean, standard deviation and 95% t-interval."""
    mean, std = mean_std(diffs)
    half = T_QUANTILE_975.get(len(diffs) - 1, 2.0) * std / math.sqrt(len(diffs))
    return mean, std, mean - half, mean + half


def judge(diffs: list[float], claim: float | None) -> tuple[str, str]:
    """(verdict, reason) of a claim against the paired differences: ``refuted`` when the 95% t-interval's
    upper end is below the claim; ``reproduced`` when the interval holds the claim (and excludes 0, unless the
    claim is within 0.5 points of 0) or lies above it; ``not resolved`` when it holds both the claim and 0, or
    the paper has no number; ``pending`` below two pairs."""
    if len(diffs) < 2:
        return "pending", f"n = {len(diffs)}"
    _, _, low, high = interval(diffs)
    if claim is None:
        return "not resolved", "the paper reports no number for this comparison"
    if high < claim:
        return "refuted", f"the 95% CI's upper end {high:+.1f} is below the claim {claim:+.2f}"
    if low > claim:
        return "reproduced", f"the 95% CI [{low:+.1f}, {high:+.1f}] lies above the claim {claim:+.2f}"
    if low <= 0.0 <= high and abs(claim) >= 0.5:
        return "not resolved", (f"the 95% CI [{low:+.1f}, {high:+.1f}] holds {claim:+.2f} and 0 at n = "
                                f"{len(diffs)}")
    return "reproduced", f"the 95% CI [{low:+.1f}, {high:+.1f}] holds {claim:+.2f}"


def verdict(diffs: list[float], claim: float | None) -> str:
    """The first table's verdict cell: :func:`judge`'s verdict with the 95% t-interval of the paired
    differences."""
    kind, reason = judge(diffs, claim)
    if kind == "pending":
        return "pending"
    _, _, low, high = interval(diffs)
    ci = f"95% CI [{low:+.1f}, {high:+.1f}]"
    if claim is None:
        return f"no paper number; {ci}"
    if kind == "refuted":
        return f"**refuted**: {ci}, its upper end {claim - high:.1f} below {claim:+.2f}"
    if kind == "not resolved":
        return f"not resolved: {ci} holds {claim:+.2f} and 0 (no gain shown at n = {len(diffs)})"
    return f"**reproduced**: {ci} {'holds' if low <= claim else 'lies above'} {claim:+.2f}"


def paired(results: dict[str, Any], name: str, label: str, against: str, epsilon: float) -> list[float]:
    """``label`` minus ``against``, dev accuracy points, paired by seed."""
    rows, base = seed_rows(results, name, label, epsilon), seed_rows(results, name, against, epsilon)
    return [100 * (rows[s]["accuracy"] - base[s]["accuracy"]) for s in sorted(set(rows) & set(base))]


def summary(diffs: list[float]) -> str:
    """mean ± std, the 95% t-interval and n of paired differences."""
    if len(diffs) == 1:
        return f"{diffs[0]:+.1f} (n=1)"
    mean, std, low, high = interval(diffs)
    return f"{mean:+.1f} ± {std:.1f}, CI [{low:+.1f}, {high:+.1f}] (n={len(diffs)})"


def against_claim(diffs: list[float], claim: float | None) -> str:
    """Where a control's 95% t-interval lies against the claim: holds it, above it or below it."""
    if claim is None or len(diffs) < 2:
        return ""
    _, _, low, high = interval(diffs)
    return f"{'below' if high < claim else 'above' if low > claim else 'holds'} {claim:+.2f}"


def utility_command(name: str, epsilon: float, labels: list[str] | None = None) -> str:
    """The command that runs (or resumes) one epsilon's cells of protocol ``name``: every row, or the rows of
    ``labels`` alone."""
    protocol = PROTOCOLS[name]
    seeds = " ".join(str(s) for s in protocol.get("seeds", [0, 1, 2]))
    command = f"python -m benchmarks utility --protocols {name} --epsilons {epsilon:g} --seeds {seeds}"
    if labels:
        command += " --methods " + " ".join(json.dumps(label, ensure_ascii=False) for label in labels)
    noise_from = any("noise_from" in ref for label, ref in protocol.get("reference", {}).items()
                     if labels is None or label in labels)
    return f"python -m benchmarks authors-noise && {command}" if noise_from else command


def first_row(results: dict[str, Any], name: str, label: str, epsilon: float) -> dict[str, Any]:
    return next(iter(seed_rows(results, name, label, epsilon).values()))


def control_cell(results: dict[str, Any], name: str, spec: dict[str, Any], baseline: str, epsilon: float,
                 claim: float | None) -> tuple[str, list[float]]:
    """The positive control's cell and its paired differences (empty: not run, or the protocol has none)."""
    if "control" not in spec:
        return spec.get("control_note", "–"), []
    labels = [spec["control"], *([spec["control_baseline"]] if "control_baseline" in spec else [])]
    control = paired(results, name, spec["control"], baseline, epsilon)
    if not control:
        return f"not run yet: `{utility_command(name, epsilon, labels)}`", []
    row = first_row(results, name, spec["control"], epsilon)
    position = against_claim(control, claim)
    cell = (f"{spec['control']} − {baseline} (σ × {row.get('noise_scale', 1.0):.3f}, ε {row['epsilon']:.3g} "
            f"spent): {summary(control)}{f'; {position}' if position else ''}")
    if "control_baseline" in spec:
        low_noise = paired(results, name, spec["control_baseline"], baseline, epsilon)
        cell += (f"; {spec['control_baseline']} − {baseline}: "
                 f"{summary(low_noise) if low_noise else 'not run yet'}")
    return cell, control


def causes(results: dict[str, Any], name: str, spec: dict[str, Any], baseline: str, epsilon: float,
           claim: float | None, kind: str, control: list[float]) -> list[str]:
    """Why a claim was refuted, as far as the control rows show it."""
    if kind != "refuted" or "control" not in spec:
        return []
    if len(control) < 2:
        return ["the positive control is not run yet"]
    position = against_claim(control, claim).split(" ")[0]
    if position == "below":
        return ["the control at the authors' released noise is below the claim too"]
    scale = first_row(results, name, spec["control"], epsilon)["noise_scale"]
    where = "holds" if position == "holds" else "lies above"
    found = [f"the gain appears at the noise the authors' code releases (σ × {scale:.3f} per unit of its "
             f"sensitivity; the control {where} the claim), not at the σ its accounting states"]
    low_noise = paired(results, name, spec.get("control_baseline", ""), baseline, epsilon)
    if len(low_noise) > 1:
        found.append(f"{spec['control_baseline']} gains {interval(low_noise)[0]:+.1f} over {baseline} from "
                     "the lower noise alone")
        own = paired(results, name, spec["control"], spec["control_baseline"], epsilon)
        if len(own) > 1:
            found.append(f"the method's own share at that noise ({spec['control']} − "
                         f"{spec['control_baseline']}): {summary(own)}")
    return found


def claim_table(results: dict[str, Any]) -> list[str]:
    """The verdict of each claim (the protocols with a ``verdict`` entry, each epsilon): the paired result at
    the stated noise, the positive control at the noise the authors' released code adds, the comparison on one
    grid point, the verdict with its cause, and the command of the row."""
    lines = ["| claim (SST-2), scale | ε | paper | at the stated noise: method − baseline | positive control: "
             "at the noise the authors' code releases | on one grid point | verdict: cause | command of the "
             "row |",
             "|---|---|---|---|---|---|---|---|"]
    scales = {"head": "linear head", "full": "every weight"}
    for name, protocol in PROTOCOLS.items():
        spec = protocol.get("verdict")
        if spec is None:
            continue
        baseline, method = list(protocol["methods"])[:2]
        scale = scales.get(protocol["scale"], f"top 2 layers {protocol.get('train')}")
        for epsilon in protocol["epsilons"]:
            claim = protocol["claims"].get(epsilon)
            stated = paired(results, name, method, baseline, epsilon)
            stated_cell = f"{method} − {baseline}: {summary(stated)}" if stated else (
                f"not run yet: `{utility_command(name, epsilon, [baseline, method])}`")
            control, control_diffs = control_cell(results, name, spec, baseline, epsilon, claim)
            compare, notes = [], []
            for label, against in spec.get("compare", {}).items():
                diffs = paired(results, name, label, against, epsilon)
                if not diffs:
                    compare.append(f"{label}: not run yet: `{utility_command(name, epsilon, [label])}`")
                    continue
                point = point_key(first_row(results, name, label, epsilon).get("point", {}))
                compare.append(f"{label} ({point}) − {against}: {summary(diffs)}")
                if len(diffs) > 1 and interval(diffs)[3] < 0:
                    notes.append(f"at one grid point {label} is below {against}")
            kind, reason = judge(stated, claim) if stated else ("not run yet", "")
            found = causes(results, name, spec, baseline, epsilon, claim, kind, control_diffs) + notes
            judgement = (f"**{kind}**{f': {reason}' if reason else ''}"
                         f"{'; cause: ' + '; '.join(found) if found else ''}")
            lines.append(f"| {protocol['paper'].split(':')[0]}, {scale} | {epsilon:g} | "
                         f"{'–' if claim is None else f'{claim:+.2f}'} | {stated_cell} | {control} | "
                         f"{'; '.join(compare) or '–'} | {judgement} | `{utility_command(name, epsilon)}` |")
    return lines


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    lines = [BEGIN, "", "| paper claim (SST-2) | scale | ε | baseline | method | method − baseline, paired "
                        "(paper) | verdict |",
             "|---|---|---|---|---|---|---|"]
    detail = ["", "Per method (dev accuracy %, mean ± std over seeds; the hyperparameters chosen on the "
                  "validation "
              "split; per run, the median wall seconds on this 2-core machine, shared with other jobs, and "
              "CPU minutes (process time, all threads; – where not recorded)):", "",
              "| protocol | method | ε (sound) | accuracy | seeds | chosen on validation | σ | steps | s/run "
              "| CPU min/run |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, protocol in PROTOCOLS.items():
        labels = list(protocol["methods"]) + list(protocol.get("reference",
                                                               {})) + protocol.get("extra_labels", [])
        baseline, method = labels[0], labels[1]
        for epsilon in protocol["epsilons"]:
            base_rows, method_rows = seed_rows(results, name, baseline, epsilon), seed_rows(results, name,
                                                                                            method, epsilon)
            paired = sorted(set(base_rows) & set(method_rows))
            diffs = [100 * (method_rows[s]["accuracy"] - base_rows[s]["accuracy"]) for s in paired]
            claim = protocol["claims"].get(epsilon)
            scale = {"head": f"linear head, {protocol.get('train_samples', 20000) // 1000}k ex.",
                     "full": "every weight, 67k ex."}.get(protocol["scale"],
                                                          f"top 2 layers {protocol.get('train')}, 6k ex.")
            if diffs:
                mean, std = mean_std(diffs)
                spread = f" ± {std:.1f}" if len(diffs) > 1 else ""  # one pair has no spread
                cell = (f"{mean:+.1f}{spread} (n={len(diffs)}; paper "
                        f"{'–' if claim is None else f'{claim:+.2f}'})")
                judgement = verdict(diffs, claim)
            elif protocol["scale"] != "head":
                cell = "not measured" if claim is None else f"not measured (paper {claim:+.2f})"
                judgement = f"not run yet: `python -m benchmarks utility --protocols {name}`"
            else:
                cell, judgement = "pending", "pending"
            lines.append(f"| {protocol['paper'].split(':')[0]} | {scale} | {epsilon:g} | {baseline} | "
                         f"{method} | {cell} | {judgement} |")
            for label in labels:
                rows = seed_rows(results, name, label, epsilon)
                if not rows:
                    continue
                accs = [100 * r["accuracy"] for r in rows.values()]
                mean, std = mean_std(accs)
                first = next(iter(rows.values()))
                point = point_key(first.get("point", {})) or "–"
                secs = np.median([r["seconds"] for r in rows.values()])
                spread = f"{mean:.1f} ± {std:.1f}" if len(accs) > 1 else f"{mean:.1f} (one seed)"
                detail.append(f"| {name} | {label} | {first['epsilon']:.2f} | {spread} | "
                              f"{len(rows)} | {point} | {first['noise_multiplier']:.3g} | {first['steps']} | "
                              f"{secs:.0f} | {cpu_minutes(rows.values())} |")
    lines += detail + ["", "CPU time of each fine-tuning protocol, every run in the results file (grid "
                           "points, failed or "
                       "left out of a later grid, and seeds):", ""]
    for name, protocol in PROTOCOLS.items():
        rows = [r for k, r in results.items() if k.startswith(f"{name}|") and "cpu_seconds" in r]
        if protocol["scale"] != "head" and rows:
            lines.append(f"- `{name}`: {len(rows)} runs, {sum(r['cpu_seconds'] for r in rows) / 60:.0f} CPU "
                         f"minutes in all, {sum(r['seconds'] for r in rows) / 60:.0f} wall minutes (torch "
                         "threads per run: "
                         f"{', '.join(str(t) for t in sorted({r['threads'] for r in rows}))}).")
    failed = [f"`{key}`: {row['failed'][:160]}" for key, row in results.items() if row.get("failed")]
    if failed:
        lines += ["", "Grid points the trainer stopped (saved as failed; they score nothing):", ""]
        lines += [f"- {entry}" for entry in failed]
    lines += ["", "Protocols (the presets in benchmarks/paper_protocols.py, `python -m benchmarks utility`):",
              ""]
    for name, protocol in PROTOCOLS.items():
        # each method's own grid: a method_grids entry adds to the shared grid, or replaces its values
        grids = "; ".join(f"{label}: {json.dumps({**protocol['grid'], **grid})}"
                          for label, grid in protocol.get("method_grids", {}).items())
        lines.append(f"- `{name}`: {protocol['paper']}; {json.dumps(protocol['common'])}; grid "
                     f"{json.dumps(protocol['grid'])}{f' ({grids})' if grids else ''}.")
    lines += ["", f"Command: `python -m benchmarks utility` (plots: `{PLOT}`).", END]
    write_generated(args.output, BEGIN, END, "\n".join(lines))
    claims = [CLAIMS_BEGIN, "", *claim_table(results), "", CLAIMS_END]
    write_generated(args.output, CLAIMS_BEGIN, CLAIMS_END, "\n".join(claims))
    plot(results, args.plot)


def write_generated(path: str, begin: str, end: str, generated: str) -> None:
    """Replace ``begin`` ... ``end`` in ``path`` (both included) with ``generated``; append it when absent."""
    text = open(path).read()
    if begin in text and end in text:
        text = text[: text.index(begin)] + generated + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + generated + "\n"
    with open(path, "w") as f:
        f.write(text)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    for ax, (name, protocol) in zip(axes.flat, PROTOCOLS.items()):
        # the controls at a scaled noise are left out: they spend another epsilon than the one they are keyed
        # at
        labels = list(protocol["methods"]) + [label for label, ref in protocol.get("reference", {}).items()
                                              if "noise_from" not in ref] + protocol.get("extra_labels", [])
        for offset, label in zip(np.linspace(-0.08, 0.08, len(labels)), labels):
            xs, means, stds, points = [], [], [], []
            for epsilon in protocol["epsilons"]:
                rows = seed_rows(results, name, label, epsilon)
                if rows:
                    accs = [100 * r["accuracy"] for r in rows.values()]
                    xs.append(epsilon * (1 + offset))
                    means.append(np.mean(accs))
                    stds.append(np.std(accs, ddof=1) if len(accs) > 1 else 0.0)
                    points.append(accs)
            if xs:
                ax.errorbar(xs, means, yerr=stds, marker="o", capsize=4, label=label)
                for x, accs in zip(xs, points):
                    ax.scatter([x] * len(accs), accs, s=8, alpha=0.4, color=ax.lines[-1].get_color())
        ax.set_xscale("log")
        ax.set_xticks(protocol["epsilons"], [f"{e:g}" for e in protocol["epsilons"]])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        low, high = min(protocol["epsilons"]), max(protocol["epsilons"])
        ax.set_xlim(low / 1.3, high * 1.3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("ε")
        ax.set_ylabel("SST-2 dev accuracy (%)")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat[len(PROTOCOLS):]:
        ax.axis("off")
    fig.suptitle("Accuracy against ε per protocol: mean ± std over seeds (dots: single seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


BEGIN, END = ("<!-- BEGIN GENERATED by benchmarks/paper_protocols.py -->", "<!-- END GENERATED by "
    "benchmarks/paper_protocols.py -->")
CLAIMS_BEGIN = "<!-- BEGIN GENERATED claim verdicts (benchmarks/paper_protocols.py) -->"
CLAIMS_END = "<!-- END GENERATED claim verdicts -->"
PLOT = "docs/img/paper_protocols.png"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocols", nargs="+",
                        default=[n for n in PROTOCOLS if n not in ("disk_full", "minilm_full")],
                        choices=list(PROTOCOLS), help="default: all but disk_full and minilm_full (every weight: "
                                                      "run them by name)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: every core; 1 when two sweeps share two cores)")
    parser.add_argument("--data_dir", default=None, help="SST-2 folder (default: ../shared/data/glue/SST-2)")
    parser.add_argument("--train_samples", type=int, default=20000)
    parser.add_argument("--top_train_samples", type=int, default=6000)
    parser.add_argument("--top_validation_samples", type=int, default=2000)
    parser.add_argument("--epsilons", type=float, nargs="+", default=None, help="only these of each "
        "protocol's")
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods of each protocol (their "
                        "labels, e.g. DP-AdamW): their tuning, seeds and reference rows")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tuning_seed", type=int, default=100)
    parser.add_argument("--report", action="store_true", help="only rewrite the tables and plots")
    parser.add_argument("--json", default="benchmarks/results/paper_protocols.json")
    parser.add_argument("--output", default="docs/results.md")
    parser.add_argument("--plot", default=PLOT)
    parser.add_argument("--work_dir", default="outputs/paper_protocols")
    args = parser.parse_args(argv)
    args.data_dir = sst2_dir(args.data_dir)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    store = Store(args.json)
    if not args.report:
        for name in args.protocols:
            run_protocol(name, args, store)
    report(store.load(), args)

