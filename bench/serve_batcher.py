"""The dynamic batcher alone, measured: rejection latency of a full queue, lateness of deadlines
that pass while a long batch runs, the cost of one expiry at growing queue depths, and exact
splitting of many mixed-size requests.

    nice -n 10 .venv/bin/python bench/serve_batcher.py
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from typing import Any

import numpy as np

from serve_common import save_json, write_section
from slimline.serve.batcher import BatcherConfig, DeadlineExceeded, DynamicBatcher, QueueFull


class Model:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sizes: list[int] = []
        self.seen: set[float] = set()
        self.lock = threading.Lock()

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        with self.lock:
            self.sizes.append(len(x))
            self.seen.update(x[:, 0].tolist())
        time.sleep(self.delay_s)
        return {"y": x * 3.0}


async def rejection(n: int) -> list[float]:
    b = DynamicBatcher(Model(2.0), BatcherConfig(max_batch_size=1, max_queue_size=8))
    running = [asyncio.create_task(b.submit({"x": np.zeros((1, 4), np.float32)}))]
    await asyncio.sleep(0.05)
    running += [
        asyncio.create_task(b.submit({"x": np.zeros((1, 4), np.float32)})) for _ in range(8)
    ]
    await asyncio.sleep(0.01)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            await b.submit({"x": np.zeros((1, 4), np.float32)})
        except QueueFull:
            times.append(time.perf_counter() - t0)
    await b.close(drain=False)
    await asyncio.gather(*running, return_exceptions=True)
    return times


async def lateness(n: int) -> tuple[list[float], bool]:
    model = Model(3.0)
    b = DynamicBatcher(model, BatcherConfig(max_batch_size=1, max_queue_size=n + 1, timeout_ms=60_000,
                                            max_queue_delay_ms=0))  # fmt: skip
    long = asyncio.create_task(b.submit({"x": np.full((1, 4), -1.0, np.float32)}))
    await asyncio.sleep(0.05)
    rng = random.Random(0)

    async def one(i: int) -> float:
        deadline = rng.uniform(0.02, 2.0)
        t0 = time.perf_counter()
        try:
            await b.submit({"x": np.full((1, 4), float(i), np.float32)}, timeout_s=deadline)
        except DeadlineExceeded:
            return time.perf_counter() - t0 - deadline
        raise AssertionError("a queued request ran")

    late = await asyncio.gather(*(one(i) for i in range(n)))
    await long
    await b.close()
    return list(late), model.seen == {-1.0}


async def expiry_cost(depth: int) -> float:
    """Microseconds of event-loop time per expired request, with ``depth`` long-lived requests
    queued ahead of ``depth`` requests whose deadlines pass together (the worst case for a
    removal that searches the queue)."""
    gate = threading.Event()  # the one running batch holds the instance until measured

    def held(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        gate.wait()
        return inputs

    b = DynamicBatcher(held, BatcherConfig(max_batch_size=1, max_queue_size=2 * depth + 1,
                                           timeout_ms=600_000, max_queue_delay_ms=0))  # fmt: skip
    x = {"x": np.zeros((1, 4), np.float32)}
    tasks = [asyncio.create_task(b.submit(x))]  # holds the only instance
    await asyncio.sleep(0.05)
    tasks += [asyncio.create_task(b.submit(x)) for _ in range(depth)]
    doomed = [asyncio.create_task(b.submit(x, timeout_s=0.5)) for _ in range(depth)]
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)  # every submit has run and set its timer by now
    deadline = loop.time() + 0.5  # a bound on the last timer's due time
    await asyncio.gather(*doomed, return_exceptions=True)
    spent = loop.time() - deadline  # from the deadlines until every request was answered
    assert b.depth == depth, "the long-lived requests must still be queued"
    gate.set()
    await b.close(drain=False)
    await asyncio.gather(*tasks, return_exceptions=True)
    return spent / depth * 1e6


async def splitting(n: int) -> dict[str, Any]:
    model = Model(0.001)
    b = DynamicBatcher(model, BatcherConfig(max_batch_size=16, max_queue_size=n, timeout_ms=600_000,
                                            max_queue_delay_ms=1, instances=2))  # fmt: skip
    rng = random.Random(1)
    sizes = [rng.randint(1, 8) for _ in range(n)]
    outs = await asyncio.gather(
        *(b.submit({"x": np.full((s, 4), float(i), np.float32)}) for i, s in enumerate(sizes))
    )
    await b.close()
    wrong = sum(
        1 for i, (s, o) in enumerate(zip(sizes, outs, strict=True))
        if o["y"].shape != (s, 4) or not np.all(o["y"] == 3.0 * i)
    )  # fmt: skip
    return {"requests": n, "rows": sum(sizes), "wrong": wrong, "batches": len(model.sizes),
            "max_batch": max(model.sizes), "mean_batch": float(np.mean(model.sizes))}  # fmt: skip


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3)


DEPTHS = (1_000, 10_000, 40_000)


def main() -> None:
    rej = asyncio.run(rejection(2000))
    late, never_ran = asyncio.run(lateness(200))
    split = asyncio.run(splitting(10_000))
    expiry = {d: statistics.median(asyncio.run(expiry_cost(d)) for _ in range(3)) for d in DEPTHS}
    doc: dict[str, Any] = {"reject_ms": {"p50": ms(rej, 50), "p99": ms(rej, 99), "max": ms(rej, 100)},
           "late_ms": {"p50": ms(late, 50), "p99": ms(late, 99), "max": ms(late, 100),
                       "min": ms(late, 0)},
           "expired_never_ran": never_ran, "split": split,
           "expiry_us_per_request": expiry}  # fmt: skip
    save_json("batcher", doc)
    r, lt = doc["reject_ms"], doc["late_ms"]
    md = (
        "## The batcher alone\n\n"
        "| measure | value |\n|---|---|\n"
        f"| full queue: time to reject (2,000 tries) | p50 {r['p50']:.3f} ms, p99 {r['p99']:.3f} "
        f"ms, max **{r['max']:.3f} ms** |\n"
        f"| deadline while a 3 s batch runs: answer time minus deadline (200 requests, "
        f"deadlines 20 ms..2 s) | min {lt['min']:.2f}, p50 {lt['p50']:.2f}, p99 {lt['p99']:.2f}, "
        f"max **{lt['max']:.2f} ms** |\n"
        f"| expired requests that ran anyway | {'none' if never_ran else 'SOME'} |\n"
        f"| event-loop time per expired request, N queued ahead of N expiring together (median "
        f"of 3; includes waking each caller and Python's garbage collector) | "
        + ", ".join(f"N={d:,}: {us:.1f} µs" for d, us in expiry.items())
        + " |\n"
        f"| 10,000 requests of 1-8 rows, max batch 16, 2 instances | {split['wrong']} wrong "
        f"outputs; {split['batches']} batches, mean {split['mean_batch']:.1f} rows, max "
        f"{split['max_batch']} |\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_batcher.py`"
    )
    write_section("batcher", md)
    print(md)


if __name__ == "__main__":
    main()
