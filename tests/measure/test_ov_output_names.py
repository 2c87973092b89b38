"""Output names on OpenVINO are the names the file declares. OpenVINO's compiled model can give a
port more names than the file did: an Identity it removes hands its input tensor's name to the
graph output (``{'mid', 'probability'}``), and ``get_any_name()`` may answer the fused one. A
third-party voice-activity model (an Identity before its ``probability`` output) stopped a whole
run with ``KeyError: 'probability'`` that way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("openvino", reason="the openvino extra is not installed")

from slimline.measure.ov import OvRunner, ov_compile
from slimline.measure.runners import OrtRunner
from slimline.serve.model import OvBackend


def identity_output(path: Path) -> Path:
    """x [N, 4] -> relu -> 'mid' -> Identity -> 'probability' (and a second output 'h_out')."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["mid"], name="relu"),
            helper.make_node("Identity", ["mid"], ["probability"], name="out"),
            helper.make_node("Neg", ["x"], ["h_out"], name="neg"),
        ],
        "fused_names",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["N", 4]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_the_runner_names_outputs_as_the_file_does(tmp_path: Path) -> None:
    path = identity_output(tmp_path / "m.onnx")
    fused = ov_compile(path, 1).outputs[0].get_names()
    assert "probability" in fused  # the case this guards: OpenVINO may add 'mid' beside it
    ov, ort = OvRunner("m", path, 1), OrtRunner("m", path, 1)
    assert ov.output_names == ["probability", "h_out"]
    x = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    a, b = ov.run_all(x), ort.run_all(x)
    assert sorted(a) == sorted(b) == ["h_out", "probability"]
    np.testing.assert_allclose(a["probability"], np.maximum(x["x"], 0), atol=1e-6)
    np.testing.assert_allclose(a["h_out"], b["h_out"], atol=1e-6)


def test_the_server_answers_the_declared_output(tmp_path: Path) -> None:
    backend = OvBackend(identity_output(tmp_path / "m.onnx"), threads=1)
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    out = backend.run({"x": x})
    np.testing.assert_allclose(out["probability"], np.maximum(x, 0), atol=1e-6)
    np.testing.assert_allclose(out["h_out"], -x, atol=1e-6)


def test_a_pair_that_loads_but_fails_to_run_is_rejected_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slimline.candidate import Candidate
    from slimline.measure.latency import benchmark
    from slimline.recipe import BenchConfig
    from slimline.runtimes import pair_name

    def broken(self: OvRunner, inputs: object) -> dict[str, np.ndarray]:
        raise KeyError("probability")  # what a misnamed output gave before

    monkeypatch.setattr(OvRunner, "call", broken)
    cand = Candidate("m", "fp32", None, onnx=identity_output(tmp_path / "m.onnx"))
    bench = BenchConfig(rounds=2, runs_per_round=100, warmup=1, batch_sizes=[1])
    sample = {"x": np.ones((2, 4), np.float32)}
    out = benchmark(
        [cand], sample, bench, 1, throughput=False, runtimes=["onnxruntime", "openvino"]
    )
    why = out[pair_name("openvino", "m")]["failed"]
    assert why.startswith("it loaded but does not run") and "probability" in why
    assert out[pair_name("onnxruntime", "m")]["latency_ms"]["rounds"] == 2
    with pytest.raises(KeyError):  # one runtime: nothing to compare it with, so it raises
        benchmark([cand], sample, bench, 1, throughput=False, runtimes=["openvino"])
