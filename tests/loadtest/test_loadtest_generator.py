"""The scheduler and statistics with a fake client: no network, known latencies."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from slimline.loadtest.client import FakeClient
from slimline.loadtest.generator import ClosedPlan, OpenPlan, Records, execute
from slimline.loadtest.payload import encode_request
from slimline.loadtest.result import summarize
from slimline.loadtest.run import LoadTestConfig, run_loadtest

PAYLOADS = [encode_request({"x": np.zeros((1, 4), np.float32)}, "json")]


def _open(rate: float, duration: float, warmup: float, **fake: Any) -> dict[str, Any]:
    cfg = LoadTestConfig(
        url="http://127.0.0.1:9",
        model="m",
        rate=rate,
        duration_s=duration,
        warmup_s=warmup,
        arrival="constant",
        processes=1,
        max_lag_ms=100.0,  # validity has its own test; a busy machine may lag 10 ms
    )
    return run_loadtest(cfg, payloads=PAYLOADS, client_factory=lambda: FakeClient(**fake))


def test_open_loop_measures_a_fixed_latency_and_counts_the_window() -> None:
    res = _open(100.0, 1.0, 0.5, latency=0.02)
    assert res["mode"] == "open" and res["valid"] and not res["partial"]
    assert res["requests"] == 100 and res["outcomes"]["ok"] == 100
    assert res["offered_rate"] == pytest.approx(100.0)
    assert res["achieved_rate"] == pytest.approx(100.0, rel=0.03)
    # asyncio.sleep in the fake wakes up to ~1 ms late, plus scheduling on a busy machine
    assert 20.0 <= res["latency_ms"]["p50"] < 35.0
    assert res["schedule_lag_ms"]["p50"] < 5.0


def test_outcomes_are_counted_by_kind() -> None:
    kinds = ["ok", "rejected", "timeout", "bad_request", "connection"]
    res = _open(100.0, 1.0, 0.0, latency=0.001, outcome=lambda i: kinds[i % 5])
    assert res["outcomes"] == {
        "ok": 20,
        "rejected": 20,
        "timeout": 20,
        "bad_request": 20,
        "connection": 20,
        "server_error": 0,
        "unfinished": 0,
    }
    assert res["error_rate"] == pytest.approx(0.8)
    assert res["latency_ms"]["p50"] is not None  # only the ok answers are in the latency


def _stall_once(index: int) -> FakeClient:
    return FakeClient(latency=lambda i: 1.0 if i == index else 0.005, serial=True)


def test_a_stall_shows_in_open_loop_and_hides_in_closed_loop() -> None:
    """Coordinated omission: one 1 s stall of a one-at-a-time server."""
    open_res = run_loadtest(
        LoadTestConfig(
            url="http://127.0.0.1:9",
            model="m",
            rate=50.0,
            duration_s=3.0,
            warmup_s=0.2,
            arrival="constant",
            processes=1,
        ),
        payloads=PAYLOADS,
        client_factory=lambda: _stall_once(60),
    )
    closed_res = run_loadtest(
        LoadTestConfig(
            url="http://127.0.0.1:9",
            model="m",
            concurrency=1,
            duration_s=3.0,
            warmup_s=0.2,
            processes=1,
        ),
        payloads=PAYLOADS,
        client_factory=lambda: _stall_once(150),
    )
    # open loop: the ~50 requests scheduled during the stall all wait for it
    assert open_res["latency_ms"]["max"] > 950.0
    assert open_res["latency_ms"]["p99"] > 800.0
    assert open_res["latency_ms"]["p95"] > 500.0
    # closed loop: the single user waits, sends nothing meanwhile, and p99 stays at the service time
    assert closed_res["latency_ms"]["max"] > 950.0
    assert (
        closed_res["latency_ms"]["p99"] < 200.0
    )  # 5 ms service; 200 leaves room for a busy machine
    assert closed_res["offered_rate"] is None and closed_res["mode"] == "closed"


def test_stop_writes_partial_results() -> None:
    stop = threading.Event()
    threading.Timer(0.8, stop.set).start()
    t = time.monotonic()
    res = run_loadtest(
        LoadTestConfig(
            url="http://127.0.0.1:9",
            model="m",
            rate=100.0,
            duration_s=10.0,
            warmup_s=0.2,
            arrival="constant",
            processes=1,
        ),
        payloads=PAYLOADS,
        client_factory=lambda: FakeClient(latency=0.01),
        stop=stop,
    )
    # stopped, not run out: the schedule asks for 10 s (the slack is for a starved CPU; the
    # window check below is the tight one)
    assert time.monotonic() - t < 8.0
    assert res["partial"] is True
    # the window ends at the stop (~0.6 s in): about 60 requests at 100 rps
    assert res["duration_s"] < 1.5 and res["requests"] == pytest.approx(
        100 * res["duration_s"], abs=3
    )
    assert res["outcomes"]["ok"] + res["outcomes"]["unfinished"] == res["requests"]


def test_a_generator_that_cannot_keep_up_is_invalid() -> None:
    async def blocking_sleep(seconds: float) -> None:
        time.sleep(0.004)  # blocks the event loop: requests leave later and later

    res = run_loadtest(
        LoadTestConfig(
            url="http://127.0.0.1:9",
            model="m",
            rate=500.0,
            duration_s=1.0,
            warmup_s=0.0,
            arrival="constant",
            processes=1,
            max_lag_ms=10.0,
        ),
        payloads=PAYLOADS,
        client_factory=lambda: FakeClient(sleep=blocking_sleep),
    )
    assert res["valid"] is False
    assert "schedule lag p99" in res["invalid_reason"] and res["schedule_lag_ms"]["p99"] > 10.0


def test_summary_windows_and_merge() -> None:
    # two requests in warm-up, three measured; one measured request unanswered
    parts = [
        Records(
            np.array([0.0, 1.0, 2.0]),
            np.array([0.0, 1.0, 2.0]),
            np.array([0.1, 1.2, np.nan]),
            np.array([0, 0, -1], np.int8),
        ),
        Records(
            np.array([0.5, 1.5]),
            np.array([0.5, 1.6]),
            np.array([0.6, 1.9]),
            np.array([0, 0], np.int8),
        ),
    ]
    rec = Records.merge(parts, [np.array([0, 2, 4]), np.array([1, 3])])
    assert rec.scheduled.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    res = summarize(
        rec, mode="open", warmup_s=1.0, duration_s=2.0, target_rate=None, max_lag_ms=500.0
    )
    assert res["requests"] == 3 and res["outcomes"]["unfinished"] == 1
    assert res["latency_ms"]["max"] == pytest.approx(400.0)  # from the scheduled 1.5, not sent 1.6
    assert res["schedule_lag_ms"]["max"] == pytest.approx(100.0)
    assert res["achieved_rate"] == pytest.approx(2 / 2.0)


def test_closed_plan_splits_users_and_open_plan_interleaves() -> None:
    assert [ClosedPlan(5, 1.0).part(w, 2).concurrency for w in range(2)] == [3, 2]
    plan = OpenPlan(np.arange(5.0), np.arange(5))
    assert plan.part(1, 2).offsets.tolist() == [1.0, 3.0]


def test_execute_runs_a_closed_plan_with_a_fake() -> None:
    rec = execute(lambda: FakeClient(latency=0.01), ClosedPlan(2, 0.3), PAYLOADS)
    assert 30 <= len(rec.scheduled) <= 62
    assert np.all(rec.done - rec.sent >= 0.008)  # uvloop timers may fire up to ~1 ms early


def test_fake_client_serial_queues_in_order() -> None:
    client = FakeClient(latency=0.01, serial=True)

    async def go() -> float:
        t = time.monotonic()
        await asyncio.gather(*(client.infer(PAYLOADS[0]) for _ in range(5)))
        return time.monotonic() - t

    assert asyncio.run(go()) >= 0.05


def test_auto_processes_doubles_when_one_generator_falls_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slimline.loadtest import run as run_mod

    used: list[int] = []

    def fake_execute(make_client, plan, payloads, processes, stop, connections):  # type: ignore[no-untyped-def]
        used.append(processes)
        late = 0.030 if processes == 1 else 0.0002  # one process: every request leaves 30 ms late
        sent = plan.offsets + late
        return Records(plan.offsets.copy(), sent, sent + 0.005, np.zeros(len(sent), np.int8))

    monkeypatch.setattr(run_mod, "execute", fake_execute)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    cfg = LoadTestConfig(
        url="http://127.0.0.1:9",
        model="m",
        rate=100.0,
        duration_s=1.0,
        warmup_s=0.0,
        arrival="constant",
    )
    res = run_loadtest(cfg, payloads=PAYLOADS, client_factory=lambda: FakeClient())
    assert used == [1, 2]
    assert res["valid"] and res["config"]["processes"] == 2 and res["config"]["escalated_from"] == 1
    used.clear()
    res = run_loadtest(
        cfg.model_copy(update={"processes": 1}),
        payloads=PAYLOADS,
        client_factory=lambda: FakeClient(),
    )
    assert used == [1] and not res["valid"]  # an explicit --processes is kept
