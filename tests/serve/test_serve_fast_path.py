"""The infer hot path (straight to the endpoint, past FastAPI's middleware and router) answers
byte for byte as FastAPI's routed way does, and one write per response reaches the socket."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from slimline.serve import (
    BatcherConfig,
    FakeBackend,
    ServedModel,
    ServeSettings,
    TensorSpec,
    run_in_thread,
)
from slimline.serve import app as serve_app
from slimline.serve.app import infer_target
from slimline.serve.transport import CoalescingTransport

TOKEN = {"Authorization": "Bearer s3cret"}


def _model() -> ServedModel:
    spec_in = [TensorSpec("x", "float32", (None, 2))]
    spec_out = [TensorSpec("y", "float32", (None, 2))]
    return ServedModel("fake", FakeBackend(spec_in, spec_out, lambda t: {"y": t["x"] + 1.0}))


def _json(x: list[list[float]], name: str = "x") -> bytes:
    tensor = {
        "name": name,
        "shape": [len(x), 2],
        "datatype": "FP32",
        "data": [v for row in x for v in row],
    }
    return json.dumps({"id": "r1", "inputs": [tensor]}).encode()


def _binary() -> tuple[bytes, dict[str, str]]:
    raw = np.array([[1.5, -2.0]], np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}],
                       "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    headers = {"Inference-Header-Content-Length": str(len(head)),
               "Content-Type": "application/octet-stream"}  # fmt: skip
    return head + raw, headers


def _cases() -> list[tuple[str, bytes, dict[str, str]]]:
    body, binary_headers = _binary()
    ok = _json([[1.0, 2.0]])
    return [
        ("/v2/models/fake/infer", ok, TOKEN),
        ("/v2/models/fake/infer", body, {**TOKEN, **binary_headers}),
        ("/v2/models/fake/versions/1/infer", ok, TOKEN),
        ("/v2/models/fake/infer", gzip.compress(ok), {**TOKEN, "Content-Encoding": "gzip"}),
        ("/v2/models/fake/infer", _json([[1.0, 2.0]], name="z"), TOKEN),
        ("/v2/models/fake/infer", b"{not json", TOKEN),
        ("/v2/models/fake/infer", ok, {**TOKEN, "X-Request-Timeout-Ms": "-3"}),
        ("/v2/models/fake/infer", ok, {**TOKEN, "Content-Type": "text/plain"}),
        ("/v2/models/fake/infer", b"x" * 5000, TOKEN),
        ("/v2/models/nope/infer", ok, TOKEN),
        ("/v2/models/fake/versions/7/infer", ok, TOKEN),
        ("/v2/models/fake/infer", ok, {}),
        ("/v2/models/fake/infer", ok, {"Authorization": "Bearer wrong"}),
    ]


def _answers(c: httpx.Client) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    out = []
    for path, body, headers in _cases():
        r = c.post(path, content=body, headers=headers)
        kept = sorted((k, v) for k, v in r.headers.items() if k not in ("date", "server"))
        out.append((r.status_code, kept, r.content))
    return out


def test_the_direct_infer_path_answers_as_the_routed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    ways: list[str] = []
    direct, routed = serve_app.InferEndpoint.direct, serve_app.InferEndpoint.__call__

    async def count_direct(self: Any, *args: Any) -> None:
        ways.append("direct")
        await direct(self, *args)

    async def count_routed(self: Any, *args: Any) -> None:
        ways.append("routed")
        await routed(self, *args)

    monkeypatch.setattr(serve_app.InferEndpoint, "direct", count_direct)
    monkeypatch.setattr(serve_app.InferEndpoint, "__call__", count_routed)
    settings = ServeSettings(port=0, api_token=SecretStr("s3cret"), max_body_bytes=4096,
                             batching=BatcherConfig(max_batch_size=4))  # fmt: skip
    with run_in_thread([_model()], settings) as url, httpx.Client(base_url=url, timeout=10) as c:
        fast = _answers(c)
        assert set(ways) == {"direct"}
        ways.clear()
        # FastAPI's OpenTelemetry configured: infer requests take the routed way
        monkeypatch.setattr(serve_app._ServeApp, "_telemetry_on", lambda self: True)
        slow = _answers(c)
        assert "routed" in ways and "direct" not in ways
        metrics = c.get("/metrics", headers=TOKEN).text
    assert [a[0] for a in fast] == [200, 200, 200, 200, 400, 400, 400, 415, 413, 404, 404, 401, 401]
    assert fast == slow
    assert json.loads(fast[0][2])["outputs"][0]["data"] == [2.0, 3.0]
    head_length = int(dict(fast[1][1])["inference-header-content-length"])
    assert np.frombuffer(fast[1][2][head_length:], np.float32).tolist() == [2.5, -1.0]
    assert 'slimline_requests_total{model="fake",outcome="ok"} 8.0' in metrics
    assert 'slimline_inflight_requests{model="fake"} 0.0' in metrics


@pytest.mark.parametrize(
    ("path", "target"),
    [
        ("/v2/models/m/infer", ("m", None)),
        ("/v2/models/m/versions/2/infer", ("m", "2")),
        ("/v2/models//infer", None),
        ("/v2/models/infer", None),
        ("/v2/models/m/infer/", None),
        ("/v2/models/m/versions//infer", None),
        ("/v2/models/a/b/infer", None),
        ("/v2/models/m/ready", None),
    ],
)
def test_infer_paths_are_recognised_as_the_routes_match_them(
    path: str, target: tuple[str, str | None] | None
) -> None:
    assert infer_target(path) == target


class _RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_writes_in_one_loop_turn_leave_in_one_write() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes], int, str]:
        inner = _RecordingTransport()
        t = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        held = t.get_write_buffer_size()
        before = list(inner.writes)
        await asyncio.sleep(0)  # the end of the turn
        return before, inner.writes, held, t.get_extra_info("peername")

    before, after, held, info = asyncio.run(scenario())
    assert before == [] and after == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    assert held == len(b"HTTP/1.1 200 OK\r\n\r\nbody") and info == "info:peername"


def test_close_sends_what_is_held_first_and_a_closed_transport_gets_nothing() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes]]:
        loop = asyncio.get_running_loop()
        inner = _RecordingTransport()
        t = CoalescingTransport(inner, loop)  # type: ignore[arg-type]
        t.write(b"bye")
        t.close()
        gone = _RecordingTransport()
        late = CoalescingTransport(gone, loop)  # type: ignore[arg-type]
        late.write(b"lost")
        gone.closed = True  # e.g. the peer went away before the end of the turn
        await asyncio.sleep(0)
        return inner.writes, gone.writes

    closed_writes, lost_writes = asyncio.run(scenario())
    assert closed_writes == [b"bye"] and lost_writes == []
