"""hf_dpfilter.randomness.noise: the step's Gaussian noise as functions (one draw per step, the seeded stream,
std 0)."""

from __future__ import annotations

import torch
from torch import nn

from hf_dpfilter.distributed.collectives import default_collectives
from hf_dpfilter.factory import make_optimizer
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.randomness.noise import (
    NoiseSource,
    gaussian_noise,
    noisy_average,
    noisy_averages,
    seeded_generator,
)


def _source(seed: int, draws: list | None = None, secure: bool = False) -> NoiseSource:
    generators: dict = {}

    def generator(device: torch.device) -> torch.Generator:
        return generators.setdefault(device, seeded_generator(seed, device))

    def draw(shape, std, like):
        if draws is not None:
            draws.append((tuple(shape), std))
        return gaussian_noise(shape, std, like, secure=secure, generator=generator,
                              collectives=default_collectives())

    return NoiseSource(draw=draw, generator=generator, secure=secure, collectives=default_collectives())


def test_the_optimizer_draws_from_the_noise_stream_of_its_seed():
    plan = PrivacyPlan.create(num_examples=100, logical_batch_size=10, epochs=1, noise_multiplier=1.0, seed=5)
    optimizer = make_optimizer(plan, [nn.Parameter(torch.zeros(3))], lr=0.1)
    cpu = torch.device("cpu")
    assert torch.equal(optimizer._generator(cpu).get_state(), seeded_generator(5, cpu).get_state())
    assert not torch.equal(seeded_generator(5, cpu).get_state(), seeded_generator(6, cpu).get_state())


def test_noisy_averages_is_one_draw_of_every_coordinate():
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))]
    sums = {params[0]: torch.ones(3, 2), params[1]: torch.full((4,), 2.0)}
    draws: list = []
    out = noisy_averages(sums, std=2.0, batch=4.0, source=_source(1, draws))
    assert draws == [((10,), 0.5)]  # one draw of all 10 coordinates, at scale std / B
    flat = torch.empty(10).normal_(0.0, 0.5, generator=seeded_generator(1, torch.device("cpu")))
    torch.testing.assert_close(out[params[0]], flat[:6].view(3, 2) + 0.25)
    torch.testing.assert_close(out[params[1]], flat[6:] + 0.5)


def test_zero_std_adds_nothing():
    summed = torch.arange(6.0)
    torch.testing.assert_close(noisy_average(summed, 0.0, 3.0, _source(0).draw), summed / 3.0)
    param = nn.Parameter(torch.zeros(6))
    torch.testing.assert_close(noisy_averages({param: summed}, 0.0, 3.0, _source(0))[param], summed / 3.0)


def test_secure_draws_touch_no_generator():
    used: list = []
    source = _source(0, secure=True)
    source = NoiseSource(draw=source.draw, generator=lambda d: used.append(d), secure=True,
                         collectives=source.collectives)
    noise = gaussian_noise(torch.Size([20000]), 1.0, torch.zeros(1, dtype=torch.float64), secure=True,
                           generator=source.generator, collectives=source.collectives)
    assert not used and abs(float(noise.std()) - 1.0) < 0.05
