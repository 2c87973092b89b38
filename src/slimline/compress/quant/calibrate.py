"""Chunked calibration: one pass over the calibration data feeds every range estimator at once.

ONNX Runtime's calibrators keep every intermediate output of every sample in memory until the
end (Percentile and Entropy on a BERT-class model with 512 samples need tens of GB). Here the
augmented model (ONNX Runtime's own, from ``create_calibrator``) is run on chunks sized to a
memory budget, and each chunk is folded at once into

* min/max per tensor (MinMax ranges),
* ONNX Runtime's ``HistogramCollector`` (Percentile and, when asked, Entropy ranges),
* running moments, for the distribution analysis.

The ranges are written as ONNX Runtime calibration caches, which ``quantize_static`` reads, so
every quantized variant (and every mixed-precision retry) reuses one calibration pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import DataError
from ...measure.runners import ort_session, session_input_spec
from ...signature import Signature, batch_axis, concat_rows, n_rows, slice_rows
from ...task import Inputs, check_inputs, iter_rows
from .prepare import quiet

__all__ = [
    "Calibration",
    "RssSampler",
    "TensorStats",
    "calibrate",
    "entropy_threshold",
    "rebatch",
    "static_op_types",
]

log = logging.getLogger("slimline.quantize")

_BINS = 2048
_OUTLIER_SIGMAS = 6.0
_MAX_CHUNK_ROWS = 64
# Entropy's threshold search is a Python loop over candidate bins: 512 (vs ONNX Runtime's 128,
# which equals MinMax when num_quantized_bins is also 128) keeps it to seconds per tensor.
_ENTROPY_BINS = 512
# Histograms and moments see a strided subsample of each tensor; min/max always see every value.
# Without it, histogramming dominates calibration time on convolutional feature maps. The
# budget is per tensor over the whole calibration, shared among its chunks, so that a model fed
# one row per chunk (large activations, a fixed batch) does not histogram every row in full:
# PP-OCR's recognizer spent 3.6 of its 4.6 s per row there. Each chunk sees at least
# _HIST_MIN_VALUES and at most _HIST_VALUES values of a tensor.
_HIST_TOTAL = 1 << 20
_HIST_MIN_VALUES = 1 << 15
_HIST_VALUES = 1 << 18
# A histogram may grow to this many times its collector's base bin count before it is re-binned.
_MAX_BIN_GROWTH = 16


def _hist_limit(rows: int, samples: int) -> int:
    """Values per tensor a chunk of ``rows`` (of ``samples`` in all) contributes to histograms."""
    share = _HIST_TOTAL * rows // max(samples, 1)
    return int(min(_HIST_VALUES, max(_HIST_MIN_VALUES, share)))


def _subsample(arr: np.ndarray, limit: int = _HIST_VALUES) -> np.ndarray:
    flat = arr.reshape(-1)
    stride = -(-flat.size // limit)
    return np.ascontiguousarray(flat[::stride], dtype=np.float32)


def static_op_types() -> list[str]:
    """The op types ``quantize_static`` quantizes by default (its QLinear and QDQ registries)."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


@dataclass
class TensorStats:
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    lo: float = float("inf")
    hi: float = float("-inf")

    def update(self, arr: np.ndarray, sample: np.ndarray) -> None:
        """Exact range from ``arr``; moments from ``sample`` (a strided subsample of it)."""
        if arr.size == 0:
            return
        self.lo = min(self.lo, float(arr.min()))
        self.hi = max(self.hi, float(arr.max()))
        a = sample.astype(np.float64)
        self.count += a.size
        self.total += float(a.sum())
        self.total_sq += float(np.square(a).sum())  # not np.dot: BLAS threads spin under load

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)

    @property
    def std(self) -> float:
        return float(np.sqrt(max(self.total_sq / max(self.count, 1) - self.mean**2, 0.0)))


@dataclass
class Calibration:
    """What one calibration pass produced: ranges per method, statistics, cost."""

    caches: dict[str, Path]  # method -> ONNX Runtime calibration cache (JSON)
    stats: dict[str, dict[str, float]]  # tensor -> range, percentiles, outlier share
    histograms: dict[str, tuple[list[int], list[float]]]  # tensor -> (counts, edges), for plots
    ranges: dict[str, tuple[float, float]]  # tensor -> MinMax range
    samples: int
    chunk_rows: int
    wall_s: float
    peak_rss_mb: float
    representativeness: dict[str, Any] = field(default_factory=dict)
    # tensor -> share of its values that were inf or NaN (attention scores under a -inf mask);
    # their ranges come from the finite values, where the quantized graph saturates the rest
    nonfinite: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "chunk_rows": self.chunk_rows,
            "wall_s": round(self.wall_s, 3),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "methods": sorted(self.caches),
            "tensors": len(self.stats),
            "nonfinite_tensors": {k: round(v, 6) for k, v in sorted(self.nonfinite.items())},
        }


