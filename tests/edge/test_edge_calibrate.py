"""Cascade threshold calibration: the curve's ends are the edge and the cloud alone, the pick
for a target escalation rate or a maximum loss, the error when nothing meets both, and the
command end to end on the tiny task (FP32 cloud, a perturbed edge)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from slimline.cli import main
from slimline.edge.calibrate import CalibrationError, curve, pick
from slimline.edge.scores import softmax_top1
from slimline.serve.cascade import load_threshold


def accuracy(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float((outputs.argmax(1) == labels).mean())


def synthetic() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """10 rows, label 0; the edge is wrong on rows 0-2 and unsure (scores lowest) on 0-3."""
    labels = np.zeros(10, dtype=int)
    cloud = np.tile([3.0, 0.0], (10, 1))
    edge = np.tile([4.0, 0.0], (10, 1))
    edge[:3] = [[0.0, 0.2], [0.0, 0.1], [0.0, 0.05]]  # wrong, unsure (row 2 the least sure)
    edge[3] = [0.3, 0.0]  # right, unsure
    return edge, cloud, labels


def test_the_curve_runs_from_the_edge_alone_to_the_cloud_alone() -> None:
    edge, cloud, labels = synthetic()
    points = curve(edge, cloud, labels, softmax_top1(edge), accuracy)
    assert points[0]["escalation"] == 0.0 and points[0]["metric"] == pytest.approx(0.7)
    assert points[-1]["escalation"] == 1.0 and points[-1]["metric"] == 1.0
    assert [p["escalation"] for p in points] == sorted(p["escalation"] for p in points)
    at_30 = next(p for p in points if p["escalation"] == pytest.approx(0.3))
    assert at_30["metric"] == 1.0  # the three wrong rows are the three least sure


def test_the_pick_for_a_rate_or_a_loss() -> None:
    edge, cloud, labels = synthetic()
    points = curve(edge, cloud, labels, softmax_top1(edge), accuracy)
    lossless = pick(points, 1.0, max_loss=0.0)
    assert lossless["escalation"] == pytest.approx(0.3) and lossless["metric"] == 1.0
    assert pick(points, 1.0, target_escalation=0.2)["metric"] == pytest.approx(0.9)
    assert pick(points, 1.0, target_escalation=0.5)["escalation"] == pytest.approx(0.4)  # spent
    assert pick(points, 1.0, max_loss=0.1)["escalation"] == pytest.approx(0.2)
    with pytest.raises(CalibrationError, match=r"best at that rate is 0\.9000") as info:
        pick(points, 1.0, target_escalation=0.2, max_loss=0.0)
    assert "\n" not in str(info.value)


def _perturbed_edge(fp32: Path, out: Path) -> Path:
    """The FP32 model with its head's bias shifted, so low-margin rows change class."""
    model = onnx.load(str(fp32))
    bias = next(i for i in model.graph.initializer if list(i.dims) == [4])
    shifted = numpy_helper.to_array(bias) + np.array([0.06, -0.02, 0.02, -0.06], np.float32)
    bias.CopyFrom(numpy_helper.from_array(shifted.astype(np.float32), bias.name))
    onnx.save(model, str(out))
    return out


def test_calibrate_writes_the_curve_and_a_threshold_serve_reads(
    tiny_recipe: dict[str, Any],
    tiny_task_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slimline import api, load_task
    from slimline.recipe import recipe_from_dict

    task = load_task(str(tiny_task_file))
    ctx = api.context_for(task, recipe_from_dict(tiny_recipe), tmp_path / "w", timed=False)
    assert ctx.baseline.onnx is not None
    cloud = ctx.baseline.onnx
    edge = _perturbed_edge(cloud, tmp_path / "edge.onnx")
    out = tmp_path / "cal" / "cascade.json"
    argv = ["cascade", "calibrate", str(edge), str(cloud), "--task", str(tiny_task_file),
            "--max-loss", "0", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert doc["cloud_metric"] == 1.0 and doc["edge_metric"] < 1.0  # labels are the FP32's
    assert doc["chosen"]["metric"] == 1.0
    least = min(p["escalation"] for p in doc["curve"] if p["metric"] == 1.0)
    assert doc["chosen"]["escalation"] == least < 1.0
    assert load_threshold(str(out)) == {"threshold": doc["threshold"], "score": "softmax"}
    assert "--cascade-threshold" in capsys.readouterr().out
    assert main([*argv[:4], "--target-escalation", "2"]) == 2
    assert main(argv[:4]) == 2  # an ONNX edge names no task
    assert "pass --task" in capsys.readouterr().err
