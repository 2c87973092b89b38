"""Peak RSS measured for real in a fresh subprocess (every pipeline fixture turns it off)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.candidate import Candidate
from slimline.measure.memory import peak_rss

FIXTURES = Path(__file__).parents[1] / "fixtures"


def matmul_model(path: Path, width: int) -> Path:
    """x FP32 [N, width] @ W [width, width]: the weights take width * width * 4 bytes."""
    w = np.random.default_rng(0).standard_normal((width, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_an_onnx_model_peaks_above_the_baseline_by_at_least_its_weights(tmp_path: Path) -> None:
    small = Candidate("small", "export", None, onnx=matmul_model(tmp_path / "s.onnx", 64))
    big = Candidate("big", "export", None, onnx=matmul_model(tmp_path / "b.onnx", 2048))
    x_small = {"x": np.ones((1, 64), np.float32)}
    x_big = {"x": np.ones((1, 2048), np.float32)}
    rs, rb = peak_rss(small, x_small, 1, None, runs=3), peak_rss(big, x_big, 1, None, runs=3)
    assert rs is not None and rb is not None
    for r in (rs, rb):
        # the runtime alone takes tens of MB; any plausible process stays far below 8 GB
        assert 10 < r["baseline_rss_mb"] < r["peak_rss_mb"] < 8192
        assert r["model_rss_mb"] == pytest.approx(r["peak_rss_mb"] - r["baseline_rss_mb"], abs=0.2)
    assert rb["model_rss_mb"] >= 16  # 2048 x 2048 FP32 weights are 16 MiB, resident once loaded
    assert rb["model_rss_mb"] > rs["model_rss_mb"] + 12


def test_a_torch_model_is_rebuilt_from_its_task_in_the_subprocess() -> None:
    fp32 = Candidate("fp32-torch", "fp32", None)
    x = {"x": np.zeros((1, 1, 12, 12), np.float32)}
    r = peak_rss(fp32, x, 1, str(FIXTURES / "tiny_task.py"), runs=2)
    assert r is not None and 10 < r["baseline_rss_mb"] < r["peak_rss_mb"] < 8192
    pruned = Candidate("pruned", "prune", "fp32-torch")  # a module only this process holds
    assert peak_rss(pruned, x, 1, str(FIXTURES / "tiny_task.py")) is None


def test_a_failing_worker_raises_with_the_candidate_and_the_workers_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a protobuf")
    cand = Candidate("broken", "export", None, onnx=broken)
    with pytest.raises(RuntimeError, match=r"peak-RSS worker failed for broken: .*\S"):
        peak_rss(cand, {"x": np.ones((1, 4), np.float32)}, 1, None, runs=1)
