"""Runtime selection: the target's runtimes, the error without the OpenVINO package, the pick
among (runtime, candidate) pairs, and a runtime-auto run end to end on the tiny task."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from pydantic import ValidationError

from slimline import steps as registry
from slimline.candidate import Candidate
from slimline.config import StepConfig
from slimline.errors import RuntimeMissingError, ServeError, is_user_error
from slimline.pick import side_by_side
from slimline.pipeline import run_recipe
from slimline.recipe import TargetConfig, recipe_from_dict
from slimline.runtimes import Pair, pair_name, pick_pair, runtimes_for, split_pair_name


def test_target_runtime_takes_the_two_runtimes_and_auto_only() -> None:
    for rt in ("onnxruntime", "openvino", "auto"):
        assert TargetConfig(runtime=rt).runtime == rt
    with pytest.raises(ValidationError):
        TargetConfig(runtime="tensorrt")
    assert runtimes_for("onnxruntime") == ["onnxruntime"]


def test_pair_names_round_trip() -> None:
    assert split_pair_name(pair_name("openvino", "quantize-nncf")) == ("openvino", "quantize-nncf")


@pytest.fixture
def no_openvino(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino -> ImportError


@pytest.mark.usefixtures("no_openvino")
@pytest.mark.parametrize("runtime", ["openvino", "auto"])
def test_openvino_without_the_package_names_the_extra(runtime: str) -> None:
    with pytest.raises(RuntimeMissingError, match=r"pip install 'slimline\[openvino\]'") as info:
        runtimes_for(runtime)
    assert is_user_error(info.value) and "\n" not in str(info.value)
    assert runtimes_for("onnxruntime") == ["onnxruntime"]  # ONNX Runtime needs nothing more


@pytest.mark.usefixtures("no_openvino")
def test_a_run_on_openvino_without_the_package_stops_before_any_work(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    recipe = recipe_from_dict({**tiny_recipe, "target": {"threads": 1, "runtime": "openvino"}})
    with pytest.raises(RuntimeMissingError, match=r"slimline\[openvino\]"):
        run_recipe(recipe, tmp_path / "run", cache=cache)
    assert not (tmp_path / "run" / "manifest.json").exists()


def _pair(rt: str, cand: str, p50: float, ok: bool = True, eligible: bool = True) -> Pair:
    return Pair(rt, cand, p50, within_budget=ok, eligible=eligible)


def test_the_pick_is_the_fastest_eligible_pair_within_budget() -> None:
    pairs = [
        _pair("onnxruntime", "fp32-onnx", 10.0),
        _pair("openvino", "fp32-onnx", 9.0),
        _pair("onnxruntime", "quantize", 4.0),
        _pair("openvino", "quantize", 3.0, ok=False),  # fastest, but over budget
        _pair("openvino", "quantize-nncf", 2.0, eligible=False),  # not faster than its parent
        _pair("openvino", "graph", 3.5),
    ]
    assert pick_pair(pairs) == pairs[5]
    assert pick_pair(pairs[:2]) == pairs[1]
    assert pick_pair([_pair("openvino", "q", 1.0, ok=False)]) is None


class _Int4Config(StepConfig):
    kind: ClassVar[str] = "int4-test"


def _measured(name: str, step: str, p50: float, tmp_path: Path) -> Candidate:
    figures = {"latency_ms": {"p50": p50}, "within_budget": True}
    return Candidate(
        name,
        step,
        None if name == "fp32-onnx" else "fp32-onnx",
        onnx=tmp_path / f"{name}.onnx",
        accepted=True,
        measurement={"runtimes": {"onnxruntime": figures}},
    )


def test_the_side_by_side_int8_is_any_step_whose_contract_produces_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new INT8 technique is INT8 to the pick by its registered contract alone; a float step
    (graph), however fast, is not."""
    contract = registry.Contract(consumes=("onnx",), produces=("onnx-int8",))
    spec = registry.StepSpec(_Int4Config, lambda cfg, cand, ctx: cand, contract)
    key: type[StepConfig] = _Int4Config  # the registry's key type
    monkeypatch.setitem(registry._SPECS, key, spec)
    cands = [
        _measured("fp32-onnx", "export", 10.0, tmp_path),
        _measured("graph", "graph", 5.0, tmp_path),
        _measured("int4", "int4-test", 8.0, tmp_path),
    ]
    assert side_by_side(cands) == [
        {"runtime": "onnxruntime", "kind": "FP32", "candidate": "fp32-onnx", "p50_ms": 10.0},
        {"runtime": "onnxruntime", "kind": "best INT8", "candidate": "int4", "p50_ms": 8.0},
    ]


