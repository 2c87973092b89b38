"""BatchNorm freezing when the QAT training loss oscillates (and the record of which rule froze
it), kept across a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from slimline.compress.qat import fakequant as fq
from slimline.compress.qat.oscillation import loss_oscillates
from slimline.compress.qat.step import QatConfig, QatHooks

UP_DOWN = [1.0, 1.4, 0.9, 1.5, 1.0, 1.3, 0.95, 1.45]
FALLING_NOISY = [2.0, 1.7, 1.8, 1.4, 1.5, 1.1, 1.2, 0.9]


def test_a_loss_that_goes_up_and_down_oscillates() -> None:
    assert loss_oscillates(UP_DOWN)
    assert not loss_oscillates(FALLING_NOISY)  # noisy, but going down
    assert not loss_oscillates([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])  # rising, no change of direction
    assert not loss_oscillates([1.0, 2.0, 1.0])  # too few steps to tell


class _ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.bn(self.conv(x)))
        return out


def _student() -> Any:
    return fq.prepare(_ConvBn().eval(), {"x": torch.zeros(2, 1, 6, 6)}, fq.FakeQuantFormat())


def _bn_frozen(student: Any) -> bool:
    flags = [m.freeze_bn for m in student.modules() if hasattr(m, "freeze_bn")]
    assert flags, "no fused Conv-BN module to freeze"
    return all(flags)


def _feed(hooks: QatHooks, student: Any, losses: list[float], start: int = 1) -> None:
    for step, loss in enumerate(losses, start=start):
        hooks.before_forward(step, student)
        hooks.on_step(step, loss)


def test_batchnorm_freezes_when_the_loss_oscillates() -> None:
    cfg = QatConfig(freeze_bn_after=None, freeze_bn_on_oscillation=6)
    hooks, student = QatHooks(cfg), _student()
    _feed(hooks, student, UP_DOWN)
    assert hooks.bn_frozen_at == 6 and hooks.bn_trigger == "oscillation"
    hooks.before_forward(len(UP_DOWN) + 1, student)  # frozen before the next step's forward
    assert _bn_frozen(student)
    rec = hooks.record(len(UP_DOWN) + 1)
    assert rec["batchnorm_trigger"] == "oscillation"
    assert "frozen after step 6: the loss oscillated" in rec["batchnorm"]


def test_a_falling_loss_leaves_batchnorm_training_until_its_step() -> None:
    cfg = QatConfig(freeze_bn_after=10, freeze_bn_on_oscillation=6)
    hooks, student = QatHooks(cfg), _student()
    _feed(hooks, student, FALLING_NOISY)
    assert (hooks.bn_frozen_at, _bn_frozen(student)) == (None, False)
    _feed(hooks, student, [0.8, 0.7, 0.6], start=9)
    assert (hooks.bn_frozen_at, hooks.bn_trigger) == (10, "steps") and _bn_frozen(student)


def test_the_oscillation_decision_survives_a_resume() -> None:
    cfg = QatConfig(freeze_bn_after=None, freeze_bn_on_oscillation=6)
    first = QatHooks(cfg)
    _feed(first, _student(), UP_DOWN)
    resumed, student = QatHooks(cfg), _student()  # a new process: fresh hooks and module
    resumed.load_state(first.state())
    resumed.before_forward(len(UP_DOWN) + 1, student)
    assert _bn_frozen(student)
    assert resumed.record(9)["batchnorm_frozen_at"] == 6


def test_the_oscillation_window_is_validated() -> None:
    with pytest.raises(ValueError, match="freeze_bn_on_oscillation"):
        QatConfig(freeze_bn_on_oscillation=2)
