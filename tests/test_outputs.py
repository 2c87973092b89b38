"""Output declarations: typed configs that round-trip and reject unknown keys, the kinds that fit
a shape (one line naming the output, shape and fitting kinds), and profile's one-line
suggestion, which is never applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from slimline.errors import RecipeError
from slimline.outputs import (
    BoxesOutput,
    CtcOutput,
    LogitsOutput,
    ProbabilityMapOutput,
    fitting_kinds,
    misfit,
    suggest,
)
from slimline.recipe import BudgetConfig, load_recipe, recipe_from_dict


@pytest.mark.parametrize(
    "cfg",
    [
        LogitsOutput(),
        ProbabilityMapOutput(threshold=0.3),
        CtcOutput(blank=5),
        BoxesOutput(decode="decode.py:boxes", iou=0.6),
        BudgetConfig(min_agreement=0.95),
    ],
)
def test_every_declaration_round_trips(cfg: Any) -> None:
    assert type(cfg).model_validate(cfg.model_dump(mode="json")) == cfg


def _onnx_recipe(**extra: Any) -> dict[str, Any]:
    return {"name": "r", "task": "model.onnx", "samples": "s.npz", **extra}


def test_recipe_with_declarations_round_trips_through_yaml(tmp_path: Path) -> None:
    data = _onnx_recipe(
        outputs={
            "maps": {"kind": "probability_map", "threshold": 0.3},
            "seq": {"kind": "ctc"},
            "det": {"kind": "boxes", "decode": "/abs/decode.py:decode"},
        },
        metric="/abs/hook.py:f1",
        budget={"min_agreement": 0.98},
    )
    r = recipe_from_dict(data)
    assert (
        isinstance(r.outputs["maps"], ProbabilityMapOutput) and r.outputs["maps"].threshold == 0.3
    )
    assert isinstance(r.outputs["seq"], CtcOutput) and r.budget.min_agreement == 0.98
    assert recipe_from_dict(r.to_dict()) == r
    f = tmp_path / "r.yaml"
    f.write_text(r.to_yaml())
    assert yaml.safe_load(f.read_text())["outputs"]["seq"] == {"kind": "ctc", "blank": 0}


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ({"y": {"kind": "ctc", "blnk": 0}}, "blnk: unknown key"),
        ({"y": {"kind": "histogram"}}, "does not match any of the expected tags"),
        ({"y": {"kind": "boxes"}}, "decode"),
        ({"y": {"kind": "boxes", "decode": "decode.py"}}, "should match pattern"),
        ({"y": {"kind": "probability_map", "threshold": 1.5}}, "threshold"),
    ],
)
def test_bad_declarations_are_recipe_errors(outputs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict(_onnx_recipe(outputs=outputs))


def test_metric_hook_is_for_onnx_tasks_only() -> None:
    with pytest.raises(RecipeError, match="metric applies to an ONNX task"):
        recipe_from_dict({"name": "r", "task": "mnist", "metric": "m.py:f"})


def test_hook_files_resolve_beside_the_recipe(tmp_path: Path) -> None:
    data = _onnx_recipe(
        outputs={"det": {"kind": "boxes", "decode": "decode.py:decode"}}, metric="hook.py:f1"
    )
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    r = load_recipe(tmp_path / "r.yaml")
    assert r.metric == f"{tmp_path.resolve()}/hook.py:f1"
    det = r.outputs["det"]
    assert isinstance(det, BoxesOutput) and det.decode == f"{tmp_path.resolve()}/decode.py:decode"


def test_kind_that_does_not_fit_names_output_shape_and_fitting_kinds() -> None:
    line = misfit("probs", "ctc", (8, 10))
    assert line is not None and "\n" not in line
    assert "'probs'" in line and "[N, 10]" in line and "2-D" in line
    assert "kinds that fit: logits, boxes" in line
    assert misfit("seq", "ctc", (8, 40, 97)) is None
    assert misfit("maps", "probability_map", (8, 1, 32, 32)) is None
    assert "probability_map" not in fitting_kinds((8, 10))


def test_profile_suggests_ctc_and_probability_map_in_one_line() -> None:
    rng = np.random.default_rng(0)
    ctc = suggest("logits", rng.normal(size=(4, 40, 6625)).astype(np.float32))
    assert ctc is not None and "\n" not in ctc and "{logits: {kind: ctc" in ctc
    maps = suggest("maps", rng.uniform(size=(4, 1, 16, 16)).astype(np.float32))
    assert maps is not None and "{maps: {kind: probability_map" in maps
    assert suggest("scores", rng.normal(size=(4, 10)).astype(np.float32)) is None
    assert suggest("feat", rng.normal(size=(4, 1, 16, 16)).astype(np.float32)) is None  # not [0, 1]
    assert suggest("seq", rng.normal(size=(4, 40, 8)).astype(np.float32)) is None  # small V


def test_cache_keys_follow_the_declarations_and_the_hooks_code(tmp_path: Path) -> None:
    hook = tmp_path / "hook.py"
    hook.write_text("def f1(outputs, labels):\n    return 1.0\n")
    r = recipe_from_dict(_onnx_recipe(metric=f"{hook}:f1"))
    before = r.judging()
    hook.write_text("def f1(outputs, labels):\n    return 0.5\n")
    assert r.judging() != before
    ctc = recipe_from_dict(_onnx_recipe(outputs={"y": {"kind": "ctc"}}))
    assert ctc.judging()["outputs"] == {"y": {"kind": "ctc", "blank": 0}}
    assert ctc.judging() != recipe_from_dict(_onnx_recipe()).judging()
