"""Where QAT's ranges start (compress/qat/start.py): with ``calibration: auto`` each of minmax and
percentile calibrates the student, and the start that scores best on the held-out batches is
kept (declared agreement where declared, else cosine)."""

from __future__ import annotations

import copy
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch import nn

from slimline.compress.qat.held_out import DeclaredScore
from slimline.compress.qat.start import AUTO_METHODS, pick_calibration, start_score
from slimline.compress.qat.step import QatConfig
from slimline.measure.judge import Judge
from slimline.outputs import ProbabilityMapOutput


class _Map(nn.Module):
    def __init__(self, weight: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        with torch.no_grad():
            self.conv.weight.fill_(weight)
            cast(torch.Tensor, self.conv.bias).zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x))


def _val() -> list[Any]:
    rng = np.random.default_rng(0)
    return [({"x": rng.standard_normal((4, 1, 6, 6)).astype(np.float32)}, None)]


def test_auto_keeps_the_start_closest_to_the_teacher_and_records_every_score() -> None:
    teacher = _Map(1.0).eval()
    students = {"minmax": _Map(-1.0), "percentile": _Map(0.9)}  # minmax's flips the map
    built: list[str] = []

    def build(method: str) -> tuple[Any, int]:
        built.append(method)
        return students[method], 7

    student, rows, method, scores = pick_calibration(build, teacher, _val(), None)
    assert built == list(AUTO_METHODS) and set(scores) == set(AUTO_METHODS)
    assert (student, rows, method) == (students["percentile"], 7, "percentile")
    assert scores["percentile"] > scores["minmax"]


def test_the_declared_agreement_scores_the_start_and_a_tie_keeps_the_first() -> None:
    teacher = _Map(1.0).eval()
    judge = cast(Judge, Judge.from_declarations({"m": ProbabilityMapOutput(threshold=0.5)}))
    score = DeclaredScore(judge, "m")
    same, scaled = copy.deepcopy(teacher), _Map(3.0)  # same mask at threshold 0.5
    same.train()
    assert start_score(same, teacher, _val(), score) == 1.0
    assert same.training  # the mode is put back
    assert start_score(scaled, teacher, _val(), None) < 1.0  # cosine sees the scaling
    students = {"minmax": same, "percentile": scaled}
    _, _, method, scores = pick_calibration(lambda m: (students[m], 1), teacher, _val(), score)
    assert method == "minmax" and scores == {"minmax": 1.0, "percentile": 1.0}
    assert score.history == []  # the held-out history is training's alone


def test_auto_is_the_default_and_the_methods_stay_validated() -> None:
    assert QatConfig().calibration == "auto"
    with pytest.raises(ValueError, match="calibration"):
        QatConfig(calibration="kl")
