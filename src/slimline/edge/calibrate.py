"""Threshold calibration of an edge-cloud cascade on the task's evaluation data.

Both models run on the evaluation data once. For every threshold (each distinct edge confidence
score, thinned to at most ``points``) the rows scored below it take the cloud's output, and the
task's own metric is computed on the mixed outputs: the curve of metric against escalation rate.
:func:`pick` chooses the threshold for a target escalation rate (the best metric at or under
it, spending the budget among equals) or for a maximum metric loss against the cloud model
alone (the least escalation within it). ``slimline serve --cascade-threshold cascade.json`` reads the chosen threshold and score.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CalibrationError, SlimlineError
from ..measure.quality import collect_outputs
from ..measure.runners import OrtRunner
from ..recipe import recipe_from_dict
from ..record import atomic_write_bytes, atomic_write_text, load_manifest
from ..task import load_task
from .scores import resolve_score

__all__ = ["CalibrationError", "calibrate", "curve", "pick", "plot_curve"]

Point = dict[str, float]


def _mix(edge: np.ndarray, cloud: np.ndarray, escalate: np.ndarray) -> np.ndarray:
    mask = escalate.reshape((-1,) + (1,) * (edge.ndim - 1))
    return np.where(mask, cloud, edge)


def _thresholds(scores: np.ndarray, points: int) -> np.ndarray:
    """Every distinct score (a row escalates when its score is below the threshold), thinned
    to about ``points``, plus one above all (everything escalates)."""
    distinct = np.unique(scores)
    if len(distinct) > points:
        distinct = distinct[np.linspace(0, len(distinct) - 1, points).round().astype(int)]
    top = np.nextafter(distinct[-1], np.inf) if len(distinct) else 0.0
    return np.unique(np.concatenate([distinct, [top]]))


def curve(
    edge: np.ndarray,
    cloud: np.ndarray,
    labels: Any,
    scores: np.ndarray,
    metric: Callable[[np.ndarray, Any], float],
    points: int = 400,
) -> list[Point]:
    """(threshold, escalation rate, metric) for each threshold, escalation ascending."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(scores) != len(edge) or edge.shape != cloud.shape:
        raise SlimlineError(
            f"the edge outputs {edge.shape}, cloud outputs {cloud.shape} and {len(scores)} scores "
            "do not line up; calibrate two models of the same task"
        )
    out = []
    for t in _thresholds(scores, points):
        escalate = scores < t
        value = float(metric(_mix(edge, cloud, escalate), labels))
        out.append({"threshold": float(t), "escalation": float(escalate.mean()), "metric": value})
    return out


def pick(
    points: list[Point],
    cloud_metric: float,
    *,
    target_escalation: float | None = None,
    max_loss: float | None = None,
) -> Point:
    """The threshold: with ``target_escalation``, the best metric at or under that rate (among
    equal metrics the most escalation: the budget given is spent where it keeps the metric on
    unseen data); with ``max_loss``, the least escalation whose metric is within it of the
    cloud's; with both, the least escalation meeting both."""
    if target_escalation is None and max_loss is None:
        raise ValueError("give target_escalation, max_loss or both")
    ok = [
        p
        for p in points
        if (target_escalation is None or p["escalation"] <= target_escalation + 1e-12)
        and (max_loss is None or cloud_metric - p["metric"] <= max_loss + 1e-12)
    ]
    if not ok:
        raise CalibrationError(_no_point(points, cloud_metric, target_escalation, max_loss))
    if max_loss is None:
        return max(ok, key=lambda p: (p["metric"], p["escalation"]))
    return min(ok, key=lambda p: (p["escalation"], -p["metric"]))


def _no_point(
    points: list[Point], cloud_metric: float, rate: float | None, loss: float | None
) -> str:
    within = [p for p in points if p["escalation"] <= (rate or 0) + 1e-12]
    best = max(within, key=lambda p: p["metric"]) if within else points[0]
    return (
        f"no threshold escalates at most {rate:g} of the rows within {loss:g} of the cloud's "
        f"metric {cloud_metric:.4f}: the best at that rate is {best['metric']:.4f} at "
        f"{best['escalation']:.3f}; allow more escalation or a larger --max-loss"
    )


