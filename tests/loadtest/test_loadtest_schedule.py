from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slimline.errors import LoadTestError
from slimline.loadtest.schedule import arrival_schedule, load_trace, replay_schedule


def test_poisson_schedule_is_seeded_sorted_and_has_the_rate() -> None:
    a = arrival_schedule("poisson", 2000.0, 10.0, seed=1)
    assert np.array_equal(a, arrival_schedule("poisson", 2000.0, 10.0, seed=1))
    assert not np.array_equal(a, arrival_schedule("poisson", 2000.0, 10.0, seed=2))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0) and a[-1] < 10.0
    assert abs(len(a) / 10.0 - 2000.0) < 4 * np.sqrt(20000) / 10.0  # 4 sigma of the count
    gaps = np.diff(a)
    # exponential gaps: coefficient of variation 1 (a constant rate would give 0)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05


def test_constant_schedule_is_evenly_spaced() -> None:
    a = arrival_schedule("constant", 50.0, 2.0)
    assert len(a) == 100
    assert np.allclose(np.diff(a), 0.02)


@pytest.mark.parametrize("rate,duration", [(0.0, 1.0), (10.0, -1.0)])
def test_schedule_rejects_non_positive_settings(rate: float, duration: float) -> None:
    with pytest.raises(LoadTestError, match="must be positive"):
        arrival_schedule("poisson", rate, duration)


def test_jsonl_trace_with_payload_refs_and_speed(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"t": 100.0, "payload": 3}\n{"t": 100.5}\n\n{"timestamp": 101.0, "payload": "a.json"}\n'
    )
    trace = load_trace(path)
    assert trace.times.tolist() == [0.0, 0.5, 1.0]
    assert trace.payloads == [3, None, "a.json"]
    assert replay_schedule(trace, speed=2.0).tolist() == [0.0, 0.25, 0.5]
    assert replay_schedule(trace, duration_s=0.9).tolist() == [0.0, 0.5]


def test_csv_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time,payload\n0.0,1\n0.1,\n0.3,2\n")
    trace = load_trace(path)
    assert trace.times.tolist() == pytest.approx([0.0, 0.1, 0.3])
    assert trace.payloads == [1, None, 2]


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"t": 0.0}\n{"t": 0.2}\n{"t": 0.1}\n', "row 3 .* comes before row 2"),
        ('{"t": -1.0}\n{"t": 0.2}\n', "row 1 has time -1.0"),
        ('{"t": 0.0}\n{"x": 1}\n', "no time field"),
        ("", "has no rows"),
        ('{"t": 0.0}\nnot json\n', "line 2 is not JSON"),
    ],
)
def test_bad_traces_are_refused_with_the_row(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(LoadTestError, match=message):
        load_trace(path)


def test_csv_without_time_column_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("when\n1\n")
    with pytest.raises(LoadTestError, match="must name a time column"):
        load_trace(path)
    with pytest.raises(LoadTestError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
