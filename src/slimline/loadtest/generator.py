"""The scheduler: open-loop firing at precomputed times, closed-loop users, and process spreading.

Open loop: a ticker thread sleeps until each scheduled time (``time.sleep`` wakes within tens of
microseconds, where an asyncio timer wakes up to a millisecond late) and hands the due requests to
the event loop, which sends them whatever happened to earlier ones. Each request's latency is
counted from its *scheduled* time, and how late it actually left is kept as its schedule lag.

All timestamps are ``time.monotonic()`` (``CLOCK_MONOTONIC``, shared by all processes of the
machine), relative to a start time ``t0`` agreed before the first request; this is what lets
several worker processes share one schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LoadTestError
from .client import OUTCOMES, Client
from .payload import Payload

__all__ = ["ClosedPlan", "OpenPlan", "Records", "auto_processes", "execute"]

UNFINISHED = -1
START_MARGIN_S = 0.25  # time between agreeing on t0 and the first scheduled request
STOP_GRACE_S = 1.0  # after a stop, how long requests in flight may still finish

ClientFactory = Callable[[], Client]


@dataclass
class OpenPlan:
    """Requests at fixed offsets (seconds from t0), each with the index of its payload."""

    offsets: np.ndarray
    payload_ids: np.ndarray

    def part(self, worker: int, workers: int) -> OpenPlan:
        return OpenPlan(self.offsets[worker::workers], self.payload_ids[worker::workers])


@dataclass
class ClosedPlan:
    """``concurrency`` users, each sending its next request when the last one returns."""

    concurrency: int
    duration_s: float

    def part(self, worker: int, workers: int) -> ClosedPlan:
        share = self.concurrency // workers + (1 if worker < self.concurrency % workers else 0)
        return ClosedPlan(share, self.duration_s)


@dataclass
class Records:
    """Per-request timestamps relative to t0 (seconds); ``done`` is NaN when never answered."""

    scheduled: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    outcome: np.ndarray  # index into OUTCOMES, or UNFINISHED
    stopped_at: float | None = None  # when a stop (Ctrl-C) was requested, relative to t0
    error_samples: dict[str, str] | None = None

    @staticmethod
    def empty(n: int) -> Records:
        nan = np.full(n, np.nan)
        return Records(nan.copy(), nan.copy(), nan.copy(), np.full(n, UNFINISHED, np.int8))

    @staticmethod
    def merge(parts: list[Records], order: list[np.ndarray] | None = None) -> Records:
        """Concatenate worker records; ``order`` gives each part's positions in the whole."""
        if order is None:
            sched, sent, done, code = (
                np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS
            )
            cat = Records(sched, sent, done, code)
        else:
            cat = Records.empty(sum(len(p.scheduled) for p in parts))
            for p, idx in zip(parts, order, strict=True):
                for f in _FIELDS:
                    getattr(cat, f)[idx] = getattr(p, f)
        stops = [p.stopped_at for p in parts if p.stopped_at is not None]
        cat.stopped_at = min(stops) if stops else None
        cat.error_samples = {k: v for p in parts for k, v in (p.error_samples or {}).items()}
        return cat


_FIELDS = ("scheduled", "sent", "done", "outcome")
_CODES = {name: i for i, name in enumerate(OUTCOMES)}


class _Ticker(threading.Thread):
    """Wakes at each scheduled offset and hands the due request indices to the event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        t0: float,
        offsets: np.ndarray,
        fire: Callable[[int, int], None],
        stop: Any,
    ):
        super().__init__(name="slimline-ticker", daemon=True)
        self.loop, self.t0, self.offsets, self.fire, self.stop = loop, t0, offsets, fire, stop

    def run(self) -> None:
        i, n = 0, len(self.offsets)
        while i < n and not self.stop.is_set():
            wait = self.offsets[i] - (time.monotonic() - self.t0)
            if wait > 0.05:
                time.sleep(0.05)  # short naps keep a stop request noticed quickly
                continue
            if wait > 0:
                time.sleep(wait)
            j = int(np.searchsorted(self.offsets, time.monotonic() - self.t0, side="right"))
            j = max(j, i + 1)
            self.loop.call_soon_threadsafe(self.fire, i, j)
            i = j


async def _safe_infer(client: Client, payload: Payload) -> str:
    """The client's outcome; an unexpected client failure counts as a connection error."""
    try:
        return await client.infer(payload)
    except Exception as err:  # counted, and one message kept, instead of a lost task exception
        samples = getattr(client, "error_samples", None)
        if isinstance(samples, dict):
            samples.setdefault("connection", f"{type(err).__name__}: {err}")
        return "connection"


