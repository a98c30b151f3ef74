"""secure_rng=True: Gaussian noise from the OS CSPRNG (Box-Muller) has the right statistics and is used."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from scipy import stats

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.randomness.secure_rng import secure_gaussian


def test_secure_gaussian_statistics():
    x = secure_gaussian((1_000_000,), 2.5, dtype=torch.float64, device=torch.device("cpu")).numpy() / 2.5
    assert abs(x.mean()) < 5 * 1 / np.sqrt(1e6)
    assert abs(x.std() - 1.0) < 5 * np.sqrt(0.5 / 1e6)
    assert stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(stats.kurtosis(x)) < 0.03 and abs(stats.skew(x)) < 0.02


def test_secure_gaussian_shapes_and_not_reproducible():
    a = secure_gaussian((3, 5), 1.0, dtype=torch.float32, device=torch.device("cpu"))
    b = secure_gaussian((3, 5), 1.0, dtype=torch.float32, device=torch.device("cpu"))
    assert a.shape == (3, 5) and a.dtype == torch.float32 and not torch.equal(a, b)
    # odd count
    assert secure_gaussian((7,), 1.0, dtype=torch.float64, device=torch.device("cpu")).shape == (7,)


def test_training_arguments_secure_rng_uses_the_csprng(tmp_path, monkeypatch):
    calls = []
    import hf_dpfilter.randomness.secure_rng as secure_rng

    original = secure_rng.secure_gaussian

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(secure_rng, "secure_gaussian", counting)
    import hf_dpfilter.randomness.sampling as sampling

    coins = []
    original_uniform = sampling.secure_uniform

    def counting_uniform(count):
        coins.append(count)
        return original_uniform(count)

    monkeypatch.setattr(sampling, "secure_uniform", counting_uniform)
    args = DPTrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        noise_multiplier=1.0, logical_batch_size=4, max_steps=1, secure_rng=True, accountant="rdp",
    )
    trainer = DPTrainer(model=tiny_roberta(), args=args,
                        train_dataset=ListDataset(make_examples(8, VOCAB, False)),
                        data_collator=PadCollator(1))
    trainer.train()
    assert trainer.dp_optimizer.secure_rng is True
    n_coordinates = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    # every coordinate's noise came from the CSPRNG, in one draw for the whole step
    assert len(calls) == 1 and sum(math.prod(shape) for shape in calls) == n_coordinates
    with pytest.raises(AssertionError):
        assert trainer.dp_optimizer._generators  # the seeded generator was never used
    assert coins == [8]  # the Poisson coins of the one step (one per example) came from the CSPRNG too
