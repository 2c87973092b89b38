"""QAT's float-layer search: the measured gain of each compute layer in float, the choice
within a MAC share, and the step keeping the chosen layers out of fake quantization."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from slimline import api
from slimline.compress.finetune import FinetuneConfig
from slimline.compress.qat import fakequant as fq
from slimline.compress.qat.held_out import DeclaredScore
from slimline.compress.qat.sensitivity import (
    COSINE_TIE_WEIGHT,
    MIN_SEARCH_ROWS,
    LayerGain,
    choose_float,
    declared_score,
    layer_gains,
    search_rows,
)
from slimline.compress.qat.step import QatConfig
from slimline.measure.judge import Judge
from slimline.outputs import LogitsOutput
from slimline.recipe import recipe_from_dict
from slimline.task import load_task

from .test_qat import DIGITS, _batches, _mk, _prepared, _tiny

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


def _out(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.from_numpy(x))
    return out


def test_each_compute_layer_gets_its_measured_gain_and_the_model_is_left_as_it_was() -> None:
    student, teacher = _prepared(), _tiny()
    fq.freeze_observers(student)
    x = _batches()[0]["x"]
    before = _out(student.eval(), x)
    student.train()
    gains = layer_gains(student, teacher, _batches(), rows=16)
    assert student.training  # the mode is restored
    assert {g.name for g in gains} == {"stem.0", "dw.0", "pw", "fc"}
    assert sum(g.mac_share for g in gains) == pytest.approx(1.0)
    assert [g.gain for g in gains] == sorted((g.gain for g in gains), reverse=True)
    torch.testing.assert_close(_out(student.eval(), x), before)  # every fake quant back on
    # the best layer's figure is the cosine measured with its fake quants switched off by hand
    best = gains[0]
    module = student.get_submodule(best.name)
    module.weight_fake_quant.disable_fake_quant()
    ref = _out(teacher, np.concatenate([b["x"] for b in _batches()])[:16]).numpy()
    off = student.eval()
    for node in off.graph.nodes:
        if node.op == "call_module" and node.target == best.name:
            for user in node.users:
                sub = off.get_submodule(str(user.target))
                if sub in fq.fake_quant_modules(off).values():
                    sub.disable_fake_quant()
    got = _out(off, np.concatenate([b["x"] for b in _batches()])[:16]).numpy()
    a, b = got.reshape(len(got), -1), ref.reshape(len(ref), -1)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert best.score_float == pytest.approx(float(cos.mean()), abs=1e-5)


def test_layers_can_be_ranked_by_the_declared_agreement_with_cosine_breaking_ties() -> None:
    """Where the task declares its output (here top-1 agreement of logits), each layer's score
    is that agreement on the rows, plus the cosine at a weight too small to outrank one row."""
    student, teacher = _prepared(), _tiny()
    fq.freeze_observers(student)
    judge = cast(Judge, Judge.from_declarations({"y": LogitsOutput()}))
    top1 = DeclaredScore(judge, "y").of_outputs
    gains = layer_gains(student, teacher, _batches(), rows=16, score=declared_score(top1))
    assert {g.name for g in gains} == {"stem.0", "dw.0", "pw", "fc"}
    for g in gains:  # k of 16 rows agree, plus at most COSINE_TIE_WEIGHT
        rows = g.score_float * 16
        assert 0.0 <= rows - np.floor(rows) <= 16 * COSINE_TIE_WEIGHT + 1e-9
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert top1([x], [x]) == 1.0 and top1([x], [x[::-1]]) == 0.0
    assert declared_score(top1)([x], [x]) == pytest.approx(1.0 + COSINE_TIE_WEIGHT)


def test_the_choice_takes_the_largest_gains_within_the_mac_share() -> None:
    gains = [
        LayerGain("big", 0.99, 0.05, 0.60),
        LayerGain("a", 0.98, 0.04, 0.02),
        LayerGain("b", 0.97, 0.03, 0.02),
        LayerGain("c", 0.96, 0.02, 0.02),
        LayerGain("none", 0.95, 0.0, 0.01),
    ]
    assert choose_float(gains, 2, 0.05) == ["a", "b"]  # "big" is over the share
    assert choose_float(gains, 5, 0.05) == ["a", "b"]  # "c" would pass 5%; no zero gains
    assert choose_float(gains, 5, 1.0) == ["big", "a", "b", "c"]
    assert choose_float(gains, 0, 1.0) == []


def test_the_search_rows_fit_its_time_and_never_go_under_the_floor() -> None:
    """The rows asked for when they fit (or with no cap, or at the floor already); the floor when
    nothing fits, flagged as over the budget. The student is left in its mode."""
    student = _prepared()
    fq.freeze_observers(student)
    student.train()
    runs = 4 + 2  # four compute layers, the baseline and the teacher
    assert search_rows(student, _batches(), 32, None) == {"rows": 32, "runs": runs}
    assert search_rows(student, _batches(), MIN_SEARCH_ROWS, 1e-9)["rows"] == MIN_SEARCH_ROWS
    roomy = search_rows(student, _batches(), 32, 1e9)
    assert roomy["rows"] == 32 and "capped_from" not in roomy and "over_budget" not in roomy
    assert roomy["estimated_s"] == pytest.approx(runs * roomy["row_s"] * 32, rel=0.01, abs=0.1)
    tight = search_rows(student, _batches(), 32, 1e-9)
    assert tight["rows"] == MIN_SEARCH_ROWS and tight["capped_from"] == 32
    assert tight["over_budget"] is True
    assert student.training


# QAT training of the digits CNN: over 7 minutes under the emulated lane (2 s natively); there the
# same formats and exports are checked on the tiny CNN (test_qdq_export_..., test_qat_export_check)
@pytest.mark.emulation_slow
def test_the_step_keeps_the_chosen_layers_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slimline.pipeline.run as pipeline

    monkeypatch.setattr(pipeline, "cache_dir", lambda *p: _mk(tmp_path.joinpath("c", *p)))
    task = load_task(str(DIGITS))
    rec = recipe_from_dict(
        {"name": "t", "task": task.source, "target": {"threads": 1},
         "budget": {"max_metric_drop": 0.05, "min_cosine": 0.95}}
    )  # fmt: skip
    ctx = api.context_for(task, rec, tmp_path / "w", timed=False, cache=tmp_path / "c")
    cfg = QatConfig(
        finetune=FinetuneConfig(steps=2, eval_every=2, progress=False),
        float_layers=1,
        max_float_macs=1.0,
        float_search_rows=8,
        compare_ptq=False,
    )
    out = api.run_step(ctx, cfg, ctx.baseline)
    search = out.meta["float_search"]
    assert search["rows"] == 8 and search["seconds"] > 0.0  # the rows asked for, and its time
    assert search["runs"] == 7 + 2  # seven compute layers, the baseline and the teacher
    assert len(search["chosen"]) == 1 and search["gains"][0]["name"] == search["chosen"][0]
    assert list(out.meta["format"]["float_modules"]) == search["chosen"]
    assert out.meta["export_check"]["int8_weights"] == 6  # of seven: the float one stays float
    assert out.meta["kernels"]["int8_share"] < 1.0


def test_a_batchnorm_after_a_float_layer_freezes_with_the_others() -> None:
    """``stem`` kept float leaves its BatchNorm outside any fused QAT module: frozen, it keeps
    its running statistics and normalizes with them in training mode too."""
    fmt = fq.FakeQuantFormat(float_modules=("stem.0",))
    batches = _batches()
    student = fq.prepare(_tiny(), {"x": torch.from_numpy(batches[0]["x"])}, fmt)
    fq.calibrate(student, batches, 32)
    fq.freeze_observers(student)
    plain = [
        m
        for n, m in student.named_modules()
        if type(m) is torch.nn.BatchNorm2d and not n.endswith(".bn")  # ".bn": inside a fused one
    ]
    assert len(plain) == 1  # not fused: its convolution stays float (dw's is fused)
    bn = plain[0]
    assert bn.running_mean is not None
    mean = bn.running_mean.clone()
    x = torch.from_numpy(batches[1]["x"])
    want = _out(student.eval(), batches[1]["x"])
    student.train()
    fq.freeze_bn(student)
    with torch.no_grad():
        got = student(x)
    torch.testing.assert_close(bn.running_mean, mean)
    torch.testing.assert_close(got, want)
