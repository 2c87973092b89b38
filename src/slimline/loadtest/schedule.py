"""Arrival schedules, computed up front: Poisson, constant rate, or a replayed trace.

A schedule is a sorted ``float64`` array of offsets in seconds from the start of the run. It is
fixed before the first request leaves, so the generator never adapts to the server's responses
(open loop), and a seed makes it repeatable.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import LoadTestError

__all__ = ["Arrival", "Trace", "arrival_schedule", "load_trace", "replay_schedule"]

Arrival = Literal["poisson", "constant"]
_TIME_KEYS = ("t", "time", "timestamp", "ts")


def arrival_schedule(arrival: Arrival, rate: float, duration_s: float, seed: int = 0) -> np.ndarray:
    """Offsets in ``[0, duration_s)`` for ``rate`` requests per second on average."""
    if rate <= 0 or duration_s <= 0:
        raise LoadTestError(f"rate ({rate}) and duration ({duration_s}) must be positive")
    if arrival == "constant":
        return np.arange(math.floor(rate * duration_s - 1e-9) + 1, dtype=np.float64) / rate
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    n = int(expected + 10 * math.sqrt(expected) + 16)  # ample: the cumsum is cut at duration_s
    offsets = np.cumsum(rng.exponential(1.0 / rate, n))
    while offsets[-1] < duration_s:  # astronomically rare; extend rather than truncate
        more = offsets[-1] + np.cumsum(rng.exponential(1.0 / rate, n))
        offsets = np.concatenate([offsets, more])
    # the first arrival is at 0 so the window starts with traffic, then Poisson gaps follow
    offsets = np.concatenate([[0.0], offsets])
    return offsets[offsets < duration_s]


@dataclass(frozen=True)
class Trace:
    """Recorded arrival times (seconds, starting at 0) and optional payload references."""

    times: np.ndarray
    payloads: list[int | str | None]
    source: str


def load_trace(path: Path) -> Trace:
    """Read a JSONL or CSV trace of timestamps; refuse empty, negative or unordered times."""
    if not path.is_file():
        raise LoadTestError(
            f"trace file {path} does not exist; give a JSONL or CSV file of timestamps"
        )
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".json", ".ndjson") else _read_csv(path)
    if not rows:
        raise LoadTestError(f"trace {path} has no rows; it needs one timestamp per request")
    times = np.array([t for t, _ in rows], dtype=np.float64)
    _check_times(times, path)
    return Trace(times=times - times[0], payloads=[p for _, p in rows], source=str(path))


def replay_schedule(
    trace: Trace, speed: float = 1.0, duration_s: float | None = None
) -> np.ndarray:
    """The trace's offsets divided by ``speed`` (2.0 = twice as fast), cut at ``duration_s``."""
    if speed <= 0:
        raise LoadTestError(f"--speed must be positive, not {speed}")
    offsets = trace.times / speed
    return offsets if duration_s is None else offsets[offsets < duration_s]


def _check_times(times: np.ndarray, path: Path) -> None:
    bad = np.flatnonzero(~np.isfinite(times) | (times < 0))
    if bad.size:
        raise LoadTestError(
            f"trace {path}: row {bad[0] + 1} has time {times[bad[0]]}; times must be finite and "
            "non-negative (seconds or epoch seconds)"
        )
    back = np.flatnonzero(np.diff(times) < 0)
    if back.size:
        i = back[0] + 1
        raise LoadTestError(
            f"trace {path}: row {i + 1} (t={times[i]}) comes before row {i} (t={times[i - 1]}); "
            "sort the trace by time"
        )


def _pick_time(record: dict[str, Any], where: str) -> float:
    for key in _TIME_KEYS:
        if key in record:
            try:
                return float(record[key])
            except (TypeError, ValueError):
                raise LoadTestError(f"{where}: time {record[key]!r} is not a number") from None
    raise LoadTestError(f"{where}: no time field; name it one of {', '.join(_TIME_KEYS)}")


def _payload_ref(value: Any) -> int | str | None:
    if value is None or value == "":
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    return str(value)


def _read_jsonl(path: Path) -> list[tuple[float, int | str | None]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise LoadTestError(
                f"trace {path} line {n} is not JSON ({err.msg}); one object per line"
            ) from None
        if isinstance(record, (int, float)):
            record = {"t": record}
        if not isinstance(record, dict):
            raise LoadTestError(f'trace {path} line {n}: expected an object like {{"t": 0.25}}')
        rows.append(
            (_pick_time(record, f"trace {path} line {n}"), _payload_ref(record.get("payload")))
        )
    return rows


def _read_csv(path: Path) -> list[tuple[float, int | str | None]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or not set(reader.fieldnames) & set(_TIME_KEYS):
            raise LoadTestError(
                f"trace {path}: the CSV header must name a time column ({', '.join(_TIME_KEYS)})"
            )
        return [
            (_pick_time(row, f"trace {path} row {n}"), _payload_ref(row.get("payload")))
            for n, row in enumerate(reader, start=1)
        ]
