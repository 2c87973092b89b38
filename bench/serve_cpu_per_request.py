"""CPU time per request on the KServe v2 infer path, server side and client side.

On a 2-core machine the load generator, the server's event loop and the inference threads share
the cores, so every microsecond of per-request CPU outside inference is throughput the model
loses. This script counts CPU seconds per request (process and thread CPU time divided by the
requests answered, not wall time), so the figures hold on a shared machine:

* **server event loop**: the server's main thread (uvicorn, HTTP parsing, the app, the batcher,
  response encoding, metrics, garbage collection);
* **server inference**: every other server thread (the runtime's threads, the batcher's pool);
* **client**: the whole load-generator process (slimline's closed-loop generator);
* **app alone**: the app's own share of the event loop, measured apart: the ASGI app driven in
  process (no sockets, no HTTP server) against a backend with the model's metadata that answers
  at once, so only protocol + validation + batcher + response + metrics remain.

Requests are single-row binary-tensor infers of the mnist example model (as
``bench/serve_throughput.py`` sends them), closed loop, the server configured as that script's
first configuration (1 instance x 2 threads, max batch 64, concurrency 128).

``--compare-src DIR`` measures a second source tree (e.g. a checkout of an older commit's
``src``) the same way in the same run, rounds interleaved (A B A B ...): server, load generator
and app each import slimline from their own tree, so the two sides differ only by the code.

    nice -n 10 .venv/bin/python bench/serve_cpu_per_request.py [--runtime openvino]
        [--seconds 8] [--rounds 3] [--compare-src /path/to/old/src]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
SRC = BENCH.parent / "src"
OUT = BENCH / "out" / "serve"
RESULTS = BENCH / "RESULTS-serve-cpu.md"
ROWS_FILE = OUT / "cpu-per-request-rows.npz"


# -- workers (run in a child process with their own source tree first on the path) ----------
def client_worker(url: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """The load generator against ``url``: requests answered and this process's CPU seconds."""
    from slimline.loadtest.client import HttpClient
    from slimline.loadtest.generator import ClosedPlan, execute
    from slimline.loadtest.payload import encode_request

    rows = dict(np.load(ROWS_FILE))
    n = len(next(iter(rows.values())))
    loads = [encode_request({k: v[i : i + 1] for k, v in rows.items()}, "binary") for i in range(n)]

    def run(duration: float) -> Any:
        return execute(lambda: HttpClient(url, "mnist", timeout_s=60), ClosedPlan(concurrency,
                       duration), loads, connections=concurrency)  # fmt: skip

    run(1.0)  # warm-up: connections, caches, the server's first batches
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rec = run(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    answered = int((rec.outcome >= 0).sum())
    return {"requests": answered, "ok": int((rec.outcome == 0).sum()), "cpu_s": cpu,
            "wall_s": wall}  # fmt: skip


def engine_worker(onnx_path: str, runtime: str, seconds: float) -> dict[str, Any]:
    """The runtime alone in this process, batches of 64 rows, 2 threads: CPU seconds per row."""
    from slimline.serve.model import make_backend

    backend = make_backend(Path(onnx_path), 2, runtime)
    rows = dict(np.load(ROWS_FILE))
    feed = {k: np.concatenate([v] * 2)[:64] for k, v in rows.items()}
    backend.run(feed)
    done, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        backend.run(feed)
        done += 64
    return {"rows": done, "cpu_s": time.process_time() - cpu0}


def app_worker(onnx_path: str, requests: int, concurrency: int) -> dict[str, Any]:
    """Event-loop CPU per request of the ASGI app alone (in-process transport, instant model)."""
    import uvloop

    from slimline.loadtest.payload import encode_request
    from slimline.serve.app import ServeSettings, build_app
    from slimline.serve.batcher import BatcherConfig
    from slimline.serve.model import FakeBackend, ServedModel, onnx_specs

    specs_in, specs_out = onnx_specs(Path(onnx_path))

    def instant(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(inputs.values())))
        return {s.name: np.zeros((n, *[d or 1 for d in s.shape[1:]]), s.dtype) for s in specs_out}

    batching = BatcherConfig(max_batch_size=64, max_queue_delay_ms=2, max_queue_size=512,
                             timeout_ms=60000)  # fmt: skip
    app = build_app([ServedModel("mnist", FakeBackend(specs_in, specs_out, instant))],
                    ServeSettings(batching=batching))  # fmt: skip
    rows = dict(np.load(ROWS_FILE))
    n = len(next(iter(rows.values())))
    loads = [encode_request({k: v[i : i + 1] for k, v in rows.items()}, "binary") for i in range(n)]
    return uvloop.run(_drive_app(app, loads, requests, concurrency))


