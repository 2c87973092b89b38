"""slimline against the same model served plainly on Ray Serve with ``@serve.batch`` defaults.

Three servers of one model, each with one ONNX Runtime session of 2 intra-op threads:

* ``ray-plain``: a Ray Serve deployment written the usual way: ``@serve.batch`` with its
  defaults (max_batch_size=10, batch_wait_timeout_s=0.01), ``max_ongoing_requests`` default,
  the batch run on the replica's event loop, v2 JSON in and out (so the same load applies);
* ``ray-slimline``: ``slimline.serve.ray`` (1 replica): the slimline app inside Ray Serve;
* ``local-slimline``: ``slimline serve`` in a child process.

Each gets the same closed-loop sweep of concurrency levels (JSON requests, one row each); the
table lists req/s and p99 at each level, then the throughput each reaches at equal p99 (linear
interpolation of its sweep at a common p99 target).

    nice -n 10 .venv/bin/python bench/serve_ray_compare.py [--model mnist] [--seconds 5]
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import numpy as np

from serve_common import MODELS, closed_loop, payloads, save_json, write_section
from slimline.serve import BatcherConfig, ServeSettings, run_in_subprocess
from slimline.serve.model import ort_serving_session

LEVELS = (1, 4, 16, 32)
THREADS = 2


def plain_ray_app(path: Path, name: str) -> Any:
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(ray_actor_options={"num_cpus": 1})
    class PlainOrt:
        def __init__(self) -> None:
            self.sess = ort_serving_session(path, THREADS)
            self.out = self.sess.get_outputs()[0].name

        @serve.batch
        async def infer(self, feeds: list[dict[str, np.ndarray]]) -> list[list[float]]:
            merged = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
            y = self.sess.run([self.out], merged)[0]
            return [row.ravel().tolist() for row in y]

        async def __call__(self, request: Request) -> dict[str, Any]:
            doc = await request.json()
            feed = {
                t["name"]: np.asarray(t["data"], dtype=_NP[t["datatype"]]).reshape(t["shape"])
                for t in doc["inputs"]
            }
            row = await self.infer(feed)
            return {"model_name": name,
                    "outputs": [{"name": self.out, "datatype": "FP32",
                                 "shape": [1, len(row)], "data": row}]}  # fmt: skip

    return PlainOrt.bind()  # type: ignore[attr-defined]  # @serve.deployment adds bind


_NP = {"FP32": np.float32, "INT64": np.int64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sweep(url: str, name: str, loads: list[Any], seconds: float) -> list[dict[str, Any]]:
    return [{"concurrency": c, **closed_loop(url, name, loads, c, seconds)} for c in LEVELS]


def on_ray(
    path: Path, name: str, loads: list[Any], seconds: float
) -> dict[str, list[dict[str, Any]]]:
    import ray
    from ray import serve

    from slimline.serve.ray import build_ray_app

    out: dict[str, list[dict[str, Any]]] = {}
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        serve.run(plain_ray_app(path, name), name="plain", route_prefix=f"/v2/models/{name}/infer")
        out["ray-plain"] = sweep(url, name, loads, seconds)
        serve.delete("plain")
        settings = ServeSettings(threads=THREADS, batching=BatcherConfig(
            max_batch_size=16, max_queue_delay_ms=2, timeout_ms=60_000))  # fmt: skip
        serve.run(build_ray_app([path], settings, replicas=1), name="slimline", route_prefix="/")
        out["ray-slimline"] = sweep(url, name, loads, seconds)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return out


def at_p99(points: list[dict[str, Any]], target_ms: float) -> float | None:
    """Throughput where the sweep's p99 crosses ``target_ms`` (linear between levels)."""
    best = None
    prev = None
    for p in points:
        if p["p99_ms"] is None:
            continue
        if p["p99_ms"] <= target_ms:
            best = p["ok_rps"]
        elif prev is not None and prev["p99_ms"] <= target_ms:
            f = (target_ms - prev["p99_ms"]) / (p["p99_ms"] - prev["p99_ms"])
            best = prev["ok_rps"] + f * (p["ok_rps"] - prev["ok_rps"])
            break
        prev = p
    return best


def report(name: str, note: str, runs: dict[str, list[dict[str, Any]]], seconds: float) -> str:
    rows = ["| server | " + " | ".join(f"c={c}: req/s, p99" for c in LEVELS) + " |",
            "|---|" + "---|" * len(LEVELS)]  # fmt: skip
    for system, points in runs.items():
        cells = [f"{p['ok_rps']:.1f}, {p['p99_ms']:.0f} ms" if p["p99_ms"] else "-" for p in points]
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    targets = sorted({round(p["p99_ms"]) for p in runs["ray-plain"] if p["p99_ms"]})
    eq = ["| p99 target | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for t in targets:
        vals = [at_p99(points, t) for points in runs.values()]
        eq.append(f"| {t} ms | " + " | ".join("-" if v is None else f"{v:.1f} req/s" for v in vals)
                  + " |")  # fmt: skip
    return (
        f"## Against plain Ray Serve (`@serve.batch` defaults), model {name}\n\n"
        f"{note}. Closed loop, JSON single-row requests, {seconds:g} s per level after 1 s "
        f"warm-up, {THREADS} ORT threads everywhere, local Ray with 2 CPUs.\n\n"
        + "\n".join(rows)
        + "\n\nThroughput at equal p99 (each plain Ray operating point as the target):\n\n"
        + "\n".join(eq)
        + "\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_ray_compare.py`"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mnist")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    path, rows, note = MODELS[args.model]()
    loads = payloads(rows, "json")
    runs = on_ray(path, args.model, loads, args.seconds)
    flags = ["--threads", str(THREADS), "--max-batch-size", "16", "--timeout-ms", "60000"]
    with run_in_subprocess([path], flags) as (url, _):
        runs["local-slimline"] = sweep(url, args.model, loads, args.seconds)
    save_json(f"ray_compare_{args.model}", runs)
    md = report(args.model, note, runs, args.seconds)
    write_section(f"ray-{args.model}", md)
    print(md)


if __name__ == "__main__":
    main()
