"""The versioned model repository: version policy, a broken version beside serving ones, the v2
repository extension over HTTP and gRPC (unchanged tritonclient), a gated load, a rollout under
load that drops no request, and `slimline publish`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from slimline.cli import main as slimline_main
from slimline.errors import ServeError
from slimline.serve import ServeSettings, serve_in_thread
from slimline.serve.publish import publish
from slimline.serve.repository import parse_policy

X = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
BODY = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": X.ravel().tolist()}]}


def _run(make_run_dir: Callable[..., Path], root: Path, metric: float) -> Path:
    """A run directory whose selected candidate scored ``metric``."""
    root.mkdir(parents=True)
    run = make_run_dir(root)
    manifest = json.loads((run / "manifest.json").read_text())
    for cand in manifest["candidates"]:
        cand["metric"] = {"value": metric}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.fixture
def repo(tmp_path: Path, model_dir: Path, make_run_dir: Callable[..., Path]) -> Path:
    """tiny/1: a run (metric 0.90); tiny/2: a bare ONNX file; tiny/3: a file that is not ONNX;
    tokens/1: another model."""
    root = tmp_path / "repo"
    assert publish(_run(make_run_dir, tmp_path / "r1", 0.90), root, "tiny") == (1, [])
    (root / "tiny" / "2").mkdir()
    (root / "tiny" / "2" / "model.onnx").write_bytes((model_dir / "tiny.onnx").read_bytes())
    (root / "tiny" / "3").mkdir()
    (root / "tiny" / "3" / "model.onnx").write_text("not a model")
    (root / "tokens" / "1").mkdir(parents=True)
    (root / "tokens" / "1" / "model.onnx").write_bytes((model_dir / "tokens.onnx").read_bytes())
    return root


def test_a_broken_version_is_unavailable_with_its_reason_and_the_others_serve(repo: Path) -> None:
    settings = ServeSettings(port=0, grpc_port=0, repository=repo, version_policy="latest:3")
    with serve_in_thread([], settings) as handle:
        ready = httpx.get(handle.url + "/v2/health/ready")
        assert ready.status_code == 200
        (bad,) = ready.json()["unavailable"]
        assert (bad["name"], bad["version"]) == ("tiny", "3") and "failed to load" in bad["reason"]
        answer = httpx.post(handle.url + "/v2/models/tiny/infer", json=BODY).json()
        assert answer["model_version"] == "2"  # the highest version that loaded is the default
        old = httpx.post(handle.url + "/v2/models/tiny/versions/1/infer", json=BODY).json()
        assert old["model_version"] == "1"
        index = {
            (m["name"], m["version"]): m
            for m in httpx.get(handle.url + "/v2/repository/index").json()
        }
        assert [index[("tiny", v)]["state"] for v in "123"] == ["READY", "READY", "UNAVAILABLE"]
        grpc_client = triton_grpc.InferenceServerClient(str(handle.grpc_target))
        grpc_index = grpc_client.get_model_repository_index(as_json=True)["models"]
        assert {"name": "tiny", "version": "3", "state": "UNAVAILABLE"}.items() <= grpc_index[
            2
        ].items()
        assert "model_repository" in grpc_client.get_server_metadata(as_json=True)["extensions"]


def test_unload_and_load_over_grpc_and_http_with_unchanged_tritonclient(repo: Path) -> None:
    settings = ServeSettings(port=0, grpc_port=0, repository=repo, version_policy="specific:1,2")
    with serve_in_thread([], settings) as handle:
        grpc_client = triton_grpc.InferenceServerClient(str(handle.grpc_target))
        http_client = triton_http.InferenceServerClient(handle.url.removeprefix("http://"))
        assert grpc_client.is_model_ready("tiny") and grpc_client.is_model_ready("tiny", "1")
        grpc_client.unload_model("tiny")
        assert not grpc_client.is_model_ready("tiny")
        with pytest.raises(InferenceServerException, match="unknown model 'tiny'"):
            http_client.get_model_metadata("tiny")
        assert httpx.post(handle.url + "/v2/models/tokens/infer", json={"inputs": [
            {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]},
            {"name": "mask", "shape": [1, 2], "datatype": "INT64", "data": [1, 1]}]}).status_code == 200  # fmt: skip
        http_client.load_model("tiny")
        assert http_client.is_model_ready("tiny") and http_client.is_model_ready("tiny", "2")
        index = http_client.get_model_repository_index()
        assert {(m["name"], m["version"], m["state"]) for m in index} >= {
            ("tiny", "1", "READY"), ("tiny", "2", "READY"), ("tiny", "3", "UNAVAILABLE")
        }  # fmt: skip
        with pytest.raises(InferenceServerException, match=r"StatusCode\.NOT_FOUND"):
            grpc_client.load_model("nope")


def test_a_version_whose_gate_fails_is_refused_and_the_serving_version_stays(
    tmp_path: Path, make_run_dir: Callable[..., Path]
) -> None:
    root = tmp_path / "repo"
    publish(_run(make_run_dir, tmp_path / "good", 0.90), root, "tiny")
    worse = _run(make_run_dir, tmp_path / "worse", 0.50)
    settings = ServeSettings(port=0, grpc_port=0, repository=root, gate=True)
    with serve_in_thread([], settings) as handle:
        assert publish(worse, root, "tiny", gate=False) == (2, [])  # someone skipped the gate
        answer = httpx.post(handle.url + "/v2/repository/models/tiny/load")
        assert answer.status_code == 400
        assert (
            "gate failed" in answer.json()["error"]
            and "metric 0.9 -> 0.5" in answer.json()["error"]
        )
        served = httpx.post(handle.url + "/v2/models/tiny/infer", json=BODY).json()
        assert served["model_version"] == "1"
        grpc_client = triton_grpc.InferenceServerClient(str(handle.grpc_target))
        with pytest.raises(InferenceServerException, match=r"INVALID_ARGUMENT.*gate failed"):
            grpc_client.load_model("tiny")


def test_a_rollout_under_load_drops_no_request_and_in_flight_requests_finish(
    tmp_path: Path, model_dir: Path
) -> None:
    root = tmp_path / "repo"
    (root / "tiny" / "1").mkdir(parents=True)
    (root / "tiny" / "1" / "model.onnx").write_bytes((model_dir / "tiny.onnx").read_bytes())
    settings = ServeSettings(port=0, repository=root)
    with serve_in_thread([], settings) as handle:
        statuses: list[int] = []
        versions: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client(base_url=handle.url, timeout=10) as c:
                while not stop.is_set():
                    r = c.post("/v2/models/tiny/infer", json=BODY)
                    statuses.append(r.status_code)
                    versions.append(r.json().get("model_version", "?"))

        senders = [threading.Thread(target=traffic) for _ in range(3)]
        for t in senders:
            t.start()
        started = time.monotonic() + 30  # version 1 answers before the rollout starts
        while versions.count("1") < 5 and time.monotonic() < started:
            time.sleep(0.01)
        (root / "tiny" / "2").mkdir()
        (root / "tiny" / "2" / "model.onnx").write_bytes((model_dir / "tiny.onnx").read_bytes())
        assert (
            httpx.post(handle.url + "/v2/repository/models/tiny/load", timeout=30).status_code
            == 200
        )
        deadline = time.monotonic() + 30
        while versions.count("2") < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        for t in senders:
            t.join()
        index = httpx.get(handle.url + "/v2/repository/index").json()
    assert set(statuses) == {200}, sorted(set(statuses))
    assert versions[0] == "1" and versions[-1] == "2"
    assert [(m["version"], m["state"]) for m in index] == [("1", "UNAVAILABLE"), ("2", "READY")]


def test_publish_refuses_a_run_whose_gate_fails_with_exit_1(
    tmp_path: Path, make_run_dir: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "repo"
    good = _run(make_run_dir, tmp_path / "good", 0.90)
    worse = _run(make_run_dir, tmp_path / "worse", 0.50)
    assert slimline_main(["publish", str(good), "--repository", str(root), "--model", "m"]) == 0
    assert sorted(p.name for p in (root / "m" / "1").iterdir()) == ["artifacts", "manifest.json"]
    assert slimline_main(["publish", str(worse), "--repository", str(root), "--model", "m"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "publish REFUSED" in out
    assert sorted(p.name for p in (root / "m").iterdir()) == ["1"]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("latest:1", ("latest", [1])), ("all", ("all", [])), ("specific:3,1", ("specific", [1, 3]))],
)
def test_version_policies(text: str, parsed: tuple[str, list[int]]) -> None:
    assert parse_policy(text) == parsed


@pytest.mark.parametrize("text", ["latest:0", "latest", "specific:", "newest:2", "all:1"])
def test_bad_version_policies_name_the_fix(text: str) -> None:
    with pytest.raises(ServeError, match="give latest:N, all, or specific:1,3"):
        parse_policy(text)