async def _drive_app(app: Any, loads: list[Any], requests: int, concurrency: int) -> dict[str, Any]:
    state = app.state.slimline
    await state.start()
    await state.warmed()
    per_user = max(1, requests // concurrency)

    async def user(u: int, count: int) -> None:
        for i in range(count):
            await _asgi_infer(app, loads[(u + i) % len(loads)])

    await asyncio.gather(*(user(u, 20) for u in range(concurrency)))
    cpu0 = time.thread_time()
    await asyncio.gather(*(user(u, per_user) for u in range(concurrency)))
    cpu = time.thread_time() - cpu0
    await state.stop()
    return {"requests": per_user * concurrency, "cpu_s": cpu}


async def _asgi_infer(app: Any, payload: Any) -> None:
    """One POST through the ASGI interface, as an HTTP server would deliver it."""
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-length", str(len(payload.body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in payload.headers.items()]
    path = "/v2/models/mnist/infer"
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {}}  # fmt: skip
    messages = [{"type": "http.request", "body": payload.body, "more_body": False}]
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # a client that stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"the app answered {status} to a valid request")


# -- the orchestrating process ----------------------------------------------------------------
def _child(src: Path, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": _pythonpath(src)}
    out = subprocess.run([sys.executable, __file__, *args], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def _pythonpath(src: Path) -> str:
    return os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])


