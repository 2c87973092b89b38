"""The QAT export check's noise floor: a quantized network can be a step function that a
rounding-sized change of its input moves; ONNX Runtime is held to the bound, or to the model's
own agreement under such noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.ao.quantization import FakeQuantizeBase

from slimline.compress.qat.export_check import NOISE, export_passes, noise_floor

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


class Rounder(FakeQuantizeBase):
    """An activation fake quant on a grid of 1 (no clamp)."""

    def __init__(self) -> None:
        super().__init__()
        self.qscheme = torch.per_tensor_affine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return torch.ones(1), torch.zeros(1, dtype=torch.int32)


class Steps(nn.Module):
    """``sin(round(x * gain))``: with a large gain, a relative change of 1e-6 in the rounded
    value crosses rounding boundaries; ``sin`` of that amplifies each crossing."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain
        self.quant = Rounder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.quant(x * self.gain))


class Smooth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x)
        return out


def _sample() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)}


def _floor(model: nn.Module) -> float:
    sample = _sample()
    with torch.no_grad():
        ref = [model(torch.from_numpy(sample["x"])).numpy()]
    return noise_floor(model, sample, ref)


def test_a_model_without_activation_fake_quants_has_no_noise_floor() -> None:
    assert _floor(Smooth()) == 1.0


def test_a_model_that_steps_at_rounding_noise_has_a_low_floor() -> None:
    # gain 1e7: values ~1e7 on a grid of 1, moved by ~10 (1e-6 of themselves): most cross
    assert NOISE == 1e-6
    assert _floor(Steps(1e7)) < 0.5
    assert _floor(Steps(1.0)) > 0.99  # values ~1 move by ~1e-6: almost none crosses


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
