"""Inputs frozen into constants and If nodes folded (compress/freeze.py), and the frozen input
dropped from every feed that still carries it: runners, the task's data, the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline import api
from slimline.candidate import Candidate
from slimline.compress.freeze import count_if, freeze_and_fold
from slimline.compress.graph import GraphConfig
from slimline.compress.quant.config import QuantizeConfig
from slimline.constant_inputs import suggest_constants
from slimline.errors import InputMismatchError, ProtocolError, RecipeError
from slimline.measure.runners import OrtRunner
from slimline.recipe import recipe_from_dict
from slimline.serve import BatcherConfig, ServeSettings, run_in_thread
from slimline.serve.model import FakeBackend, ServedModel, TensorSpec, load_served_models
from slimline.serve.protocol import model_metadata, validate_inputs
from slimline.task import load_task
from slimline.tensors import frozen_inputs


def _branch(name: str, factor: float) -> onnx.GraphProto:
    w = np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32) * factor
    k = numpy_helper.from_array(w, f"k_{name}")
    node = helper.make_node("MatMul", ["x", f"k_{name}"], [f"y_{name}"])
    out = helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["N", 4])
    return helper.make_graph([node], name, [], [out], [k])


def if_model(path: Path, *, on_shape: bool = False) -> Path:
    """``y = relu(x @ (2 W if sr == 16000 else 3 W))``; with ``on_shape``, the If asks whether
    ``x``'s fixed axis 1 is 4 instead (``Shape(x, start=1)``: static given the model's shapes)."""
    inits = [numpy_helper.from_array(np.array(4 if on_shape else 16000, np.int64), "want")]
    if on_shape:
        inits.append(numpy_helper.from_array(np.array(0, np.int64), "axis1"))
        nodes = [
            helper.make_node("Shape", ["x"], ["shape"], start=1),
            helper.make_node("Gather", ["shape", "axis1"], ["got"], axis=0),
        ]
    else:
        nodes = [helper.make_node("Identity", ["sr"], ["got"])]
    nodes += [
        helper.make_node("Equal", ["got", "want"], ["cond"]),
        helper.make_node(
            "If", ["cond"], ["m"], then_branch=_branch("then", 2.0), else_branch=_branch("els", 3.0)
        ),
        helper.make_node("Relu", ["m"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    if not on_shape:
        inputs.append(helper.make_tensor_value_info("sr", TensorProto.INT64, []))
    graph = helper.make_graph(
        nodes, "ifm", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _rows(n: int, sr: int = 16000) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    return {"x": x, "sr": np.array(sr, np.int64)}


def test_declared_input_is_frozen_the_if_folded_and_results_match(tmp_path: Path) -> None:
    src = if_model(tmp_path / "m.onnx")
    const = {"sr": np.array(16000, np.int64)}
    out, rec = freeze_and_fold(src, tmp_path / "f.onnx", const, _rows(1), threads=1)
    assert out == tmp_path / "f.onnx" and rec["frozen"] == {"sr": 16000}
    assert rec["if_before"] == 1 and rec["if_folded"] == 1
    folded = onnx.load(str(out))
    assert count_if(folded) == 0 and [i.name for i in folded.graph.input] == ["x"]
    assert {k: v.tolist() for k, v in frozen_inputs(out).items()} == {"sr": 16000}
    rows = _rows(5)
    want = OrtRunner("a", src, 1).run(rows)
    runner = OrtRunner("b", out, 1)
    np.testing.assert_array_equal(runner.run(rows), want)  # the samples still carry sr
    np.testing.assert_array_equal(runner.run({"x": rows["x"]}), want)  # or leave it out
    with pytest.raises(InputMismatchError, match=r"'sr' was frozen to 16000.*8000"):
        runner.run(_rows(5, sr=8000))


def test_if_static_by_shape_folds_without_a_declaration_and_else_the_source_stays(
    tmp_path: Path,
) -> None:
    src = if_model(tmp_path / "s.onnx", on_shape=True)
    x = {"x": _rows(2)["x"]}
    out, rec = freeze_and_fold(src, tmp_path / "sf.onnx", {}, x, threads=1)
    assert rec["if_folded"] == 1 and count_if(onnx.load(str(out))) == 0
    np.testing.assert_array_equal(OrtRunner("b", out, 1).run(x), OrtRunner("a", src, 1).run(x))
    # an If on a runtime input without a declaration: nothing to fold, the source goes on
    dyn = if_model(tmp_path / "d.onnx")
    out, rec = freeze_and_fold(dyn, tmp_path / "df.onnx", {}, _rows(1), threads=1)
    assert out == dyn and rec["if_folded"] == 0 and "kept the source" in rec["fold"]


def _npz(path: Path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return str(path)


@pytest.mark.parametrize(
    ("declared", "fragment"),
    [
        ({"sr": 8000}, r"declared 8000, but samples a\.npz carry 16000 for 'sr'.*fix the value"),
        ({"rate": 16000}, r"no input 'rate' \(it takes x, sr\)"),
        ({"sr": 16000.5}, "does not fit the input's dtype int64"),
        ({"sr": [16000, 1]}, r"has shape \[2\], but the input is int64 scalar"),
        ({"x": 1}, "has a batch axis"),
    ],
)
def test_a_bad_declaration_gets_one_line_naming_the_input_and_the_fix(
    tmp_path: Path, declared: dict[str, Any], fragment: str
) -> None:
    model = if_model(tmp_path / "m.onnx")
    with pytest.raises(RecipeError, match=fragment):
        load_task(str(model), _npz(tmp_path / "a.npz", _rows(8)), constant_inputs=declared)


def test_task_without_the_frozen_input_and_profile_suggestion(tmp_path: Path) -> None:
    model = if_model(tmp_path / "m.onnx")
    samples = _npz(tmp_path / "a.npz", _rows(8))
    task = load_task(str(model), samples)
    (line,) = suggest_constants(task)
    assert "'sr' is 16000 in every sample" in line and "constant_inputs: {sr: 16000}" in line
    declared = load_task(str(model), samples, constant_inputs={"sr": 16000})
    assert declared.constant_inputs["sr"].dtype == np.int64 and not suggest_constants(declared)
    fitted = declared.without_inputs(declared.constant_inputs)
    assert all("sr" not in b for b in fitted.calibration_data())
    assert fitted.signature is not None and "sr" not in fitted.signature.inputs


def test_server_drops_the_frozen_input_and_refuses_another_value() -> None:
    spec = [TensorSpec("x", "float32", (None, 4))]
    model = ServedModel("vad", FakeBackend(spec, spec, lambda t: t))
    model.frozen = {"sr": np.array(16000, np.int64)}
    x = np.zeros((2, 4), np.float32)
    fed = validate_inputs(model, {"x": x, "sr": np.array([16000], np.int32)}, max_batch=8,
                          allow_nonfinite=False)  # fmt: skip
    assert set(fed) == {"x"}
    assert set(validate_inputs(model, {"x": x}, max_batch=8, allow_nonfinite=False)) == {"x"}
    with pytest.raises(ProtocolError, match=r"input 'sr' = 16000.*sends 8000") as info:
        validate_inputs(model, {"x": x, "sr": np.array(8000)}, max_batch=8, allow_nonfinite=False)
    assert info.value.status == 400


def test_a_served_frozen_file_says_what_it_was_frozen_for(tmp_path: Path) -> None:
    const = {"sr": np.array(16000, np.int64)}
    out, _ = freeze_and_fold(if_model(tmp_path / "m.onnx"), tmp_path / "f.onnx", const, None, 1)
    (model,) = load_served_models([out])
    assert model.frozen["sr"].tolist() == 16000 and [s.name for s in model.backend.inputs] == ["x"]
    assert model_metadata(model)["parameters"] == {"constant_inputs": {"sr": 16000}}


def _body(x: np.ndarray, sr: int | None) -> dict[str, Any]:
    inputs = [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    if sr is not None:
        inputs.append({"name": "sr", "shape": [], "datatype": "INT64", "data": [sr]})
    return {"inputs": inputs}


def test_serving_a_frozen_file_over_http(tmp_path: Path) -> None:
    src = if_model(tmp_path / "m.onnx")
    const = {"sr": np.array(16000, np.int64)}
    out, _ = freeze_and_fold(src, tmp_path / "vad.onnx", const, None, 1)
    x = _rows(2)["x"]
    want = OrtRunner("a", src, 1).run(_rows(2))
    settings = ServeSettings(port=0, batching=BatcherConfig(max_batch_size=4))
    with (
        run_in_thread(load_served_models([out]), settings) as url,
        httpx.Client(base_url=url, timeout=10) as client,
    ):
        for sr in (16000, None):  # the frozen value is dropped; leaving it out is fine
            r = client.post("/v2/models/vad/infer", json=_body(x, sr))
            assert r.status_code == 200, r.text
            got = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(want.shape)
            np.testing.assert_allclose(got, want, rtol=1e-6)
        r = client.post("/v2/models/vad/infer", json=_body(x, 8000))
        assert r.status_code == 400 and "'sr' = 16000" in r.text and "8000" in r.text


def _recipe(tmp_path: Path, steps: list[Any]) -> dict[str, Any]:
    return {
        "name": "ifm",
        "task": str(if_model(tmp_path / "m.onnx")),
        "samples": _npz(tmp_path / "a.npz", _rows(32)),
        "constant_inputs": {"sr": 16000},
        "target": {"threads": 1},
        "bench": {"rounds": 2, "runs_per_round": 100, "batch_sizes": [1], "warmup": 1,
                  "throughput_min_seconds": 0.01, "peak_rss": False},
        "steps": steps,
    }  # fmt: skip


def test_a_step_after_the_graph_step_gets_data_without_the_frozen_input(tmp_path: Path) -> None:
    """The quantize step calibrates by feeding the folded graph the task's rows directly."""
    rec = recipe_from_dict(_recipe(tmp_path, [{"graph": {}}, {"quantize": {"samples": 16}}]))
    task = load_task(rec.task, rec.samples, constant_inputs=rec.constant_inputs)
    ctx = api.context_for(task, rec, tmp_path / "w", timed=False)
    graph = api.run_step(ctx, GraphConfig(), ctx.baseline)
    assert graph.meta["frozen"] == {"sr": 16000} and graph.meta["if_folded"] == 1
    int8 = api.run_step(ctx, QuantizeConfig(mode="static", samples=16), graph)
    assert int8.onnx is not None and "sr" in frozen_inputs(int8.onnx)
    # a step that writes its graph anew (a QAT export) gets the record back
    fitted = ctx.for_candidate(graph)
    anew = onnx.load(str(int8.onnx))
    del anew.metadata_props[:]
    onnx.save(anew, tmp_path / "w" / "anew.onnx")
    fitted.keep_frozen([Candidate("qat", "qat", "graph", onnx=tmp_path / "w" / "anew.onnx")])
    assert "sr" in frozen_inputs(tmp_path / "w" / "anew.onnx")
    assert api.evaluate(ctx, int8).cosine_mean > 0.99


def test_constant_inputs_belong_to_an_onnx_task() -> None:
    with pytest.raises(RecipeError, match="constant_inputs applies to an ONNX task"):
        recipe_from_dict({"name": "m", "task": "mnist", "constant_inputs": {"sr": 16000}})


def test_an_openvino_ir_says_which_inputs_it_was_frozen_for(tmp_path: Path) -> None:
    """The IR keeps the frozen values in its model-level rt_info (as NNCF's candidate writes
    them), read back without loading the model."""
    ov = pytest.importorskip("openvino")
    from slimline.tensors import FROZEN_RT_INFO, frozen_to_json

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    model = ov.convert_model(str(src))
    plain = tmp_path / "plain.xml"
    ov.save_model(model, str(plain))
    assert frozen_inputs(plain) == {}
    model.set_rt_info(frozen_to_json({"sr": np.array(16000, np.int64)}), FROZEN_RT_INFO)
    frozen = tmp_path / "frozen.xml"
    ov.save_model(model, str(frozen))
    got = frozen_inputs(frozen)
    assert {k: v.tolist() for k, v in got.items()} == {"sr": 16000}
    assert got["sr"].dtype == np.int64
