"""Adversarial review of issues 21 (engine side) and 22 (the run), through the public API only.

Each test is an attack that found a hole (now closed) or that adds coverage the other files lack:

* a forward that writes state only on some steps (after the first, proving, step): every recorded step
  compares buffer and parameter identities and versions before its backward, so the write is refused before
  that step releases anything; transformers' dynamic / LongRoPE rotary embeddings (which replace or rewrite
  ``inv_freq`` from the longest position of the batch) are refused at attach by a validator.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dpfilter import GhostClippingEngine, ModuleValidationError
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.validators import StateWrittenError


# --------------------------------------------------------------------- state written after the first step
class _WritesLater(nn.Module):
    """Writes a buffer from the data only when an input is large: never on the first (proving) step."""

    def __init__(self, replace: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.replace = replace
        self.register_buffer("peak", torch.zeros(3))

    def forward(self, x):
        if bool(x.abs().max() > 10):
            if self.replace:
                self.peak = x.detach().amax(0)
            else:
                self.peak.copy_(x.detach().amax(0))
        return self.proj(x)


@pytest.mark.parametrize("replace", [False, True], ids=["in_place", "replaced"])
def test_state_written_on_a_later_step_is_refused_before_that_step_releases(replace):
    torch.manual_seed(0)
    model = _WritesLater(replace)
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=4, epochs=1, noise_multiplier=0.0,
                              max_grad_norm=1.0, seed=0)
    engine = plan.make_engine(model)
    optimizer = plan.make_optimizer(list(model.parameters()), base=torch.optim.SGD, lr=0.0)
    labels = torch.tensor([0, 1, 0, 1])

    def step(x):
        optimizer.accumulate(engine, lambda values: F.cross_entropy(model(x), labels, reduction="none"), batch_size=4)

    step(torch.randn(4, 3))  # the proving step: nothing written
    optimizer.zero_grad()
    sums_before = {p: s.clone() for p, s in optimizer._local_sums().items()}
    outlier = torch.randn(4, 3)
    outlier[2, 1] = 50.0  # one private example large enough to make the forward write
    with pytest.raises(StateWrittenError, match=r"'peak'"):
        step(outlier)
    after = optimizer._local_sums()
    assert all(torch.equal(after[p], s) for p, s in sums_before.items())  # nothing of that step entered the sums


def test_a_model_writing_no_state_passes_every_step():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = GhostClippingEngine(model)
    for seed in range(3):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
        with engine.record():
            loss = F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long), reduction="none")
        engine.per_example_gradients(loss)


# ------------------------------------------------------------------------------ data-dependent RoPE
def _llama(rope_type: str):
    import transformers

    params = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0, 1.0], long_factor=[2.0, 2.0], original_max_position_embeddings=8)
    config = transformers.LlamaConfig(
        vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=8, rope_parameters=params,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_data_dependent_rope_is_refused_at_attach_with_the_fix(rope_type):
    with pytest.raises(ModuleValidationError, match=rf"(?s)'model.rotary_emb'.*'{rope_type}'.*Fix: use a static"):
        GhostClippingEngine(_llama(rope_type))


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_static_rope_scalings_stay_accepted(rope_type):
    GhostClippingEngine(_llama(rope_type)).detach()
