"""QAT judged as the task is (compress/qat/held_out.py): the declared kind picks the distillation
loss, and the held-out score that keeps the weights is the declared agreement, not the loss."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from slimline.compress.finetune import DistillHooks, FinetuneConfig, distill
from slimline.compress.qat.held_out import (
    TIE_WEIGHT,
    DeclaredScore,
    declared_output,
    kind_loss,
)
from slimline.compress.qat.step import QatConfig, QatHooks
from slimline.measure.judge import Judge
from slimline.outputs import LogitsOutput, ProbabilityMapOutput
from slimline.task import Task


def _task(**declared: Any) -> Task:
    return cast(Task, SimpleNamespace(judge=Judge.from_declarations(declared)))


def test_the_declared_kind_picks_the_output_and_the_loss() -> None:
    maps = _task(prob=ProbabilityMapOutput(threshold=0.3))
    assert declared_output(maps, "prob") == "prob"
    assert declared_output(maps, None) == "prob"  # a torch task: its one declared output
    assert kind_loss(maps, "prob") == "bce"
    logits = _task(cls=LogitsOutput())
    assert kind_loss(logits, "cls") is None  # logits are distilled by KL already
    both = _task(a=LogitsOutput(), b=LogitsOutput())
    assert declared_output(both, None) is None  # which one the module returns is unknown
    assert declared_output(_task(), "x") is None  # nothing declared: the loss keeps the weights


class _Map(nn.Module):
    """A probability map: sigmoid of a 1x1 convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x))


def _val(rows: int = 4) -> list[Any]:
    rng = np.random.default_rng(0)
    return [({"x": rng.standard_normal((rows, 1, 6, 6)).astype(np.float32)}, None)]


def test_the_held_out_score_is_the_declared_agreement_with_the_loss_as_tie_break() -> None:
    torch.manual_seed(0)
    teacher = _Map().eval()
    with torch.no_grad():
        teacher.conv.weight.fill_(1.0)
        cast(torch.Tensor, teacher.conv.bias).zero_()
    same, moved = copy.deepcopy(teacher), copy.deepcopy(teacher)
    with torch.no_grad():
        moved.conv.weight.fill_(-1.0)  # the pixels above the threshold flip
    score = DeclaredScore(cast(Judge, Judge.from_declarations({"m": ProbabilityMapOutput()})), "m")
    same.train()
    assert score(same, teacher, _val(), 0.5) == TIE_WEIGHT  # agreement 1, the first loss
    assert same.training  # the student's mode is put back
    worse = score(moved, teacher, _val(), 0.01)  # a smaller loss does not outweigh the IoU
    assert worse > 10 * TIE_WEIGHT
    assert score.history[0]["agreement"] == 1.0
    assert score.history[1]["agreement"] < 1.0


def _batches() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    rng = np.random.default_rng(1)
    for _ in range(8):
        yield {"x": rng.standard_normal((4, 1, 6, 6)).astype(np.float32)}, None


class _FirstIsBest(DistillHooks):
    """A held-out score under which no trained weights beat the start."""

    def held_out_loss(
        self, student: nn.Module, teacher: nn.Module, val: list[Any], loss: float
    ) -> float:
        self.calls = getattr(self, "calls", 0) + 1
        return 0.0 if self.calls == 1 else 1.0


def test_distill_keeps_the_weights_of_the_best_held_out_score_not_of_the_loss() -> None:
    torch.manual_seed(0)
    teacher = _Map().eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.conv.weight.mul_(-1.0)  # far from the teacher: training lowers the loss
    start = copy.deepcopy(student.state_dict())
    cfg = FinetuneConfig(steps=6, lr=0.05, eval_every=2, patience=2, val_batches=2, progress=False)
    by_loss = copy.deepcopy(student)
    plain = distill(by_loss, teacher, _batches, cfg, output_kind="other")
    assert plain.best_step > 0  # the loss alone keeps trained weights
    res = distill(student, teacher, _batches, cfg, output_kind="other", hooks=_FirstIsBest())
    assert res.best_step == 0 and res.stopped_early
    assert all(torch.equal(v, start[k]) for k, v in student.state_dict().items())


def test_qat_hooks_score_by_the_declaration_and_keep_its_first_loss_across_a_resume() -> None:
    judge = cast(Judge, Judge.from_declarations({"m": ProbabilityMapOutput()}))
    torch.manual_seed(0)
    teacher = _Map().eval()
    hooks = QatHooks(QatConfig(), DeclaredScore(judge, "m"))
    assert hooks.held_out_loss(copy.deepcopy(teacher), teacher, _val(), 2.0) == TIE_WEIGHT
    again = QatHooks(QatConfig(), DeclaredScore(judge, "m"))
    again.load_state(hooks.state())
    assert again.score is not None and again.score.first_loss == 2.0
    plain = QatHooks(QatConfig())
    assert plain.held_out_loss(teacher, teacher, _val(), 0.25) == 0.25  # nothing declared


def test_a_ptq_row_screened_on_a_subset_is_judged_again_on_every_row() -> None:
    from slimline.candidate import Candidate
    from slimline.compress.qat.compare import _all_rows

    seen: list[str] = []

    def evaluate(cand: Candidate) -> str:
        seen.append(cand.name)
        return "all rows"

    ctx: Any = SimpleNamespace(evaluate_fn=evaluate, evaluate=evaluate)
    cand = Candidate("ptq", "quantize", None)
    screened: Any = SimpleNamespace(screened="8 of 31 rows", quality="subset")
    assert _all_rows(ctx, screened, cand) == "all rows" and seen == ["ptq"]
    judged: Any = SimpleNamespace(screened=None, quality="every row")
    assert _all_rows(ctx, judged, cand) == "every row" and seen == ["ptq"]