def plot_curve(doc: dict[str, Any], path: Path) -> None:
    """Metric against escalation rate, with the edge, the cloud and the chosen point."""
    from ..report.plots import figure, plt

    pts = doc["curve"]
    fig, ax = figure()
    ax.plot([p["escalation"] for p in pts], [p["metric"] for p in pts], label="cascade")
    ax.axhline(doc["cloud_metric"], color="gray", linestyle="--", label="cloud alone")
    ax.axhline(doc["edge_metric"], color="gray", linestyle=":", label="edge alone")
    chosen = doc["chosen"]
    ax.scatter([chosen["escalation"]], [chosen["metric"]], color="red", zorder=3,
               label=f"chosen: threshold {chosen['threshold']:.4g}")  # fmt: skip
    ax.set_xlabel("escalation rate (share of rows sent to the cloud)")
    ax.set_ylabel(doc.get("metric_name") or "metric")
    ax.legend(fontsize=8)
    import io

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _task_for(edge: Path, task_spec: str | None) -> Any:
    """The task named by ``--task``, else the one the edge's run directory was made from."""
    if task_spec is not None:
        return load_task(task_spec)
    if not edge.is_dir():
        raise SlimlineError(
            f"{edge} is an ONNX file, which names no task; pass --task (an example name or a "
            "task .py file) for its evaluation data"
        )
    recipe = recipe_from_dict(load_manifest(edge)["recipe"])
    return load_task(recipe.task, recipe.samples, recipe.eval_samples,
                     batch_axes=recipe.batch_axes(), primary_output=recipe.primary_output)  # fmt: skip


def _score_spec(task: Any, score: str | None) -> str:
    """``--score``, else the task's own ``cascade_score`` function if it has one, else softmax."""
    if score is not None:
        return score
    if task.extra("cascade_score") is not None and str(task.source).endswith(".py"):
        return f"{task.source}:cascade_score"
    return "softmax"


def calibrate(
    edge: Path,
    cloud: Path,
    *,
    task_spec: str | None = None,
    score: str | None = None,
    target_escalation: float | None = None,
    max_loss: float | None = None,
    threads: int = 1,
    limit: int | None = None,
) -> dict[str, Any]:
    """Run both models on the task's evaluation data, sweep the threshold, and choose one."""
    from ..serve.model import resolve_model_path

    task = _task_for(edge, task_spec)
    spec = _score_spec(task, score)
    outputs = {}
    for tier, path in (("edge", edge), ("cloud", cloud)):
        _, onnx_path, _ = resolve_model_path(path)
        runner = OrtRunner(tier, onnx_path, threads, task.signature, user_model=True)
        outputs[tier], labels, _ = collect_outputs(runner, task, limit)
    scores = resolve_score(spec)(outputs["edge"])
    points = curve(outputs["edge"], outputs["cloud"], labels, scores, task.metric)
    cloud_metric, edge_metric = points[-1]["metric"], points[0]["metric"]
    if target_escalation is None and max_loss is None:
        max_loss = 0.001
    chosen = pick(points, cloud_metric, target_escalation=target_escalation, max_loss=max_loss)
    return {
        "task": task.name,
        "metric_name": task.metric_name,
        "edge": str(edge),
        "cloud": str(cloud),
        "score": spec,
        "rows": len(scores),
        "edge_metric": edge_metric,
        "cloud_metric": cloud_metric,
        "target_escalation": target_escalation,
        "max_loss": max_loss,
        "threshold": chosen["threshold"],
        "chosen": chosen,
        "curve": points,
    }


def write_calibration(doc: dict[str, Any], out: Path) -> Path:
    """``out`` (JSON) and the plot beside it (same stem, ``.png``); returns the plot's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(doc, indent=1))
    png = out.with_suffix(".png")
    plot_curve(doc, png)
    return png
