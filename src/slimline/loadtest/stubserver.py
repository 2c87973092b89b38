"""A KServe v2 server with a known service time, to check the load generator against the truth.

It answers ``infer`` after exactly ``delay_ms`` (a thread's ``time.sleep``, which wakes within
tens of microseconds), either in parallel (every request waits its own delay: no queue) or
serially (one request at a time, like a single-worker model server, so a queue forms above
``1000 / delay_ms`` requests per second). Optionally, one request stalls for ``stall_ms``. It
records each request's own service time (``GET /stub/timings``) and serves Prometheus metrics.

Run it with ``python -m slimline.loadtest.stubserver --delay-ms 20``; it prints its port. In
tests and benchmarks use :func:`stub_server`, which starts it in a subprocess on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httptools
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..childproc import ChildOutput

__all__ = ["StubSettings", "stub_server"]


class StubSettings(argparse.Namespace):
    model: str = "stub"
    delay_ms: float = 10.0
    serial: bool = False
    stall_ms: float = 0.0
    stall_after: int = 0  # the index of the infer request that stalls
    inputs: str = "x:FP32:-1,4"


class _State:
    def __init__(self, s: StubSettings):
        self.s = s
        self.pool = cf.ThreadPoolExecutor(1 if s.serial else 512)
        self.count = 0
        self.timings: list[float] = []
        self.waiting = 0
        reg = self.registry = CollectorRegistry()
        self.requests = Counter(
            "stub_requests", "infer requests", ["model", "outcome"], registry=reg
        )
        self.queue = Gauge("stub_queue_depth", "requests waiting", ["model"], registry=reg)
        self.batch = Histogram(
            "stub_batch_size",
            "rows per batch",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=reg,
        )

    def metadata(self) -> dict[str, Any]:
        inputs = []
        for spec in self.s.inputs.split(";"):
            name, dtype, shape = spec.split(":")
            inputs.append(
                {"name": name, "datatype": dtype, "shape": [int(d) for d in shape.split(",")]}
            )
        outputs = [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]
        return {
            "name": self.s.model,
            "platform": "stub",
            "versions": ["1"],
            "inputs": inputs,
            "outputs": outputs,
        }


def _rows(body: bytes, headers: dict[bytes, bytes]) -> int:
    """Rows of the first input, from a JSON or binary-extension request; raises ValueError."""
    head_len = headers.get(b"inference-header-content-length")
    doc = json.loads(body[: int(head_len)] if head_len else body)
    inputs = doc["inputs"]
    if not inputs or not all("name" in t and "shape" in t and "datatype" in t for t in inputs):
        raise ValueError("each input needs name, shape and datatype")
    return int(inputs[0]["shape"][0])


class _Handler(asyncio.Protocol):
    def __init__(self, state: _State):
        self.state = state
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.reply(400, {"error": "bad HTTP request"})
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.route(method, self.url.decode().split("?")[0].rstrip("/"))

    def reply(
        self, status: int, doc: Any, content_type: bytes = b"application/json", extra: bytes = b""
    ) -> None:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        head = b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status,
            content_type,
            len(body),
            extra,
        )
        if not self.transport.is_closing():
            self.transport.write(head + body)

    def route(self, method: str, path: str) -> None:
        st, model = self.state, self.state.s.model
        if path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{model}/ready"):
            self.reply(200, b"")
        elif path == "/v2":
            self.reply(
                200, {"name": "slimline-stub", "version": "1", "extensions": ["binary_tensor_data"]}
            )
        elif path == f"/v2/models/{model}":
            self.reply(200, st.metadata())
        elif path == f"/v2/models/{model}/infer" and method == "POST":
            self.infer()
        elif path == "/metrics":
            self.reply(200, generate_latest(st.registry), b"text/plain; version=0.0.4")
        elif path == "/stub/timings":  # returns and clears the service times recorded so far
            self.reply(200, st.timings)
            st.timings = []
        elif path.startswith("/v2/models/"):
            self.reply(
                404, {"error": f"model {path.split('/')[3]!r} not found; this server has {model!r}"}
            )
        else:
            self.reply(404, {"error": f"no route {path}"})

    def infer(self) -> None:
        st = self.state
        try:
            rows = _rows(bytes(self.body), self.headers)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            st.requests.labels(st.s.model, "bad_request").inc()
            self.reply(400, {"error": f"bad infer request: {err}"})
            return
        index, st.count = st.count, st.count + 1
        stall = st.s.stall_ms > 0 and index == st.s.stall_after
        seconds = (st.s.stall_ms if stall else st.s.delay_ms) / 1e3
        t_in = time.perf_counter()
        st.waiting += 1
        st.queue.labels(st.s.model).set(st.waiting)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(st.pool, time.sleep, seconds)
        fut.add_done_callback(lambda _f: self.answer(rows, t_in))

    def answer(self, rows: int, t_in: float) -> None:
        st = self.state
        st.waiting -= 1
        st.queue.labels(st.s.model).set(st.waiting)
        st.batch.labels(st.s.model).observe(rows)
        st.requests.labels(st.s.model, "ok").inc()
        ms = (time.perf_counter() - t_in) * 1e3
        st.timings.append(ms)
        doc = {
            "model_name": st.s.model,
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": [rows, 1], "data": [0.0] * rows}
            ],
        }
        self.reply(200, doc, extra=b"Server-Timing: app;dur=%.3f\r\n" % ms)


async def serve(settings: StubSettings, port: int = 0) -> None:
    state = _State(settings)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Handler(state), "127.0.0.1", port)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _parse(argv: list[str] | None) -> tuple[StubSettings, int]:
    p = argparse.ArgumentParser(prog="python -m slimline.loadtest.stubserver")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default=StubSettings.model)
    p.add_argument("--delay-ms", type=float, default=StubSettings.delay_ms)
    p.add_argument("--serial", action="store_true", help="one request at a time (a queue forms)")
    p.add_argument("--stall-ms", type=float, default=0.0, help="one request takes this long")
    p.add_argument("--stall-after", type=int, default=0, help="index of the request that stalls")
    p.add_argument("--inputs", default=StubSettings.inputs, help="name:DTYPE:d0,d1;...")
    ns = p.parse_args(argv, namespace=StubSettings())
    return ns, int(ns.port)


def main(argv: list[str] | None = None) -> None:
    settings, port = _parse(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, port))


@contextlib.contextmanager
def stub_server(*args: str, ready_timeout_s: float = 60.0) -> Iterator[str]:
    """Start the stub in a subprocess with CLI ``args``; yields its base URL, then stops it."""
    cmd = [sys.executable, "-m", "slimline.loadtest.stubserver", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    output = ChildOutput(proc)
    try:
        try:
            port = output.wait_for("port ", ready_timeout_s)
        except (TimeoutError, EOFError) as err:
            raise RuntimeError(f"stub server did not start: {err}") from None
        yield f"http://127.0.0.1:{int(port)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        output.close()
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__":
    main()
