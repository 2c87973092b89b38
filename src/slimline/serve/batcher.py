"""Dynamic batching: a small asyncio queue class with no HTTP in it.

``await batcher.submit(inputs)`` queues one request (its own batch dimension may be above 1) and
returns that request's slice of the model's outputs. A collector task forms a batch whenever an
instance is free: it takes the oldest request and every later request with the same trailing
shapes, in order, up to ``max_batch_size`` rows, waiting at most ``max_queue_delay_ms`` after the
oldest request arrived (with ``adaptive_delay``, the default, only while requests arrive at
least once per window on average: at low load a lone request runs at once). The batch runs in a thread pool of ``instances`` threads (ONNX Runtime
releases the GIL), so up to ``instances`` batches run at once and the event loop stays free.

Queue policy: a full queue rejects at once (:class:`QueueFull`); each request has a deadline,
and a timer answers it with :class:`DeadlineExceeded` on time. A request that has not started is
only marked as done, in O(1); the collector drops it when it reaches it, so it never runs. Every
request has its own future; an exception in a batch reaches every request in it; the model must
return one result row per input row. If the collector itself dies (a bug), every queued and later
request gets :class:`BatcherStopped` at once and :attr:`DynamicBatcher.failure` says why, so the
server can report itself unhealthy instead of timing every request out.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import Field

from ..errors import (
    BatcherError,
    BatcherStopped,
    DeadlineExceeded,
    InferenceFailed,
    InvalidRequest,
    QueueFull,
    ShuttingDown,
)
from ..recipe import Config

__all__ = [
    "BatcherConfig",
    "BatcherError",
    "BatcherObserver",
    "BatcherStopped",
    "DeadlineExceeded",
    "DynamicBatcher",
    "InferenceFailed",
    "InvalidRequest",
    "QueueFull",
    "ShuttingDown",
]

Tensors = dict[str, np.ndarray]
log = logging.getLogger(__name__)


class BatcherConfig(Config):
    max_batch_size: int = Field(8, ge=1, le=4096, description="rows per batch, all requests")
    max_queue_delay_ms: float = Field(2.0, ge=0.0, le=60_000.0)
    max_queue_size: int = Field(256, ge=1, le=1_000_000, description="queued requests")
    timeout_ms: float = Field(1000.0, gt=0.0, le=3_600_000.0, description="default deadline")
    instances: int = Field(1, ge=1, le=64, description="batches running at once")
    adaptive_delay: bool = Field(
        True, description="wait for company only when requests arrive faster than the window"
    )


class BatcherObserver(Protocol):
    """Receives the batcher's events (the server turns them into Prometheus metrics)."""

    def queue_depth(self, depth: int) -> None: ...

    def batch_done(self, rows: int, queue_s: list[float], compute_s: float) -> None: ...


class _NullObserver:
    def queue_depth(self, depth: int) -> None:
        pass

    def batch_done(self, rows: int, queue_s: list[float], compute_s: float) -> None:
        pass


