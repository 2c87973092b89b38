"""Serving a run's INT8 model on a CPU whose INT8 numerics differ from the one its run judged it
on: a warning at load, and the model's metadata says so."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from slimline import cpu
from slimline.serve import load_served_models

VNNI = {"avx2": True, "avx512bw": True, "avx512_vnni": True, "avx_vnni": False,
        "amx_int8": False, "kind": "x86-avx512-vnni", "source": "cpuid"}  # fmt: skip
AVX2 = {"avx2": True, "avx512bw": False, "avx512_vnni": False, "avx_vnni": False,
        "amx_int8": False, "kind": "x86-avx2", "source": "cpuid"}  # fmt: skip


def _cpu(features: set[str]) -> cpu.CpuInt8:
    return cpu.CpuInt8("x86_64", frozenset(features), source="cpuid")


def _run(make_run_dir: Callable[..., Path], root: Path, int8: dict[str, object]) -> Path:
    run = make_run_dir(root)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["hardware"] = {"machine": "x86_64", "int8": int8}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.mark.parametrize(
    ("built", "here", "warned"),
    [
        (VNNI, {"avx2", "avx512bw"}, True),  # 32-bit sums when judged, 16-bit here
        (AVX2, {"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, True),  # the other way round
        (VNNI, {"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, False),  # AMX: same numerics
        (AVX2, {"avx2"}, False),
    ],
)
def test_an_int8_model_judged_on_other_int8_numerics_is_served_with_a_warning(
    built: dict[str, object],
    here: set[str],
    warned: bool,
    make_run_dir: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _cpu(here))
    with caplog.at_level(logging.WARNING, logger="slimline.serve"):
        (model,) = load_served_models([_run(make_run_dir, tmp_path, built)])
    assert model.meta["int8_built_on"] == built["kind"]
    note = model.meta.get("int8_kind_warning")
    assert (note is not None) is warned
    assert any("judged on a" in r.getMessage() for r in caplog.records) is warned
    if note is not None:
        assert str(built["kind"]) in note and _cpu(here).kind in note
        assert "slimline optimize" in note  # the fix


def test_a_float_model_is_the_same_on_every_kind(
    make_run_dir: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(make_run_dir, tmp_path, VNNI)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["candidates"][-1]["step"] = "graph"  # a float candidate selected
    (run / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(cpu, "detect", lambda: _cpu({"avx2"}))
    (model,) = load_served_models([run])
    assert "int8_built_on" not in model.meta and "int8_kind_warning" not in model.meta


def test_a_repository_version_gets_the_same_warning(
    make_run_dir: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slimline.serve.repository import load_version

    run = _run(make_run_dir, tmp_path, VNNI)
    monkeypatch.setattr(cpu, "detect", lambda: _cpu({"avx2"}))
    model = load_version(run, "tiny", 3, threads=1)
    assert "x86-avx512-vnni" in model.meta["int8_kind_warning"]


def test_the_int8_steps_serving_knows_are_the_steps_that_produce_int8() -> None:
    from slimline.serve.model import INT8_STEPS
    from slimline.steps import kinds_producing

    assert kinds_producing("onnx-int8") == INT8_STEPS
    assert cpu.recorded_saturates(AVX2) and not cpu.recorded_saturates(VNNI)
    assert not cpu.recorded_saturates({"kind": "arm64-dotprod"})
