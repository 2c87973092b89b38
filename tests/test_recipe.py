from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slimline.compress.graph import GraphConfig
from slimline.errors import RecipeError
from slimline.export import ExportConfig
from slimline.recipe import BenchConfig, BudgetConfig, TargetConfig, load_recipe, recipe_from_dict


def test_round_trip_through_dict_and_yaml(tiny_recipe: dict[str, Any], tmp_path: Path) -> None:
    r = recipe_from_dict(tiny_recipe)
    assert [type(s) for s in r.steps] == [ExportConfig, GraphConfig]
    again = recipe_from_dict(r.to_dict())
    assert again == r
    f = tmp_path / "r.yaml"
    f.write_text(r.to_yaml())
    assert load_recipe(f) == r


@pytest.mark.parametrize(
    "cfg",
    [
        ExportConfig(),
        GraphConfig(level="basic"),
        TargetConfig(threads=3),
        BudgetConfig(max_metric_drop=0.02),
        BenchConfig(rounds=10, runs_per_round=20),
    ],
)
def test_every_config_round_trips(cfg: Any) -> None:
    assert type(cfg).model_validate(cfg.model_dump(mode="json")) == cfg


def test_unknown_key_is_an_error_naming_the_key(tiny_recipe: dict[str, Any]) -> None:
    tiny_recipe["budgett"] = {}
    with pytest.raises(RecipeError, match="budgett: unknown key"):
        recipe_from_dict(tiny_recipe)


def test_unknown_step_key_and_wrong_type(tiny_recipe: dict[str, Any]) -> None:
    tiny_recipe["steps"] = [{"graph": {"levl": "basic"}}]
    with pytest.raises(RecipeError, match="levl"):
        recipe_from_dict(tiny_recipe)
    tiny_recipe["steps"] = [{"graph": {"level": "ultra"}}]
    with pytest.raises(RecipeError, match="level"):
        recipe_from_dict(tiny_recipe)
    tiny_recipe["steps"] = ["nosuchstep"]
    with pytest.raises(RecipeError, match="unknown step 'nosuchstep'"):
        recipe_from_dict(tiny_recipe)


def test_too_few_timed_runs_rejected(tiny_recipe: dict[str, Any]) -> None:
    tiny_recipe["bench"]["runs_per_round"] = 10
    with pytest.raises(RecipeError, match="at least 200 runs"):
        recipe_from_dict(tiny_recipe)


def test_validate_assignment() -> None:
    b = BudgetConfig()
    with pytest.raises(ValueError):
        b.min_cosine = 2.0


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    bad.write_text("- just a list")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(bad)


def test_relative_task_path_is_relative_to_recipe(tmp_path: Path, tiny_task_file: Path) -> None:
    (tmp_path / "t.py").write_text(tiny_task_file.read_text())
    f = tmp_path / "r.yaml"
    f.write_text("name: x\ntask: t.py\n")
    assert load_recipe(f).task == str(tmp_path / "t.py")


def test_onnx_task_keys_round_trip_and_are_typed(tmp_path: Path) -> None:
    data = {
        "name": "vad",
        "task": "vad.onnx",
        "samples": "calib.npz",
        "eval_samples": "held.npz",
        "inputs": {"state": {"batch_axis": 1}, "sr": {"batch_axis": None}},
        "primary_output": "output",
    }
    r = recipe_from_dict(data)
    assert r.batch_axes() == {"state": 1, "sr": None}
    assert recipe_from_dict(r.to_dict()) == r
    f = tmp_path / "r.yaml"
    f.write_text(r.to_yaml())
    assert load_recipe(f).eval_samples == str(tmp_path / "held.npz")
    with pytest.raises(RecipeError, match=r"inputs\.sr\.batch_axis: Field required"):
        recipe_from_dict({**data, "inputs": {"sr": {}}})
    with pytest.raises(RecipeError, match=r"inputs\.sr\.axis: unknown key"):
        recipe_from_dict({**data, "inputs": {"sr": {"batch_axis": None, "axis": 0}}})
    with pytest.raises(RecipeError, match="greater than or equal to 0"):
        recipe_from_dict({**data, "inputs": {"sr": {"batch_axis": -1}}})
    with pytest.raises(RecipeError, match="eval_samples applies to an ONNX task"):
        recipe_from_dict({**data, "task": "mnist"})


def test_command_line_revalidation_keeps_defaults_apart_from_what_the_recipe_set() -> None:
    """`optimize` validates its overrides by a round trip through a dict; the quantize step's
    automatic mode tries first/last layers in INT8, and picks the INT8 format for the CPU, only
    where the recipe did not set them, so the round trip must not turn defaults into settings."""
    from slimline.commands import revalidated
    from slimline.compress.quant.config import QuantizeConfig

    r = recipe_from_dict(
        {"name": "x", "task": "mnist", "steps": ["export", {"quantize": {"samples": 64}}]}
    )
    r = r.model_copy(update={"target": r.target.model_copy(update={"threads": 1})})
    again = revalidated(r)
    assert again == recipe_from_dict(r.to_dict())
    assert again.step_config(QuantizeConfig).model_fields_set == {"samples"}
    assert again.target.threads == 1
