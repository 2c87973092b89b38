"""The edge-cloud cascade end to end over HTTP: routing by confidence, the cloud's rows in place
of the edge's, fallback to the edge answer when the cloud fails, times out or is unreachable
(degraded readiness), and the start-up check of the two tiers' outputs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from slimline.edge.scores import margin, probability_top1, resolve_score, softmax_top1
from slimline.errors import ServeError, SlimlineError
from slimline.serve import (
    BatcherConfig,
    FakeBackend,
    ServedModel,
    ServeSettings,
    TensorSpec,
    load_served_models,
    run_in_thread,
)
from slimline.serve.cascade import CascadeConfig, attach_cascade, check_outputs, load_threshold
from slimline.serve.cli import main as serve_main

X_SPEC = [TensorSpec("x", "float32", (None, 2))]
OUT_SPEC = [TensorSpec("logits", "float32", (None, 2))]
CLOUD_ROW = [0.0, 7.0]
SURE, UNSURE = [5.0, 0.0], [0.125, 0.0]  # softmax top-1: 0.993 and 0.531 (exact in FP32)
SETTINGS = ServeSettings(port=0, batching=BatcherConfig(max_batch_size=8, max_queue_delay_ms=1))


def edge_model() -> ServedModel:
    return ServedModel("clf", FakeBackend(X_SPEC, OUT_SPEC, lambda t: {"logits": t["x"].copy()}))


def cloud_backend(fn: Callable[[Any], Any] | None = None, delay_s: float = 0.0) -> FakeBackend:
    def answer(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": np.tile(np.array(CLOUD_ROW, np.float32), (len(t["x"]), 1))}

    return FakeBackend(X_SPEC, OUT_SPEC, fn or answer, delay_s)


def cascade(cloud: FakeBackend | str, **config: Any) -> ServedModel:
    def load(path: Path) -> ServedModel:
        assert isinstance(cloud, FakeBackend)
        return ServedModel("cloud", cloud)

    cfg = CascadeConfig(**{"threshold": 0.9, **config})
    target = "local.onnx" if isinstance(cloud, FakeBackend) else cloud
    return attach_cascade(edge_model(), target, cfg, batching=SETTINGS.batching, load=load)


def infer(url: str, rows: list[list[float]]) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(rows), 2],
                        "data": np.ravel(rows).tolist()}]}  # fmt: skip
    return httpx.post(f"{url}/v2/models/clf/infer", json=body, timeout=10)


def logits(r: httpx.Response) -> np.ndarray:
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and all(p in line for p in want.split(",")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exposed")


def test_unsure_rows_get_the_cloud_answer_and_sure_rows_stay_on_the_edge() -> None:
    cloud = cloud_backend()
    with run_in_thread([cascade(cloud)], SETTINGS) as url:
        r = infer(url, [SURE, UNSURE, SURE])
        assert r.status_code == 200
        np.testing.assert_array_equal(logits(r), [SURE, CLOUD_ROW, SURE])
        assert r.json()["parameters"] == {"cascade_tier": "edge+cloud", "cascade_escalated_rows": 1}
        assert cloud.batches == [1]  # only the unsure row went to the cloud
        r = infer(url, [SURE])
        assert r.json()["parameters"] == {"cascade_tier": "edge"}
        np.testing.assert_array_equal(logits(r), [SURE])
        r = infer(url, [UNSURE])
        assert r.json()["parameters"]["cascade_tier"] == "cloud"
        assert cloud.batches == [1, 1]
        assert metric(url, "slimline_cascade_escalation_ratio", model="clf") == pytest.approx(2 / 5)
        assert metric(url, "slimline_cascade_rows_total", route="cloud") == 2
        assert metric(url, "slimline_cascade_rows_total", route="edge") == 3
        assert metric(url, "slimline_cascade_tier_duration_seconds_count", tier="edge") == 3
        assert metric(url, "slimline_cascade_tier_duration_seconds_count", tier="cloud") == 2


def test_a_margin_score_and_threshold_decide_escalation() -> None:
    cloud = cloud_backend()
    with run_in_thread([cascade(cloud, score="margin", threshold=1.0)], SETTINGS) as url:
        r = infer(url, [[2.0, 0.5], [1.0, 0.5]])  # margins 1.5 and 0.5
        np.testing.assert_array_equal(logits(r), [[2.0, 0.5], CLOUD_ROW])


def test_a_failing_cloud_returns_the_edge_answer_marked_and_the_request_succeeds() -> None:
    def broken(t: Any) -> Any:
        raise RuntimeError("cloud exploded")

    with run_in_thread([cascade(cloud_backend(broken))], SETTINGS) as url:
        r = infer(url, [SURE, UNSURE])
        assert r.status_code == 200
        np.testing.assert_array_equal(logits(r), [SURE, UNSURE])
        params = r.json()["parameters"]
        assert params["cascade_tier"] == "edge" and params["cascade_fallback"] == "error"
        assert (
            params["cascade_escalated_rows"] == 1
            and "exploded" in params["cascade_fallback_reason"]
        )
        assert metric(url, "slimline_cascade_cloud_failures_total", kind="error") == 1
        assert metric(url, "slimline_cascade_rows_total", route="fallback") == 1
        assert metric(url, "slimline_requests_total", model="clf", outcome="ok") == 1


def test_a_slow_cloud_times_out_to_the_edge_answer() -> None:
    slow = cloud_backend(delay_s=1.0)
    with run_in_thread([cascade(slow, cloud_timeout_ms=50)], SETTINGS) as url:
        r = infer(url, [UNSURE])
        assert r.status_code == 200
        np.testing.assert_array_equal(logits(r), [UNSURE])
        assert r.json()["parameters"]["cascade_fallback"] == "timeout"
        assert metric(url, "slimline_cascade_cloud_failures_total", kind="timeout") == 1


def test_an_unreachable_cloud_url_starts_degraded_and_answers_from_the_edge() -> None:
    model = cascade("http://127.0.0.1:9/v2/models/big", probe_interval_s=60)
    with run_in_thread([model], SETTINGS) as url:
        ready = httpx.get(f"{url}/v2/health/ready")
        assert ready.status_code == 200
        doc = ready.json()
        assert doc["ready"] is True and doc["degraded"] is True
        assert "127.0.0.1:9/v2/models/big" in doc["reason"] and "unreachable" in doc["reason"]
        r = infer(url, [SURE, UNSURE])
        assert r.status_code == 200
        np.testing.assert_array_equal(logits(r), [SURE, UNSURE])
        assert r.json()["parameters"]["cascade_fallback"] == "unavailable"
        assert metric(url, "slimline_cascade_degraded", model="clf") == 1


def test_a_kserve_cloud_over_http_answers_the_unsure_rows(model_dir: Path) -> None:
    cloud = load_served_models([model_dir / "tiny.onnx"])
    edge = load_served_models([model_dir / "tiny.onnx"])[0]
    x = np.array([[30.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)  # max p .99, .56
    with run_in_thread(cloud, SETTINGS) as cloud_url:
        cfg = CascadeConfig(threshold=0.9, score="probability", output="probs")
        attach_cascade(edge, cloud_url, cfg, batching=SETTINGS.batching, load=None)
        assert edge.cascade.degraded is None
        with run_in_thread([edge], SETTINGS) as url:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                "data": x.ravel().tolist()}]}  # fmt: skip
            r = httpx.post(f"{url}/v2/models/tiny/infer", json=body)
            assert r.json()["parameters"] == {
                "cascade_tier": "edge+cloud",
                "cascade_escalated_rows": 1,
            }
            assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
        other = load_served_models([model_dir / "tokens.onnx"])
    with run_in_thread(other, SETTINGS) as tokens_url, pytest.raises(ServeError, match="differ"):
        attach_cascade(
            load_served_models([model_dir / "tiny.onnx"])[0],
            f"{tokens_url}/v2/models/tokens",
            cfg,
            batching=SETTINGS.batching,
            load=None,
        )


def test_tiers_with_different_outputs_are_a_one_line_error_at_start_up(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cascade", str(model_dir / "tiny.onnx"), str(model_dir / "tokens.onnx"),
            "--cascade-threshold", "0.9", "--port", "0"]  # fmt: skip
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: cascade:") and "differ" in err
    renamed = [TensorSpec("y", "float32", (None, 2))]
    assert "outputs" in (check_outputs(OUT_SPEC, renamed) or "")
    wider = [TensorSpec("logits", "float32", (None, 3))]
    assert "logits" in (check_outputs(OUT_SPEC, wider) or "")
    assert check_outputs(OUT_SPEC, [TensorSpec("logits", "float32", (None, None))]) is None
    with pytest.raises(ServeError, match=r"cloud's \(y float32"):
        attach_cascade(
            edge_model(),
            "x.onnx",
            CascadeConfig(threshold=0.5),
            batching=SETTINGS.batching,
            load=lambda p: ServedModel("c", FakeBackend(X_SPEC, renamed, lambda t: t)),
        )


def test_the_threshold_comes_from_a_number_or_the_calibration_file(tmp_path: Path) -> None:
    assert load_threshold("0.75") == {"threshold": 0.75}
    f = tmp_path / "cascade.json"
    f.write_text(json.dumps({"threshold": 0.6, "score": "margin", "curve": []}))
    assert load_threshold(str(f)) == {"threshold": 0.6, "score": "margin"}
    with pytest.raises(ServeError, match="neither a number"):
        load_threshold(str(tmp_path / "missing.json"))


def test_scores_of_logits_and_probabilities(tmp_path: Path) -> None:
    x = np.array([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    e = np.exp(x[0])
    np.testing.assert_allclose(softmax_top1(x), [e.max() / e.sum(), np.e / (2 * np.e + 1)])
    np.testing.assert_allclose(margin(x), [2.0, 0.0])
    np.testing.assert_allclose(probability_top1(x), [2.0, 1.0])
    f = tmp_path / "score.py"
    f.write_text("import numpy as np\ndef first(o):\n    return np.asarray(o)[:, 0]\n")
    np.testing.assert_allclose(resolve_score(f"{f}:first")(x), [2.0, 1.0])
    with pytest.raises(SlimlineError, match=re.escape("softmax, probability, margin")):
        resolve_score("entropy")
