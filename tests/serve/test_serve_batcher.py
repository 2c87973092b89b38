"""The dynamic batcher alone: batching, splitting, queue policy, deadlines, errors, drain."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from slimline.serve.batcher import (
    BatcherConfig,
    BatcherStopped,
    DeadlineExceeded,
    DynamicBatcher,
    InferenceFailed,
    InvalidRequest,
    QueueFull,
    ShuttingDown,
)

Tensors = dict[str, np.ndarray]


class Recorder:
    """A model that doubles ``x``, returns its row sums, and records every batch it ran."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False, drop_row: bool = False) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.drop_row = drop_row
        self.batches: list[np.ndarray] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        with self._lock:
            self.batches.append(x.copy())
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.fail:
                raise RuntimeError("kernel exploded")
            out = {"y": x * 2.0, "s": x.sum(axis=1)}
            if self.drop_row:
                out["y"] = out["y"][:-1]
            return out
        finally:
            with self._lock:
                self.active -= 1

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(coro_fn())


def request(rows: int, tag: float, width: int = 3) -> Tensors:
    return {"x": np.full((rows, width), tag, dtype=np.float32)}


def config(**kw: Any) -> BatcherConfig:
    base: dict[str, Any] = {"max_batch_size": 8, "max_queue_delay_ms": 5.0, "timeout_ms": 5000.0}
    base.update(kw)
    return BatcherConfig(**base)


def test_mixed_request_sizes_are_split_back_exactly_and_never_exceed_max() -> None:
    model = Recorder(delay_s=0.002)
    rng = random.Random(0)
    sizes = [rng.randint(1, 5) for _ in range(300)]

    async def main() -> list[Tensors]:
        b = DynamicBatcher(model, config(max_batch_size=8, max_queue_size=1000, instances=2))
        outs = await asyncio.gather(*(b.submit(request(n, float(i))) for i, n in enumerate(sizes)))
        await b.close()
        return outs

    outs = run(main)
    for i, (n, out) in enumerate(zip(sizes, outs, strict=True)):
        np.testing.assert_array_equal(out["y"], np.full((n, 3), 2.0 * i, dtype=np.float32))
        np.testing.assert_array_equal(out["s"], np.full(n, 3.0 * i, dtype=np.float32))
    assert max(model.sizes) <= 8
    assert sum(model.sizes) == sum(sizes)
    assert len(model.batches) < len(sizes) / 2  # requests really were batched together
    # every batch holds whole requests: each tag appears with exactly its request's row count
    for batch in model.batches:
        tags, counts = np.unique(batch[:, 0], return_counts=True)
        for tag, count in zip(tags, counts, strict=True):
            assert sizes[int(tag)] == count


def test_requests_with_different_trailing_shapes_never_share_a_batch() -> None:
    model = Recorder()

    async def main() -> None:
        b = DynamicBatcher(model, config(max_queue_delay_ms=20.0))
        await asyncio.gather(*(b.submit(request(1, float(i), width=3 + i % 2)) for i in range(10)))
        await b.close()

    run(main)
    assert sorted(b.shape[1] for b in model.batches) == [3, 4]
    assert sorted(model.sizes) == [5, 5]


def test_full_queue_rejects_at_once() -> None:
    model = Recorder(delay_s=0.3)

    async def main() -> float:
        b = DynamicBatcher(model, config(max_batch_size=1, max_queue_size=4))
        tasks = [asyncio.create_task(b.submit(request(1, 0.0)))]
        await asyncio.sleep(0.05)  # that one runs; four more wait
        tasks += [asyncio.create_task(b.submit(request(1, float(i)))) for i in range(1, 5)]
        await asyncio.sleep(0.01)
        assert b.depth == 4
        t0 = time.perf_counter()
        with pytest.raises(QueueFull):
            await b.submit(request(1, 99.0))
        elapsed = time.perf_counter() - t0
        with pytest.raises(QueueFull):
            b.check_admission()  # what a server asks before decoding a request
        await b.close()
        await asyncio.gather(*tasks)
        return elapsed

    assert run(main) < 0.005


