from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tiny_task_file() -> Path:
    return FIXTURES / "tiny_task.py"


@pytest.fixture
def tiny_recipe(tiny_task_file: Path) -> dict[str, Any]:
    """A fast recipe on the tiny task: 200 timed runs, small batches, no RSS subprocess."""
    return {
        "name": "tiny",
        "task": str(tiny_task_file),
        "target": {"threads": 1},
        "bench": {
            "rounds": 4,
            "runs_per_round": 50,
            "batch_sizes": [1, 4],
            "throughput_min_seconds": 0.02,
            "warmup": 2,
            "peak_rss": False,
        },
        "steps": ["export", {"graph": {"level": "extended"}}],
    }


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"
