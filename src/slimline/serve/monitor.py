"""Watching the model, not the server: prediction drift, bad rows, non-finite outputs, warnings.

A :class:`PredictionReference` is the distribution of what the model predicted on the run's
evaluation data: the top-1 class histogram of a logits output, or, for any other output, the
deciles of each row's mean value (bin edges from the reference, so every bin holds a tenth of
it). A :class:`DriftWindow` keeps the bins of the last ``window`` live rows; the drift score is
the population stability index of the window against the reference,

    PSI = sum_i (live_i - ref_i) * ln(live_i / ref_i)      (shares floored at 1e-4)

read when Prometheus scrapes. Common reading: below 0.1 stable, 0.1-0.25 moving, above 0.25
shifted; the shipped alert fires above 0.2 (deploy/prometheus/slimline-model-alerts.yml). The
score is NaN until the window holds ``min_rows`` rows, so a quiet model never alerts on noise.

=============================================  =======  ===========================================
metric                                         type     labels / meaning
=============================================  =======  ===========================================
``slimline_prediction_drift_psi``              gauge    model, version, output; PSI of the window
``slimline_prediction_drift_window_rows``      gauge    model, version, output; rows in the window
``slimline_invalid_rows_total``                counter  model, version; rows of requests that
                                                        failed input validation
``slimline_nonfinite_outputs_total``           counter  model, version, output; output rows with
                                                        NaN or Inf
``slimline_runtime_warnings_total``            counter  model, version, kind; warnings raised while
                                                        the model ran (by category), and ONNX
                                                        Runtime's float fallbacks at load
                                                        (kind ``float_fallback``)
=============================================  =======  ===========================================
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..errors import ServeError

__all__ = [
    "DriftWindow",
    "ModelMonitor",
    "MonitorMetrics",
    "PredictionReference",
    "count_warnings",
    "find_reference",
    "float_fallbacks",
    "load_reference_outputs",
    "psi",
    "references_for",
]

Tensors = dict[str, np.ndarray]
REFERENCE_FILE = "monitor_reference.npz"  # in a run directory or a repository version folder
PSI_FLOOR = 1e-4
DEFAULT_WINDOW = 1000


@dataclass(frozen=True)
class PredictionReference:
    """The reference distribution of one output: ``expected[i]`` is the share of bin ``i``."""

    output: str
    kind: Literal["top1", "deciles"]
    expected: np.ndarray
    edges: np.ndarray | None = None  # inner bin edges of the per-row means (deciles)

    @staticmethod
    def from_outputs(
        output: str, values: np.ndarray, logits: bool, bins: int = 10
    ) -> PredictionReference:
        """The reference of ``values`` (rows first); ``logits`` selects the top-1 histogram."""
        if len(values) == 0:
            raise ServeError(f"the reference outputs of {output!r} are empty; give eval outputs")
        if logits and values.ndim == 2 and values.shape[1] >= 2:
            counts = np.bincount(values.argmax(axis=1), minlength=values.shape[1])
            return PredictionReference(output, "top1", counts / counts.sum())
        means = _row_means(values)
        edges = np.unique(np.quantile(means, np.linspace(0, 1, bins + 1)[1:-1]))
        counts = np.bincount(np.searchsorted(edges, means, side="right"), minlength=len(edges) + 1)
        return PredictionReference(output, "deciles", counts / counts.sum(), edges)

    def bins_of(self, values: np.ndarray) -> np.ndarray:
        """The bin of each row of live ``values``."""
        if self.kind == "top1":
            top = values.reshape(len(values), -1).argmax(axis=1)
            return np.asarray(np.minimum(top, len(self.expected) - 1))
        assert self.edges is not None
        return np.asarray(np.searchsorted(self.edges, _row_means(values), side="right"))


def _row_means(values: np.ndarray) -> np.ndarray:
    rows = values.reshape(len(values), -1).astype(np.float64)
    return np.asarray(np.nan_to_num(rows.mean(axis=1), nan=0.0, posinf=0.0, neginf=0.0))


def psi(expected: np.ndarray, counts: np.ndarray) -> float:
    """The population stability index of observed ``counts`` against ``expected`` shares."""
    total = counts.sum()
    if total == 0:
        return math.nan
    live = np.maximum(counts / total, PSI_FLOOR)
    ref = np.maximum(expected, PSI_FLOOR)
    return float(np.sum((live - ref) * np.log(live / ref)))


class DriftWindow:
    """The bins of the last ``size`` live rows, with running counts (O(rows) per update)."""

    def __init__(self, reference: PredictionReference, size: int, min_rows: int) -> None:
        self.reference = reference
        self.rows: deque[int] = deque()
        self.size = size
        self.min_rows = min_rows
        self.counts = np.zeros(len(reference.expected), dtype=np.int64)
        self._lock = threading.Lock()  # updated on the event loop, read by the scrape thread

    def add(self, values: np.ndarray) -> None:
        bins = self.reference.bins_of(values)[-self.size :]
        with self._lock:
            np.add.at(self.counts, bins, 1)
            self.rows.extend(bins.tolist())
            while len(self.rows) > self.size:
                self.counts[self.rows.popleft()] -= 1

    def score(self) -> float:
        with self._lock:
            if len(self.rows) < self.min_rows:
                return math.nan
            return psi(self.reference.expected, self.counts)

    def filled(self) -> int:
        return len(self.rows)


class MonitorMetrics:
    """The model-monitoring families, in the server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.drift = Gauge(
            "slimline_prediction_drift_psi",
            "Population stability index of live predictions against the evaluation outputs",
            ["model", "version", "output"], registry=r,
        )  # fmt: skip
        self.window = Gauge(
            "slimline_prediction_drift_window_rows", "Live rows in the drift window",
            ["model", "version", "output"], registry=r,
        )  # fmt: skip
        self.invalid = Counter(
            "slimline_invalid_rows", "Rows of requests that failed input validation",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self.nonfinite = Counter(
            "slimline_nonfinite_outputs", "Output rows holding NaN or Inf",
            ["model", "version", "output"], registry=r,
        )  # fmt: skip
        self.warnings = Counter(
            "slimline_runtime_warnings", "Warnings raised while the model ran, by kind",
            ["model", "version", "kind"], registry=r,
        )  # fmt: skip

    def add_model(
        self,
        model: str,
        version: str,
        outputs: list[str],
        reference: list[PredictionReference],
        window: int = DEFAULT_WINDOW,
    ) -> ModelMonitor:
        return ModelMonitor(self, model, version, outputs, reference, window)


class ModelMonitor:
    """One model version's monitors; :meth:`observe` takes each answered request's outputs."""

    def __init__(
        self,
        metrics: MonitorMetrics,
        model: str,
        version: str,
        outputs: list[str],
        reference: list[PredictionReference],
        window: int,
    ) -> None:
        self.labels = (model, version)
        self.metrics = metrics
        self.invalid = metrics.invalid.labels(model, version)
        self.invalid.inc(0)
        self.nonfinite = {o: metrics.nonfinite.labels(model, version, o) for o in outputs}
        self.windows: dict[str, DriftWindow] = {}
        for ref in reference:
            win = self.windows[ref.output] = DriftWindow(ref, window, min(window, 200))
            metrics.drift.labels(model, version, ref.output).set_function(win.score)
            metrics.window.labels(model, version, ref.output).set_function(win.filled)
        self.warning("float_fallback", 0)  # the family exists from the start

    def observe(self, outputs: Tensors) -> None:
        for name, arr in outputs.items():
            window = self.windows.get(name)
            if window is not None:
                window.add(arr)
            counter = self.nonfinite.get(name)
            if counter is not None and arr.dtype.kind == "f" and arr.size:
                bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1) if arr.ndim else None
                n = int(bad.sum()) if bad is not None else int(not np.isfinite(arr))
                if n:
                    counter.inc(n)

    def invalid_rows(self, n: int) -> None:
        self.invalid.inc(n)

    def warning(self, kind: str, n: int = 1) -> None:
        self.metrics.warnings.labels(*self.labels, kind).inc(n)

    def remove(self) -> None:
        """Drop this version's series (its model version was unloaded)."""
        for family, extra in ((self.metrics.drift, self.windows), (self.metrics.window, self.windows),
                              (self.metrics.nonfinite, self.nonfinite)):  # fmt: skip
            for output in extra:
                family.remove(*self.labels, output)


