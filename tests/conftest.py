from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.int8_kinds import CPU_KINDS
from slimline import cpu as cpu_module
from slimline.cpu import CpuInt8

FIXTURES = Path(__file__).parent / "fixtures"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The CPU-kind lane (scripts/test-cpu-kinds.sh) names the kind it emulates: a run whose CPUID
    shows another kind would test the host again, so it stops before any test."""
    expected = os.environ.get("SLIMLINE_EXPECT_CPU_KIND")
    if not expected:
        return
    from slimline.cpu import detect

    seen = detect()
    if seen.kind != expected:
        pytest.exit(
            f"the CPU-kind lane expects {expected}, but CPUID shows {seen.describe()}: "
            "run it with scripts/test-cpu-kinds.sh, which starts Python under qemu-x86_64",
            returncode=3,
        )


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


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuInt8]:
    """slimline chooses its INT8 formats as on this CPU kind, whatever the host is: every loaded
    slimline module's reference to :func:`slimline.cpu.detect` answers with the kind. The formats
    then run on the host's own kernels, so a test asserts the choice, not the kernels' numbers."""
    kind = CPU_KINDS[request.param]
    real = cpu_module.detect
    for name, module in list(sys.modules.items()):
        if name == "slimline" or name.startswith("slimline."):
            for attr, value in list(vars(module).items()):
                if value is real:
                    monkeypatch.setattr(module, attr, lambda: kind)
    yield kind
