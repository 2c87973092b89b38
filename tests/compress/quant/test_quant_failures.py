"""A failing quantized candidate rejects that candidate, never the run; the opset-12 per-channel
graph that ONNX Runtime refused (PP-OCR's detector) is prepared into a valid one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from quant_fixtures import batches, cnn_task, make_ctx

from fixtures.int8_kinds import first_static_label
from slimline.candidate import Candidate
from slimline.compress.quant import trial
from slimline.compress.quant.calibrate import _bound_bins, calibrate
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.engine import quantize_model
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import prepare
from slimline.compress.quant.step import quantize_step
from slimline.cpu import CpuInt8
from slimline.errors import CandidateError, StepError
from slimline.measure.runners import check_candidate

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane

PER_CHANNEL = QuantSpec(mode="static", per_channel=True)


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], name=f"{name}/const", value=numpy_helper.from_array(value, name)
    )


def _paddle_style_opset12() -> onnx.ModelProto:
    """The structure of PP-OCR's detector as paddle2onnx writes it: opset 12, every weight a
    Constant node (no initializers), a bias-free Conv followed by BatchNormalization."""
    rs = np.random.RandomState(0)
    f32 = np.float32
    nodes = [
        _constant("w1", rs.randn(8, 3, 3, 3).astype(f32) * 0.3),
        _constant("bn_scale", rs.uniform(0.5, 1.5, 8).astype(f32)),
        _constant("bn_bias", rs.uniform(-0.2, 0.2, 8).astype(f32)),
        _constant("bn_mean", rs.uniform(-0.1, 0.1, 8).astype(f32)),
        _constant("bn_var", rs.uniform(0.5, 1.5, 8).astype(f32)),
        _constant("w2", rs.randn(4, 8, 1, 1).astype(f32) * 0.3),
        _constant("b2", rs.randn(4).astype(f32) * 0.1),
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization",
            ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
            ["n1"],
            name="bn1",
        ),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "paddle_style",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def _inputs(seed: int, n: int) -> dict[str, np.ndarray]:
    return {"x": np.random.RandomState(seed).randn(n, 3, 8, 8).astype(np.float32)}


def _calibrated(src: Path, out: Path) -> dict[str, Path]:
    calib = calibrate(
        src, list(batches(_inputs, 2, 4)), out, samples=8, methods={"minmax"}, threads=1
    )
    return calib.caches


def test_the_fixture_reproduces_the_invalid_graph_without_the_opset_upgrade(
    tmp_path: Path,
) -> None:
    """ONNX Runtime's own pre-processing turns the Constant weights into initializers and folds
    the BatchNorm into a Conv bias; per-channel QDQ then writes DequantizeLinear nodes with an
    `axis` attribute that opset 12 does not have, and ONNX Runtime refuses the model."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    src = tmp_path / "m.onnx"
    onnx.save(_paddle_style_opset12(), src)
    pre = tmp_path / "pre.onnx"
    quant_pre_process(str(src), str(pre))
    caches = _calibrated(pre, tmp_path / "cal")
    # the engine's own guard stops here; ONNX Runtime's quantizer alone writes the bad model
    with pytest.raises(StepError, match="needs opset 13 or later"):
        quantize_model(pre, tmp_path / "q.onnx", PER_CHANNEL, [], caches)
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    out = tmp_path / "q-raw.onnx"
    quantize_static(
        str(pre),
        str(out),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        calibrate_method=CalibrationMethod.MinMax,
        calibration_cache_path=str(caches["minmax"]),
    )
    with pytest.raises(CandidateError, match=r"axis for operator DequantizeLinear.*node "):
        check_candidate(out)


def test_prepare_upgrades_opset_12_so_per_channel_models_load(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_paddle_style_opset12(), src)
    prepared = prepare(src, tmp_path / "p", _inputs(0, 1))
    model = onnx.load(str(prepared.path))
    assert next(o.version for o in model.opset_import if o.domain == "") == 13
    assert any("opset 12 to 13" in n for n in prepared.notes)
    caches = _calibrated(prepared.path, tmp_path / "cal")
    plan = resolve_plan(prepared.compute_nodes, {}, False)
    q = quantize_model(prepared.path, tmp_path / "q.onnx", PER_CHANNEL, plan.float_nodes, caches)
    check_candidate(q)  # onnx.checker and an ONNX Runtime load
    axes = [
        n
        for n in onnx.load(str(q)).graph.node
        if n.op_type == "DequantizeLinear" and any(a.name == "axis" for a in n.attribute)
    ]
    assert axes, "per-channel weights were quantized per channel"


def _sabotage(match: str, how: str):  # type: ignore[no-untyped-def]
    """A ``quantize_model`` that breaks the trials whose label contains ``match``: it raises
    (``how == "raise"``), or writes a model onnx.checker rejects (``how == "invalid"``)."""
    real = quantize_model

    def fake(src: Path, dst: Path, spec: QuantSpec, *args, **kw):  # type: ignore[no-untyped-def]
        if match not in spec.label:
            return real(src, dst, spec, *args, **kw)
        if how == "raise":
            raise RuntimeError("quantizer exploded on node /c2/Conv")
        real(src, dst, spec, *args, **kw)
        model = onnx.load(str(dst))
        node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
        node.attribute.append(helper.make_attribute("bogus", 1))
        onnx.save(model, str(dst))
        return dst

    return fake


