"""Fixture models for the server tests: small ONNX graphs built with onnx.helper, a run dir."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
BIAS = np.array([0.5, -0.25, 1.0], dtype=np.float32)


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def linear_model(path: Path, batch: str | int = "N") -> Path:
    """x FP32 [batch, 4] -> logits = x @ W + b [batch, 3], probs = softmax(logits)."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 3]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 3]),
        ],
        initializer=[numpy_helper.from_array(WEIGHTS, "W"), numpy_helper.from_array(BIAS, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save(model, path)


def token_model(path: Path) -> Path:
    """ids INT64 [N, S], mask INT64 [N, S] -> summed FP32 [N] (a text-model-shaped graph)."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["ids", "mask"], ["masked"]),
            helper.make_node("Cast", ["masked"], ["as_float"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["as_float", "axes"], ["total"], keepdims=0),
        ],
        "tokens",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "S"]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["N", "S"]),
        ],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save(model, path)


def _expected_logits(x: np.ndarray) -> Any:
    return x @ WEIGHTS + BIAS


@pytest.fixture(scope="session")
def expected_logits() -> Callable[[np.ndarray], np.ndarray]:
    """What the linear fixture model computes, in numpy."""
    return _expected_logits


def write_run_dir(root: Path, task: str = "tiny", selected: str = "quantize") -> Path:
    """A run directory as the pipeline writes it, with the selected candidate's artifact."""
    run = root / "run"
    (run / "artifacts").mkdir(parents=True)
    linear_model(run / "artifacts" / f"{selected}.onnx")
    manifest = {
        "schema": 1,
        "status": "complete",
        "task": {"name": task, "source": task, "metric_name": "top1", "output_kind": "logits",
                 "inputs": {"x": {"dtype": "float32", "shape": [None, 4]}}},
        "selected": selected,
        "candidates": [
            {"name": "fp32-torch", "step": "load", "parent": None, "accepted": True,
             "artifact": None},
            {"name": "fp32-onnx", "step": "export", "parent": "fp32-torch", "accepted": True,
             "artifact": "artifacts/fp32-onnx.onnx"},
            {"name": selected, "step": "quantize", "parent": "fp32-onnx", "accepted": True,
             "artifact": f"artifacts/{selected}.onnx"},
        ],
    }  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.fixture
def make_run_dir() -> Callable[..., Path]:
    """``make_run_dir(root, task=..., selected=...)``: a run directory as the pipeline writes."""
    return write_run_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve-models")
    linear_model(d / "tiny.onnx")
    linear_model(d / "fixed.onnx", batch=2)
    token_model(d / "tokens.onnx")
    return d


@pytest.fixture(scope="session")
def slow_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of about 25 ms a row on one thread (x FP32 [N, 1024] -> y FP32 [N])."""
    return slow_model(tmp_path_factory.mktemp("slow") / "slow.onnx", layers=120)


@pytest.fixture(scope="session")
def slower_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of about 80 ms a row on one thread: 30 queued requests are seconds of work."""
    return slow_model(tmp_path_factory.mktemp("slower") / "slow.onnx", layers=400)


def slow_model(path: Path, layers: int = 40, width: int = 1024) -> Path:
    """x FP32 [N, width] through ``layers`` MatMuls (40: about 8 ms a row on one thread)."""
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", "W"], [f"h{i + 1}"])
        for i in range(layers)
    ]
    nodes.append(helper.make_node("ReduceMean", [f"h{layers}"], ["y"], axes=[1], keepdims=0))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save(model, path)
