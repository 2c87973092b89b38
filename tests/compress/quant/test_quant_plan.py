from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slimline.compress.quant.auto import pick
from slimline.compress.quant.candidates import candidates, forced, format_warnings
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import Prepared
from slimline.compress.quant.trial import Trial
from slimline.cpu import CpuInt8
from slimline.errors import RecipeError
from slimline.measure.quality import Quality
from slimline.recipe import recipe_from_dict

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane

VNNI = CpuInt8("x86_64", frozenset({"avx2", "avx512bw", "avx512_vnni"}))
AVX2 = CpuInt8("x86_64", frozenset({"avx2"}))
ARM = CpuInt8("aarch64", frozenset({"asimddp"}))

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
    tries = candidates(QuantizeConfig(), bert, plan, VNNI)
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
    assert len(candidates(QuantizeConfig(keep_first_last_float=True), bert, plan, VNNI)) == 3
    cnn = Prepared(
        tmp_path / "c.onnx",
        ["/a/Conv", "/b/Conv", "/fc/Gemm"],
        {"/a/Conv": "Conv", "/b/Conv": "Conv", "/fc/Gemm": "Gemm"},
        False,
        {},
    )
    cnn_tries = candidates(QuantizeConfig(), cnn, resolve_plan(cnn.compute_nodes, {}, True), VNNI)
    assert [(s.label, p.tag) for s, p in cnn_tries] == [
        ("static QDQ U8S8 per-channel minmax", ""),
        ("static QDQ U8S8 per-channel percentile 99.99", ""),
        ("static QDQ U8S8 per-channel compute-ops minmax", ""),
        ("static QDQ U8S8 per-channel minmax", "-edges-int8"),
    ]
    # a placement set in the recipe is the only one tried
    compute = QuantizeConfig(quantize_ops="compute")
    plan = resolve_plan(cnn.compute_nodes, {}, True)
    assert [s.label for s, _ in candidates(compute, cnn, plan, VNNI)] == [
        "static QDQ U8S8 per-channel compute-ops minmax",
        "static QDQ U8S8 per-channel compute-ops percentile 99.99",
        "static QDQ U8S8 per-channel compute-ops minmax",
    ]


def _bert(tmp_path: Path) -> tuple[Prepared, list[str]]:
    nodes = ["Attention_0", "/l0/ffn/MatMul", "Attention_1", "/l1/ffn/MatMul"]
    ops = {n: n.split("_")[0].split("/")[-1] for n in nodes}
    return Prepared(tmp_path / "m.onnx", nodes, ops, True, {}), nodes


def test_without_vnni_u8s8_gets_reduce_range_and_u8u8_joins(tmp_path: Path) -> None:
    bert, nodes = _bert(tmp_path)
    plan = resolve_plan(nodes, {}, keep_first_last_float=True)
    labels = [(s.label, p.tag) for s, p in candidates(QuantizeConfig(), bert, plan, AVX2)]
    assert labels == [
        ("static QDQ U8S8 per-channel reduce-range minmax", ""),
        ("static QDQ U8S8 per-channel reduce-range percentile 99.99", ""),
        ("static QDQ U8U8 per-channel minmax", ""),
        ("dynamic S8 per-channel reduce-range", ""),
        ("dynamic U8 per-channel", ""),
        ("dynamic S8 per-channel reduce-range", "-edges-int8"),
    ]
    # VNNI and ARM accumulate in 32 bits: the config's format alone, full 8-bit weights
    for cpu in (VNNI, ARM):
        specs = [s for s, _ in candidates(QuantizeConfig(), bert, plan, cpu)]
        assert {(s.activation_type, s.weight_type, s.reduce_range) for s in specs} == {
            ("uint8", "int8", False)
        }


def test_a_format_set_in_the_recipe_is_kept_on_any_cpu(tmp_path: Path) -> None:
    bert, nodes = _bert(tmp_path)
    plan = resolve_plan(nodes, {}, keep_first_last_float=True)
    for cfg in (QuantizeConfig(reduce_range=False), QuantizeConfig(weight_type="int8")):
        specs = [s for s, _ in candidates(cfg, bert, plan, AVX2)]
        assert {(s.weight_type, s.reduce_range) for s in specs} == {("int8", False)}
        # it runs, with the risk named; the measured fidelity decides
        (warning,) = format_warnings(specs, AVX2)
        assert "reduce_range" in warning and "x86-avx2" in warning
        assert format_warnings(specs, VNNI) == []
    safe = [s for s, _ in candidates(QuantizeConfig(), bert, plan, AVX2)]
    assert format_warnings(safe, AVX2) == []