def test_runtime_auto_measures_every_pair_and_serves_the_pick(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    pytest.importorskip("nncf", reason="the openvino extra is not installed")
    raw = {
        **tiny_recipe,
        "target": {"threads": 1, "runtime": "auto"},
        "steps": ["export", {"quantize": {"mode": "static", "samples": 16, "nncf": True}}],
    }
    run = run_recipe(recipe_from_dict(raw), tmp_path / "run", cache=cache)
    m = json.loads((run.out / "manifest.json").read_text())
    assert set(m["runtimes"]) == {"onnxruntime", "openvino"}
    assert m["runtimes"]["openvino"]["settings"]["INFERENCE_NUM_THREADS"] == 1
    assert m["runtimes"]["openvino"]["settings"]["ENABLE_HYPER_THREADING"] is False
    assert m["runtimes"]["onnxruntime"]["settings"]["intra_op_num_threads"] == 1
    by_name = {c["name"]: c for c in m["candidates"]}
    # a pair whose median could no longer fall below a contender's leaves the final benchmark
    # early, and the manifest says so; the others run every round, or until one pair is left
    stopped = run.extra["measurement_conditions"].get("rounds_stopped", {})
    most = max(
        f["latency_ms"]["rounds"]
        for c in m["candidates"]
        for f in (c.get("runtimes") or {}).values()
        if "latency_ms" in f
    )
    for name in ("fp32-onnx", "quantize", "quantize-nncf"):
        runtimes = by_name[name]["runtimes"]
        assert set(runtimes) == {"onnxruntime", "openvino"}, name
        verdicts = by_name[name]["meta"].get("runtime_verdicts", {})
        for rt, f in runtimes.items():
            if name == "fp32-onnx" or verdicts[rt]["accepted"]:  # can be the pick: timed
                rounds = f["latency_ms"]["rounds"]
                left = rounds == most or pair_name(rt, name) in stopped
                assert rounds == 4 or (1 <= rounds < 4 and left), name
                assert f["fidelity"]["cosine_mean"] > 0.9
            else:  # rejected there by its accept/reject test: never the pick, not timed again
                assert "latency_ms" not in f and ("not_timed" in f or "failed" in f)
    assert set(by_name["quantize"]["meta"]["runtime_verdicts"]) == {"onnxruntime", "openvino"}
    ir = by_name["quantize-nncf-ov"]  # NNCF's documented OpenVINO path: an IR, judged on OpenVINO
    assert (
        ir["artifact"].endswith(".xml") and (run.out / ir["artifact"]).with_suffix(".bin").is_file()
    )
    assert ir["meta"]["nncf"]["backend"] == "openvino" and ir["meta"]["nncf"]["fake_quantize"] > 0
    ov_verdict = ir["meta"]["runtime_verdicts"]["openvino"]["reason"]
    assert not ov_verdict.startswith("failed") and "cosine" in ov_verdict
    assert "runs on OpenVINO only" in ir["runtimes"]["onnxruntime"]["failed"]
    pick = m["runtime_pick"]
    eligible = [p for p in pick["pairs"] if p["eligible"] and p["within_budget"]]
    fastest = min(eligible, key=lambda p: p["p50_ms"])
    assert (m["selected"], m["selected_runtime"]) == (fastest["candidate"], fastest["runtime"])
    chosen = by_name[m["selected"]]
    assert chosen["runtime"] == m["selected_runtime"]
    assert chosen["latency_ms"] == chosen["runtimes"][m["selected_runtime"]]["latency_ms"]
    kinds = {(r["runtime"], r["kind"]) for r in pick["side_by_side"]}
    assert {("onnxruntime", "FP32"), ("openvino", "FP32")} <= kinds
    assert "fp32-onnx" in m["profiles_openvino"]  # per-operator time on OpenVINO too
    assert m["profiles_openvino"]["fp32-onnx"]["by_op_type"]

    from slimline.serve import load_served_models

    (served,) = load_served_models([run.out], threads=1)
    assert served.meta["runtime"] == m["selected_runtime"]
    other = "openvino" if m["selected_runtime"] == "onnxruntime" else "onnxruntime"
    if chosen["artifact"].endswith(".xml"):  # an IR runs on OpenVINO only
        with pytest.raises(ServeError, match="runs on OpenVINO only"):
            load_served_models([run.out], threads=1, runtime=other)
        return
    (overridden,) = load_served_models([run.out], threads=1, runtime=other)
    assert overridden.meta["runtime"] == other
    assert overridden.backend.platform.startswith(other)


@pytest.mark.cpu_kinds
def test_nncf_competes_with_the_qdq_pick_on_one_runtime(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    pytest.importorskip("nncf", reason="the openvino extra is not installed")
    raw = {
        **tiny_recipe,
        "steps": ["export", {"quantize": {"mode": "static", "samples": 16, "nncf": True}}],
    }
    run = run_recipe(recipe_from_dict(raw), tmp_path / "run", cache=cache)
    m = json.loads((run.out / "manifest.json").read_text())
    entries = {c["name"]: c for c in m["candidates"]}
    nncf, qdq = entries["quantize-nncf"], entries["quantize"]
    assert nncf["step"] == "nncf" and nncf["meta"]["nncf"]["quantize_linear"] > 0
    assert nncf["reason"] and qdq["reason"]  # both judged against fp32-onnx, on ONNX Runtime
    in_chain = [c["name"] for c in m["candidates"] if not c.get("alternative")]
    if "quantize-nncf" in in_chain:  # kept and faster than the QDQ pick: it took its place
        assert (
            nncf["accepted"] and qdq["alternative"] and qdq["meta"]["replaced_by"] == nncf["name"]
        )
    else:
        assert nncf.get("alternative") and "quantize" in in_chain
    assert m["selected_runtime"] == "onnxruntime" and set(m["runtimes"]) == {"onnxruntime"}
    ir = entries["quantize-nncf-ov"]  # an OpenVINO IR: not built for an ONNX Runtime target
    assert not ir["accepted"] and ir["artifact"] is None and "OpenVINO only" in ir["reason"]


@pytest.mark.cpu_kinds
def test_the_nncf_step_alone_writes_an_int8_model_both_runtimes_load(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    pytest.importorskip("nncf", reason="the openvino extra is not installed")
    raw = {**tiny_recipe, "target": {"threads": 1, "runtime": "openvino"}}
    raw["steps"] = ["export", {"nncf": {"samples": 16}}]
    run = run_recipe(recipe_from_dict(raw), tmp_path / "run", cache=cache)
    m = json.loads((run.out / "manifest.json").read_text())
    step = next(c for c in m["candidates"] if c["step"] == "nncf")
    assert step["meta"]["nncf"]["calibration_items"] >= 1 and step["runtime"] == "openvino"
    assert step["accepted"] == step["reason"].startswith("faster")  # judged on OpenVINO

    from slimline.measure.ov import OvRunner
    from slimline.measure.runners import OrtRunner

    path = run.out / step["artifact"]
    x = {"x": np.zeros((2, 1, 12, 12), np.float32)}
    assert OvRunner("n", path, 1).run(x).shape == OrtRunner("n", path, 1).run(x).shape == (2, 4)
