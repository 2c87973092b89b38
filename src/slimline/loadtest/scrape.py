"""Server-side figures during a load step, read from the server's Prometheus ``/metrics``.

Any v2 server may expose metrics under its own prefix, so families are matched by suffix:
a gauge ending in ``queue_depth`` (sampled during the step: mean and max) and a histogram ending
in ``batch_size`` (its ``_sum``/``_count`` difference over the step: the mean batch size). Samples
carrying a ``model`` label are kept only for the model under test. A server without ``/metrics``
simply yields no figures.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsWatcher", "cascade_figures", "read_metrics"]


def read_metrics(
    url: str, model: str, headers: dict[str, str] | None = None
) -> dict[str, float] | None:
    """``{"queue_depth": .., "batch_size_sum": .., "batch_size_count": ..}`` or ``None``."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers or {}, timeout=2.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return _figures(resp.text, model)
    except ValueError:
        return None


def _mine(labels: dict[str, str], model: str) -> bool:
    return labels.get("model", model) == model


def _figures(text: str, model: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "gauge" and fam.name.endswith("queue_depth"):
            values = [s.value for s in fam.samples if _mine(s.labels, model)]
            if values:
                out["queue_depth"] = float(sum(values))
        elif fam.name.endswith("cascade_rows") or fam.name.endswith("cascade_cloud_failures"):
            _add_labelled(out, fam, model, "route" if "rows" in fam.name else "kind")
        elif fam.type == "histogram" and fam.name.endswith("cascade_tier_duration_seconds"):
            for s in fam.samples:
                if _mine(s.labels, model) and s.name.endswith(("_sum", "_count")):
                    key = f"cascade_{s.labels.get('tier')}_{s.name.rsplit('_', 1)[1]}"
                    out[key] = out.get(key, 0.0) + float(s.value)
        elif fam.type == "histogram" and fam.name.endswith("batch_size"):
            for s in fam.samples:
                if _mine(s.labels, model) and s.name.endswith(("_sum", "_count")):
                    key = "batch_size_sum" if s.name.endswith("_sum") else "batch_size_count"
                    out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _add_labelled(out: dict[str, float], fam: Any, model: str, label: str) -> None:
    """A cascade counter per label value: ``cascade_rows_cloud``, ``cascade_failures_timeout``."""
    kind = "rows" if label == "route" else "failures"
    for s in fam.samples:
        if _mine(s.labels, model) and s.name.endswith("_total"):
            key = f"cascade_{kind}_{s.labels.get(label)}"
            out[key] = out.get(key, 0.0) + float(s.value)


def cascade_figures(first: dict[str, float], last: dict[str, float]) -> dict[str, Any]:
    """A cascade's figures over a step: the share of rows escalated, the rows the edge answered
    because the cloud failed, cloud failures by kind, and each tier's mean latency (ms)."""

    def delta(key: str) -> float:
        return last.get(key, 0.0) - first.get(key, 0.0)

    rows = {r: delta(f"cascade_rows_{r}") for r in ("edge", "cloud", "fallback")}
    total = sum(rows.values())
    if total <= 0:
        return {}
    out: dict[str, Any] = {
        "cascade_rows": int(total),
        "escalation_rate": (rows["cloud"] + rows["fallback"]) / total,
        "cloud_fallback_rows": int(rows["fallback"]),
        "cloud_failures": {
            k: int(delta(f"cascade_failures_{k}"))
            for k in ("error", "timeout", "rejected", "unavailable")
            if delta(f"cascade_failures_{k}") > 0
        },
    }
    for tier in ("edge", "cloud"):
        n = delta(f"cascade_{tier}_count")
        if n > 0:
            out[f"{tier}_tier_mean_ms"] = 1000 * delta(f"cascade_{tier}_sum") / n
    return out


class MetricsWatcher:
    """Samples ``/metrics`` every ``interval_s`` in a thread between ``start()`` and ``stop()``."""

    def __init__(
        self, url: str, model: str, headers: dict[str, str] | None = None, interval_s: float = 0.5
    ):
        self.url, self.model, self.headers, self.interval_s = url, model, headers, interval_s
        self.first: dict[str, float] | None = None
        self.depths: list[float] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slimline-metrics", daemon=True)

    def start(self) -> MetricsWatcher:
        self.first = read_metrics(self.url, self.model, self.headers)
        if self.first is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            figures = read_metrics(self.url, self.model, self.headers)
            if figures and "queue_depth" in figures:
                self.depths.append(figures["queue_depth"])

    def stop(self) -> dict[str, Any] | None:
        """The step's server figures, or ``None`` when the server has no usable ``/metrics``."""
        if self.first is None:
            return None
        self._halt.set()
        self._thread.join(timeout=5)
        last = read_metrics(self.url, self.model, self.headers) or {}
        out: dict[str, Any] = {}
        if self.depths:
            out["queue_depth_mean"] = sum(self.depths) / len(self.depths)
            out["queue_depth_max"] = max(self.depths)
        count = last.get("batch_size_count", 0.0) - self.first.get("batch_size_count", 0.0)
        if count > 0:
            total = last.get("batch_size_sum", 0.0) - self.first.get("batch_size_sum", 0.0)
            out["batch_size_mean"] = total / count
            out["batches"] = int(count)
        out.update(cascade_figures(self.first, last))
        return out
