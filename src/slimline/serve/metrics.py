"""Prometheus metrics for one server, in a registry of its own (one per app, so tests and
several apps in one process never collide).

=====================================  =========  ==============================================
metric                                 type       labels / meaning
=====================================  =========  ==============================================
``slimline_requests_total``            counter    model, outcome (ok, rejected, timeout,
                                                  bad_request, error)
``slimline_request_duration_seconds``  histogram  model; end to end, requests answered 200
``slimline_queue_duration_seconds``    histogram  model; enqueue to batch start
``slimline_compute_duration_seconds``  histogram  model; one batch in the model
``slimline_batch_size``                histogram  model; rows per batch
``slimline_queue_depth``               gauge      model; requests waiting
``slimline_inflight_requests``         gauge      model; requests inside the server
``process_resident_memory_bytes``      gauge      process RSS (prometheus-client's process
                                                  collector; also CPU seconds, open fds)
=====================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

__all__ = ["OUTCOMES", "ModelObserver", "ServeMetrics"]

OUTCOMES = ("ok", "rejected", "timeout", "bad_request", "error")
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip


class ServeMetrics:
    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "slimline_requests", "Inference requests by outcome", ["model", "outcome"], registry=r
        )
        self.latency = Histogram(
            "slimline_request_duration_seconds", "End-to-end latency of successful requests",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "slimline_queue_duration_seconds", "Time from enqueue to batch start",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute = Histogram(
            "slimline_compute_duration_seconds", "Model time of one batch",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch = Histogram(
            "slimline_batch_size", "Rows per batch", ["model"],
            buckets=_batch_buckets(max_batch_size), registry=r,
        )  # fmt: skip
        self.depth = Gauge("slimline_queue_depth", "Requests waiting", ["model"], registry=r)
        self.inflight = Gauge(
            "slimline_inflight_requests", "Requests inside the server", ["model"], registry=r
        )
        ProcessCollector(registry=r)

    def add_model(self, model: str) -> ModelObserver:
        """Create every label child at zero (so rates exist from the start) and an observer."""
        for outcome in OUTCOMES:
            self.requests.labels(model, outcome)
        self.depth.labels(model).set(0)
        self.inflight.labels(model).set(0)
        return ModelObserver(self, model)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Level:
    """A level changed on the event loop and read by its gauge when scraped: a plain int, so a
    change costs no lock (a gauge's ``inc``/``set`` takes one, per request)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class ModelObserver:
    """One model's series: the batcher's observer (queue depth, batch sizes, queue/compute
    time) and the request-level children, looked up once rather than per request."""

    def __init__(self, metrics: ServeMetrics, model: str) -> None:
        self.inflight = _gauged(metrics.inflight, model)
        self.latency = metrics.latency.labels(model)
        self.requests = {o: metrics.requests.labels(model, o) for o in OUTCOMES}
        self._depth = _gauged(metrics.depth, model)
        self._batch = metrics.batch.labels(model)
        self._queue = metrics.queue.labels(model)
        self._compute = metrics.compute.labels(model)

    def queue_depth(self, depth: int) -> None:
        self._depth.value = depth

    def batch_done(self, rows: int, queue_s: list[float], compute_s: float) -> None:
        self._batch.observe(rows)
        self._compute.observe(compute_s)
        for q in queue_s:
            self._queue.observe(q)


def _gauged(gauge: Gauge, model: str) -> Level:
    level = Level()
    gauge.labels(model).set_function(lambda: level.value)
    return level


def _batch_buckets(max_batch_size: int) -> tuple[float, ...]:
    sizes = {1, max_batch_size}
    b = 2
    while b < max_batch_size:
        sizes.add(b)
        b *= 2
    return tuple(float(s) for s in sorted(sizes))