# -- warnings raised while a model runs -----------------------------------------------------
_running = threading.local()
_hook_lock = threading.Lock()


def count_warnings(
    run: Callable[[Tensors], Tensors], monitor: ModelMonitor
) -> Callable[[Tensors], Tensors]:
    """``run`` with every warning it raises counted on ``monitor`` by category (and still shown
    as Python shows it, so the warnings filter decides which are: by default, once per place).
    The hook on :func:`warnings.showwarning` is process-wide and put back if something replaced
    it; the thread running a batch names the model, so models never count each other's."""

    def counted(inputs: Tensors) -> Tensors:
        if not getattr(warnings.showwarning, "_slimline", False):
            _install_hook()
        before = getattr(_running, "monitor", None)
        _running.monitor = monitor
        try:
            return run(inputs)
        finally:
            _running.monitor = before

    return counted


def _install_hook() -> None:
    with _hook_lock:
        shown = warnings.showwarning
        if getattr(shown, "_slimline", False):
            return

        def counting(message: Any, category: type[Warning], *args: Any, **kw: Any) -> None:
            monitor = getattr(_running, "monitor", None)
            if monitor is not None:
                monitor.warning(category.__name__)
            shown(message, category, *args, **kw)

        counting._slimline = True  # type: ignore[attr-defined]
        warnings.showwarning = counting