def test_queued_request_times_out_on_time_while_a_long_batch_runs_and_never_runs() -> None:
    model = Recorder(delay_s=0.6)

    async def main() -> float:
        b = DynamicBatcher(model, config(max_batch_size=1, max_queue_delay_ms=0.0))
        long = asyncio.create_task(b.submit(request(1, 1.0)))
        await asyncio.sleep(0.05)  # the long batch is running in the pool
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded) as info:
            await b.submit(request(1, 2.0), timeout_s=0.1)
        late = time.perf_counter() - t0 - 0.1
        assert info.value.ran is False
        assert b.depth == 0
        await long
        await b.close()
        return late

    late = run(main)
    assert 0.0 <= late < 0.010
    assert [float(x[0, 0]) for x in model.batches] == [1.0]  # the expired request never ran


def test_max_queue_delay_bounds_the_wait_for_a_batch_to_fill() -> None:
    model = Recorder()

    async def main() -> tuple[float, float]:
        cfg = config(max_batch_size=4, max_queue_delay_ms=60.0, adaptive_delay=False)
        b = DynamicBatcher(model, cfg)
        t0 = time.perf_counter()
        await b.submit(request(1, 0.0))  # alone: waits the full (fixed) delay, then runs
        lone = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(b.submit(request(1, 1.0)) for _ in range(4)))  # fills at once
        full = time.perf_counter() - t0
        await b.close()
        return lone, full

    lone, full = run(main)
    assert 0.055 <= lone < 0.5
    assert full < 0.05
    assert model.sizes == [1, 4]


def test_an_exception_in_a_batch_reaches_every_request_in_it() -> None:
    model = Recorder(fail=True)

    async def main() -> list[Any]:
        b = DynamicBatcher(model, config(max_queue_delay_ms=30.0))
        res = await asyncio.gather(
            *(b.submit(request(2, float(i))) for i in range(4)), return_exceptions=True
        )
        await b.close()
        return res

    results = run(main)
    assert model.sizes == [8]
    assert all(isinstance(r, InferenceFailed) for r in results)
    assert all("kernel exploded" in str(r) for r in results)


def test_model_returning_the_wrong_number_of_rows_fails_every_request() -> None:
    model = Recorder(drop_row=True)

    async def main() -> list[Any]:
        b = DynamicBatcher(model, config(max_queue_delay_ms=30.0))
        res = await asyncio.gather(
            *(b.submit(request(1, float(i))) for i in range(3)), return_exceptions=True
        )
        await b.close()
        return res

    results = run(main)
    assert all(isinstance(r, InferenceFailed) for r in results)
    assert "one result per input row" in str(results[0])


def test_instances_run_batches_concurrently() -> None:
    model = Recorder(delay_s=0.2)

    async def main() -> float:
        b = DynamicBatcher(model, config(max_batch_size=2, max_queue_delay_ms=0.0, instances=2))
        t0 = time.perf_counter()
        await asyncio.gather(*(b.submit(request(2, float(i))) for i in range(2)))
        elapsed = time.perf_counter() - t0
        await b.close()
        return elapsed

    elapsed = run(main)
    assert model.max_active == 2
    assert elapsed < 0.38


def test_oversized_and_inconsistent_requests_are_rejected() -> None:
    async def main() -> None:
        b = DynamicBatcher(Recorder(), config(max_batch_size=4))
        with pytest.raises(InvalidRequest, match="batch size 5"):
            await b.submit(request(5, 0.0))
        bad = {"x": np.zeros((2, 3), np.float32), "z": np.zeros((3, 3), np.float32)}
        with pytest.raises(InvalidRequest, match="same leading size"):
            await b.submit(bad)
        await b.close()

    run(main)


def test_close_drains_every_queued_request_then_refuses_new_ones() -> None:
    model = Recorder(delay_s=0.02)

    async def main() -> None:
        b = DynamicBatcher(model, config(max_batch_size=2, max_queue_size=100))
        tasks = [asyncio.create_task(b.submit(request(1, float(i)))) for i in range(20)]
        await asyncio.sleep(0)
        await b.close(drain=True)
        outs = [t.result() for t in tasks]  # all done, none failed
        assert [float(o["y"][0, 0]) for o in outs] == [2.0 * i for i in range(20)]
        with pytest.raises(ShuttingDown):
            await b.submit(request(1, 0.0))

    run(main)
    assert sum(model.sizes) == 20


