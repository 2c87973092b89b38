"""Model monitoring: drift of live predictions against the evaluation outputs (real digits, a
linear classifier fitted on them), bad rows, non-finite outputs, warnings; the alert rules."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as triton_grpc
import yaml
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits

from slimline.serve import (
    FakeBackend,
    ServedModel,
    ServerHandle,
    ServeSettings,
    TensorSpec,
    serve_in_thread,
)
from slimline.serve.model import load_served_models
from slimline.serve.monitor import PredictionReference, psi

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
MODEL_RULES = RULES_DIR / "slimline-model-alerts.yml"
DRIFT_THRESHOLD = 0.2  # the alert's line in slimline-model-alerts.yml (checked below)


def _digits_model(path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A least-squares linear classifier on the first 1,000 real digits; returns the ONNX file
    and two disjoint evaluation sets (rows 1000-1399 and 1400-1796)."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    design = np.hstack([x[:1000], np.ones((1000, 1), np.float32)])
    w, *_ = np.linalg.lstsq(design, np.eye(10, dtype=np.float32)[y[:1000]], rcond=None)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["logits"])],
        "digits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=[numpy_helper.from_array(w[:64].astype(np.float32), "W"),
                     numpy_helper.from_array(w[64].astype(np.float32), "b")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path, x[1000:1400], x[1400:]


@pytest.fixture
def digits_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerHandle, np.ndarray]]:
    root = tmp_path_factory.mktemp("digits")
    path, reference_inputs, live_inputs = _digits_model(root / "digits.onnx")
    models = load_served_models([path])
    logits = models[0].backend.run({"x": reference_inputs})["logits"]  # the evaluation outputs
    np.savez(root / "digits.monitor_reference.npz", logits=logits, __logits__=np.array(["logits"]))
    models = load_served_models([path])
    settings = ServeSettings(port=0, grpc_port=0, drift_window=300)
    with serve_in_thread(models, settings) as handle:
        yield handle, live_inputs


def _send(handle: ServerHandle, rows: np.ndarray, batch: int = 8) -> None:
    client = triton_grpc.InferenceServerClient(str(handle.grpc_target))
    for start in range(0, len(rows), batch):
        chunk = np.ascontiguousarray(rows[start : start + batch])
        inp = triton_grpc.InferInput("x", list(chunk.shape), "FP32")
        inp.set_data_from_numpy(chunk)
        client.infer("digits", [inp])


def _metric(handle: ServerHandle, name: str, **labels: str) -> float:
    text = httpx.get(handle.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exposed")


def test_unshifted_eval_stream_stays_below_and_a_shifted_one_crosses_the_threshold(
    digits_server: tuple[ServerHandle, np.ndarray],
) -> None:
    handle, live = digits_server
    assert math.isnan(_metric(handle, "slimline_prediction_drift_psi", model="digits"))
    _send(handle, live)  # 397 unseen evaluation digits: same population as the reference
    assert _metric(handle, "slimline_prediction_drift_window_rows", model="digits") == 300
    calm = _metric(handle, "slimline_prediction_drift_psi", model="digits", version="1",
                   output="logits")  # fmt: skip
    assert calm < DRIFT_THRESHOLD / 2, calm
    # the same digits with their strokes thinned and the background lit: a camera change
    shifted = np.clip(live * 0.5 + 0.4, 0, 1).astype(np.float32)
    _send(handle, shifted)
    drifted = _metric(handle, "slimline_prediction_drift_psi", model="digits")
    assert drifted > DRIFT_THRESHOLD, drifted


def test_invalid_rows_are_counted(digits_server: tuple[ServerHandle, np.ndarray]) -> None:
    handle, _ = digits_server
    before = _metric(handle, "slimline_invalid_rows_total", model="digits")
    body = {"inputs": [{"name": "x", "shape": [3, 63], "datatype": "FP32", "data": [0.0] * 189}]}
    assert httpx.post(handle.url + "/v2/models/digits/infer", json=body).status_code == 400
    assert _metric(handle, "slimline_invalid_rows_total", model="digits") == before + 3


@pytest.mark.filterwarnings("always::RuntimeWarning")
def test_nonfinite_outputs_and_warnings_are_counted_by_kind() -> None:
    spec = [TensorSpec("x", "float32", (None, 2))]

    def overflowing(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (t["x"] > 1e30).any():
            warnings.warn("overflow in the model", RuntimeWarning, stacklevel=1)
        return {"x": t["x"] * np.float32(1e10)}

    model = ServedModel("big", FakeBackend(spec, spec, overflowing))
    with serve_in_thread([model], ServeSettings(port=0, grpc_port=0)) as handle:
        client = triton_grpc.InferenceServerClient(str(handle.grpc_target))
        inp = triton_grpc.InferInput("x", [2, 2], "FP32")
        inp.set_data_from_numpy(np.array([[1e35, 1], [1, 1]], np.float32))
        client.infer("big", [inp])
        assert _metric(handle, "slimline_nonfinite_outputs_total", model="big") == 1.0
        kinds = {"kind": "RuntimeWarning"}  # the model's own warning and numpy's overflow
        assert _metric(handle, "slimline_runtime_warnings_total", model="big", **kinds) == 2.0


def test_psi_and_references() -> None:
    ref = PredictionReference.from_outputs("y", np.eye(4)[[0, 1, 1, 2, 3, 3, 3, 3]], logits=True)
    np.testing.assert_allclose(ref.expected, [1 / 8, 2 / 8, 1 / 8, 4 / 8])
    assert psi(ref.expected, np.array([10, 20, 10, 40])) == pytest.approx(0.0)
    assert psi(ref.expected, np.array([40, 20, 10, 10])) > 0.5
    values = np.random.default_rng(0).normal(size=(1000, 3))
    deciles = PredictionReference.from_outputs("z", values, logits=False)
    assert deciles.kind == "deciles" and len(deciles.expected) == 10
    np.testing.assert_allclose(deciles.expected, 0.1, atol=0.01)


def test_model_alert_rules_pass_promtool_and_use_exposed_metrics() -> None:
    doc = yaml.safe_load(MODEL_RULES.read_text())
    drift = next(r for g in doc["groups"] for r in g["rules"]
                 if r.get("alert") == "SlimlinePredictionDrift")  # fmt: skip
    assert drift["expr"].endswith(f"> {DRIFT_THRESHOLD}")
    spec = [TensorSpec("x", "float32", (None, 2))]
    model = ServedModel("m", FakeBackend(spec, spec, lambda t: t))
    with serve_in_thread([model], ServeSettings(port=0)) as handle:
        text = httpx.get(handle.url + "/metrics").text
    exposed = {n.removesuffix("_total") for n in re.findall(r"^# TYPE (\S+)", text, re.M)}
    used = set(re.findall(r"\b(slimline_[a-z_]+)\b", MODEL_RULES.read_text()))
    assert {u.removesuffix("_total") for u in used} <= exposed
    if shutil.which("promtool") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promtool is not installed; scripts/setup.sh installs it")
        pytest.skip("promtool is not installed")
    tests = RULES_DIR / "slimline-model-alerts.test.yml"
    for args in (["check", "rules", str(MODEL_RULES)], ["test", "rules", str(tests)]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def _weight_only_qdq(path: Path) -> Path:
    """x FP32 [N, 4] @ DequantizeLinear(W INT8): quantized on paper, a float MatMul at run time."""
    w = np.arange(12, dtype=np.int8).reshape(4, 3)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"]),
         helper.make_node("MatMul", ["x", "W"], ["y"])],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(w, "Wq"),
                     numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                     numpy_helper.from_array(np.array(0, np.int8), "z")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_float_fallbacks_of_a_quantized_model_are_counted(tmp_path: Path) -> None:
    models = load_served_models([_weight_only_qdq(tmp_path / "qdq.onnx")])
    with serve_in_thread(models, ServeSettings(port=0)) as handle:
        deadline = time.monotonic() + 30
        kinds = {"kind": "float_fallback"}
        while _metric(handle, "slimline_runtime_warnings_total", model="qdq", **kinds) == 0:
            assert time.monotonic() < deadline, "the fallback was never counted"
            time.sleep(0.05)
        assert _metric(handle, "slimline_runtime_warnings_total", model="qdq", **kinds) == 1.0


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "slimline-dashboard.json"
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? \S+$")


def _queries(doc: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def test_every_metric_the_dashboard_queries_exists_on_a_running_server(
    digits_server: tuple[ServerHandle, np.ndarray],
) -> None:
    handle, live = digits_server
    _send(handle, live[:16])
    text = httpx.get(handle.url + "/metrics").text
    exposed = {m.group(1) for line in text.splitlines() if (m := _SERIES.match(line))}
    doc = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for expr in _queries(doc)
        for name in re.findall(r"\b((?:slimline|process)_[a-z_]+)\b", expr)
    }
    assert "slimline_prediction_drift_psi" in queried and len(queried) >= 12
    assert queried <= exposed, queried - exposed
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


TASK = """
import numpy as np
from sklearn.datasets import load_digits