def rebatch(
    batches: Iterable[Inputs], rows: int, limit: int | None, sig: Signature | None = None
) -> Iterator[Inputs]:
    """Re-cut ``batches`` into chunks of exactly ``rows`` rows along each input's batch axis
    (the last may be shorter; rows of different shapes are never merged), up to ``limit`` rows
    in total."""
    buf: list[Inputs] = []
    have = 0
    for b in iter_rows(batches, limit, sig):
        n, start = n_rows(b, sig), 0
        while start < n:
            if buf and not _same_shapes(buf[0], b, sig):
                yield concat_rows(buf, sig)
                buf, have = [], 0
            take = min(rows - have, n - start)
            buf.append(slice_rows(b, start, start + take, sig))
            have, start = have + take, start + take
            if have == rows:
                yield concat_rows(buf, sig)
                buf, have = [], 0
    if buf:
        yield concat_rows(buf, sig)


def _same_shapes(a: Inputs, b: Inputs, sig: Signature | None) -> bool:
    def row_shape(name: str, arr: np.ndarray) -> tuple[int, ...]:
        axis = batch_axis(sig, name)
        return arr.shape if axis is None else arr.shape[:axis] + arr.shape[axis + 1 :]

    return all(row_shape(k, a[k]) == row_shape(k, b[k]) and a[k].dtype == b[k].dtype for k in a)