class _State(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3


@dataclass(eq=False)
class _Pending:
    inputs: Tensors
    rows: int
    key: Hashable
    future: asyncio.Future[Tensors]
    enqueued: float
    state: _State = _State.QUEUED
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class DynamicBatcher:
    """Batches concurrent requests for ``run(inputs) -> outputs`` (batch on axis 0).

    ``stack=False`` is for models whose inputs have a fixed leading size: every request then
    runs alone and ``max_batch_size`` is only the row count each request must not exceed.
    """

    def __init__(
        self,
        run: Callable[[Tensors], Tensors],
        config: BatcherConfig,
        *,
        stack: bool = True,
        observer: BatcherObserver | None = None,
        name: str = "model",
    ) -> None:
        self._run = run
        self.config = config
        self.stack = stack
        self.name = name
        self._observer = observer or _NullObserver()
        self._queue: deque[_Pending] = deque()  # may hold finished entries, skipped lazily
        self._queued = 0  # entries of _queue still QUEUED
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(config.instances)
        self._pool = ThreadPoolExecutor(config.instances, thread_name_prefix=f"infer-{name}")
        self._tasks: set[asyncio.Task[None]] = set()
        self._collector: asyncio.Task[None] | None = None
        self._closing = False
        self.failure: str | None = None  # why the collector died, if it did
        self._gap = math.inf  # moving mean of the time between arrivals (s); inf: none seen yet
        self._last_arrival: float | None = None

    # -- public surface -------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self._queued

    @property
    def closing(self) -> bool:
        return self._closing

    def check_admission(self) -> None:
        """Raise now what :meth:`submit` would raise for a full queue or a closing batcher,
        so a server can turn a request away before it spends time decoding it."""
        if self.failure is not None:
            raise BatcherStopped(self._stopped_message())
        if self._closing:
            raise ShuttingDown(f"model {self.name} is shutting down; retry on another replica")
        if self._queued >= self.config.max_queue_size:
            raise QueueFull(
                f"model {self.name}: queue full ({self.config.max_queue_size} requests); "
                "retry later"
            )

    def batch_sizes(self) -> list[int]:
        """The batch sizes (in rows) to warm up: powers of two up to the largest, and the largest.

        ONNX Runtime's first run at a shape pays for allocations; the powers of two cover the
        arena's growth steps without running every size up to ``max_batch_size`` (up to 4096).
        """
        largest = self.config.max_batch_size
        if not self.stack:
            return [largest]
        return sorted({*(1 << i for i in range(largest.bit_length())), largest})

    def start(self) -> None:
        """Start the collector on the running event loop (idempotent)."""
        if self._collector is None:
            self._collector = asyncio.get_running_loop().create_task(self._collect())
            self._collector.add_done_callback(self._collector_ended)

    def _collector_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()  # a bug: say so loudly, answer everyone, refuse new requests
        self.failure = f"{type(err).__name__}: {err}"
        log.error("batcher of %s stopped", self.name, exc_info=err)
        self._fail_queued(BatcherStopped(self._stopped_message()))

    def _stopped_message(self) -> str:
        return (
            f"model {self.name}: the batcher stopped ({self.failure}); the server is unhealthy "
            "and must be restarted"
        )

    async def submit(self, inputs: Tensors, timeout_s: float | None = None) -> Tensors:
        """Queue one request and wait for its outputs; raises a :class:`BatcherError`."""
        rows, key = self._shape_key(inputs)
        self.check_admission()
        self.start()
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._note_arrival(now)
        pending = _Pending(inputs, rows, key, loop.create_future(), now)
        timeout = self.config.timeout_ms / 1000.0 if timeout_s is None else timeout_s
        pending.timer = loop.call_at(now + timeout, self._expire, pending)
        self._queue.append(pending)
        self._queued += 1
        self._observer.queue_depth(self._queued)
        self._arrived.set()
        try:
            return await pending.future
        except asyncio.CancelledError:  # the caller went away: never run it if not started
            self._forget(pending)
            raise

    def _note_arrival(self, now: float) -> None:
        """Update the moving mean gap between arrivals (each gap capped at 1 s, so an idle
        spell is forgotten within a few dozen requests of a burst)."""
        if self._last_arrival is not None:
            gap = min(now - self._last_arrival, 1.0)
            self._gap = gap if math.isinf(self._gap) else 0.8 * self._gap + 0.2 * gap
        self._last_arrival = now

    def waits_for_company(self) -> bool:
        """Whether a lone request waits up to ``max_queue_delay_ms`` for others to join it:
        always with a fixed window; with ``adaptive_delay`` only when requests arrive at least
        once per window on average (at low load the wait would hold it for nothing)."""
        return not self.config.adaptive_delay or self._gap < self.config.max_queue_delay_ms / 1e3

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; with ``drain`` answer every queued one first."""
        self._closing = True
        if not drain:
            self._fail_queued(ShuttingDown(f"model {self.name} shut down"))
        self._arrived.set()
        if self._collector is not None:
            await asyncio.gather(self._collector, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)

    # -- request bookkeeping --------------------------------------------------------------
    def _shape_key(self, inputs: Tensors) -> tuple[int, Hashable]:
        if not inputs:
            raise InvalidRequest(f"model {self.name}: a request needs at least one input")
        key = tuple((k, v.dtype, v.shape[1:]) for k, v in sorted(inputs.items()))
        if not self.stack:
            return 1, key
        leading = {v.shape[0] if v.ndim else -1 for v in inputs.values()}
        if len(leading) != 1 or -1 in leading:
            raise InvalidRequest(
                f"model {self.name}: inputs disagree on the batch dimension {sorted(leading)}; "
                "send every input with the same leading size"
            )
        rows = leading.pop()
        if not 1 <= rows <= self.config.max_batch_size:
            raise InvalidRequest(
                f"model {self.name}: a request has batch size {rows}; send between 1 and "
                f"max_batch_size={self.config.max_batch_size} rows, or split the request"
            )
        return rows, key

    def _expire(self, p: _Pending) -> None:
        if p.future.done():
            return
        ran = p.state is _State.RUNNING
        self._drop(p)
        where = "while running" if ran else "in the queue"
        p.future.set_exception(
            DeadlineExceeded(f"model {self.name}: deadline passed {where}", ran=ran)
        )

    def _forget(self, p: _Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
        self._drop(p)

    def _drop(self, p: _Pending) -> None:
        """Mark ``p`` done in O(1); a queued entry stays in the deque until the collector or a
        compaction skips it (it never runs)."""
        if p.state is _State.QUEUED:
            self._queued -= 1
            self._observer.queue_depth(self._queued)
            self._arrived.set()
        p.state = _State.DONE
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        # Rebuilding only when finished entries outnumber queued ones keeps each removal
        # amortised O(1) and the deque's dead weight (and the inputs it holds) bounded.
        if len(self._queue) > 2 * self._queued + 64:
            self._queue = deque(q for q in self._queue if q.state is _State.QUEUED)

    def _fail_queued(self, error: BatcherError) -> None:
        while self._queue:
            p = self._queue.popleft()
            if p.state is _State.QUEUED:
                self._finish(p, error=error)
        self._queued = 0
        self._observer.queue_depth(0)

    def _finish(
        self, p: _Pending, result: Tensors | None = None, error: BaseException | None = None
    ) -> None:
        if p.timer is not None:
            p.timer.cancel()
        if p.state is _State.QUEUED:
            self._queued -= 1
        p.state = _State.DONE
        if p.future.done():
            return
        if error is not None:
            p.future.set_exception(error)
        else:
            assert result is not None
            p.future.set_result(result)

    # -- batch formation ------------------------------------------------------------------
    async def _collect(self) -> None:
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            task = asyncio.get_running_loop().create_task(self._dispatch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _next_batch(self) -> list[_Pending] | None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queued:
                if self._closing:
                    return None
                self._arrived.clear()
                await self._arrived.wait()
            first = self._oldest()
            delay = self.config.max_queue_delay_ms / 1000.0 if self.waits_for_company() else 0.0
            fill_by = first.enqueued + delay
            while first.state is _State.QUEUED and not self._full(first):
                wait = fill_by - loop.time()
                if wait <= 0 or self._closing:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), wait)
            if first.state is _State.QUEUED:
                return self._take(self._select(first)[0])

    def _oldest(self) -> _Pending:
        """The oldest queued request; finished entries ahead of it are dropped on the way."""
        while self._queue[0].state is not _State.QUEUED:
            self._queue.popleft()
        return self._queue[0]

    def _full(self, first: _Pending) -> bool:
        return not self.stack or self._select(first)[1] >= self.config.max_batch_size

    def _select(self, first: _Pending) -> tuple[list[_Pending], int]:
        """The oldest requests sharing ``first``'s shapes, in order, that fit in one batch."""
        chosen: list[_Pending] = []
        rows = 0
        for p in self._queue:
            if p.state is not _State.QUEUED or p.key != first.key:
                continue
            if rows + p.rows > self.config.max_batch_size:
                break
            chosen.append(p)
            rows += p.rows
            if not self.stack or rows == self.config.max_batch_size:
                break
        return chosen, rows

    def _take(self, chosen: list[_Pending]) -> list[_Pending]:
        for p in chosen:  # left in the deque as RUNNING: skipped and popped lazily
            p.state = _State.RUNNING
        self._queued -= len(chosen)
        while self._queue and self._queue[0].state is not _State.QUEUED:
            self._queue.popleft()
        self._compact_if_sparse()
        self._observer.queue_depth(self._queued)
        return chosen

    # -- batch execution ------------------------------------------------------------------
    async def _dispatch(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        queue_s = [started - p.enqueued for p in batch]
        rows = sum(p.rows for p in batch)
        try:
            parts = await loop.run_in_executor(
                self._pool, self._compute, [p.inputs for p in batch], [p.rows for p in batch]
            )
        except Exception as err:  # every waiter gets its own error carrying the cause
            for p in batch:
                failure = InferenceFailed(f"model {self.name} failed on a batch of {rows}: {err}")
                failure.__cause__ = err
                self._finish(p, error=failure)
        else:
            for p, out in zip(batch, parts, strict=True):
                self._finish(p, result=out)
        finally:
            self._slots.release()
            self._observer.batch_done(rows, queue_s, loop.time() - started)

    def _compute(self, inputs: list[Tensors], rows: list[int]) -> list[Tensors]:
        """Runs in a pool thread: concatenate, run, check one result per row, split back."""
        if len(inputs) == 1:
            merged = inputs[0]
        else:
            merged = {k: np.concatenate([i[k] for i in inputs]) for k in inputs[0]}
        out = self._run(merged)
        if not self.stack:
            return [out]
        total = sum(rows)
        for name, arr in out.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                got = arr.shape[0] if arr.ndim else "a scalar"
                raise InferenceFailed(
                    f"output {name!r} has {got} rows for {total} input rows; a batched model "
                    "must return one result per input row"
                )
        bounds = np.cumsum([0, *rows])
        return [{k: v[a:b] for k, v in out.items()} for a, b in itertools.pairwise(bounds)]
