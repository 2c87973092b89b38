"""bench/bench_out.py: a result states only what its run measured; a failed or skipped check
renders as "not measured", never as the claim it would support."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH_OUT = Path(__file__).resolve().parents[1] / "bench" / "bench_out.py"


@pytest.fixture(scope="module")
def bench_out() -> Iterator[ModuleType]:
    """The scripts' helper, loaded from its file (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_out", BENCH_OUT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


CLAIM = "a full queue rejects in < 5 ms"


def test_a_passed_check_states_its_claim_with_what_it_saw(bench_out: ModuleType) -> None:
    check = bench_out.run_check("overload", lambda: (True, "p99 1.8 ms"))
    assert check.status == "passed"
    assert bench_out.claim(check, CLAIM) == f"{CLAIM} (p99 1.8 ms)"


def test_a_failed_check_writes_not_measured(bench_out: ModuleType) -> None:
    check = bench_out.run_check("overload", lambda: (False, "pytest exit 1"))
    text = bench_out.claim(check, CLAIM)
    assert CLAIM not in text
    assert text == "overload: not measured (failed: pytest exit 1)"


def test_a_check_that_raises_is_a_failed_check_with_its_error(bench_out: ModuleType) -> None:
    def boom() -> tuple[bool, str]:
        raise RuntimeError("server did not start")

    check = bench_out.run_check("overload", boom)
    assert check.status == "failed" and "RuntimeError: server did not start" in check.detail
    assert bench_out.claim(check, CLAIM).startswith("overload: not measured (failed: RuntimeError")


def test_a_skipped_check_writes_not_measured(bench_out: ModuleType) -> None:
    check = bench_out.skipped("alert rules", "promtool is not installed")
    text = bench_out.claim(check, "the alert rules load in Prometheus")
    assert text == "alert rules: not measured (skipped: promtool is not installed)"


def test_a_figure_the_run_did_not_get_is_not_measured(bench_out: ModuleType) -> None:
    assert bench_out.figure(None) == "not measured"
    assert bench_out.figure(0.0) == "0.000"  # zero is a measurement, not a missing one
    assert bench_out.figure(1.23456, ".1f", " ms") == "1.2 ms"


def test_publish_writes_markdown_and_json_atomically(
    bench_out: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "RESULTS-x.md"
    check = bench_out.skipped("alert rules", "promtool is not installed")
    bench_out.publish("# x\n", {"checks": [check.to_dict()], "path": tmp_path}, out)
    assert out.read_text() == "# x\n" and "# x" in capsys.readouterr().out
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["checks"][0] == {
        "name": "alert rules",
        "status": "skipped",
        "detail": "promtool is not installed",
    }
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_section_is_replaced_in_place_and_appended_when_new(bench_out: ModuleType) -> None:
    first = bench_out.put_section("# title\n", "k", "one")
    assert first == "# title\n\n<!-- k -->\none\n<!-- /k -->\n"
    again = bench_out.put_section(first + "after\n", "k", "two")
    assert again == "# title\n\n<!-- k -->\ntwo\n<!-- /k -->\nafter\n"
