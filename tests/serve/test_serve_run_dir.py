"""End to end with the real pipeline: `slimline optimize` writes a run, `slimline serve` serves
its selected candidate under the task's name, with the artifact's exact outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton

from slimline.pipeline import run_recipe
from slimline.recipe import recipe_from_dict
from slimline.serve import load_served_models, run_in_thread


@pytest.mark.slow
def test_a_pipeline_run_is_served_under_its_task_name(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    manifest = json.loads((out / "manifest.json").read_text())
    selected = next(c for c in manifest["candidates"] if c["name"] == manifest["selected"])
    x = np.random.default_rng(0).standard_normal((3, 1, 12, 12)).astype(np.float32)
    expected = ort.InferenceSession(str(out / selected["artifact"])).run(None, {"x": x})[0]

    models = load_served_models([out])
    assert [m.name for m in models] == ["tiny"]
    with run_in_thread(models) as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        assert client.get_model_metadata("tiny")["inputs"][0]["shape"] == [-1, 1, 12, 12]
        inp = triton.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        got = client.infer("tiny", [inp]).as_numpy("output")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_run_whose_pick_is_an_openvino_ir_is_served(
    make_run_dir: Any, tmp_path: Path, expected_logits: Any
) -> None:
    """A run's NNCF pick is an IR (`.xml`, no ONNX graph): its inputs and outputs come from the
    compiled model's ports."""
    ov = pytest.importorskip("openvino")
    run = make_run_dir(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    onnx_file = run / manifest["candidates"][-1]["artifact"]
    ov.save_model(ov.convert_model(str(onnx_file)), str(run / "artifacts" / "pick.xml"))
    manifest["candidates"][-1]["artifact"] = "artifacts/pick.xml"
    manifest["selected_runtime"] = "openvino"
    (run / "manifest.json").write_text(json.dumps(manifest))
    (model,) = load_served_models([run])
    assert [(s.name, s.dtype, s.shape) for s in model.backend.inputs] == [
        ("x", "float32", (None, 4))
    ]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    got = model.backend.run({"x": x})[model.backend.outputs[0].name]
    # OpenVINO may run f32 models in bf16 on a CPU that has it: the model's values, not its bits
    np.testing.assert_allclose(got, expected_logits(x), rtol=1e-2, atol=1e-2)