def _thread_cpu(pid: int) -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def _batches(url: str) -> tuple[float, float]:
    """(rows, batches) the server has run so far, from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if f.name == "slimline_batch_size"}  # fmt: skip
    return got.get("slimline_batch_size_sum", 0.0), got.get("slimline_batch_size_count", 0.0)


def _server_round(url: str, pid: int, src: Path, a: argparse.Namespace) -> dict[str, float]:
    before, rows0 = _thread_cpu(pid), _batches(url)
    res = _child(src, ["--client-worker", url, "--seconds", str(a.seconds),
                       "--concurrency", str(a.concurrency)])  # fmt: skip
    after, rows1 = _thread_cpu(pid), _batches(url)
    used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    n = res["requests"]
    loop_s = used.get(pid, 0.0)
    return {
        "requests": n,
        "ok_rps": res["ok"] / res["wall_s"],
        "loop_us": loop_s / n * 1e6,
        "inference_us": (sum(used.values()) - loop_s) / n * 1e6,
        "client_us": res["cpu_s"] / n * 1e6,
        "rows_per_batch": (rows1[0] - rows0[0]) / max(rows1[1] - rows0[1], 1.0),
    }


def measure(a: argparse.Namespace, onnx_path: Path) -> dict[str, Any]:
    from contextlib import ExitStack

    from slimline.serve import run_in_subprocess

    flags = ["--threads", str(a.threads), "--instances", str(a.instances), "--max-batch-size", "64",
             "--max-queue-delay-ms", "2", "--max-queue-size", "512", "--timeout-ms", "60000",
             "--runtime", a.runtime]  # fmt: skip
    sides = {"this tree": SRC} | ({a.compare_name: Path(a.compare_src)} if a.compare_src else {})
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                run_in_subprocess([onnx_path], flags, env={"PYTHONPATH": _pythonpath(src)})
            )
            for name, src in sides.items()
        }
        for _ in range(a.rounds):  # A B A B ...: drift of the shared machine hits both sides
            for name, src in sides.items():
                url, proc = servers[name]
                r = _server_round(url, proc.pid, src, a)
                r["app_us"] = _app_round(src, onnx_path, a)
                engine = _child(src, ["--engine-worker", str(onnx_path), "--runtime", a.runtime,
                                      "--seconds", str(a.seconds / 2)])  # fmt: skip
                r["engine_us_per_row"] = engine["cpu_s"] / engine["rows"] * 1e6
                rounds[name].append(r)
    return {name: {"rounds": rs, "median": _medians(rs)} for name, rs in rounds.items()}


def _app_round(src: Path, onnx_path: Path, a: argparse.Namespace) -> float:
    res = _child(src, ["--app-worker", str(onnx_path), "--requests", str(a.app_requests),
                       "--concurrency", str(a.concurrency)])  # fmt: skip
    return float(res["cpu_s"] / res["requests"] * 1e6)


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| code | server event loop | app alone (in-process ASGI) | load generator | event loop "
        "+ load generator | server inference threads | same runtime in process (batch 64) "
        "| rows per batch | ok req/s (shared machine) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        m = res["median"]
        per_round = ", ".join(f"{r['loop_us']:.0f}" for r in res["rounds"])
        lines.append(
            f"| {name} | **{m['loop_us']:.1f} µs** ({per_round}) | {m['app_us']:.1f} µs | "
            f"{m['client_us']:.1f} µs | **{m['loop_us'] + m['client_us']:.1f} µs** | "
            f"{m['inference_us']:.0f} µs | {m['engine_us_per_row']:.0f} µs | "
            f"{m['rows_per_batch']:.1f} | {m['ok_rps']:.0f} |"
        )
    return "\n".join(lines)


def write_results(section: str) -> None:
    """Replace the measured section of bench/RESULTS-serve-cpu.md; the rest is kept."""
    from bench_out import put_section
    from slimline.record import atomic_write_text

    text = RESULTS.read_text() if RESULTS.is_file() else "# CPU per request on the infer path\n"
    atomic_write_text(RESULTS, put_section(text, "measured", section))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", choices=["onnxruntime", "openvino"], default="openvino")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--instances", type=int, default=1, help="server instances")
    ap.add_argument("--threads", type=int, default=2, help="server threads per instance")
    ap.add_argument("--app-requests", type=int, default=25600)
    ap.add_argument("--compare-src", default=None, help="a second source tree to measure")
    ap.add_argument("--compare-name", default="compared", help="its name in the table")
    ap.add_argument("--client-worker", metavar="URL", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--app-worker", metavar="ONNX", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-worker", metavar="ONNX", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=25600, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client_worker:
        print(json.dumps(client_worker(a.client_worker, a.seconds, a.concurrency)))
        return
    if a.engine_worker:
        print(json.dumps(engine_worker(a.engine_worker, a.runtime, a.seconds)))
        return
    if a.app_worker:
        print(json.dumps(app_worker(a.app_worker, a.requests, a.concurrency)))
        return
    run(a)


def run(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(BENCH))
    from serve_common import conditions, mnist_model, save_json

    onnx_path, rows, note = mnist_model()
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(ROWS_FILE, **rows)  # type: ignore[arg-type]
    results = measure(a, onnx_path)
    save_json("cpu-per-request", {"runtime": a.runtime, "results": results})
    md = (
        f"## CPU per request, mnist on {a.runtime}\n\n"
        "Single-row binary-tensor infers, closed loop, concurrency "
        f"{a.concurrency}; server {a.instances} instance(s) x {a.threads} thread(s), max batch 64, "
        "max_queue_delay 2 ms. "
        f"{a.rounds} rounds of {a.seconds:g} s per side (after 1 s of warm-up), medians; per "
        "round the event-loop figure is listed. CPU seconds (user + system) divided by the "
        "requests answered (the inference columns: per row). App alone: the same app driven "
        "in process through ASGI, "
        f"{a.app_requests} requests, an instant model with mnist's metadata. Same runtime in "
        f"process: the serving backend alone, batches of 64 rows, {a.seconds / 2:g} s per "
        "round. Model: mnist "
        f"({note}).\n\n"
        f"{table(results)}\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_cpu_per_request.py"
        f"{'' if a.runtime == 'openvino' else ' --runtime ' + a.runtime}"
        f"{'' if (a.instances, a.threads) == (1, 2) else f' --instances {a.instances} --threads {a.threads}'}"
        f"{'' if a.concurrency == 128 else f' --concurrency {a.concurrency}'}"
        f"{f' --compare-src {a.compare_src} --compare-name {a.compare_name!r}' if a.compare_src else ''}`\n\n"
        f"{conditions()}\n"
    )
    write_results(md)
    print(md)


if __name__ == "__main__":
    main()