def _embedding_graph(path: Path) -> None:
    from onnx import TensorProto, helper, numpy_helper, save

    table = numpy_helper.from_array(np.zeros((50, 8), np.float32), "table")
    w = numpy_helper.from_array(np.zeros((8, 8), np.float32), "w")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"], name="emb"),
        helper.make_node("MatMul", ["e", "w"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [table, w],
    )
    save(helper.make_model(graph), str(path))


def test_dynamic_candidates_store_embedding_tables_in_int8(tmp_path: Path) -> None:
    _embedding_graph(tmp_path / "e.onnx")
    prep = Prepared(tmp_path / "e.onnx", ["mm"], {"mm": "MatMul"}, True, {"Gather": 1, "MatMul": 1})
    plan = resolve_plan(["mm"], {}, keep_first_last_float=False)
    tries = candidates(QuantizeConfig(), prep, plan, VNNI)
    assert [s.label for s, _ in tries if s.mode == "dynamic"] == [
        "dynamic S8 per-channel +embeddings"
    ]
    assert not any(s.embeddings for s, _ in tries if s.mode == "static")
    off = candidates(QuantizeConfig(quantize_embeddings=False), prep, plan, VNNI)
    assert not any(s.embeddings for s, _ in off)
    # a Gather over a computed tensor is no table: nothing to store in INT8
    shape_only = Prepared(tmp_path / "m.onnx", ["mm"], {"mm": "MatMul"}, True, {"MatMul": 1})
    assert not any(s.embeddings for s, _ in candidates(QuantizeConfig(), shape_only, plan, VNNI))


def _trial(tmp_path: Path, name: str, size: int, rounds: list[float]) -> Trial:
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(b"\0" * size)
    plan = resolve_plan(["mm"], {}, keep_first_last_float=False)
    t = Trial(QuantSpec("dynamic"), plan, path, {"summary": ""})
    t.latency = {
        "p50": float(np.median(rounds)),
        "band": [min(rounds), max(rounds)],
        "per_round_p50": rounds,
    }
    return t


def test_objective_size_picks_the_smallest_within_budget(tmp_path: Path) -> None:
    big_fast = _trial(tmp_path, "a", 600, [5.0, 5.1, 4.9, 5.0, 5.0])
    small_slow = _trial(tmp_path, "b", 200, [8.0, 8.1, 7.9, 8.0, 8.0])
    assert pick([big_fast, small_slow], "size", 0.03) is small_slow
    assert pick([big_fast, small_slow], "latency", 0.03) is big_fast


def test_latency_ties_go_to_the_smaller_file(tmp_path: Path) -> None:
    fastest = _trial(tmp_path, "a", 600, [5.0, 5.3, 4.8, 6.0, 5.1])
    # slower at the median by 4%, but faster in two of five rounds: the run cannot tell
    as_fast = _trial(tmp_path, "b", 200, [5.2, 5.2, 5.3, 5.5, 5.3])
    assert pick([fastest, as_fast], "latency", 0.03) is as_fast
    # slower by 10% in every round: slower, however small
    slower = _trial(tmp_path, "c", 200, [r * 1.1 for r in [5.0, 5.3, 4.8, 6.0, 5.1]])
    assert pick([fastest, slower], "latency", 0.03) is fastest
    # a few bytes smaller is no reason to give up the fastest median
    same_size = _trial(tmp_path, "d", 590, [5.2, 5.2, 5.3, 5.5, 5.3])
    assert pick([fastest, same_size], "latency", 0.03) is fastest


def test_latency_ties_of_one_size_go_to_the_more_faithful(tmp_path: Path) -> None:
    fastest = _trial(tmp_path, "a", 600, [5.0, 5.3, 4.8, 6.0, 5.1])
    as_fast = _trial(tmp_path, "b", 600, [5.2, 5.2, 5.3, 5.5, 5.3])
    fastest.quality = Quality(0.98, 0.9966, 0.98, 0.1, 1.0)
    as_fast.quality = Quality(0.98, 0.9999, 0.999, 0.01, 1.0)
    assert pick([fastest, as_fast], "latency", 0.03) is as_fast
    # measurably slower: fidelity beyond the budget buys no speed back
    slower = _trial(tmp_path, "c", 600, [r * 1.1 for r in [5.0, 5.3, 4.8, 6.0, 5.1]])
    slower.quality = as_fast.quality
    assert pick([fastest, slower], "latency", 0.03) is fastest


def test_forced_dynamic_mode_quantizes_tables_only_where_there_are_some(tmp_path: Path) -> None:
    _embedding_graph(tmp_path / "e.onnx")
    plan = resolve_plan(["mm"], {}, keep_first_last_float=False)
    cfg = QuantizeConfig(mode="dynamic")
    tables = Prepared(tmp_path / "e.onnx", ["mm"], {"mm": "MatMul"}, True, {"Gather": 1})
    none = Prepared(tmp_path / "m.onnx", ["mm"], {"mm": "MatMul"}, True, {"MatMul": 1})
    assert [s.embeddings for s, _ in forced(cfg, tables, plan)] == [True]
    assert [s.embeddings for s, _ in forced(cfg, none, plan)] == [False]
    off = QuantizeConfig(mode="dynamic", quantize_embeddings=False)
    assert [s.embeddings for s, _ in forced(off, tables, plan)] == [False]


def test_a_latency_tie_never_goes_to_a_larger_file_for_fidelity(tmp_path: Path) -> None:
    """What slimline did with minilm on an AVX2 machine: the fastest median was the smaller file
    (22.8 MB) and a 25.9 MB file tied with it on latency; the larger one won on fidelity and the
    record called it smaller. Of the ties, only files within ``min_gain`` of the smallest count."""
    small = _trial(tmp_path, "small", 228, [0.63, 0.64, 0.62, 0.66, 0.63])
    large = _trial(tmp_path, "large", 259, [0.64, 0.63, 0.65, 0.64, 0.64])
    small.quality = Quality(0.80, 0.995, 0.98, 0.1, None)
    large.quality = Quality(0.81, 0.998, 0.99, 0.1, None)
    assert pick([small, large], "latency", 0.03) is small
    assert pick([large, small], "latency", 0.03) is small
    # a file within min_gain of the smallest is as small: fidelity decides between the two
    close = _trial(tmp_path, "close", 233, [0.64, 0.63, 0.65, 0.64, 0.64])
    close.quality = Quality(0.81, 0.998, 0.99, 0.1, None)
    assert pick([small, close, large], "latency", 0.03) is close
