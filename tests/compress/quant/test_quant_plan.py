from __future__ import annotations

from pathlib import Path

import pytest

from slimline.compress.quant.auto import candidates
from slimline.compress.quant.config import QuantizeConfig
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import Prepared
from slimline.errors import RecipeError
from slimline.recipe import recipe_from_dict

NODES = ["/stem/Conv", "/l1/Conv", "/l2/Conv", "/l2/down/Conv", "/fc/Gemm"]


def test_default_keeps_first_and_last_compute_layers_float() -> None:
    plan = resolve_plan(NODES, {}, keep_first_last_float=True)
    assert plan.float_nodes == ["/stem/Conv", "/fc/Gemm"]
    assert plan.rule["/stem/Conv"] == "first/last compute layer"
    assert resolve_plan(NODES, {}, keep_first_last_float=False).float_nodes == []


def test_precedence_exact_then_regex_in_order_then_default() -> None:
    plan = resolve_plan(
        NODES,
        {"re:/l2/.*": "float", "re:.*Conv": "int8", "/l2/down/Conv": "int8", "/fc/Gemm": "int8"},
        keep_first_last_float=True,
    )
    assert plan.precision["/l2/down/Conv"] == "int8"  # exact beats the regex
    assert plan.precision["/l2/Conv"] == "float"  # first matching regex wins
    assert plan.precision["/stem/Conv"] == "int8"  # a regex beats the first/last default
    assert plan.precision["/fc/Gemm"] == "int8"  # exact beats the first/last default
    assert plan.rule["/l2/Conv"] == "precision map (re:/l2/.*)"


def test_unknown_names_and_dead_patterns_are_errors_naming_them() -> None:
    with pytest.raises(RecipeError, match=r"/nope/Conv.*re:/zzz.*"):
        resolve_plan(NODES, {"/nope/Conv": "float", "re:/zzz.*": "int8"}, True)


def test_with_float_adds_nodes_without_touching_the_original() -> None:
    plan = resolve_plan(NODES, {}, True)
    mixed = plan.with_float(["/l1/Conv"], "mixed precision")
    assert "/l1/Conv" in mixed.float_nodes and "/l1/Conv" not in plan.float_nodes
    assert mixed.to_dict()["float"] == 3


def test_config_round_trips_through_a_recipe_and_rejects_bad_values() -> None:
    data = {
        "name": "q",
        "task": "t.py",
        "steps": [
            {
                "quantize": {
                    "mode": "static",
                    "calibration": "percentile",
                    "precision": {"re:.*fc.*": "float"},
                }
            }
        ],
    }
    recipe = recipe_from_dict(data)
    cfg = recipe.steps[0]
    assert (
        isinstance(cfg, QuantizeConfig)
        and cfg.calibration == "percentile"
        and cfg.percentile == 99.99
    )
    assert recipe_from_dict(recipe.to_dict()) == recipe
    for bad in (
        {"calibration": "kl"},
        {"precision": {"re:(": "float"}},
        {"precision": {"a": "int4"}},
        {"bogus": 1},
    ):
        with pytest.raises(RecipeError):
            recipe_from_dict({**data, "steps": [{"quantize": bad}]})


def test_auto_candidates_follow_the_model_and_the_first_last_rule(tmp_path: Path) -> None:
    nodes = ["Attention_0", "/l0/ffn/MatMul", "Attention_1", "/l1/ffn/MatMul"]
    bert = Prepared(
        tmp_path / "m.onnx", nodes, {n: n.split("_")[0].split("/")[-1] for n in nodes}, True, {}
    )
    plan = resolve_plan(nodes, {}, keep_first_last_float=True)
    tries = candidates(QuantizeConfig(), bert, plan)
    labels = [(spec.label, p.tag) for spec, p in tries]
    assert labels == [
        ("static QDQ U8S8 per-channel minmax", ""),
        ("static QDQ U8S8 per-channel percentile 99.99", ""),
        ("dynamic S8 per-channel", ""),
        ("dynamic S8 per-channel", "-edges-int8"),
    ]
    assert tries[3][1].float_nodes == [] and tries[2][1].float_nodes == [
        "Attention_0",
        "/l1/ffn/MatMul",
    ]
    # an explicit rule is obeyed; a CNN gets no dynamic candidate
    assert len(candidates(QuantizeConfig(keep_first_last_float=True), bert, plan)) == 3
    cnn = Prepared(
        tmp_path / "c.onnx",
        ["/a/Conv", "/b/Conv", "/fc/Gemm"],
        {"/a/Conv": "Conv", "/b/Conv": "Conv", "/fc/Gemm": "Gemm"},
        False,
        {},
    )
    cnn_tries = candidates(QuantizeConfig(), cnn, resolve_plan(cnn.compute_nodes, {}, True))
    assert [(s.label, p.tag) for s, p in cnn_tries] == [
        ("static QDQ U8S8 per-channel minmax", ""),
        ("static QDQ U8S8 per-channel percentile 99.99", ""),
        ("static QDQ U8S8 per-channel minmax", "-edges-int8"),
    ]
