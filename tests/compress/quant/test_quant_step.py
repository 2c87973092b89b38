from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from quant_fixtures import (
    batches,
    cnn_inputs,
    cnn_task,
    encoder_task,
    fp32_timed,
    make_ctx,
    text_inputs,
)

from slimline.candidate import QUANTIZABLE_SOURCE, Candidate
from slimline.compress.quant.calibrate import calibrate
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.mixed import mixed_precision
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import prepare
from slimline.compress.quant.step import quantize_step
from slimline.compress.quant.trial import Search
from slimline.context import StepContext
from slimline.cpu import detect as detect_cpu
from slimline.errors import RecipeError

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


def _input(onnx_path: Path) -> Candidate:
    return Candidate("fp32-onnx", "export", None, onnx=onnx_path)


@pytest.fixture(scope="module")
def auto_run(
    cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Candidate, StepContext, Path]:
    task = cnn_task(cnn_onnx)
    work = tmp_path_factory.mktemp("auto") / "work"
    ctx = make_ctx(task, cnn_onnx, work, {"max_metric_drop": 0.05, "min_cosine": 0.98})
    fp32_timed(ctx)  # the choice is forced: a candidate within budget is always chosen
    cfg = QuantizeConfig(samples=64, keep_first_last_float=True)  # explicit: no edges-int8 variant
    return quantize_step(cfg, _input(cnn_onnx), ctx), ctx, work


def test_auto_mode_records_every_candidate_and_what_it_applied(
    auto_run: tuple[Candidate, StepContext, Path],
) -> None:
    out, ctx, work = auto_run
    assert out.onnx is not None and work in out.onnx.parents
    meta = out.meta
    json.dumps(meta)  # the manifest needs it
    assert meta["fallback_report"].endswith("quantizable ops run INT8")
    assert meta["precision_map"]["nodes"]["/c1/Conv"]["rule"] == "first/last compute layer"
    assert {r["node"] for r in meta["layerwise"]} == {"/c2/Conv", "/c3/Conv", "/c4/Conv"}
    assert meta["layerwise_statement"].startswith("error concentrates in /c")
    assert meta["calibration"]["samples"] == 64 and meta["calibration"]["peak_rss_mb"] > 0
    assert meta["distributions"]["recommendation"]["method"] in ("minmax", "percentile")
    labels = [c["label"] for c in meta["search"]["candidates"]]
    rr = " reduce-range" if detect_cpu().u8s8_saturates else ""  # the CPU's own format
    assert labels[:2] == [
        f"static QDQ U8S8 per-channel{rr} minmax",
        f"static QDQ U8S8 per-channel{rr} percentile 99.99",
    ]
    assert len(ctx.alternatives) == len(labels) - 1
    assert all(a.accepted is False and a.reason and a.measurement for a in ctx.alternatives)
    assert any("fewer than 300" in w for w in ctx.warnings)
    # the choice follows the measurements it recorded: FP32 is timed 10x slower (auto_run), so
    # a candidate within budget is chosen, and it is the fastest of those within budget
    assert "no_candidate_met_budget" not in meta
    chosen = next(c for c in meta["search"]["candidates"] if c["label"] == meta["label"])
    assert chosen["budget_ok"] and chosen["ratio_vs_fp32"] < 1 - ctx.recipe.budget.min_gain
    faster_ok = [
        c
        for c in meta["search"]["candidates"]
        if c["budget_ok"] and c["ratio_vs_fp32"] < chosen["ratio_vs_fp32"]
    ]
    assert not any(a.reason.startswith("fastest") for a in ctx.alternatives)
    # a faster median loses only to a candidate the run cannot tell apart in speed that is a
    # file at least min_gain smaller, or as large and more faithful
    gain = ctx.recipe.budget.min_gain
    cosine = chosen["fidelity"]["cosine_mean"]
    assert all(
        chosen["size_bytes"] <= (1 - gain) * c["size_bytes"]
        or cosine > c["fidelity"]["cosine_mean"]
        for c in faster_ok
    )
    assert out.measurement is not None and out.measurement["fidelity"]["cosine_mean"] > 0.98