@pytest.mark.parametrize("how", ["raise", "invalid"])
def test_a_failing_trial_is_rejected_with_its_reason_and_the_search_goes_on(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, cpu_kind: CpuInt8
) -> None:
    monkeypatch.setattr(trial, "quantize_model", _sabotage("percentile", how))
    task = cnn_task(cnn_onnx)
    ctx = make_ctx(task, cnn_onnx, tmp_path / "work", {"max_metric_drop": 0.5, "min_cosine": 0.5})
    cfg = QuantizeConfig(samples=32, keep_first_last_float=True, mixed_precision=False)
    out = quantize_step(cfg, Candidate("fp32-onnx", "export", None, onnx=cnn_onnx), ctx)
    assert out.onnx is not None and "minmax" in out.meta["label"]
    failed = [a for a in ctx.alternatives if "percentile" in a.name]
    assert len(failed) == 1
    reason = failed[0].reason
    percentile = first_static_label(cpu_kind, "percentile")
    assert reason.startswith(f"failed: {percentile}: building failed")
    if how == "raise":
        assert "RuntimeError: quantizer exploded on node /c2/Conv" in reason
        assert failed[0].onnx is None
    else:
        assert "Unrecognized attribute: bogus for operator DequantizeLinear" in reason
        assert "(DequantizeLinear))" in reason  # the node is named
    assert "re-export" not in reason
    summary = {c["label"]: c for c in out.meta["search"]["candidates"]}
    assert summary[percentile]["failure"]


def test_every_trial_failing_fails_the_step_with_each_reason(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_kind: CpuInt8
) -> None:
    monkeypatch.setattr(trial, "quantize_model", _sabotage("static", "raise"))
    task = cnn_task(cnn_onnx)
    ctx = make_ctx(task, cnn_onnx, tmp_path / "work")
    cfg = QuantizeConfig(samples=16, keep_first_last_float=True)
    with pytest.raises(StepError, match="every quantized candidate failed") as info:
        quantize_step(cfg, Candidate("fp32-onnx", "export", None, onnx=cnn_onnx), ctx)
    assert f"{first_static_label(cpu_kind)}: building failed: RuntimeError" in str(info.value)
    assert "percentile 99.99: building failed" in str(info.value)
    assert not info.value.user_error and info.value.exit_code == 3
    assert [c["reason"] for c in info.value.details["candidates"]]


def test_chunked_histograms_stay_bounded_when_a_range_grows_by_orders_of_magnitude() -> None:
    """ONNX Runtime's histogram keeps its first chunk's bin width and adds bins of that width as
    the range grows: a tensor that starts near zero (PP-OCR's detector: 3e-4, then 0.14, after
    earlier growth) reached 2.7e8 bins and numpy refused ("Too many bins for data range").
    Re-binning keeps every count, at a bounded number of bins."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    rs = np.random.RandomState(0)
    chunks = [rs.uniform(0, hi, 4096).astype(np.float32) for hi in (1e-5, 1e-2, 1.0)]
    plain = HistogramCollector("percentile", False, 2048, 128, 99.99, "same")
    for c in chunks[:2]:
        plain.collect({"t": c})
    assert len(plain.histogram_dict["t"][0]) > 1000 * 2048  # the growth that ends in the error
    bounded = HistogramCollector("percentile", False, 2048, 128, 99.99, "same")
    for c in chunks:
        _bound_bins(bounded, {"t": c})
        bounded.collect({"t": c})
    hist, edges, lo, hi, threshold = bounded.histogram_dict["t"]
    assert hist.sum() == 3 * 4096 and len(hist) <= 16 * 2048
    assert float(threshold) == pytest.approx(float(chunks[2].max()))
    assert float(edges[0]) <= float(lo) and float(hi) <= float(edges[-1]) * (1 + 1e-6)


def test_chunked_calibration_of_a_tensor_that_starts_near_zero(tmp_path: Path) -> None:
    """End to end through :func:`calibrate` (one-row first chunk, then larger ones)."""
    prepared = prepare(_write(tmp_path), tmp_path / "p", _inputs(0, 1))

    def growing() -> list[dict[str, np.ndarray]]:
        return [{"x": _inputs(i, 4)["x"] * 10.0 ** (3 * i - 6)} for i in range(3)]

    calib = calibrate(
        prepared.path,
        growing(),
        tmp_path / "cal",
        samples=12,
        methods={"minmax", "percentile"},
        threads=1,
    )
    assert set(calib.caches) == {"minmax", "percentile"} and calib.samples == 12


def _write(tmp_path: Path) -> Path:
    src = tmp_path / "m.onnx"
    onnx.save(_paddle_style_opset12(), src)
    return src
