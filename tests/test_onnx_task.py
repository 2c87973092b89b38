"""ONNX tasks take real input signatures: batch axes inferred, scalars passed whole, a fixed
batch of 1 fed row by row, every output compared, evaluation rows held out, bad samples named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from onnx import TensorProto

from fixtures.signatures import (
    batch_one_in_fact_model,
    fixed_batch_model,
    fixed_batch_samples,
    indexed_model,
    passthrough_model,
    recurrent_model,
    recurrent_samples,
)
from slimline.cli import main
from slimline.errors import DataError, InputMismatchError, RecipeError
from slimline.measure.runners import OrtRunner
from slimline.task import load_task


def _npz(path: Path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return str(path)


@pytest.fixture
def recurrent(tmp_path: Path) -> Path:
    return recurrent_model(tmp_path / "vad.onnx")


@pytest.fixture
def fixed(tmp_path: Path) -> Path:
    return fixed_batch_model(tmp_path / "ocr.onnx")


@pytest.mark.parametrize("named", [False, True])
def test_batch_axes_inferred_from_dims_and_samples(tmp_path: Path, named: bool) -> None:
    model = recurrent_model(tmp_path / "m.onnx", named=named)
    t = load_task(str(model), _npz(tmp_path / "s.npz", recurrent_samples(12)))
    sig = t.signature
    assert sig is not None
    assert sig.inputs == {"input": 0, "state": 1, "sr": None}
    assert sig.outputs == {"output": 0, "stateN": 1} and sig.max_batch is None
    assert sig.primary_output == "output"
    one = t.sample_inputs(1)
    assert (
        one["state"].shape == (2, 1, 4) and one["sr"].shape == () and one["input"].shape == (1, 16)
    )


def test_two_rows_make_the_batch_axis_unambiguous_only_where_sizes_differ(tmp_path: Path) -> None:
    """With 2 rows the state [2, batch, 4] still has one axis that can hold the batch."""
    model = recurrent_model(tmp_path / "m.onnx")
    t = load_task(str(model), _npz(tmp_path / "s.npz", recurrent_samples(2)))
    assert t.signature is not None and t.signature.inputs["state"] == 1


def test_fixed_batch_of_one_is_fed_row_by_row(tmp_path: Path, fixed: Path) -> None:
    samples = fixed_batch_samples(9)
    t = load_task(str(fixed), _npz(tmp_path / "s.npz", samples))
    assert t.signature is not None and t.signature.max_batch == 1
    runner = OrtRunner("m", fixed, 1, t.signature)
    together = runner.run(samples)
    one_by_one = [OrtRunner("m", fixed, 1).run({"x": samples["x"][i : i + 1]}) for i in range(9)]
    assert together.shape == (9, 20)
    np.testing.assert_allclose(together, np.concatenate(one_by_one), rtol=0, atol=0)


def test_free_batch_axis_that_fails_on_two_rows_is_fed_row_by_row(tmp_path: Path) -> None:
    model = batch_one_in_fact_model(tmp_path / "m.onnx")
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    t = load_task(str(model), _npz(tmp_path / "s.npz", {"x": x}))
    assert t.signature is not None and t.signature.max_batch == 1
    np.testing.assert_array_equal(OrtRunner("m", model, 1, t.signature).run({"x": x}), x)


def test_held_out_split_is_disjoint_and_deterministic(tmp_path: Path, recurrent: Path) -> None:
    npz = _npz(tmp_path / "s.npz", recurrent_samples(20))

    def rows(task_rows: list[dict[str, np.ndarray]]) -> set[float]:
        return {float(v) for b in task_rows for v in b["input"][:, 0]}

    t = load_task(str(recurrent), npz)
    calib, held = rows(list(t.calibration_data())), rows([b for b, _ in t.eval_data()])
    assert len(calib) == 15 and len(held) == 5 and not calib & held
    again = load_task(str(recurrent), npz)
    assert rows([b for b, _ in again.eval_data()]) == held
    assert "held out of calibration" in t.notes[0]


def test_separate_eval_samples_are_used_whole(tmp_path: Path, recurrent: Path) -> None:
    a = _npz(tmp_path / "a.npz", recurrent_samples(10, seed=1))
    b = _npz(tmp_path / "b.npz", recurrent_samples(6, seed=2))
    t = load_task(str(recurrent), a, b)
    assert sum(len(x["input"]) for x in t.calibration_data()) == 10
    evaluated = [x for x, _ in t.eval_data()]
    assert sum(len(x["input"]) for x in evaluated) == 6 and "b.npz" in t.notes[0]
    np.testing.assert_array_equal(evaluated[0]["state"], np.load(b)["state"])


def test_one_row_cannot_be_split(tmp_path: Path, recurrent: Path) -> None:
    with pytest.raises(DataError, match=r"one row cannot be split.*eval_samples"):
        load_task(str(recurrent), _npz(tmp_path / "s.npz", recurrent_samples(1)))


def _bad(tmp_path: Path, model: Path, **changes: Any) -> str:
    samples = {**recurrent_samples(8), **changes}
    samples = {k: v for k, v in samples.items() if v is not None}
    with pytest.raises(InputMismatchError) as err:
        load_task(str(model), _npz(tmp_path / "bad.npz", samples))
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_bad_samples_get_one_line_naming_input_expectation_and_fix(
    tmp_path: Path, recurrent: Path
) -> None:
    rng = np.random.default_rng(0)
    msg = _bad(tmp_path, recurrent, audio=np.zeros((8, 16), np.float32))
    assert "no input named 'audio'" in msg and "sr (int64 scalar)" in msg and "name one" in msg
    msg = _bad(tmp_path, recurrent, sr=np.array(16000, np.int32))
    assert "'sr' is int32" in msg and "int64 scalar" in msg and ".astype(np.int64)" in msg
    msg = _bad(tmp_path, recurrent, state=rng.standard_normal((2, 8, 5)).astype(np.float32))
    assert "'state' has shape [2, 8, 5]" in msg and "float32 [2, batch, 4]" in msg
    assert "axis 2 must be 4" in msg
    msg = _bad(tmp_path, recurrent, state=np.zeros((2, 6, 4), np.float32))
    assert "'state'" in msg and "no axis of 8 rows" in msg and "same number of rows" in msg
    msg = _bad(tmp_path, recurrent, input=np.float32(0.5))
    assert "'input' is a 0-d array" in msg and "rows (batch) axis" in msg
    msg = _bad(tmp_path, recurrent, input=np.zeros(16, np.float32))
    assert "'input' has 1 axes [16]" in msg


def test_named_batch_dim_names_the_row_count_mismatch(tmp_path: Path) -> None:
    model = recurrent_model(tmp_path / "m.onnx", named=True)
    msg = _bad(tmp_path, model, state=np.zeros((2, 6, 4), np.float32))
    assert "'state' has 6 rows (axis 1" in msg and "'input' has 8" in msg


def test_ambiguous_axis_asks_for_the_recipe_key_and_the_key_settles_it(tmp_path: Path) -> None:
    free: list[int | str | None] = [None, None, None]
    model = passthrough_model(
        tmp_path / "m.onnx", {"a": (TensorProto.FLOAT, [None, 3]), "b": (TensorProto.FLOAT, free)}
    )
    npz = _npz(
        tmp_path / "s.npz",
        {"a": np.zeros((4, 3), np.float32), "b": np.zeros((2, 4, 4), np.float32)},
    )
    with pytest.raises(InputMismatchError, match=r"'b' has 4 entries on axes \[1, 2\].*batch_axis"):
        load_task(str(model), npz)
    t = load_task(str(model), npz, batch_axes={"b": 2})
    assert t.signature is not None and t.signature.inputs == {"a": 0, "b": 2}
    assert t.signature.outputs == {"a_out": 0, "b_out": 2}


def test_recipe_axis_hints_are_checked(tmp_path: Path, recurrent: Path) -> None:
    npz = _npz(tmp_path / "s.npz", recurrent_samples(8))
    with pytest.raises(RecipeError, match="'stat' is not an input"):
        load_task(str(recurrent), npz, batch_axes={"stat": 1})
    with pytest.raises(RecipeError, match="out of range for a 3-axis input"):
        load_task(str(recurrent), npz, batch_axes={"state": 3})
    with pytest.raises(RecipeError, match=r"'logits' is not an output.*output, stateN"):
        load_task(str(recurrent), npz, primary_output="logits")
    t = load_task(str(recurrent), npz, batch_axes={"state": 1, "sr": None}, primary_output="stateN")
    assert t.signature is not None and t.signature.primary_output == "stateN"
    assert next(iter(t.eval_data()))[1].shape[1:] == (2, 4)  # stateN, rows first


def test_samples_the_model_fails_on_get_one_line_with_the_runtimes_cause(tmp_path: Path) -> None:
    model = indexed_model(tmp_path / "m.onnx")
    x = np.zeros((4, 3), np.float32)
    t = load_task(str(model), _npz(tmp_path / "s.npz", {"x": x, "index": np.array(2)}))
    assert t.signature is not None and t.signature.inputs == {"x": 0, "index": None}
    with pytest.raises(DataError) as err:
        load_task(str(model), _npz(tmp_path / "bad.npz", {"x": x, "index": np.array(9)}))
    msg = str(err.value)
    assert (
        "fails on the first sample row" in msg
        and "out of data bounds, idx=9" in msg
        and "\n" not in msg
    )


def test_a_fixed_batch_above_one_is_refused(tmp_path: Path) -> None:
    model = passthrough_model(tmp_path / "m.onnx", {"x": (TensorProto.FLOAT, [4, 3])})
    npz = _npz(tmp_path / "s.npz", {"x": np.zeros((4, 3), np.float32)})
    with pytest.raises(InputMismatchError, match="cannot tell which axis"):
        load_task(str(model), npz)
    with pytest.raises(InputMismatchError, match="fixes the batch axis of input 'x' at 4"):
        load_task(str(model), npz, batch_axes={"x": 0})


def _recipe(tmp_path: Path, model: Path, samples: dict[str, np.ndarray]) -> Path:
    recipe = {
        "name": model.stem,
        "task": str(model),
        "samples": _npz(tmp_path / f"{model.stem}.npz", samples),
        "target": {"threads": 1},
        "bench": {
            "rounds": 4,
            "runs_per_round": 50,
            "batch_sizes": [1, 4],
            "throughput_min_seconds": 0.02,
            "warmup": 2,
            "peak_rss": False,
        },
        "steps": [{"graph": {"level": "extended"}}, {"quantize": {"samples": 16}}],
    }
    path = tmp_path / f"{model.stem}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _optimize(tmp_path: Path, recipe: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SLIMLINE_CACHE", str(cache))
    out = tmp_path / f"run-{recipe.stem}"
    assert main(["optimize", str(recipe), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and (out / "report.html").is_file()
    return m


def test_recurrent_model_end_to_end(
    tmp_path: Path, recurrent: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, recurrent, recurrent_samples(48))
    doc = yaml.safe_load(recipe.read_text())  # the sample rate frozen by the graph step
    recipe.write_text(yaml.safe_dump({**doc, "constant_inputs": {"sr": 16000}}))
    m = _optimize(tmp_path, recipe, cache, monkeypatch)
    assert m["task"]["constant_inputs"] == {"sr": 16000}
    graph = next(c for c in m["candidates"] if c["name"] == "graph")
    assert graph["meta"]["frozen"] == {"sr": 16000}
    sig = m["task"]["signature"]
    assert sig["inputs"]["state"] == {"batch_axis": 1} and sig["inputs"]["sr"] == {
        "batch_axis": None
    }
    assert "12 of the 48 sample rows" in m["task"]["notes"][0]
    measured = [c for c in m["candidates"] if not c.get("alternative")]
    assert {c["name"] for c in measured} >= {"fp32-onnx", "graph", "quantize"}
    for c in measured:
        per = c["fidelity"]["outputs"]
        assert set(per) == {"output", "stateN"}
        assert c["fidelity"]["cosine_mean"] == min(f["cosine_mean"] for f in per.values())
        assert set(c["throughput"]) == {"1", "4"}
    base = next(c for c in measured if c["name"] == "fp32-onnx")
    assert base["fidelity"]["outputs"]["stateN"]["max_abs_err"] == 0.0
    html = (tmp_path / "run-vad" / "report.html").read_text()
    assert "Fidelity per output" in html and "none (passed whole to every call)" in html


def test_fixed_batch_model_end_to_end(
    tmp_path: Path, fixed: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _optimize(tmp_path, _recipe(tmp_path, fixed, fixed_batch_samples(24)), cache, monkeypatch)
    assert m["task"]["signature"]["max_batch"] == 1
    for c in (c for c in m["candidates"] if not c.get("alternative")):
        assert set(c["throughput"]) == {"1"}
        assert "fixed batch" in c["throughput_not_applicable"]["4"]
        assert c["fidelity"]["outputs"]["y"]["cosine_mean"] > 0.9
    html = (tmp_path / "run-ocr" / "report.html").read_text()
    assert "n/a" in html and "one row per call" in html


def test_profile_takes_eval_samples(
    tmp_path: Path, recurrent: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIMLINE_CACHE", str(cache))
    a = _npz(tmp_path / "a.npz", recurrent_samples(8, seed=1))
    b = _npz(tmp_path / "b.npz", recurrent_samples(4, seed=2))
    out = tmp_path / "run"
    args = ["profile", str(recurrent), "--samples", a, "--eval-samples", b, "--out", str(out)]
    assert main([*args, "--threads", "1"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["recipe"]["eval_samples"] == b and "evaluation uses b.npz" in m["task"]["notes"][0]