class RssSampler:
    """Samples this process's RSS every 20 ms; ``peak_mb`` is the highest seen."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return float(self.peak) / 2**20


def calibrate(
    model: Path,
    batches: Iterable[Inputs],
    out_dir: Path,
    *,
    samples: int,
    methods: set[str],
    percentile: float = 99.99,
    symmetric: bool = False,
    chunk_mb: int = 256,
    op_types: list[str] | None = None,
    threads: int = 1,
    eval_batches: Iterable[Inputs] | None = None,
    eval_samples: int = 64,
    signature: Signature | None = None,
) -> Calibration:
    """Run ``model`` (a prepared float graph) on up to ``samples`` rows of ``batches`` in chunks.

    ``methods`` is a subset of {"minmax", "percentile", "entropy"}; a cache is written for each.
    When ``eval_batches`` is given, up to ``eval_samples`` of its rows are checked against the
    calibrated ranges (see :func:`_representativeness`). ``signature`` says where each input's
    batch axis is, and caps the rows per call of a model that takes one at a time.
    """
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with RssSampler() as rss, quiet():
        calibrator = create_calibrator(
            model,
            op_types or static_op_types(),
            augmented_model_path=str(out_dir / "augmented.onnx"),
            calibrate_method=CalibrationMethod.Percentile,
            extra_options={"symmetric": symmetric, "num_bins": _BINS, "percentile": percentile},
        )
        calibrator.infer_session = None  # ours below is pinned to the target's threads
        session = ort_session(out_dir / "augmented.onnx", threads, level="basic")
        wanted = sorted(calibrator.tensors_to_calibrate)
        acc = _Accumulator(methods, percentile, symmetric)
        n, chunk_rows = _collect(session, wanted, batches, samples, chunk_mb, acc, signature)
        caches = acc.write_caches(out_dir)
        rep = _representativeness(
            session, wanted, acc.moments, eval_batches, eval_samples, signature
        )
    return Calibration(
        caches=caches,
        stats=acc.tensor_stats(),
        histograms=acc.histograms(),
        ranges={k: (s.lo, s.hi) for k, s in acc.moments.items()},
        samples=n,
        chunk_rows=chunk_rows,
        wall_s=time.perf_counter() - t0,
        peak_rss_mb=rss.peak_mb,
        representativeness=rep,
        nonfinite=acc.nonfinite_shares(),
    )


def _collect(
    session: Any,
    wanted: list[str],
    batches: Iterable[Inputs],
    samples: int,
    chunk_mb: int,
    acc: _Accumulator,
    sig: Signature | None = None,
) -> tuple[int, int]:
    spec = session_input_spec(session)
    it = iter(rebatch(batches, 1, samples, sig))
    first = next(it, None)
    if first is None:
        raise DataError(
            "calibration_data() yielded no samples; the quantize step needs input batches"
        )
    check_inputs(first, spec, "calibration data")
    per_row = acc.fold(session, wanted, first, _hist_limit(1, samples))
    chunk_rows = int(max(1, min(_MAX_CHUNK_ROWS, chunk_mb * 2**20 // max(per_row, 1))))
    if sig is not None and sig.max_batch is not None:
        chunk_rows = min(chunk_rows, sig.max_batch)
    seen = 1
    for chunk in rebatch(it, chunk_rows, None, sig):
        check_inputs(chunk, spec, "calibration data")
        acc.fold(session, wanted, chunk, _hist_limit(n_rows(chunk, sig), samples))
        seen += n_rows(chunk, sig)
    return seen, chunk_rows


class _Accumulator:
    def __init__(self, methods: set[str], percentile: float, symmetric: bool) -> None:
        from onnxruntime.quantization.calibrate import HistogramCollector

        self.methods = methods
        self.moments: dict[str, TensorStats] = {}
        self.nonfinite: dict[str, list[int]] = {}  # tensor -> [non-finite values, all values]
        # the value histogram serves the statistics, and Percentile when asymmetric
        self.value = HistogramCollector("percentile", False, _BINS, 128, percentile, "same")
        self.absolute = (
            HistogramCollector("percentile", True, _BINS, 128, percentile, "same")
            if "percentile" in methods and symmetric
            else None
        )
        self.entropy = (
            HistogramCollector("entropy", False, _ENTROPY_BINS, 128, percentile, "same")
            if "entropy" in methods
            else None
        )
        if self.entropy is not None:  # the same thresholds, without a Python sum per bin
            self.entropy.get_entropy_threshold = entropy_threshold

    def fold(self, session: Any, wanted: list[str], inputs: Inputs, limit: int) -> int:
        outs = session.run(wanted, inputs)
        data = {
            name: self._finite(name, arr)
            for name, arr in zip(wanted, outs, strict=True)
            if arr.dtype.kind == "f"
        }
        sub = {name: _subsample(arr, limit) for name, arr in data.items()}
        for name, arr in data.items():
            self.moments.setdefault(name, TensorStats()).update(arr, sub[name])
        for coll in (self.value, self.absolute, self.entropy):
            if coll is not None:
                _bound_bins(coll, sub)
                coll.collect(sub)
        return int(sum(a.nbytes for a in outs))

    def _finite(self, name: str, arr: np.ndarray) -> np.ndarray:
        """``arr`` with inf and NaN set to its finite extremes (0 when none is finite): a
        masked attention score of -inf has no range to calibrate, and one such value would
        make every range and histogram of the tensor infinite."""
        ok = np.isfinite(arr)
        count = self.nonfinite.setdefault(name, [0, 0])
        count[1] += arr.size
        if ok.all():
            return arr
        count[0] += int(arr.size - ok.sum())
        finite = arr[ok]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        out: np.ndarray = np.nan_to_num(
            arr, nan=0.0 if lo <= 0.0 <= hi else lo, posinf=hi, neginf=lo
        )
        return out

    def nonfinite_shares(self) -> dict[str, float]:
        return {k: bad / total for k, (bad, total) in self.nonfinite.items() if bad}

    def write_caches(self, out_dir: Path) -> dict[str, Path]:
        from onnxruntime.quantization.calibrate import (
            CalibrationMethod,
            TensorsData,
            save_tensors_data,
        )

        caches: dict[str, Path] = {}
        for method in sorted(self.methods):
            if method == "minmax":
                data: Any = {
                    k: (np.array(s.lo, np.float32), np.array(s.hi, np.float32))
                    for k, s in self.moments.items()
                }
                td = TensorsData(CalibrationMethod.MinMax, data)
            elif method == "percentile":
                coll = self.absolute or self.value
                td = TensorsData(CalibrationMethod.Percentile, coll.compute_collection_result())
            else:
                assert self.entropy is not None
                td = TensorsData(
                    CalibrationMethod.Entropy, self.entropy.compute_collection_result()
                )
            caches[method] = out_dir / f"calibration-{method}.json"
            save_tensors_data(td, caches[method])
        return caches

    def tensor_stats(self) -> dict[str, dict[str, float]]:
        hists = self.value.get_histogram_dict()
        return {name: _describe(m, hists.get(name)) for name, m in self.moments.items()}

    def histograms(self) -> dict[str, tuple[list[int], list[float]]]:
        out = {}
        for name, h in self.value.get_histogram_dict().items():
            counts, edges = _coarsen(np.asarray(h[0]), np.asarray(h[1]), 64)
            out[name] = (counts.tolist(), [float(e) for e in edges])
        return out


def entropy_threshold(histogram: Any, num_quantized_bins: int) -> tuple[Any, Any]:
    """ONNX Runtime's ``HistogramCollector.get_entropy_threshold`` (the KL-divergence search
    over symmetric windows around the zero bin), with its per-bin Python ``sum`` calls turned
    into prefix sums and reshapes: the same windows, the same integer merging and expansion
    (``q`` truncated to int64 as there), the same smoothing and divergence, so the same
    thresholds. Theirs spends most of an entropy calibration's time in those sums."""
    from onnxruntime.quantization.calibrate import entropy
    from onnxruntime.quantization.quant_utils import smooth_distribution

    hist, edges = np.asarray(histogram[0]), np.asarray(histogram[1])
    dtype, nq = edges.dtype, num_quantized_bins
    zero, half = hist.size // 2, nq // 2
    prefix = np.concatenate([[0], np.cumsum(hist)])
    best: tuple[float, int] | None = None
    for i in range(half, zero + 1):
        start, end = zero - i, min(zero + i + 1, hist.size)
        sliced = hist[start:end]
        p = sliced.copy()
        p[0] += prefix[start]
        p[-1] += prefix[-1] - prefix[end]
        nonzeros = (p != 0).astype(np.int64)
        m = sliced.size // nq
        merged = sliced[: nq * m].reshape(nq, m).sum(axis=1).astype(np.int64)
        merged[-1] += sliced[nq * m :].sum()
        norm = nonzeros[: nq * m].reshape(nq, m).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            spread = np.where(norm != 0, merged / np.maximum(norm, 1), 0.0)
        q = np.zeros(p.size, dtype=np.int64)
        q[: nq * m] = np.repeat(spread.astype(np.int64), m)
        ps, qs = smooth_distribution(p), smooth_distribution(q)
        div = float(np.inf) if ps is None or qs is None else float(entropy(ps, qs))
        div = float(np.array(div, dtype=dtype))  # their divergences are stored in this dtype
        if np.isnan(div):  # np.argmin: the first NaN wins
            best = (div, i)
            break
        if best is None or div < best[0]:  # np.argmin: the first of equal divergences
            best = (div, i)
    assert best is not None
    i = best[1]
    lo, hi = edges[zero - i], edges[min(zero + i + 1, hist.size)]
    lo = histogram[2] if lo < histogram[2] else lo
    hi = histogram[3] if hi > histogram[3] else hi
    return lo, hi