def test_a_cancelled_queued_request_never_runs() -> None:
    model = Recorder(delay_s=0.2)

    async def main() -> None:
        b = DynamicBatcher(model, config(max_batch_size=1, max_queue_delay_ms=0.0))
        first = asyncio.create_task(b.submit(request(1, 1.0)))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(b.submit(request(1, 2.0)))
        await asyncio.sleep(0.02)
        second.cancel()
        await asyncio.sleep(0)
        assert b.depth == 0
        await first
        await b.close()

    run(main)
    assert [float(x[0, 0]) for x in model.batches] == [1.0]


def test_unstacked_model_runs_each_request_alone() -> None:
    model = Recorder()

    async def main() -> None:
        b = DynamicBatcher(model, config(max_batch_size=2, max_queue_delay_ms=20.0), stack=False)
        outs = await asyncio.gather(*(b.submit(request(2, float(i))) for i in range(3)))
        assert [float(o["y"][0, 0]) for o in outs] == [0.0, 2.0, 4.0]
        assert b.batch_sizes() == [2]
        await b.close()

    run(main)
    assert model.sizes == [2, 2, 2]


def test_expired_requests_are_skipped_without_running_and_the_queue_stays_bounded() -> None:
    model = Recorder(delay_s=2.0)  # outlasts the deadlines below, even on a loaded machine

    async def main() -> None:
        cfg = config(max_batch_size=4, max_queue_delay_ms=0.0, max_queue_size=4096)
        b = DynamicBatcher(model, cfg)
        long = asyncio.create_task(b.submit(request(1, 1.0)))
        await asyncio.sleep(0.05)  # the long batch holds the only instance
        kept = asyncio.create_task(b.submit(request(1, 2.0)))
        doomed = [
            asyncio.create_task(b.submit(request(1, 9.0), timeout_s=0.5)) for _ in range(2000)
        ]
        also_kept = asyncio.create_task(b.submit(request(1, 3.0)))
        await asyncio.sleep(0.01)
        assert b.depth == 2002
        outcomes = await asyncio.gather(*doomed, return_exceptions=True)
        assert all(isinstance(o, DeadlineExceeded) and not o.ran for o in outcomes)
        assert b.depth == 2
        assert len(b._queue) <= 2 * 2 + 64 + 1  # finished entries do not pile up
        await asyncio.gather(long, kept, also_kept)
        await b.close()

    run(main)
    assert [x[:, 0].tolist() for x in model.batches] == [[1.0], [2.0, 3.0]]


def test_warm_up_sizes_are_the_powers_of_two_and_the_largest() -> None:
    def sizes(n: int) -> list[int]:
        return DynamicBatcher(Recorder(), config(max_batch_size=n)).batch_sizes()

    assert sizes(1) == [1]
    assert sizes(6) == [1, 2, 4, 6]
    assert sizes(8) == [1, 2, 4, 8]
    assert sizes(4096) == [2**i for i in range(13)]


class _BrokenCollector(DynamicBatcher):
    def _select(self, first: Any) -> Any:
        raise RuntimeError("bug in batch formation")


def test_a_dead_collector_fails_every_request_at_once_and_says_why() -> None:
    model = Recorder()

    async def main() -> None:
        b = _BrokenCollector(model, config(timeout_ms=5000.0))
        t0 = time.perf_counter()
        with pytest.raises(BatcherStopped, match="bug in batch formation"):
            await b.submit(request(1, 1.0))
        assert time.perf_counter() - t0 < 2.0  # not after the 5 s deadline
        assert b.failure == "RuntimeError: bug in batch formation"
        assert b.depth == 0
        with pytest.raises(BatcherStopped, match="must be restarted"):
            b.check_admission()
        with pytest.raises(BatcherStopped):
            await b.submit(request(1, 2.0))
        await b.close()  # closing a batcher with a dead collector does not raise

    run(main)
    assert model.batches == []


def test_an_adaptive_window_runs_a_lone_request_at_once_and_still_batches_a_burst() -> None:
    model = Recorder()

    async def main() -> None:
        b = DynamicBatcher(model, config(max_batch_size=4, max_queue_delay_ms=60_000.0))
        assert b.waits_for_company() is False  # nothing arrived yet: an idle server
        await asyncio.wait_for(b.submit(request(1, 0.0)), 30)  # not held for the 60 s window
        await asyncio.gather(*(b.submit(request(1, 1.0)) for _ in range(4)))  # queued together
        assert b.waits_for_company() is True  # arrivals within the window: wait for company
        await b.close()

    run(main)
    assert model.sizes == [1, 4]