def load_reference_outputs(path: Path) -> Tensors:
    """Evaluation outputs saved with ``numpy.savez`` (one array per output name, rows first)."""
    try:
        with np.load(path) as data:
            return {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError) as err:
        raise ServeError(
            f"monitor reference {path} is not a readable .npz ({err}); write the evaluation "
            "outputs with numpy.savez(path, **{output_name: array})"
        ) from None


LOGITS_KEY = "__logits__"  # optional array in the reference file: outputs that are logits


def find_reference(source: str) -> Path | None:
    """The evaluation outputs saved beside a served model: ``RUN_DIR/monitor_reference.npz``,
    ``<stem>.monitor_reference.npz`` beside an ONNX file, or ``monitor_reference.npz`` in its
    folder (a repository version)."""
    if not source:
        return None
    path = Path(source)
    candidates = (
        [path / REFERENCE_FILE]
        if path.is_dir()
        else [path.with_name(f"{path.stem}.{REFERENCE_FILE}"), path.with_name(REFERENCE_FILE)]
    )
    return next((c for c in candidates if c.is_file()), None)


def references_for(
    path: Path | None, outputs: list[str], logits_output: str | None
) -> list[PredictionReference]:
    """The reference of each model output found in the file at ``path`` (none without one).
    An output is read as logits when the run declared its output kind ``logits`` (its primary
    output, ``logits_output``) or the file lists it under ``__logits__``."""
    if path is None:
        return []
    saved = load_reference_outputs(path)
    logits = {str(x) for x in saved.pop(LOGITS_KEY, np.array([])).ravel()}
    if logits_output:
        logits.add(logits_output)
    unknown = sorted(set(saved) - set(outputs))
    if unknown:
        raise ServeError(
            f"monitor reference {path} holds {unknown}, which the model does not output "
            f"(its outputs: {', '.join(outputs)}); save the evaluation outputs under those names"
        )
    return [
        PredictionReference.from_outputs(n, saved[n], n in logits) for n in outputs if n in saved
    ]


def float_fallbacks(path: Path) -> int:
    """How many quantized ops of the ONNX model at ``path`` ONNX Runtime runs as float kernels
    (0 without any DequantizeLinear: nothing was quantized)."""
    import onnx

    from ..compress.quant.fallback import kernel_report

    graph = onnx.load(str(path), load_external_data=False).graph
    if not any(n.op_type == "DequantizeLinear" for n in graph.node):
        return 0
    return len(kernel_report(path)["fallback"])
