"""Screening: a quantize trial is evaluated on a quarter of the rows first and rejected there
only when the budget is out of reach whatever the other rows give; the search records why it
stopped. Qualities are crafted, so no verdict depends on INT8 rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slimline.candidate import Candidate
from slimline.compress.quant.auto import _stopped
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.plan import PrecisionPlan
from slimline.compress.quant.trial import Search, Trial
from slimline.context import StepContext
from slimline.measure.quality import Quality, Reference
from slimline.measure.screen import best_case, subset_reference
from slimline.recipe import recipe_from_dict
from slimline.taskspec import Task


def _task(onnx: bool = True) -> Task:
    return Task(
        name="t",
        source="t",
        calibration_data=lambda: [],
        eval_data=lambda: [],
        metric=lambda o, lab: float(np.mean(o)),
        onnx_path=Path("m.onnx") if onnx else None,
    )


def _quality(cos: float, **kw: Any) -> Quality:
    return Quality(
        metric=cos, cosine_mean=cos, cosine_min=cos, max_abs_err=0.1, top1_agreement=None, **kw
    )


def _ctx(
    rows: int, full: list[str], subset: Quality | None, full_cos: float = 0.999
) -> StepContext:
    ref = Reference(outputs=np.zeros((rows, 3), np.float32), labels=None, metric=1.0)

    def evaluate(c: Candidate) -> Quality:
        full.append(c.name)
        return _quality(full_cos)

    recipe = recipe_from_dict({"name": "r", "task": "m.onnx", "samples": "s.npz"})
    return StepContext(
        task=_task(),
        recipe=recipe,
        workdir=Path("."),
        baseline=Candidate("fp32-onnx", "fp32", None),
        reference=ref,
        evaluate_fn=evaluate,
        evaluate_rows_fn=lambda c, k: subset,
    )


def _search(ctx: StepContext, tmp_path: Path, screen: bool = True) -> tuple[Search, Trial]:
    cfg = QuantizeConfig(screen=screen)
    s = Search(ctx, cfg, None, {}, tmp_path, lambda: [])  # type: ignore[arg-type]
    trial = Trial(QuantSpec(mode="static"), PrecisionPlan({}, {}), tmp_path / "t.onnx")
    return s, trial


def test_a_subset_far_below_budget_rejects_without_evaluating_all_rows(tmp_path: Path) -> None:
    full: list[str] = []
    s, trial = _search(_ctx(64, full, _quality(0.90)), tmp_path)
    s.judge(trial)
    assert full == [] and not trial.budget_ok and trial.screened == "16 of 64 rows"
    assert trial.budget_reason.startswith(
        "over budget on the first 16 of 64 evaluation rows, even if the other 48 matched FP32"
    )
    assert "at best" in trial.budget_reason and "0.9750" in trial.budget_reason  # (16*.9+48)/64


@pytest.mark.parametrize("subset_cos", [0.97, 0.999])
def test_a_subset_that_keeps_the_budget_in_reach_is_evaluated_on_all_rows(
    tmp_path: Path, subset_cos: float
) -> None:
    full: list[str] = []
    s, trial = _search(_ctx(64, full, _quality(subset_cos)), tmp_path)
    s.judge(trial)  # 0.97 on a quarter: the rest at 1.0 would give 0.9925, within 0.99
    assert full == [trial.name] and trial.screened is None and trial.budget_ok


def test_few_rows_or_screen_off_evaluate_all_rows_directly(tmp_path: Path) -> None:
    for rows, screen in ((15, True), (64, False)):
        full: list[str] = []
        s, trial = _search(_ctx(rows, full, _quality(0.5)), tmp_path, screen)
        s.judge(trial)
        assert full == [trial.name] and trial.screened is None


def test_best_case_never_rejects_what_all_rows_would_keep() -> None:
    rng = np.random.default_rng(0)
    task = _task()
    for _ in range(200):
        n = int(rng.integers(16, 200))
        k = max(8, n // 4)
        rows = 1.0 - rng.exponential(rng.uniform(1e-4, 0.05), size=n)
        sub = _quality(float(rows[:k].mean()))
        bound = best_case(sub, task, k, n)
        assert bound.cosine_mean >= rows.mean() - 1e-12
        assert bound.metric >= rows.mean() - 1e-12


def test_best_case_bounds_row_means_only() -> None:
    declared = {
        "maps": {"kind": "probability_map", "agreement": 0.5},
        "text": {"kind": "ctc", "agreement": 0.5},
    }
    q = _quality(0.99, declared=declared, agreement=0.5)
    b = best_case(q, _task(onnx=False), 8, 32)
    assert b.declared is not None
    assert b.declared["maps"]["agreement"] == pytest.approx((8 * 0.5 + 24) / 32)
    assert b.declared["text"]["agreement"] == 1.0  # CER is not a row mean: no bound
    assert b.metric == float("inf")  # a task's own metric is not bounded either


def test_subset_reference_takes_fp32s_metric_on_the_same_rows() -> None:
    out = np.arange(8, dtype=np.float32)[:, None]
    ref = Reference(outputs=out, labels=np.arange(8), metric=3.5, all_outputs={"y": out})
    cut = subset_reference(ref, _task(), 4)
    assert cut is not None and cut.metric == 1.5 and len(cut.labels) == 4
    assert subset_reference(Reference(out, [np.arange(4)] * 2, 3.5), _task(), 4) is None


def test_the_search_records_why_it_stopped(tmp_path: Path) -> None:
    full: list[str] = []
    s, trial = _search(_ctx(64, full, _quality(0.5)), tmp_path)
    s.trials = [s.judge(trial)]
    s.mixed_trace = [{"result": "even 12 nodes in float miss the budget"}]
    why = _stopped(s, [], mixed_tried=True)
    assert why.startswith("mixed precision did not meet the budget: even 12 nodes in float")
    assert "1 of 1 trials over budget on a subset of the evaluation rows" in why


def test_mixed_precision_stops_when_the_float_share_cannot_reach_the_budget(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    from quant_fixtures import batches, cnn_inputs, cnn_task, make_ctx

    from slimline.compress.quant.calibrate import calibrate
    from slimline.compress.quant.mixed import mixed_precision
    from slimline.compress.quant.plan import resolve_plan
    from slimline.compress.quant.prepare import prepare

    prepared = prepare(cnn_onnx, tmp_path / "p", cnn_inputs(0, 1))
    calib = calibrate(
        prepared.path,
        list(batches(cnn_inputs, 4, 16)),
        tmp_path / "c",
        samples=64,
        methods={"minmax"},
    )
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=False)
    task = cnn_task(cnn_onnx)
    # a cosine of exactly 1 is out of reach of any model with a node in INT8, on every CPU kind
    ctx = make_ctx(task, cnn_onnx, tmp_path / "w", {"min_cosine": 1.0})
    cfg = QuantizeConfig(max_float_share=0.5, layerwise_samples=8, impact_nodes=8)
    s = Search(
        ctx, cfg, prepared, calib.caches, tmp_path / "q", lambda: (x for x, _ in task.eval_data())
    )
    (tmp_path / "q").mkdir()
    base = s.judge(s.build(QuantSpec("static"), plan))
    assert not base.budget_ok
    best = mixed_precision(s, base)
    assert best is not None and not best.budget_ok
    assert [t for t in s.mixed_trace if "float_nodes" in t] == [s.mixed_trace[0]]  # one probe
    result = s.mixed_trace[-1]["result"]
    assert result.startswith("out of reach: even the ") and "(max_float_share 0.5)" in result
    assert not any("impact" in t for t in s.mixed_trace)  # no evaluation per node was spent


def test_outputs_judged_only_by_non_row_means_are_not_screened(tmp_path: Path) -> None:
    from slimline.measure.judge import Judge
    from slimline.measure.screen import can_screen
    from slimline.outputs import CtcOutput, ProbabilityMapOutput

    ref = Reference(
        outputs=np.zeros((64, 3), np.float32),
        labels=None,
        metric=1.0,
        all_outputs={"text": np.zeros((64, 3), np.float32)},
    )
    ctc = Task(**{**_task().__dict__, "judge": Judge({"text": CtcOutput()})})
    assert not can_screen(ctc, ref)  # CER: no bound from a subset
    maps = Task(**{**_task().__dict__, "judge": Judge({"text": ProbabilityMapOutput()})})
    assert can_screen(maps, ref) and can_screen(_task(), ref)
    full: list[str] = []
    ctx = _ctx(64, full, _quality(0.5))
    ctx.task = ctc
    ctx.reference = ref
    s, trial = _search(ctx, tmp_path)
    s.judge(trial)
    assert full == [trial.name] and "screen" not in s.timings  # no subset was evaluated
