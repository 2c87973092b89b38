"""The prune step inside a recipe run: cached, restored, composed with INT8, reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slimline.compress.pruning import step as prune_mod
from slimline.pipeline import run_recipe
from slimline.recipe import recipe_from_dict

from .conftest import DIGITS

PRUNE = {
    "target": 0.3,
    "rounds": 2,
    "workers": 1,
    "progress": False,
    "sensitivity_samples": 200,
    "finetune": {"steps": 30, "eval_every": 15, "val_batches": 2, "progress": False},
}


def _recipe(steps: list[Any]) -> dict[str, Any]:
    # objective: size makes each step's acceptance independent of the machine's speed: removing
    # 30% of the MACs shrinks the file well past min_gain, and INT8 shrinks it about 4x
    return {
        "name": "digits-prune",
        "task": str(DIGITS),
        "target": {"threads": 1},
        "budget": {
            "max_metric_drop": 0.05,
            "min_cosine": 0.9,
            "min_gain": 0.1,
            "objective": "size",
        },
        "bench": {
            "rounds": 4,
            "runs_per_round": 50,
            "batch_sizes": [1, 4],
            "warmup": 2,
            "throughput_min_seconds": 0.02,
            "peak_rss": False,
        },
        "steps": steps,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("pipeline")
    recipe = recipe_from_dict(
        _recipe(["export", {"prune": PRUNE}, {"quantize": {"mode": "static", "samples": 128}}])
    )
    run_recipe(recipe, base / "run", cache=base / "cache")
    return base, base / "run", json.loads((base / "run" / "manifest.json").read_text())


def test_prune_then_quantize_records_both_stages(run: tuple[Path, Path, dict[str, Any]]) -> None:
    _, out, m = run
    assert m["status"] == "complete"
    by_name = {c["name"]: c for c in m["candidates"]}
    prune, quant = by_name["prune"], by_name["quantize"]
    assert prune["parent"] == "fp32-onnx"
    assert prune["accepted"] is True and prune["reason"].startswith("smaller: ")
    assert quant["accepted"] is True and quant["parent"] == "prune"  # builds on what was kept
    assert m["selected"] == "quantize"
    assert prune["meta"]["macs"]["removed"] >= 0.3
    assert (out / prune["artifact"]).is_file()
    assert prune["metric"]["value"] >= m["reference_metric"] - 0.05
    assert prune["meta"]["torch"]["latency_ms"]["p50"] > 0


def test_report_shows_heatmap_plan_and_four_way_table(
    run: tuple[Path, Path, dict[str, Any]],
) -> None:
    page = (run[1] / "report.html").read_text()
    assert "Structured pruning" in page and 'alt="sensitivity heatmap' in page
    assert "FP32 vs optimized: PyTorch and ONNX Runtime" in page
    assert page.count("PyTorch</td>") == 2 and page.count("ONNX Runtime</td>") == 2


def test_a_repeated_run_restores_the_pruned_model_from_cache(
    run: tuple[Path, Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _, first = run

    def must_not_run(*a: Any, **kw: Any) -> Any:
        raise AssertionError("the prune step ran again instead of using its cache entry")

    monkeypatch.setattr(prune_mod, "PruneGraph", must_not_run)
    recipe = recipe_from_dict(
        _recipe(["export", {"prune": PRUNE}, {"quantize": {"mode": "static", "samples": 128}}])
    )
    run_recipe(recipe, base / "again", cache=base / "cache")
    again = json.loads((base / "again" / "manifest.json").read_text())
    a = {c["name"]: c for c in first["candidates"]}
    b = {c["name"]: c for c in again["candidates"]}
    assert b["prune"]["meta"]["plan"] == a["prune"]["meta"]["plan"]
    assert b["quantize"]["metric"]["value"] == pytest.approx(a["quantize"]["metric"]["value"])
