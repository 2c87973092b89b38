"""A failing step or candidate is rejected with its reason and the run goes on; a run that
cannot go on leaves its manifest and report; only the user's input is ever blamed on the user."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fixtures.int8_kinds import first_static_label
from slimline import steps
from slimline.candidate import Candidate
from slimline.cli import main
from slimline.compress.graph import GraphConfig, graph_step
from slimline.compress.quant import trial
from slimline.config import StepConfig
from slimline.cpu import CpuInt8
from slimline.errors import DataError, ExportError
from slimline.pipeline import run_recipe
from slimline.recipe import recipe_from_dict

_GRAPH: type[StepConfig] = GraphConfig  # the registry's key type


def _manifest(out: Path) -> Any:
    return json.loads((out / "manifest.json").read_text())


def _by_name(m: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in m["candidates"]}


def _replace_graph_step(monkeypatch: pytest.MonkeyPatch, basic: Any) -> None:
    """The graph step runs ``basic`` for ``level: basic``, its real handler otherwise."""

    def handler(cfg: GraphConfig, cand: Candidate, ctx: Any) -> Candidate:
        return basic(cfg, cand, ctx) if cfg.level == "basic" else graph_step(cfg, cand, ctx)

    spec = steps.spec_for(GraphConfig)  # loads the built-in handlers before replacing one
    monkeypatch.setitem(steps._SPECS, _GRAPH, dataclasses.replace(spec, handler=handler))


def test_a_step_failing_in_a_library_is_rejected_and_the_run_completes(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(cfg: GraphConfig, cand: Candidate, ctx: Any) -> Candidate:
        raise RuntimeError("optimizer library exploded in node /stem/Conv")

    _replace_graph_step(monkeypatch, explode)
    tiny_recipe["steps"] = ["export", {"graph": {"level": "basic"}}, {"graph": {}}]
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["status"] == "complete" and "failure" not in m
    failed, after = _by_name(m)["graph"], _by_name(m)["graph-2"]
    assert failed["accepted"] is False and failed["artifact"] is None
    assert "RuntimeError: optimizer library exploded in node /stem/Conv" in failed["reason"]
    assert failed["meta"]["failure"]["type"] == "StepError" and "latency_ms" not in failed
    assert after["parent"] == "fp32-onnx" and after["latency_ms"]["p50"] > 0
    assert any("step graph rejected" in w for w in m["warnings"])
    assert "optimizer library exploded" in (out / "report.html").read_text()


def test_every_quantize_trial_failing_keeps_the_parent_and_completes_the_run(
    tiny_recipe: dict[str, Any],
    tmp_path: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu_kind: CpuInt8,
) -> None:
    def broken(*args: Any, **kw: Any) -> Path:
        raise RuntimeError("quantizer internals failed")

    monkeypatch.setattr(trial, "quantize_model", broken)
    tiny_recipe["steps"] = ["export", {"quantize": {"samples": 16}}]
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["status"] == "complete" and m["selected"] == "fp32-onnx"
    q = _by_name(m)["quantize"]
    assert q["accepted"] is False and "every quantized candidate failed" in q["reason"]
    assert f"{first_static_label(cpu_kind)}: building failed: RuntimeError" in q["reason"]
    trials = q["meta"]["failure"]["candidates"]
    assert len(trials) >= 2 and all("quantizer internals failed" in t["reason"] for t in trials)
    assert (out / "report.html").is_file()


def test_a_candidate_slimline_wrote_that_fails_to_load_is_rejected_not_blamed_on_the_user(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def corrupt(cfg: GraphConfig, cand: Candidate, ctx: Any) -> Candidate:
        path = ctx.workdir / "model.onnx"
        path.write_bytes(b"not a protobuf")
        return Candidate("graph", "graph", cand.name, onnx=path)

    _replace_graph_step(monkeypatch, corrupt)
    tiny_recipe["steps"] = ["export", {"graph": {"level": "basic"}}]
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["status"] == "complete" and m["selected"] == "fp32-onnx"
    g = _by_name(m)["graph"]
    assert g["accepted"] is False and "a candidate slimline wrote" in g["reason"]
    assert "re-export" not in g["reason"] and "corrupt or not an ONNX model" not in g["reason"]
    assert g["meta"]["failure"]["type"] == "CandidateError"


def _onnx_recipe(tmp_path: Path, model: Path, samples: Path) -> Path:
    f = tmp_path / "r.yaml"
    recipe = {"name": "u", "task": str(model), "samples": str(samples), "steps": ["graph"]}
    f.write_text(yaml.safe_dump(recipe))
    return f


def test_a_users_model_onnx_runtime_cannot_load_is_a_one_line_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"\x08\x07garbage that is not a model")
    samples = tmp_path / "x.npz"
    np.savez(samples, x=np.zeros((2, 1, 12, 12), np.float32))
    assert main(["optimize", str(_onnx_recipe(tmp_path, model, samples))]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ONNX Runtime") and "cannot load the model" in err
    assert str(model) in err and "re-export it" in err


def test_a_failed_baseline_export_ends_the_run_with_manifest_report_and_exit_3(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_recipe["steps"] = [{"export": {"max_abs_err": 1e-30, "min_cosine": 1.0}}]
    out = tmp_path / "run"
    with pytest.raises(ExportError, match="disagrees with PyTorch"):
        run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["status"] == "failed" and m["failure"]["user_error"] is False
    assert [c["name"] for c in m["candidates"]] == ["fp32-torch"]
    assert (out / "report.html").is_file()
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(tiny_recipe))
    code = main(["optimize", str(f), "--out", str(tmp_path / "cli"), "--cache", str(cache)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and lines[-1].startswith("error: step export failed on fp32-torch: ")
    assert "exported ONNX disagrees with PyTorch" in lines[-1]


def test_a_user_error_inside_a_step_still_fails_fast(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bad_data(cfg: GraphConfig, cand: Candidate, ctx: Any) -> Candidate:
        raise DataError("calibration_data() yielded no samples; give it input batches")

    _replace_graph_step(monkeypatch, bad_data)
    tiny_recipe["steps"] = ["export", {"graph": {"level": "basic"}}, {"graph": {}}]
    out = tmp_path / "run"
    with pytest.raises(DataError, match="yielded no samples"):
        run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["status"] == "failed" and m["failure"]["user_error"] is True
    assert [c["name"] for c in m["candidates"]] == ["fp32-torch", "fp32-onnx"]
