"""SIGTERM: the server stops accepting, answers every accepted request, then exits 0."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from slimline.serve import run_in_subprocess


def test_sigterm_drains_every_accepted_request(slower_onnx: Path) -> None:
    # about 80 ms a row: 30 requests are 2.4 s of work, so all of them are inside the server
    # (queued or running) long before the queue empties, on a fast machine or a slow one
    body = {"inputs": [{"name": "x", "shape": [1, 1024], "datatype": "FP32",
                        "data": np.ones(1024, np.float32).tolist()}]}  # fmt: skip
    # 30 queued requests of ~80 ms each: a deadline far above that, so the test is about the
    # drain alone, not about whether a busy machine answers within the default 1 s deadline
    flags = ["--max-batch-size", "1", "--instances", "1", "--threads", "1", "--timeout-ms", "60000"]
    with run_in_subprocess([slower_onnx], flags) as (url, proc):
        statuses: list[int] = []
        lock = threading.Lock()
        start = threading.Barrier(30)

        def send() -> None:
            with httpx.Client(timeout=60) as c:
                start.wait()
                code = c.post(url + "/v2/models/slow/infer", json=body).status_code
            with lock:
                statuses.append(code)

        threads = [threading.Thread(target=send) for _ in range(30)]
        for t in threads:
            t.start()
        # SIGTERM only once the server has taken in all 30: a request still in the socket's
        # backlog was never accepted, and a draining server may close its connection
        inflight = _wait_accepted(url, total=30)
        assert inflight >= 10, f"only {inflight} requests were queued when SIGTERM came"
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert proc.wait(timeout=60) == 0
        assert statuses == [200] * 30
        try:
            httpx.get(url + "/v2/health/live", timeout=2)
            raise AssertionError("the server still accepts connections after draining")
        except httpx.ConnectError:
            pass


def _wait_accepted(url: str, total: int) -> float:
    """Wait until ``total`` requests have entered the server; return how many are still inside."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        m = re.search(r'slimline_inflight_requests\{model="slow"\} ([0-9.]+)', text)
        done = re.findall(
            r'slimline_requests_total\{model="slow",outcome="[a-z_]+"\} ([0-9.]+)', text
        )
        inflight = float(m.group(1)) if m else 0.0
        if inflight + sum(float(d) for d in done) >= total:
            return inflight
        time.sleep(0.005)
    raise AssertionError("the requests never all reached the server")