def test_no_candidate_within_budget_is_recorded_with_every_candidates_reason(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    task = cnn_task(cnn_onnx)
    # a cosine of exactly 1.0 is out of reach for any INT8 model: the rejection is forced
    ctx = make_ctx(task, cnn_onnx, tmp_path / "work", {"min_cosine": 1.0})
    fp32_timed(ctx)
    cfg = QuantizeConfig(samples=64, keep_first_last_float=True, mixed_precision=False)
    out = quantize_step(cfg, _input(cnn_onnx), ctx)
    why = out.meta["no_candidate_met_budget"]
    assert why.startswith("no candidate is both faster than FP32 and within budget; ")
    labels = [c["label"] for c in out.meta["search"]["candidates"]]
    assert len(labels) >= 2 and not any(c["budget_ok"] for c in out.meta["search"]["candidates"])
    assert why.count("over budget: ") == len(labels)  # every candidate, with its reason
    assert any(w.startswith("quantize: no candidate") for w in ctx.warnings)


def test_the_layer_table_is_not_measured_for_a_choice_slower_than_fp32(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    """Every candidate within budget but timed slower than FP32 (FP32's timing scaled 10x
    down, as on a CPU where INT8 runs slower): no INT8 model of the search can be kept, so the
    diagnostic layer table is skipped, and the record says why."""
    task = cnn_task(cnn_onnx)
    ctx = make_ctx(task, cnn_onnx, tmp_path / "work", {"max_metric_drop": 0.05, "min_cosine": 0.9})
    fp32_timed(ctx, factor=0.1)
    cfg = QuantizeConfig(samples=64, keep_first_last_float=True, mixed_precision=False)
    out = quantize_step(cfg, _input(cnn_onnx), ctx)
    assert "no_candidate_met_budget" in out.meta
    assert any(c["budget_ok"] for c in out.meta["search"]["candidates"])
    assert out.meta["layerwise"] == []
    assert "is not measurably faster than FP32" in out.meta["layerwise_statement"]


def test_report_sections_render_the_step_record(
    auto_run: tuple[Candidate, StepContext, Path], tmp_path: Path
) -> None:
    from slimline.report import quantization

    out, ctx, _ = auto_run
    chosen = {
        "name": "quantize",
        "step": "quantize",
        "accepted": True,
        "reason": out.reason,
        "meta": out.meta,
    }
    alts = [
        {"name": a.name, "step": "quantize", "alternative": True, "reason": a.reason}
        for a in ctx.alternatives
    ]
    manifest = {"candidates": [{"name": "fp32-onnx", "step": "export", "meta": {}}, chosen, *alts]}
    html = quantization.search(manifest, tmp_path) or ""
    assert out.meta["fallback_report"] in html and out.meta["label"] in html
    assert all(a.name in html for a in ctx.alternatives)
    layer = quantization.layerwise(manifest, tmp_path) or ""
    assert "<img" in layer and out.meta["layerwise"][0]["node"] in layer
    dist = quantization.distributions(manifest, tmp_path) or ""
    assert "Recommended calibration" in dist and "<img" in dist
    assert quantization.search({"candidates": [chosen | {"step": "graph"}]}, tmp_path) is None


def test_a_budget_nobody_meets_ends_cleanly_with_the_best_found_and_why(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    task = cnn_task(cnn_onnx)
    ctx = make_ctx(task, cnn_onnx, tmp_path / "work", {"min_cosine": 1.0})
    cfg = QuantizeConfig(samples=64, max_float_share=0.34)
    out = quantize_step(cfg, _input(cnn_onnx), ctx)
    assert (
        "no candidate is both faster than FP32 and within budget"
        in out.meta["no_candidate_met_budget"]
    )
    assert "mean cosine" in out.meta["no_candidate_met_budget"]
    assert out.onnx is not None and out.onnx.is_file()
    assert all(a.onnx is not None and a.onnx.is_file() for a in ctx.alternatives)
    assert any("no candidate" in w for w in ctx.warnings)


def _widen_range(cache: Path, tensor: str, factor: float) -> None:
    """Tamper with a calibration cache: one activation gets a range ``factor`` times too wide."""
    data = json.loads(cache.read_text())
    data["data"][tensor]["highest"]["data"] *= factor
    cache.write_text(json.dumps(data))


def test_mixed_precision_keeps_the_worst_ranked_node_in_float(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    task = cnn_task(cnn_onnx)
    prepared = prepare(cnn_onnx, tmp_path / "p", cnn_inputs(0, 1))
    calib = calibrate(
        prepared.path,
        list(batches(cnn_inputs, 4, 16)),
        tmp_path / "c",
        samples=64,
        methods={"minmax"},
    )
    c2_input = next(
        n.input[0] for n in onnx.load(str(prepared.path)).graph.node if n.name == "/c2/Conv"
    )
    _widen_range(calib.caches["minmax"], c2_input, 60.0)  # /c2/Conv's input loses 6 bits
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=True)
    spec = QuantSpec("static")
    cfg = QuantizeConfig(max_float_share=1.0, layerwise_samples=8)
    probe = make_ctx(task, cnn_onnx, tmp_path / "w0")
    s0 = Search(
        probe,
        cfg,
        prepared,
        calib.caches,
        tmp_path / "q0",
        lambda: (x for x, _ in task.eval_data()),
    )
    broken = s0.judge(s0.build(spec, plan))
    fixed = s0.judge(s0.build(spec, plan.with_float(["/c2/Conv"], "test"), "-fixed"))
    assert broken.quality is not None and fixed.quality is not None
    assert fixed.quality.cosine_mean > broken.quality.cosine_mean
    budget = (broken.quality.cosine_mean + fixed.quality.cosine_mean) / 2
    ctx = make_ctx(task, cnn_onnx, tmp_path / "w1", {"min_cosine": budget})
    s = Search(
        ctx, cfg, prepared, calib.caches, tmp_path / "q1", lambda: (x for x, _ in task.eval_data())
    )
    base = s.judge(s.build(spec, plan))
    assert not base.budget_ok
    best = mixed_precision(s, base)
    assert best is not None and best.budget_ok
    assert best.plan.float_nodes == ["/c1/Conv", "/c2/Conv", "/fc/Gemm"]
    assert best.plan.rule["/c2/Conv"] == "mixed precision"
    assert s.mixed_trace[-1]["float_nodes_list"] == ["/c2/Conv"]
    probes = [p for p in s.mixed_trace if "float_nodes" in p]
    assert probes[0] == {**probes[0], "float_nodes": 3, "ok": True}  # max_float_share=1: all three
    assert any(p["float_nodes"] == 1 and p["ok"] for p in probes)
    impact = next(t for t in s.mixed_trace if "impact" in t)  # measured, then tried in order
    assert impact["order"][0] == "/c2/Conv"
    assert max(impact["impact"], key=lambda r: r["gain"])["node"] == "/c2/Conv"

    from slimline.report.quantization import _precision

    html = _precision(
        {"precision_map": best.plan.to_dict(), "search": {"mixed_precision": s.mixed_trace}}  # type: ignore[typeddict-item]
    )
    assert "Output impact" in html and "/c2/Conv" in html and "impact:" not in html


def test_manual_dynamic_mode_on_a_transformer(encoder_onnx: Path, tmp_path: Path) -> None:
    from slimline.measure.runners import OrtRunner

    ref = OrtRunner("ref", encoder_onnx, 1)
    task = encoder_task(encoder_onnx)
    assert ref.run(text_inputs(1, 1)).shape == (1, 64)
    ctx = make_ctx(task, encoder_onnx, tmp_path / "w", {"min_cosine": 0.95})
    rr = detect_cpu().u8s8_saturates  # the format this CPU runs well
    out = quantize_step(
        QuantizeConfig(mode="dynamic", samples=16, keep_first_last_float=False, reduce_range=rr),
        _input(encoder_onnx),
        ctx,
    )
    reduce = " reduce-range" if rr else ""
    assert out.meta["label"] == f"dynamic S8 per-channel{reduce} +embeddings"  # tables by default
    assert out.meta["kernels"]["kernels"].get("QAttention") == 2
    assert out.meta["prepared"]["transformer"] is True
    assert out.measurement is not None and out.measurement["fidelity"]["cosine_mean"] > 0.95
    assert ctx.alternatives == []


def test_precision_map_naming_missing_nodes_is_an_error(cnn_onnx: Path, tmp_path: Path) -> None:
    ctx = make_ctx(cnn_task(cnn_onnx), cnn_onnx, tmp_path / "w")
    cfg = QuantizeConfig(mode="static", samples=16, precision={"/no/such/Conv": "float"})
    with pytest.raises(RecipeError, match="/no/such/Conv"):
        quantize_step(cfg, _input(cnn_onnx), ctx)


def test_a_graph_step_output_is_prepared_from_the_export(cnn_onnx: Path, tmp_path: Path) -> None:
    from slimline.measure.runners import ort_session

    fused = tmp_path / "graph.onnx"
    ort_session(cnn_onnx, 1, optimized_out=fused, level="extended")
    shutil.copyfile(cnn_onnx, tmp_path / "source.onnx")
    ctx = make_ctx(
        cnn_task(cnn_onnx), cnn_onnx, tmp_path / "w", {"max_metric_drop": 0.1, "min_cosine": 0.9}
    )
    # the graph step names the float graph it started from: its saved fusions are runtime-only
    graph = Candidate(
        "graph", "graph", "fp32-onnx", onnx=fused, meta={QUANTIZABLE_SOURCE: "source.onnx"}
    )
    out = quantize_step(QuantizeConfig(mode="static", samples=16), graph, ctx)
    assert out.meta["prepared"]["notes"][0].startswith("prepared from fp32-onnx")
    assert out.meta["kernels"]["int8_kernels"] == 3


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_out_of_range_serving_inputs_warn_only_where_the_chosen_model_uses_the_ranges(
    cnn_onnx: Path, tmp_path: Path, mode: str
) -> None:
    """Evaluation inputs 4x the calibration scale leave the calibrated ranges. A static model
    quantizes with those ranges (warn, naming its tensors); a dynamic one computes its ranges per
    input (record it, no warning)."""
    ctx = make_ctx(cnn_task(cnn_onnx, eval_scale=4.0), cnn_onnx, tmp_path / "w", {"min_cosine": 0})
    out = quantize_step(QuantizeConfig(mode=mode, samples=64), _input(cnn_onnx), ctx)
    rep = out.meta["representativeness"]
    assert rep["flagged"], "4x inputs must leave the calibrated ranges"
    warned = [w for w in ctx.warnings if "exceed the calibrated ranges" in w]
    if mode == "static":
        assert rep["flagged_in_chosen"] and len(warned) == 1
        assert rep["flagged_in_chosen"][0] in warned[0]
    else:
        assert rep["flagged_in_chosen"] == [] and warned == []
        assert "does not quantize with those ranges" in rep["note"]


def test_graph_step_fuses_attention_and_keeps_the_outputs(
    encoder_onnx: Path, tmp_path: Path
) -> None:
    """The graph step fuses Attention with the verified head count (the fuser's own detection
    fails on the legacy exporter's reshapes), and the optimized graph computes the same thing."""
    import numpy as np

    from slimline.compress.graph import GraphConfig, optimize_graph
    from slimline.measure.runners import OrtRunner

    sample = text_inputs(1, 1)
    dst = tmp_path / "g.onnx"
    rec = optimize_graph(encoder_onnx, dst, GraphConfig(), threads=1, sample=sample)
    assert rec["transformer_fusion"] and rec["attention_fused"] == 2, rec
    assert any("num_heads=" in n for n in rec["notes"])
    assert not dst.with_name("g.fusion").exists()  # scratch files removed
    x = text_inputs(7, 4)
    a, b = OrtRunner("a", encoder_onnx, 1).run(x), OrtRunner("b", dst, 1).run(x)
    np.testing.assert_allclose(a, b, atol=1e-4)