async def _open_loop(
    client: Client, plan: OpenPlan, payloads: list[Payload], t0: float, stop: Any
) -> Records:
    rec = Records.empty(len(plan.offsets))
    rec.scheduled[:] = plan.offsets
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    all_fired = asyncio.Event()

    async def one(k: int) -> None:
        rec.sent[k] = time.monotonic() - t0
        outcome = await _safe_infer(client, payloads[int(plan.payload_ids[k])])
        rec.done[k] = time.monotonic() - t0
        rec.outcome[k] = _CODES[outcome]

    def fire(i: int, j: int) -> None:
        for k in range(i, j):
            task = loop.create_task(one(k))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if j >= len(plan.offsets):
            all_fired.set()

    ticker = _Ticker(loop, t0, plan.offsets, fire, stop)
    ticker.start()
    while not all_fired.is_set() and not stop.is_set() and len(plan.offsets):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_fired.wait(), 0.05)
    ticker.join()
    await _drain(tasks, stop, rec, t0)
    return rec


async def _drain(tasks: set[asyncio.Task[None]], stop: Any, rec: Records, t0: float) -> None:
    """Wait for requests in flight; after a stop, give them STOP_GRACE_S and then cancel."""
    grace_end: float | None = None
    while tasks:
        if stop.is_set() and grace_end is None:
            rec.stopped_at = max(0.0, time.monotonic() - t0)
            grace_end = time.monotonic() + STOP_GRACE_S
        if grace_end is not None and time.monotonic() > grace_end:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            break
        await asyncio.wait(tasks, timeout=0.05)
    if stop.is_set() and rec.stopped_at is None:
        rec.stopped_at = max(0.0, time.monotonic() - t0)


async def _closed_loop(
    client: Client, plan: ClosedPlan, payloads: list[Payload], t0: float, stop: Any
) -> Records:
    rows: list[tuple[float, float, int]] = []

    async def user(u: int) -> None:
        k = u
        while not stop.is_set() and (sent := time.monotonic() - t0) < plan.duration_s:
            outcome = await _safe_infer(client, payloads[k % len(payloads)])
            rows.append((sent, time.monotonic() - t0, _CODES[outcome]))
            k += plan.concurrency

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    await asyncio.gather(*(user(u) for u in range(plan.concurrency)))
    arr = np.array(rows, dtype=np.float64).reshape(-1, 3)
    rec = Records(arr[:, 0].copy(), arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].astype(np.int8))
    if stop.is_set():
        rec.stopped_at = float(np.nanmax(arr[:, 1])) if len(arr) else 0.0
    return rec


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop when installed (less client time per request), else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def _run_plan(
    make_client: ClientFactory,
    plan: OpenPlan | ClosedPlan,
    payloads: list[Payload],
    t0_source: Callable[[], float],
    stop: Any,
    connections: int,
) -> Records:
    client = make_client()
    try:
        connect = getattr(client, "connect", None)
        if connect is not None and connections > 0:
            await connect(connections)
        t0 = t0_source()
        if isinstance(plan, OpenPlan):
            rec = await _open_loop(client, plan, payloads, t0, stop)
        else:
            rec = await _closed_loop(client, plan, payloads, t0, stop)
        rec.error_samples = dict(getattr(client, "error_samples", {}))
        return rec
    finally:
        await client.aclose()


