"""Load testing and capacity planning for KServe v2 servers.

* :func:`run_loadtest`: one open-loop (or closed-loop) load test; latency counts from each
  request's scheduled time, so a stalled server cannot hide its queue.
* The result format is described in :mod:`slimline.loadtest.result`.
"""

from __future__ import annotations

from .client import OUTCOMES, Client, FakeClient, HttpClient
from .payload import Payload, build_payloads, load_samples
from .result import read_result, write_json
from .run import LoadTestConfig, run_loadtest
from .schedule import arrival_schedule, load_trace, replay_schedule

__all__ = [
    "OUTCOMES",
    "Client",
    "FakeClient",
    "HttpClient",
    "LoadTestConfig",
    "Payload",
    "arrival_schedule",
    "build_payloads",
    "load_samples",
    "load_trace",
    "read_result",
    "replay_schedule",
    "run_loadtest",
    "write_json",
]
