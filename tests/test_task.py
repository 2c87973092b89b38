from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slimline.errors import DataError, InputMismatchError, ModelFileError, TaskError
from slimline.export import export_module
from slimline.task import check_inputs, load_task, take_samples


def test_task_file_loads(tiny_task_file: Path) -> None:
    t = load_task(str(tiny_task_file))
    assert t.name == "tiny" and t.metric_name == "top1" and t.output_kind == "logits"
    s = t.sample_inputs(10)
    assert s["x"].shape == (10, 1, 12, 12)


def test_missing_factory_is_named(tmp_path: Path, tiny_task_file: Path) -> None:
    src = tiny_task_file.read_text().replace("def model()", "def not_a_model()")
    f = tmp_path / "t.py"
    f.write_text(src)
    with pytest.raises(TaskError, match=r"does not define model\(\)"):
        load_task(str(f))


def test_unknown_example_and_broken_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="unknown task 'nope'"):
        load_task("nope")
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(TaskError, match="failed to import: RuntimeError: boom"):
        load_task(str(f))


def test_take_samples_concatenates_and_cuts() -> None:
    batches = [{"a": np.full((3, 2), i)} for i in range(3)]
    out = take_samples(batches, 5)
    assert out["a"].shape == (5, 2) and out["a"][3, 0] == 1
    assert take_samples([], 5) == {}


def test_check_inputs_messages() -> None:
    spec = {"x": ("float32", [None, 1, 12, 12])}
    check_inputs({"x": np.zeros((2, 1, 12, 12), np.float32)}, spec, "m")
    with pytest.raises(InputMismatchError, match=r"named \['y'\]"):
        check_inputs({"y": np.zeros((2, 1, 12, 12), np.float32)}, spec, "m")
    with pytest.raises(InputMismatchError, match="is float64 but the model expects float32"):
        check_inputs({"x": np.zeros((2, 1, 12, 12))}, spec, "m")
    with pytest.raises(InputMismatchError, match=r"shape \[2, 1, 12, 11\]"):
        check_inputs({"x": np.zeros((2, 1, 12, 11), np.float32)}, spec, "m")


@pytest.fixture
def onnx_file(tmp_path: Path, tiny_task_file: Path) -> Path:
    t = load_task(str(tiny_task_file))
    assert t.model is not None
    return export_module(t.model(), t.sample_inputs(2), tmp_path / "tiny.onnx")


def test_onnx_task_metric_is_fidelity(onnx_file: Path, tmp_path: Path) -> None:
    npz = tmp_path / "s.npz"
    np.savez(npz, x=np.random.default_rng(0).standard_normal((20, 1, 12, 12)).astype(np.float32))
    t = load_task(str(onnx_file), str(npz))
    assert t.metric_name == "fidelity" and t.is_onnx
    batches = list(t.eval_data())
    # a quarter of the rows is held out for evaluation, the rest calibrates; none is shared
    assert sum(len(b[0]["x"]) for b in batches) == 5
    calib = np.concatenate([b["x"] for b in t.calibration_data()])
    held = np.concatenate([b[0]["x"] for b in batches])
    assert len(calib) == 15 and not (calib[:, None] == held[None]).all((2, 3, 4)).any()
    assert "5 of the 20 sample rows" in t.notes[0]
    outs = np.concatenate([lab for _, lab in batches])
    assert t.metric(outs, outs) == pytest.approx(1.0)
    assert t.metric(-outs, outs) == pytest.approx(-1.0)


def test_onnx_task_bad_inputs(onnx_file: Path, tmp_path: Path) -> None:
    npz = tmp_path / "s.npz"
    np.savez(npz, x=np.zeros((4, 1, 10, 10), np.float32))
    with pytest.raises(InputMismatchError, match="shape"):
        load_task(str(onnx_file), str(npz))
    np.savez(npz, image=np.zeros((4, 1, 12, 12), np.float32))
    with pytest.raises(InputMismatchError, match="named"):
        load_task(str(onnx_file), str(npz))
    with pytest.raises(DataError, match="needs sample inputs"):
        load_task(str(onnx_file))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"not a readable \.npz"):
        load_task(str(onnx_file), str(tmp_path / "junk.npz"))


def test_corrupt_and_missing_onnx(tmp_path: Path) -> None:
    npz = tmp_path / "s.npz"
    np.savez(npz, x=np.zeros((4, 1, 12, 12), np.float32))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(ModelFileError, match="corrupt or not an ONNX model"):
        load_task(str(bad), str(npz))
    with pytest.raises(ModelFileError, match="does not exist"):
        load_task(str(tmp_path / "missing.onnx"), str(npz))


def test_a_task_file_imports_its_sibling_modules_in_a_fresh_process(
    tmp_path: Path, tiny_task_file: Path
) -> None:
    """A task split over files (its data helpers beside it) loads the way the pipeline's worker
    processes load it: by path, in an interpreter whose path does not hold the task's folder."""
    import subprocess
    import sys

    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "sibling_helpers_for_task.py").write_text("ROWS = 3\n")
    task = folder / "task.py"
    task.write_text(
        tiny_task_file.read_text() + "\nimport sibling_helpers_for_task\n\nNAME = 'sib'\n"
    )
    code = f"from slimline.task import load_task; print(load_task({str(task)!r}).name)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "sib"
