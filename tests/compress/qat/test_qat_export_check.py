"""The QAT export check's noise floor: a quantized network can be a step function that a
rounding-sized change of its input moves; ONNX Runtime is held to the bound, or to the model's
own agreement under such noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from slimline.compress.qat.step import NOISE, _noise_floor, export_passes


class Steps(nn.Module):
    """``round(x * gain)`` scaled back: with a large gain, noise of 1e-6 of the input's spread
    crosses rounding boundaries; ``sin`` of that amplifies each crossing."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.round(x * self.gain))


def _sample() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)}


def _floor(model: nn.Module) -> float:
    sample = _sample()
    with torch.no_grad():
        ref = model(torch.from_numpy(sample["x"])).numpy()
    return _noise_floor(model, sample, ref)


class Smooth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x)
        return out


def test_a_smooth_model_has_no_noise_floor() -> None:
    assert _floor(Smooth()) > 0.999999


def test_a_model_that_steps_at_rounding_noise_has_a_low_floor() -> None:
    # each row has 64 values; gain 1e7 puts input steps of 1e-7 on the rounding grid, and the
    # perturbation (1e-6 of the spread, ~1) moves most of them by several steps
    assert NOISE == 1e-6
    assert _floor(Steps(1e7)) < 0.5
    assert _floor(Steps(1.0)) == pytest.approx(1.0)  # steps of 1 are not crossed by 1e-6


def test_integer_inputs_are_not_perturbed() -> None:
    class Embed(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.sin(ids.float() * 1e7)

    sample = {"ids": np.arange(16, dtype=np.int64).reshape(2, 8)}
    assert _noise_floor(Embed(), sample, np.zeros((2, 8), np.float32)) == 1.0


@pytest.mark.parametrize(
    ("cosine", "floor", "ok"),
    [
        (0.9995, 1.0, True),  # at the bound
        (0.990, 1.0, False),  # a smooth model: the bound holds
        (0.990, 0.9905, True),  # as close as the model is to itself, within the slack
        (0.980, 0.9905, False),  # further than rounding explains: a wrong export
    ],
)
def test_the_rule(cosine: float, floor: float, ok: bool) -> None:
    assert export_passes(cosine, floor, 0.999) is ok