def _run_here(
    make_client: ClientFactory,
    plan: OpenPlan | ClosedPlan,
    payloads: list[Payload],
    t0_source: Callable[[], float],
    stop: Any,
    connections: int,
) -> Records:
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner, _no_gc_pauses():
        return runner.run(_run_plan(make_client, plan, payloads, t0_source, stop, connections))


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """No cyclic garbage collection while requests are in flight: a full collection stops the
    event loop for milliseconds, which would show up as client-side latency in the tail. Objects
    alive at the start are frozen out of later collections; one collection runs at the end. A
    request's objects are freed by reference counting, so memory stays flat meanwhile."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
        gc.collect()


def _worker(
    conn: Any,
    make_client: ClientFactory,
    plan: OpenPlan | ClosedPlan,
    payloads: list[Payload],
    stop: Any,
    connections: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns Ctrl-C into `stop`

    def wait_for_t0() -> float:
        conn.send("ready")
        return float(conn.recv())

    try:
        conn.send(_run_here(make_client, plan, payloads, wait_for_t0, stop, connections))
    except BaseException as err:  # reported to the parent, which raises it loudly
        conn.send(err if isinstance(err, Exception) else RuntimeError(repr(err)))
    finally:
        conn.close()


def execute(
    make_client: ClientFactory,
    plan: OpenPlan | ClosedPlan,
    payloads: list[Payload],
    processes: int = 1,
    stop: Any = None,
    connections: int = 4,
) -> Records:
    """Run ``plan`` in this process, or split over ``processes`` worker processes."""
    if processes <= 1:
        flag = stop if stop is not None else threading.Event()
        return _run_here(
            make_client,
            plan,
            payloads,
            lambda: time.monotonic() + START_MARGIN_S,
            flag,
            connections,
        )
    return _execute_spread(make_client, plan, payloads, processes, stop, connections)


def _execute_spread(
    make_client: ClientFactory,
    plan: OpenPlan | ClosedPlan,
    payloads: list[Payload],
    processes: int,
    stop: Any,
    connections: int,
) -> Records:
    ctx = mp.get_context("spawn")
    flag = ctx.Event()
    pipes, procs = [], []
    per_worker = max(1, connections // processes)
    for w in range(processes):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker,
            args=(child, make_client, plan.part(w, processes), payloads, flag, per_worker),
            daemon=True,
        )
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        parts = _gather_workers(pipes, flag, stop)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if isinstance(plan, OpenPlan):
        n = len(plan.offsets)
        return Records.merge(parts, [np.arange(n)[w::processes] for w in range(processes)])
    return Records.merge(parts)


def _gather_workers(pipes: list[Any], flag: Any, stop: Any) -> list[Records]:
    for pipe in pipes:
        msg = _recv(pipe, flag, stop)
        if msg != "ready":
            raise _worker_error(msg)
    t0 = time.monotonic() + START_MARGIN_S
    for pipe in pipes:
        pipe.send(t0)
    parts = []
    for pipe in pipes:
        msg = _recv(pipe, flag, stop)
        if not isinstance(msg, Records):
            raise _worker_error(msg)
        parts.append(msg)
    return parts


def _recv(pipe: Any, flag: Any, stop: Any) -> Any:
    """Receive from a worker, passing a stop request on to all workers meanwhile."""
    while not pipe.poll(0.05):
        if stop is not None and stop.is_set():
            flag.set()
    try:
        return pipe.recv()
    except EOFError:
        return "the process exited without a result"


def _worker_error(msg: Any) -> Exception:
    if isinstance(msg, LoadTestError):
        return msg
    return LoadTestError(f"a load generator process failed: {msg!r}; rerun with --processes 1")


def auto_processes(rate: float, per_process_rate: float) -> int:
    """Worker processes needed for ``rate``, within the machine's cores."""
    return max(1, min(os.cpu_count() or 1, int(np.ceil(rate / per_process_rate))))
