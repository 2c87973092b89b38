"""The memory profile: the setting grid, the choice under a budget (on measured rows), the
no-fit error, varying shapes, one real measurement in fresh subprocesses, and the server and
report using a recorded profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.edge.memory import (
    MemoryBudgetError,
    choose,
    measure_settings,
    settings_grid,
    shape_variants,
    workload,
)
from slimline.edge.serving import serving_memory
from slimline.edge.setting import MemorySetting, session_path
from slimline.recipe import recipe_from_dict
from slimline.report.memory import memory_profile as memory_section
from slimline.serve.model import OrtBackend, load_served_models


def matmul_model(path: Path, width: int = 32) -> Path:
    w = np.random.default_rng(0).standard_normal((width, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def table_model(path: Path, rows: int, width: int) -> Path:
    """ids INT64 [N] -> Gather of a [rows, width] FP32 table: an embedding, as text models have
    (its weights are read as they are: ONNX Runtime prepacks no copy of a Gather's table)."""
    table = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "table",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        initializer=[numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def sequence_model(path: Path) -> Path:
    """ids FP32 [N, S] -> ReduceSum over S: a free non-batch dimension, as a text model has."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["ids", "axes"], ["total"], keepdims=0)],
        "seq",
        [helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["N", "S"])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def row(
    label: str, peak: float, p50: float, p99: float | None = None, **setting: Any
) -> dict[str, Any]:
    s = MemorySetting(**setting)
    return {"setting": s.model_dump(), "label": label, "peak_rss_mb": peak, "p50_ms": p50,
            "p99_ms": p99 if p99 is not None else p50 * 2}  # fmt: skip


ROWS = [
    row("default", 400.0, 1.0, threads=2),
    row("no arena", 250.0, 1.1, arena=False, threads=2),
    row("no arena 1 thread", 180.0, 1.8, arena=False, threads=1),
    row("parallel", 390.0, 0.9, execution_mode="parallel", threads=2),
]


def test_the_fastest_setting_under_the_budget_is_chosen() -> None:
    assert choose(ROWS, 1000)["label"] == "parallel"
    assert choose(ROWS, 300)["label"] == "no arena"
    assert choose(ROWS, 200)["label"] == "no arena 1 thread"
    assert choose(ROWS, 180)["label"] == "no arena 1 thread"  # at the budget fits


def test_equal_p50_is_settled_by_p99() -> None:
    rows = [row("a", 100, 1.0, 5.0), row("b", 100, 1.0, 3.0)]
    assert choose(rows, 200)["label"] == "b"


def test_a_budget_below_every_setting_names_the_smallest_peak_and_its_setting() -> None:
    with pytest.raises(MemoryBudgetError) as info:
        choose(ROWS, 100)
    msg = str(info.value)
    assert "\n" not in msg
    assert "180 MB" in msg and "no arena 1 thread" in msg and "100 MB" in msg
    assert info.value.exit_code == 2


def test_a_setting_whose_measurement_failed_is_never_chosen() -> None:
    rows = [*ROWS, {"setting": MemorySetting().model_dump(), "label": "broken", "error": "boom"}]
    assert choose(rows, 1000)["label"] == "parallel"
    with pytest.raises(MemoryBudgetError, match="180 MB"):
        choose(rows, 10)


def test_the_grid_covers_arena_patterns_mode_threads_and_shrinkage_for_varying_shapes() -> None:
    fixed, varying = settings_grid(4, False), settings_grid(4, True)
    assert fixed[0] == MemorySetting(threads=4)  # ONNX Runtime's defaults first
    assert len(fixed) == 40 and len(set(map(str, fixed))) == 40
    assert {s.threads for s in fixed} == {1, 4} and {s.graph_level for s in fixed} == {
        "all",
        "basic",
    }
    mapped = [s for s in fixed if s.mmap_weights]
    assert len(mapped) == 8 and all(
        s.mem_pattern and s.execution_mode == "sequential" for s in mapped
    )
    assert {(s.arena, s.mem_pattern, s.execution_mode) for s in fixed} == {
        (a, p, m) for a in (True, False) for p in (True, False) for m in ("sequential", "parallel")
    }
    assert not any(s.arena_shrinkage for s in fixed)
    shrink = [s for s in varying if s.arena_shrinkage]
    assert len(shrink) == 20 and all(s.arena for s in shrink)
    assert len(settings_grid(1, False)) == 20


def test_shrinkage_is_a_run_option_only_with_the_arena_on() -> None:
    assert MemorySetting().run_options() is None
    assert MemorySetting(arena=False, arena_shrinkage=True).run_options() is None
    assert MemorySetting(arena_shrinkage=True).run_options() is not None


def test_a_free_sequence_dimension_gives_shorter_shapes_first(tmp_path: Path) -> None:
    model = sequence_model(tmp_path / "seq.onnx")
    calls, timed, varying = workload(model, lambda b: {"ids": np.ones((b, 40), np.float32)}, [1, 4])
    assert varying
    assert [c["ids"].shape for c in calls] == [(1, 10), (1, 20), (1, 40), (4, 10), (4, 20), (4, 40)]
    assert calls[timed]["ids"].shape == (1, 40)
    fixed = matmul_model(tmp_path / "m.onnx")
    calls, timed, varying = workload(fixed, lambda b: {"x": np.ones((b, 32), np.float32)}, [1, 2])
    assert not varying and len(calls) == 2 and timed == 0
    assert shape_variants({"x": np.ones((2, 8))}, {"x": ["N", ""]}, set())[0]["x"].shape == (2, 8)


def test_each_setting_is_measured_in_a_fresh_process(tmp_path: Path) -> None:
    model = matmul_model(tmp_path / "m.onnx", 256)
    settings = [MemorySetting(threads=1), MemorySetting(arena=False, mem_pattern=False)]
    calls = [{"x": np.ones((b, 256), np.float32)} for b in (1, 8)]
    rows = measure_settings(model, calls, settings, runs=3)
    weights_mb = 256 * 256 * 4 / 2**20
    for r, s in zip(rows, settings, strict=True):
        assert "error" not in r, r
        assert r["setting"] == s.model_dump() and r["label"] == s.label
        assert r["peak_rss_mb"] >= r["baseline_rss_mb"] + weights_mb * 0.9
        assert 0 < r["p50_ms"] <= r["p99_ms"]
    broken = measure_settings(tmp_path / "missing.onnx", calls, settings[:1], runs=1)
    assert "error" in broken[0]


def test_memory_mapped_weights_load_one_copy_and_answer_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIMLINE_CACHE", str(tmp_path / "cache"))
    rows, width = 16384, 256  # 16 MB of weights: far above the noise of an interpreter's RSS
    model = table_model(tmp_path / "m.onnx", rows, width)
    mapped = MemorySetting(threads=1, mmap_weights=True)
    external = session_path(model, mapped)
    assert external != model and (external.parent / "model.onnx.data").is_file()
    assert external.stat().st_size < 100_000  # the graph only; the weights are beside it
    assert session_path(model, mapped) == external  # written once per source file
    assert session_path(model, MemorySetting(threads=1)) == model
    calls = [{"ids": np.arange(8, dtype=np.int64)}]
    embedded_row, mapped_row = measure_settings(
        model, calls, [MemorySetting(threads=1), mapped], runs=1
    )
    weights_mb = rows * width * 4 / 2**20
    # loading from the file holds the parsed file and the tensors built from it; mapping, one copy
    assert embedded_row["model_rss_mb"] >= 1.5 * weights_mb, embedded_row
    assert mapped_row["model_rss_mb"] <= embedded_row["model_rss_mb"] - 0.5 * weights_mb, mapped_row
    ids = {"ids": np.random.default_rng(1).integers(0, rows, 64)}
    plain = OrtBackend(model, 1).run(ids)
    via_map = OrtBackend(model, 1, memory=mapped).run(ids)
    np.testing.assert_array_equal(plain["y"], via_map["y"])


def test_a_recipe_target_carries_the_budget_outside_the_cache_key() -> None:
    recipe = recipe_from_dict({"name": "r", "task": "mnist", "target": {"memory_mb": 300}})
    assert recipe.target.memory_mb == 300
    assert "memory_mb" not in recipe.target.key_dict()
    assert recipe_from_dict(recipe.to_dict()).target.memory_mb == 300
    with pytest.raises(Exception, match="memory_mb"):
        recipe_from_dict({"name": "r", "task": "mnist", "target": {"memory_mb": -1}})


def _run_dir(root: Path, profile: dict[str, Any]) -> Path:
    run = root / "run"
    (run / "artifacts").mkdir(parents=True)
    matmul_model(run / "artifacts" / "int8.onnx")
    manifest = {"task": {"name": "tiny"}, "selected": "int8", "memory_profile": profile,
                "candidates": [{"name": "int8", "artifact": "artifacts/int8.onnx"}]}  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_serve_runs_the_recorded_setting_and_reselects_under_a_new_budget(tmp_path: Path) -> None:
    profile = {"candidate": "int8", "budget_mb": 300, "batch_sizes": [1, 2, 4, 8],
               "rows": ROWS, "chosen": ROWS[1]}  # fmt: skip
    run = _run_dir(tmp_path, profile)
    (served,) = load_served_models([run], 2, memory=serving_memory(None, 2, 8))
    assert served.meta["memory_setting"] == ROWS[1]["setting"]
    assert isinstance(served.backend, OrtBackend)
    assert served.backend.session.get_session_options().enable_cpu_mem_arena is False
    (served,) = load_served_models([run], 2, memory=serving_memory(200, 2, 8))
    assert served.meta["memory_setting"]["threads"] == 1
    with pytest.raises(MemoryBudgetError, match="180 MB"):
        load_served_models([run], 2, memory=serving_memory(50, 2, 8))


def test_a_model_served_with_a_memory_setting_answers_the_same(tmp_path: Path) -> None:
    model = sequence_model(tmp_path / "seq.onnx")
    x = {"ids": np.arange(12, dtype=np.float32).reshape(3, 4)}
    plain = OrtBackend(model).run(x)["total"]
    lean = OrtBackend(model, memory=MemorySetting(arena_shrinkage=True, mem_pattern=False))
    np.testing.assert_array_equal(lean.run(x)["total"], plain)


def test_the_report_plots_each_setting_and_marks_the_chosen_one() -> None:
    profile = {"candidate": "int8", "budget_mb": 300, "batch_sizes": [1], "rows": ROWS,
               "chosen": ROWS[1], "default": ROWS[0]}  # fmt: skip
    out = memory_section({"memory_profile": profile}, Path("."))
    assert out is not None
    assert "<img" in out and "Chosen: <b>no arena</b>" in out
    assert out.count("<tr") == len(ROWS) + 1
    assert memory_section({}, Path(".")) is None


def test_a_run_with_a_budget_records_the_chosen_setting_and_a_tight_one_fails(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    from slimline.pipeline import run_recipe
    from slimline.record import load_manifest

    tiny_recipe["steps"] = ["export"]
    tiny_recipe["target"]["memory_mb"] = 100_000
    run = run_recipe(recipe_from_dict(tiny_recipe), tmp_path / "ok", cache=cache)
    profile = load_manifest(run.out)["memory_profile"]
    assert profile["candidate"] == load_manifest(run.out)["selected"]
    assert profile["batch_sizes"] == [1, 4] and len(profile["rows"]) == 20  # one thread
    assert profile["chosen"] == choose(profile["rows"], 100_000)
    assert "Memory profile" in (run.out / "report.html").read_text()
    tiny_recipe["target"]["memory_mb"] = 1
    with pytest.raises(MemoryBudgetError, match="smallest peak RSS is"):
        run_recipe(recipe_from_dict(tiny_recipe), tmp_path / "tight", cache=cache)
    failed = load_manifest(tmp_path / "tight")
    assert failed["status"] == "failed" and failed["memory_profile"]["chosen"] is None


def test_serve_with_a_budget_no_setting_fits_is_one_line_naming_the_smallest_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slimline.serve.cli import main as serve_main

    model = matmul_model(tmp_path / "m.onnx")
    argv = [
        str(model),
        "--memory-mb",
        "1",
        "--threads",
        "1",
        "--max-batch-size",
        "1",
        "--port",
        "0",
    ]
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: memory budget 1 MB is below every measured setting")
    assert "smallest peak RSS is" in err and "1 thread" in err
