from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slimline.envlock import environment_record
from slimline.errors import ExportError
from slimline.gate import compare_manifests
from slimline.measure.latency import benchmark
from slimline.pipeline import run_recipe
from slimline.recipe import recipe_from_dict


def _manifest(out: Path) -> Any:
    return json.loads((out / "manifest.json").read_text())


def test_full_run_writes_manifest_artifacts_report(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    assert m["schema"] == 1 and m["status"] == "complete"
    assert set(m["hashes"]) == {"model", "calibration_data", "eval_data"}
    assert all(v.startswith("sha256:") for v in m["hashes"].values())
    assert {"slimline", "python", "torch", "onnx", "onnxruntime"} <= set(m["versions"])
    assert m["step_versions"] == {"export": 3, "graph": 2}  # what each cached step ran
    assert m["environment"] == environment_record()  # the packages against the repository's lock
    names = [c["name"] for c in m["candidates"]]
    assert names[:2] == ["fp32-torch", "fp32-onnx"] and "graph" in names
    onnx = m["candidates"][1]
    assert (out / onnx["artifact"]).is_file() and onnx["accepted"]
    lat = onnx["latency_ms"]
    assert lat["runs"] >= 200 and lat["band"][0] <= lat["p50"] <= lat["band"][1]
    assert lat["p50"] <= lat["p95"] <= lat["p99"]
    assert set(onnx["throughput"]) == {"1", "4"}
    # the FP32 export reproduces the FP32 torch model exactly on the task metric
    assert onnx["metric"]["value"] == m["candidates"][0]["metric"]["value"]
    assert onnx["fidelity"]["cosine_min"] > 0.9999 and onnx["fidelity"]["top1_agreement"] == 1.0
    # BatchNorm folded into the conv: its 2x16 affine parameters are gone from the ONNX graph
    assert onnx["size_bytes"] > 0 and onnx["params"] == m["candidates"][0]["params"] - 32
    graph = m["candidates"][2]
    assert graph["reason"] and graph["meta"]["nodes_after"] <= graph["meta"]["nodes_before"]
    assert m["selected"] in names
    html = (out / "report.html").read_text()
    assert "data:image/png;base64" in html and "fp32-onnx" in html
    assert "by_op_type" in json.dumps(m["profiles"])


def test_rerun_reuses_cache(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = recipe_from_dict(tiny_recipe)
    run_recipe(recipe, tmp_path / "a", cache=cache)
    caplog.set_level("INFO", logger="slimline")
    run_recipe(recipe, tmp_path / "b", cache=cache)
    text = caplog.text
    assert "step export: reusing cached result" in text
    assert "step graph: reusing cached result" in text
    assert "reusing cached figures" in text
    a, b = _manifest(tmp_path / "a"), _manifest(tmp_path / "b")
    assert [c["latency_ms"] for c in a["candidates"]] == [c["latency_ms"] for c in b["candidates"]]


def test_failed_export_check_is_an_error_and_run_records_it(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    tiny_recipe["steps"] = [{"export": {"max_abs_err": 1e-30, "min_cosine": 1.0}}]
    with pytest.raises(ExportError, match="disagrees with PyTorch"):
        run_recipe(recipe_from_dict(tiny_recipe), tmp_path / "r", cache=cache)
    m = _manifest(tmp_path / "r")
    assert m["status"] == "failed" and "disagrees" in m["failure"]["error"]


def test_kill_and_resume(tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path) -> None:
    """SIGKILL a run after its first step; the rerun resumes and leaves no partial file."""
    tiny_recipe["bench"]["rounds"] = 8
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "slimline.cli",
        "optimize",
        str(recipe),
        "--out",
        str(out),
        "--cache",
        str(cache),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    deadline = time.time() + 120
    for line in proc.stderr:
        if "step graph: running" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    if (out / "manifest.json").exists():  # whatever was written is whole, valid JSON
        assert _manifest(out)["status"] in ("running", "complete")
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step export: reusing cached result" in again.stderr
    assert _manifest(out)["status"] == "complete"
    leftovers = [
        p
        for p in [*out.rglob("*"), *cache.rglob("*")]
        if p.name.endswith(".tmp") or p.name.startswith("tmp-")
    ]
    assert leftovers == []


def test_check_gate_detects_slowdown_beyond_noise() -> None:
    def manifest(p50: float, band: tuple[float, float], metric: float) -> dict[str, Any]:
        return {
            "schema": 1,
            "candidates": [
                {
                    "name": "q",
                    "latency_ms": {"p50": p50, "band": list(band)},
                    "metric": {"name": "top1", "value": metric},
                }
            ],
        }

    base = manifest(1.0, (0.95, 1.05), 0.90)
    regs, _ = compare_manifests(manifest(1.30, (1.25, 1.35), 0.90), base)
    assert [r.figure for r in regs] == ["latency p50 ms"]
    # +30% but the band overlaps the baseline's: noise, not a regression
    regs, _ = compare_manifests(manifest(1.30, (1.0, 1.6), 0.90), base)
    assert regs == []
    # within tolerance
    regs, _ = compare_manifests(manifest(1.08, (1.07, 1.09), 0.90), base)
    assert regs == []
    regs, _ = compare_manifests(manifest(1.0, (0.95, 1.05), 0.89), base, max_metric_drop=0.005)
    assert [r.figure for r in regs] == ["metric"] and "drop 0.0100" in regs[0].detail


def test_a_drifting_machine_is_named_in_the_manifest(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final benchmark's baseline moved 1.6x between rounds (a VM changing speed mode): the
    run times batch 1 again with twice the rounds, pools them, and says so in the manifest
    instead of letting the ratios pass as settled."""
    from slimline.pipeline import final

    real = benchmark

    def drifting(cands, sample, bench, threads, **kw):  # type: ignore[no-untyped-def]
        figures = real(cands, sample, bench, threads, **kw)
        if kw.get("desc") == "measure all candidates":
            lat = figures["fp32-onnx"]["latency_ms"]
            # round 1 at 1.6x the slowest round: the spread is at least 1.6x whatever the
            # real rounds measured (scaling round 1 by 1.6 could land under the threshold
            # when round 1 happened to be the fastest)
            rounds = lat["per_round_p50"]
            slowest = max(rounds)
            lat["per_round_p50"] = [slowest * 1.6 if i == 1 else v for i, v in enumerate(rounds)]
        return figures

    monkeypatch.setattr(final, "benchmark", drifting)
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = _manifest(out)
    # measured again with twice the rounds, pooled: three times the recipe's rounds
    base = next(c for c in m["candidates"] if c["name"] == "fp32-onnx")["latency_ms"]
    assert base["rounds"] == len(base["per_round_p50"]) == 3 * tiny_recipe["bench"]["rounds"]
    spread = m["measurement_conditions"]["round_spread"]
    assert spread["fp32-onnx"] >= 1.5 and set(spread) >= {"fp32-onnx", "fp32-torch"}
    assert any("machine speed drifted during the benchmark" in w for w in m["warnings"])
