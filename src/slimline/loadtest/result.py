"""The load-test result format, computed from per-request records, and its JSON file.

One result (``"kind": "loadtest"``)::

    {"schema": 1, "kind": "loadtest", "mode": "open" | "closed", "partial": false,
     "valid": true, "invalid_reason": null,
     "target_rate": 100.0,       # what was asked for (null for closed loop or replay)
     "offered_rate": 99.2,       # requests scheduled in the measurement window / its length
     "achieved_rate": 99.0,      # ok answers completed in the window / its length
     "duration_s": 5.0, "warmup_s": 1.0, "requests": 496,
     "outcomes": {"ok": 496, "rejected": 0, "timeout": 0, "bad_request": 0,
                  "connection": 0, "server_error": 0, "unfinished": 0},
     "error_rate": 0.0,
     "latency_ms": {"p50": .., "p95": .., "p99": .., "p999": .., "max": .., "mean": ..},
     "schedule_lag_ms": {"p50": .., "p99": .., "max": .., "mean": ..},
     "latency_cdf_ms": [[0.5, 20.3], ...],   # (quantile, latency) pairs, for plots
     "config": {...}, "error_samples": {...}}

Latency counts from each request's scheduled time and covers requests answered ``ok`` whose
scheduled time falls in the measurement window ``[warmup, warmup + duration)``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LoadTestError
from .client import OUTCOMES
from .generator import UNFINISHED, Records

__all__ = ["CDF_QUANTILES", "atomic_write", "read_result", "summarize", "write_json"]

SCHEMA = 1
CDF_QUANTILES = np.unique(
    np.concatenate([np.linspace(0.0, 0.9, 19), 1 - np.logspace(-1, -4, 31), [1.0]])
)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def latency_stats(ms: np.ndarray) -> dict[str, float | None]:
    return {
        "p50": _pct(ms, 50),
        "p95": _pct(ms, 95),
        "p99": _pct(ms, 99),
        "p999": _pct(ms, 99.9),
        "max": float(ms.max()) if ms.size else None,
        "mean": float(ms.mean()) if ms.size else None,
    }


def summarize(
    rec: Records,
    *,
    mode: str,
    warmup_s: float,
    duration_s: float,
    target_rate: float | None,
    max_lag_ms: float,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result dict for ``rec``; the window ends early when the run was stopped."""
    end = warmup_s + duration_s
    if rec.stopped_at is not None:
        end = min(end, rec.stopped_at)
    window = max(end - warmup_s, 1e-9)
    measured = (rec.scheduled >= warmup_s) & (rec.scheduled < end)
    ok = rec.outcome == OUTCOMES.index("ok")
    latency = (rec.done - rec.scheduled)[measured & ok] * 1e3
    sent = measured & np.isfinite(rec.sent)
    lag = (rec.sent - rec.scheduled)[sent] * 1e3
    answered_in_window = ok & (rec.done >= warmup_s) & (rec.done < end)
    outcomes = _outcome_counts(rec.outcome[measured])
    n = int(measured.sum())
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "loadtest",
        "mode": mode,
        "partial": rec.stopped_at is not None,
        "target_rate": target_rate,
        "offered_rate": n / window if mode == "open" else None,
        "achieved_rate": int(answered_in_window.sum()) / window,
        "duration_s": window,
        "warmup_s": warmup_s,
        "requests": n,
        "outcomes": outcomes,
        "error_rate": (n - outcomes["ok"]) / n if n else 0.0,
        "latency_ms": latency_stats(latency),
        "schedule_lag_ms": {
            k: v for k, v in latency_stats(lag).items() if k in ("p50", "p99", "max", "mean")
        },
        "latency_cdf_ms": _cdf(latency),
        "config": config or {},
        "error_samples": rec.error_samples or {},
    }
    if mode == "closed":
        result["offered_rate"] = None
    reason = invalid_reason(result, max_lag_ms)
    result["valid"] = reason is None
    result["invalid_reason"] = reason
    return result


def _outcome_counts(codes: np.ndarray) -> dict[str, int]:
    counts = {name: int((codes == i).sum()) for i, name in enumerate(OUTCOMES)}
    counts["unfinished"] = int((codes == UNFINISHED).sum())
    return counts


def _cdf(latency_ms: np.ndarray) -> list[list[float]]:
    if not latency_ms.size:
        return []
    values = np.quantile(latency_ms, CDF_QUANTILES)
    return [
        [round(float(q), 6), round(float(v), 4)] for q, v in zip(CDF_QUANTILES, values, strict=True)
    ]


def invalid_reason(result: dict[str, Any], max_lag_ms: float) -> str | None:
    """Why the measurement cannot be trusted, or ``None``.

    Lag adds to every latency (they count from the scheduled time), so a run is invalid when the
    lag p99 exceeds ``max_lag_ms`` *and* a tenth of the latency p99: a late client then distorts
    the figures it reports. A 10 ms lag behind a 2 s overload queue does not.
    """
    if result["requests"] == 0:
        return "no request was scheduled in the measurement window; raise --duration or --rate"
    lag_p99 = result["schedule_lag_ms"]["p99"]
    lat_p99 = result["latency_ms"]["p99"] or 0.0
    if (
        result["mode"] == "open"
        and lag_p99 is not None
        and lag_p99 > max(max_lag_ms, 0.1 * lat_p99)
    ):
        return (
            f"schedule lag p99 {lag_p99:.1f} ms exceeds --max-lag-ms {max_lag_ms:g} (and 10% of "
            f"latency p99 {lat_p99:.1f} ms): the generator could not keep the schedule; add "
            "--processes or lower --rate"
        )
    return None


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (temp file + rename); NaN becomes null."""
    atomic_write(path, (json.dumps(_clean(doc), indent=1) + "\n").encode())


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    return obj


def read_result(path: Path) -> dict[str, Any]:
    """A loadtest or sweep result file, checked for the fields the planners read."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadTestError(
            f"result file {path} does not exist; run `slimline loadtest --out` first"
        ) from None
    except json.JSONDecodeError as err:
        raise LoadTestError(
            f"{path} is not JSON ({err.msg}); give a `slimline loadtest` result"
        ) from None
    if not isinstance(doc, dict) or doc.get("kind") not in ("loadtest", "sweep"):
        raise LoadTestError(f'{path} is not a slimline load-test or sweep result (no "kind")')
    return doc
