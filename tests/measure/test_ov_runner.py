"""The OpenVINO runner: the same numbers as ONNX Runtime on the same file, its load failures
blamed like ONNX Runtime's, and per-(runtime, candidate) rejection in a benchmark."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.candidate import Candidate
from slimline.errors import CandidateError, ModelFileError
from slimline.measure.latency import benchmark
from slimline.measure.runners import OrtRunner, make_runner
from slimline.recipe import BenchConfig
from slimline.runtimes import pair_name

pytest.importorskip("openvino", reason="the openvino extra is not installed")

from slimline.measure.ov import OvRunner
from slimline.measure.ov_profile import ov_profile_ops

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 32)).astype(np.float32)
W2 = RNG.standard_normal((32, 4)).astype(np.float32)


def mlp(path: Path) -> Path:
    """x [N, 16] -> relu(x W1) W2 [N, 4]."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def det_model(path: Path) -> Path:
    """Det, a standard ONNX op ONNX Runtime runs and OpenVINO has no conversion rule for."""
    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["y"], name="det")],
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def qdq(src: Path, dst: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = iter([{"x": RNG.standard_normal((8, 16)).astype(np.float32)}] * 4)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ)
    return dst


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def test_openvino_matches_onnx_runtime_on_the_same_fp32_file(tmp_path: Path) -> None:
    path = mlp(tmp_path / "m.onnx")
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    ov, ort = OvRunner("m", path, 1), OrtRunner("m", path, 1)
    # f32 inference precision: no bf16 on AMX/AVX512-BF16 CPUs, so only summation order differs
    np.testing.assert_allclose(ov.run({"x": x}), ort.run({"x": x}), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ov.run({"x": x}), np.maximum(x @ W1, 0) @ W2, rtol=1e-4, atol=1e-4)
    assert ov.model_inputs["x"].dtype == "float32" and ov.output_names == ["y"]
    assert ov.spec == {"x": ("float32", [None, 16])}


def test_openvino_runs_a_qdq_int8_file_close_to_onnx_runtime(tmp_path: Path) -> None:
    path = qdq(mlp(tmp_path / "m.onnx"), tmp_path / "q.onnx")
    x = RNG.standard_normal((64, 16)).astype(np.float32)
    ov = make_runner(Candidate("q", "quantize", None, onnx=path), 1, runtime="openvino")
    ort = make_runner(Candidate("q", "quantize", None, onnx=path), 1)
    assert isinstance(ov, OvRunner) and not isinstance(ort, OvRunner)
    # both run INT8 kernels with their own rounding: close, not identical
    assert _cosine(ov.run({"x": x}), ort.run({"x": x})) > 0.999
    prof = ov_profile_ops(path, {"x": x[:1]}, 1, runs=3, warmup=1)
    assert prof["runs"] == 3 and prof["by_op_type"] and prof["runtime"].startswith("openvino")
    assert abs(sum(r["share"] for r in prof["by_op_type"]) - 1.0) < 1e-6


def test_a_candidate_openvino_cannot_load_is_a_candidate_error_with_its_message(
    tmp_path: Path,
) -> None:
    path = det_model(tmp_path / "det.onnx")
    OrtRunner("det", path, 1)  # ONNX Runtime runs it
    with pytest.raises(CandidateError) as info:
        OvRunner("det", path, 1)
    msg = str(info.value)
    assert msg.startswith("OpenVINO cannot load det.onnx, a candidate slimline wrote: ")
    assert "Det" in msg and "\n" not in msg and "src/" not in msg
    with pytest.raises(ModelFileError, match=r"OpenVINO .* cannot load the model .*det\.onnx"):
        OvRunner("det", path, 1, user_model=True)


def test_benchmark_rejects_only_the_pair_a_runtime_cannot_load(tmp_path: Path) -> None:
    det = Candidate("det", "fp32", None, onnx=det_model(tmp_path / "det.onnx"))
    bench = BenchConfig(rounds=2, runs_per_round=100, warmup=1, batch_sizes=[1])
    sample = {"x": RNG.standard_normal((2, 4, 4)).astype(np.float32)}
    out = benchmark([det], sample, bench, 1, throughput=False, runtimes=["onnxruntime", "openvino"])
    assert set(out) == {pair_name("onnxruntime", "det"), pair_name("openvino", "det")}
    assert "Det" in out[pair_name("openvino", "det")]["failed"]
    assert out[pair_name("onnxruntime", "det")]["latency_ms"]["rounds"] == 2