def _x():
    return (load_digits().data / 16.0).astype(np.float32)

def model():
    raise NotImplementedError("the reference only needs the evaluation data")

def calibration_data():
    return [{"x": _x()[:64]}]

def eval_data():
    x, y = _x(), load_digits().target
    return [({"x": x[s : s + 100]}, y[s : s + 100]) for s in range(1000, 1400, 100)]

def metric(outputs, labels):
    return float((outputs.argmax(1) == labels).mean())
"""


def test_publish_saves_the_runs_evaluation_outputs_and_the_server_compares_with_them(
    tmp_path: Path,
) -> None:
    from slimline.serve.publish import publish

    run = tmp_path / "run"
    (run / "artifacts").mkdir(parents=True)
    _, _, live = _digits_model(run / "artifacts" / "int8.onnx")
    (tmp_path / "digits_task.py").write_text(TASK)
    manifest = {
        "task": {"name": "digits", "source": str(tmp_path / "digits_task.py"), "output_kind": "logits"},
        "selected": "int8",
        "candidates": [{"name": "int8", "artifact": "artifacts/int8.onnx"}],
    }  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert publish(run, tmp_path / "repo", "digits") == (1, [])
    saved = np.load(tmp_path / "repo" / "digits" / "1" / "monitor_reference.npz")
    assert saved["logits"].shape == (400, 10) and list(saved["__logits__"]) == ["logits"]
    settings = ServeSettings(port=0, grpc_port=0, repository=tmp_path / "repo", drift_window=300)
    with serve_in_thread([], settings) as handle:
        _send(handle, live)
        psi_now = _metric(handle, "slimline_prediction_drift_psi", model="digits", version="1")
    assert psi_now < DRIFT_THRESHOLD / 2, psi_now
