"""QuantizeConfig rejects a setting its mode never reads, with one line naming the field; a
default value there is harmless (a printed recipe lists every field and must load again)."""

from __future__ import annotations

from typing import Any

import pytest

from slimline.compress.quant.config import QuantizeConfig
from slimline.errors import RecipeError
from slimline.recipe import recipe_from_dict


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"mode": "static", "percentile": 99.9}, "percentile: 99.9"),
        ({"calibration": "entropy"}, "calibration: entropy"),
        ({"per_channel": False}, "per_channel: false"),
        ({"mode": "static", "quantize_embeddings": False}, "quantize_embeddings: false"),
        ({"mode": "dynamic", "calibration": "percentile"}, "calibration: percentile"),
        ({"mode": "dynamic", "activation_type": "int8"}, "activation_type: int8"),
        ({"mode": "dynamic", "quantize_ops": "compute"}, "quantize_ops: compute"),
        ({"mixed_precision": False, "impact_nodes": 3}, "impact_nodes: 3"),
        ({"mode": "static", "recalibrate_near_miss": 0.0}, "recalibrate_near_miss: 0.0"),
        ({"mode": "dynamic", "recalibrate_near_miss": 1.0}, "recalibrate_near_miss: 1.0"),
    ],
)
def test_a_setting_the_mode_ignores_is_a_one_line_error_naming_it(
    settings: dict[str, Any], field: str
) -> None:
    with pytest.raises(RecipeError, match=f"`{field}` is ignored") as info:
        recipe_from_dict({"name": "q", "task": "mnist", "steps": [{"quantize": settings}]})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "static", "calibration": "percentile", "percentile": 99.9},
        {"mode": "dynamic", "quantize_embeddings": False, "per_channel": False},
        {"percentile": 99.9, "activation_type": "int8"},  # auto builds a percentile candidate
        {"mode": "static", "per_channel": False, "quantize_ops": "compute"},
        {"recalibrate_near_miss": 0.0},
    ],
)
def test_settings_the_mode_reads_are_accepted(settings: dict[str, Any]) -> None:
    QuantizeConfig(**settings)


@pytest.mark.parametrize("mode", ["auto", "static", "dynamic"])
def test_every_field_written_out_at_its_default_loads_again(mode: str) -> None:
    cfg = QuantizeConfig(mode=mode)
    again = QuantizeConfig(**cfg.model_dump())
    assert again == cfg