def _bound_bins(coll: Any, arrays: dict[str, np.ndarray]) -> None:
    """Re-bin, before a merge, every histogram that the merge would grow past
    :data:`_MAX_BIN_GROWTH` times the collector's base bin count.

    ONNX Runtime's ``HistogramCollector`` keeps the bin width of the first values it saw and adds
    bins of that width as later values widen the range. ONNX Runtime's own calibration passes
    all data in one call, so that never happens there; chunked calibration merges once per
    chunk, and a tensor whose first chunk is nearly all zero (PP-OCR's detector: max 3e-4, then
    0.14 in a later chunk) asks numpy for 10^8 bins ("Too many bins for data range"). The old
    counts are moved, by bin centre, onto the base bin count over the new range; the merge
    then adds the new chunk at that resolution."""
    cap = _MAX_BIN_GROWTH * coll.num_bins
    for name, arr in arrays.items():
        old = coll.histogram_dict.get(name)
        if old is None or arr.size == 0:
            continue
        hist, edges = np.asarray(old[0]), np.asarray(old[1])
        width, top = float(edges[1] - edges[0]), float(np.nanmax(np.abs(arr)))
        if not width > 0 or not top > float(edges[-1]):
            continue
        if len(hist) + 2 * (top - float(edges[-1])) / width + 2 <= cap:
            continue
        absolute = len(old) == 4  # (hist, edges, min, max); the value form adds its threshold
        new_edges = np.linspace(float(edges[0]) if absolute else -top, top, coll.num_bins + 1)
        centers = (edges[:-1] + edges[1:]) / 2
        counts = np.histogram(centers, bins=new_edges, weights=hist)[0].astype(hist.dtype)
        rebinned: tuple[Any, ...] = (counts, new_edges.astype(edges.dtype), old[2], old[3])
        if not absolute:
            rebinned = (*rebinned, np.array(top, dtype=np.asarray(old[4]).dtype))
        coll.histogram_dict[name] = rebinned


