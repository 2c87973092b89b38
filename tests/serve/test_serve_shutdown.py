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


def test_sigterm_drains_every_accepted_request(slow_onnx: Path) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 1024], "datatype": "FP32",
                        "data": np.ones(1024, np.float32).tolist()}]}  # fmt: skip
    # 30 queued requests of ~25 ms each: a deadline far above that, so the test is about the
    # drain alone, not about whether a busy machine answers within the default 1 s deadline
    flags = ["--max-batch-size", "1", "--instances", "1", "--threads", "1", "--timeout-ms", "60000"]
    with run_in_subprocess([slow_onnx], flags) as (url, proc):
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
        _wait_inflight(url, at_least=20)
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


def _wait_inflight(url: str, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        m = re.search(r'slimline_inflight_requests\{model="slow"\} ([0-9.]+)', text)
        if m and float(m.group(1)) >= at_least:
            return
        time.sleep(0.005)
    raise AssertionError("requests never queued up")
