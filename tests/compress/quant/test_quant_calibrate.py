from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from quant_fixtures import batches, cnn_inputs

from slimline.compress.quant.calibrate import calibrate, rebatch
from slimline.compress.quant.distribution import analyse, weight_stats
from slimline.compress.quant.prepare import prepare
from slimline.errors import DataError, InputMismatchError
from slimline.measure.runners import ort_session


@pytest.fixture(scope="module")
def prepared(cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return prepare(cnn_onnx, tmp_path_factory.mktemp("prep"), cnn_inputs(0, 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_entropy_threshold_is_onnx_runtimes_own(seed: int) -> None:
    """The vectorised KL search returns ONNX Runtime's thresholds, on histograms collected
    the way calibration collects them (skewed, with outliers and empty bins)."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    from slimline.compress.quant.calibrate import entropy_threshold

    rng = np.random.default_rng(seed)
    coll = HistogramCollector("entropy", False, 300 + 97 * seed, 128, 99.99, "same")
    data = {
        "relu": np.maximum(rng.normal(0.2, 1.0, 5000), 0).astype(np.float32),
        "tail": np.concatenate([rng.normal(0, 0.1, 4000), [8.0, -3.0]]).astype(np.float32),
    }
    coll.collect(data)
    for hist in coll.histogram_dict.values():
        want = coll.get_entropy_threshold(hist, 128)
        got = entropy_threshold(hist, 128)
        assert [float(x) for x in got] == [float(x) for x in want]


def test_prepare_takes_a_relative_folder(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-processing runs inside a temporary folder (chdir): a relative output folder still
    names the one the caller meant."""
    monkeypatch.chdir(tmp_path)
    out = prepare(cnn_onnx, Path("prep"), cnn_inputs(0, 1))
    assert (tmp_path / "prep" / "prepared.onnx").is_file() and out.path.exists()


def _true_ranges(
    model: Path, names: list[str], data: list[dict[str, np.ndarray]]
) -> dict[str, tuple[float, float]]:
    m = onnx.load(str(model))
    for n in names:
        m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    path = model.with_name("exposed.onnx")
    onnx.save(m, str(path))
    sess = ort_session(path, 1)
    outs = [sess.run(names, d) for d in data]
    return {
        n: (min(float(o[i].min()) for o in outs), max(float(o[i].max()) for o in outs))
        for i, n in enumerate(names)
    }


def test_rebatch_cuts_and_merges_rows_up_to_the_limit() -> None:
    src = [cnn_inputs(i, n) for i, n in enumerate([3, 5, 2])]
    sizes = [len(b["x"]) for b in rebatch(src, 4, limit=9)]
    assert sizes == [4, 4, 1]
    merged = np.concatenate([b["x"] for b in rebatch(src, 4, limit=9)])
    np.testing.assert_array_equal(merged, np.concatenate([b["x"] for b in src])[:9])


def test_minmax_ranges_are_exact_and_chunking_does_not_change_them(
    prepared: Any, tmp_path: Path
) -> None:
    data = list(batches(cnn_inputs, 3, 8))
    big = calibrate(
        prepared.path, data, tmp_path / "a", samples=24, methods={"minmax", "percentile"}
    )
    small = calibrate(
        prepared.path, data, tmp_path / "b", samples=24, methods={"minmax"}, chunk_mb=16
    )
    assert big.samples == small.samples == 24
    names = sorted(big.ranges)[:6]
    truth = _true_ranges(prepared.path, names, data)
    for n in names:
        assert big.ranges[n] == pytest.approx(truth[n], rel=1e-5, abs=1e-6)
        assert small.ranges[n] == pytest.approx(truth[n], rel=1e-5, abs=1e-6)
    # the caches are ONNX Runtime calibration caches, and Percentile clips inside MinMax
    mm = json.loads((tmp_path / "a" / "calibration-minmax.json").read_text())
    pc = json.loads((tmp_path / "a" / "calibration-percentile.json").read_text())
    assert set(mm) >= set(names) or "data" in mm
    assert big.peak_rss_mb > 0 and big.wall_s > 0
    assert pc


def test_calibration_memory_budget_sets_the_chunk_size(prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = list(batches(cnn_inputs, 2, 8))
    assert (
        calibrate(prepared.path, data, tmp_path / "a", samples=16, methods={"minmax"}).chunk_rows
        > 1
    )
    assert (
        calibrate(
            prepared.path, data, tmp_path / "b", samples=16, methods={"minmax"}, chunk_mb=16
        ).chunk_rows
        >= 1
    )


def test_bad_calibration_data_is_a_clear_error(prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DataError, match="no samples"):
        calibrate(prepared.path, [], tmp_path / "e", samples=8, methods={"minmax"})
    with pytest.raises(InputMismatchError, match="named"):
        calibrate(
            prepared.path,
            [{"image": np.zeros((2, 3, 16, 16), np.float32)}],
            tmp_path / "n",
            samples=8,
            methods={"minmax"},
        )
    with pytest.raises(InputMismatchError, match="shape"):
        calibrate(
            prepared.path,
            [{"x": np.zeros((2, 3, 8), np.float32)}],
            tmp_path / "s",
            samples=8,
            methods={"minmax"},
        )


def test_representativeness_flags_shifted_evaluation_inputs(prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    calib = list(batches(cnn_inputs, 2, 16))
    same = calibrate(
        prepared.path,
        calib,
        tmp_path / "same",
        samples=32,
        methods={"minmax"},
        eval_batches=list(batches(cnn_inputs, 1, 16, seed=50)),
        eval_samples=16,
    )
    shifted = calibrate(
        prepared.path,
        calib,
        tmp_path / "shift",
        samples=32,
        methods={"minmax"},
        eval_batches=list(batches(cnn_inputs, 1, 16, seed=50, scale=4.0)),
        eval_samples=16,
    )
    assert same.representativeness["eval_samples"] == 16
    assert len(shifted.representativeness["flagged"]) > len(same.representativeness["flagged"])
    worst = shifted.representativeness["flagged"][0]
    assert worst["exceed_share"] > 0.5 and worst["max_overshoot"] > 0.05


def _spiky(seed: int, n: int) -> dict[str, np.ndarray]:
    """Gaussian images with rare large spikes (1 pixel in 1,000 at 40x)."""
    x = cnn_inputs(seed, n)["x"]
    rs = np.random.RandomState(seed + 1000)
    mask = rs.rand(*x.shape) < 1e-3
    x[mask] *= 40.0
    return {"x": x}


def test_distribution_analysis_recommends_percentile_for_heavy_outliers(
    prepared: Any, tmp_path: Path
) -> None:
    w = weight_stats(prepared.path, prepared.compute_nodes)
    assert len(w) == len(prepared.compute_nodes)
    clean = calibrate(
        prepared.path,
        list(batches(cnn_inputs, 2, 16)),
        tmp_path / "d",
        samples=32,
        methods={"minmax"},
    )
    summary = analyse(clean, w)
    assert summary["activation_tensors"] == len(clean.stats) and summary["histograms"]
    for s in clean.stats.values():
        assert s["min"] <= s["p1"] <= s["p50"] <= s["p99"] <= s["max"] + 1e-6
    spiky = calibrate(
        prepared.path, list(batches(_spiky, 2, 16)), tmp_path / "s", samples=32, methods={"minmax"}
    )
    rec = analyse(spiky, w)["recommendation"]
    assert rec["method"] == "percentile" and "heavy-tailed" in rec["reason"], rec
    assert rec["heavy_tensors"] > summary["recommendation"]["heavy_tensors"]
    assert spiky.stats["x"]["outlier_share"] > 1e-4 > clean.stats["x"]["outlier_share"]


def _spiky_ranges(prepared, out: Path, methods: set[str], **kw):  # type: ignore[no-untyped-def]
    """Calibrate on spiky inputs; the calibration and each method's cached ranges."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    calib = calibrate(
        prepared.path, list(batches(_spiky, 2, 16)), out, samples=32, methods=methods, **kw
    )
    return calib, {m: load_tensors_data(p) for m, p in calib.caches.items()}


def test_percentile_ranges_clip_inside_minmax(prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # the spikes are 0.1% of the values: a 99% range leaves them out
    calib, ranges = _spiky_ranges(
        prepared, tmp_path / "r", {"minmax", "percentile"}, percentile=99.0
    )
    x = {m: [float(v) for v in ranges[m]["x"].range_value] for m in ranges}
    assert x["minmax"] == pytest.approx(list(calib.ranges["x"]), rel=1e-5)
    lo, hi = x["percentile"]
    assert x["minmax"][0] <= lo < hi <= x["minmax"][1]
    assert hi - lo < 0.5 * (x["minmax"][1] - x["minmax"][0])  # the 40x spikes are clipped


def test_entropy_ranges_differ_from_minmax_and_clip_the_spikes(prepared, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """ONNX Runtime's entropy calibration at its default 128 bins writes MinMax's file again; with
    slimline's bins the KL threshold search clips rare 40x spikes inside the MinMax range."""
    _, ranges = _spiky_ranges(prepared, tmp_path / "e", {"minmax", "entropy"})
    assert set(ranges) == {"minmax", "entropy"}
    mm = [float(v) for v in ranges["minmax"]["x"].range_value]
    lo, hi = (float(v) for v in ranges["entropy"]["x"].range_value)
    assert mm[0] <= lo < hi <= mm[1] + 1e-6
    assert hi - lo < 0.5 * (mm[1] - mm[0])  # the spikes are clipped, not kept
    # every calibrated tensor has an entropy range, and at least one differs from MinMax
    assert set(ranges["entropy"]) == set(ranges["minmax"])
    assert any(
        [float(v) for v in ranges["entropy"][k].range_value]
        != pytest.approx([float(v) for v in ranges["minmax"][k].range_value], rel=1e-3)
        for k in ranges["minmax"]
    )


def test_histogram_work_per_tensor_is_bounded_over_the_whole_calibration() -> None:
    """One-row chunks (a fixed batch, or rows too large to chunk) share one budget per tensor
    instead of each histogramming up to the per-chunk cap."""
    from slimline.compress.quant.calibrate import (
        _HIST_MIN_VALUES,
        _HIST_TOTAL,
        _HIST_VALUES,
        _hist_limit,
        _subsample,
    )

    assert _hist_limit(1, 300) == _HIST_MIN_VALUES
    assert _hist_limit(64, 64) == _HIST_VALUES
    total = sum(_hist_limit(1, 32) for _ in range(32))
    assert total <= _HIST_TOTAL
    big = np.arange(_HIST_VALUES * 4, dtype=np.float32)
    assert _subsample(big, _hist_limit(1, 300)).size == _HIST_MIN_VALUES
    assert _subsample(big[:100], _hist_limit(1, 300)).size == 100  # small tensors whole


def test_infinite_activations_are_calibrated_on_their_finite_values(tmp_path: Path) -> None:
    # an attention-like graph: scores + mask, where the mask is -inf on padded positions
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["scores"]),
            helper.make_node("Add", ["scores", "mask"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "V"], ["y"]),
        ],
        "masked",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        initializer=[
            onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "W"),
            onnx.numpy_helper.from_array(np.ones((4, 2), np.float32), "V"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "masked.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 2, size=(16, 4)).astype(np.float32)
    mask = np.where(np.arange(4)[None, :] < 3, 0.0, -np.inf).astype(np.float32).repeat(16, 0)
    cal = calibrate(path, [{"x": x, "mask": mask}], tmp_path / "c", samples=16,
                    methods={"minmax", "percentile", "entropy"})  # fmt: skip
    lo, hi = cal.ranges["masked"]
    finite = (x + mask)[:, :3]
    assert (lo, hi) == pytest.approx((float(finite.min()), float(finite.max())), rel=1e-6)
    assert cal.nonfinite["masked"] == pytest.approx(0.25)  # one position in four
    assert "x" not in cal.nonfinite
    assert cal.summary()["nonfinite_tensors"]["masked"] == pytest.approx(0.25)
    for method in ("minmax", "percentile", "entropy"):
        text = (tmp_path / "c" / f"calibration-{method}.json").read_text()
        assert "Infinity" not in text and "NaN" not in text, method