def _coarsen(counts: np.ndarray, edges: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge histogram bins down to ``bins`` (for plots), dropping empty outer bins first."""
    nz = np.nonzero(counts)[0]
    if nz.size:
        counts, edges = counts[nz[0] : nz[-1] + 1], edges[nz[0] : nz[-1] + 2]
    step = max(1, int(np.ceil(len(counts) / bins)))
    pad = (-len(counts)) % step
    c = np.concatenate([counts, np.zeros(pad, counts.dtype)]).reshape(-1, step).sum(axis=1)
    e = edges[::step]
    if len(e) < len(c) + 1:
        e = np.append(e, edges[-1])
    return c, e[: len(c) + 1]


def _describe(m: TensorStats, hist: Any) -> dict[str, float]:
    out = {"min": m.lo, "max": m.hi, "mean": m.mean, "std": m.std, "count": float(m.count)}
    absmax = max(abs(m.lo), abs(m.hi))
    if hist is None or m.count == 0:
        return {**out, "p99_99_abs": absmax, "range_ratio": 1.0, "outlier_share": 0.0}
    counts, edges = np.asarray(hist[0], np.float64), np.asarray(hist[1], np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    cdf = np.cumsum(counts) / max(counts.sum(), 1.0)
    for q, key in (
        (0.0001, "p0_01"),
        (0.01, "p1"),
        (0.5, "p50"),
        (0.99, "p99"),
        (0.9999, "p99_99"),
    ):
        out[key] = float(centers[min(int(np.searchsorted(cdf, q)), len(centers) - 1)])
    abs_order = np.argsort(np.abs(centers))
    abs_cdf = np.cumsum(counts[abs_order]) / max(counts.sum(), 1.0)
    p_abs = float(
        np.abs(centers[abs_order][min(int(np.searchsorted(abs_cdf, 0.9999)), len(centers) - 1)])
    )
    width = float(edges[1] - edges[0]) if len(edges) > 1 else 0.0
    out["p99_99_abs"] = max(p_abs, width)
    out["range_ratio"] = absmax / out["p99_99_abs"] if out["p99_99_abs"] > 0 else 1.0
    far = np.abs(centers - m.mean) > _OUTLIER_SIGMAS * max(m.std, 1e-12)
    out["outlier_share"] = float(counts[far].sum() / max(counts.sum(), 1.0))
    return out


_EXCEED_TOL = 0.05  # share of the calibrated range an eval value may overshoot unnoticed
_EXCEED_WARN = 0.10  # share of eval samples overshooting that makes a tensor worth a warning


def _representativeness(
    session: Any,
    wanted: list[str],
    moments: dict[str, TensorStats],
    batches: Iterable[Inputs] | None,
    limit: int,
    sig: Signature | None = None,
) -> dict[str, Any]:
    """Per tensor: the share of evaluation samples whose values leave the calibrated range by more
    than 5% of its width, and the largest overshoot (in range widths)."""
    if batches is None or limit <= 0:
        return {}
    names = [n for n in wanted if n in moments]
    hits = dict.fromkeys(names, 0)
    worst = dict.fromkeys(names, 0.0)
    n = 0
    for row in rebatch(batches, 1, limit, sig):
        for name, arr in zip(names, session.run(names, row), strict=True):
            m = moments[name]
            width = max(m.hi - m.lo, 1e-12)
            over = max((m.lo - float(arr.min())) / width, (float(arr.max()) - m.hi) / width, 0.0)
            worst[name] = max(worst[name], over)
            hits[name] += over > _EXCEED_TOL
        n += 1
    if n == 0:
        return {}
    share = {k: v / n for k, v in hits.items()}
    flagged = sorted((k for k in names if share[k] > _EXCEED_WARN), key=lambda k: -share[k])
    return {
        "eval_samples": n,
        "tolerance": _EXCEED_TOL,
        "flagged": [
            {"tensor": k, "exceed_share": round(share[k], 4), "max_overshoot": round(worst[k], 3)}
            for k in flagged
        ],
        "tensors_checked": len(names),
    }


# The histogram settings and helpers, for the qat step's calibration of a torch model's fake
# quantization from the same estimators (compress/qat/fakequant.py)
HISTOGRAM_BINS = _BINS
ENTROPY_BINS = _ENTROPY_BINS
bound_bins = _bound_bins
hist_limit = _hist_limit
subsample = _subsample
