"""Outputs judged by what the task sees, end to end on ONNX tasks whose outputs are crafted:
the FP32 model returns its input (Identity), a candidate adds a fixed ``delta`` to it, so each
verdict follows from the crafted numbers alone, on every CPU kind (no INT8 kernels run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from fixtures.signatures import passthrough_model
from slimline import api
from slimline.candidate import Candidate
from slimline.cli import main
from slimline.context import StepContext
from slimline.errors import RecipeError, TaskError
from slimline.recipe import load_recipe
from slimline.task import load_task

BENCH = {
    "rounds": 4,
    "runs_per_round": 50,
    "batch_sizes": [1, 4],
    "throughput_min_seconds": 0.02,
    "warmup": 2,
    "peak_rss": False,
}


def shifted_model(path: Path, dims: list[int | None], delta: np.ndarray, scale: float) -> Path:
    """``x_out = x * scale + delta``: a candidate whose outputs differ from FP32's as crafted."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "scale"], ["scaled"]),
            helper.make_node("Add", ["scaled", "delta"], ["x_out"]),
        ],
        "shifted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("x_out", TensorProto.FLOAT, dims)],
        [
            numpy_helper.from_array(delta.astype(np.float32), "delta"),
            numpy_helper.from_array(np.array(scale, np.float32), "scale"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _setup(tmp_path: Path, x: np.ndarray, eval_x: np.ndarray, **recipe: Any) -> tuple[Path, Path]:
    """(FP32 model, recipe file) of an Identity model on ``x``, evaluated on ``eval_x``."""
    dims: list[int | str | None] = [None, *x.shape[1:]]
    model = passthrough_model(tmp_path / "fp32.onnx", {"x": (int(TensorProto.FLOAT), dims)})
    np.savez(tmp_path / "calib.npz", x=x)
    np.savez(tmp_path / "eval.npz", x=eval_x, **recipe.pop("arrays", {}))
    data = {
        "name": "kinds",
        "task": "fp32.onnx",
        "samples": "calib.npz",
        "eval_samples": "eval.npz",
        "target": {"threads": 1},
        "bench": BENCH,
        **recipe,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return model, path


def _context(tmp_path: Path, recipe_file: Path) -> StepContext:
    r = load_recipe(recipe_file)
    task = load_task(r.task, r.samples, r.eval_samples, outputs=r.outputs, metric=r.metric)
    return api.context_for(task, r, tmp_path / "work", timed=False)


def _verdict(
    ctx: StepContext, tmp_path: Path, delta: np.ndarray, scale: float = 1.0
) -> tuple[bool, str, Any]:
    dims: list[int | None] = [None, *delta.shape]
    name = f"cand-{abs(hash((delta.tobytes(), scale)))}.onnx"
    cand = shifted_model(tmp_path / name, dims, delta, scale)
    q = ctx.evaluate(Candidate("cand", "quantize", None, onnx=cand))
    ok, why = ctx.within_budget(q)
    return ok, why, q


def _maps(rows: int, seed: int) -> np.ndarray:
    """Probability maps: a 3x3 block at 0.9 (text) at a row-dependent place, 0.05 elsewhere."""
    rng = np.random.default_rng(seed)
    x = np.full((rows, 1, 8, 8), 0.05, np.float32)
    for i, (r, c) in enumerate(rng.integers(0, 5, size=(rows, 2))):
        x[i, 0, r : r + 3, c : c + 3] = 0.9
    return x


@pytest.mark.parametrize("declared", [False, True])
def test_probability_map_is_judged_by_iou_not_cosine(tmp_path: Path, declared: bool) -> None:
    kinds = {"outputs": {"x_out": {"kind": "probability_map", "threshold": 0.5}}}
    _, recipe = _setup(tmp_path, _maps(16, 0), _maps(8, 1), **(kinds if declared else {}))
    ctx = _context(tmp_path, recipe)
    # every pixel raised by 0.25: the background (0.3) stays below the threshold, so the
    # regions are FP32's while the cosine drops
    haze = np.full((1, 8, 8), 0.25, np.float32)
    ok, why, q = _verdict(ctx, tmp_path, haze)
    assert q.cosine_mean < 0.95
    assert ok is declared, why
    if declared:
        assert q.agreement == 1.0 and "IoU 1.0000" in why and "cosine" in why
        assert q.declared["x_out"]["cosine_mean"] == q.cosine_mean
    # every pixel halved: text at 0.45 is below the threshold, the cosine is 1
    ok, why, q = _verdict(ctx, tmp_path, np.zeros((1, 8, 8), np.float32), scale=0.5)
    assert q.cosine_mean > 0.99
    assert ok is not declared, why
    if declared:
        assert q.agreement == 0.0 and why.startswith("agreement 0.0000 < budget 0.9900")


def _ctc_logits(rows: int, seed: int, t: int = 12, v: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    best = rng.integers(0, v, size=(rows, t))
    best[:, ::2] = 0  # a blank between characters: every character is kept
    return (np.eye(v, dtype=np.float32)[best] * 4.0).astype(np.float32)


def test_ctc_is_judged_by_cer_of_the_decoded_text(tmp_path: Path) -> None:
    x, ev = _ctc_logits(16, 0), _ctc_logits(8, 1)
    _, recipe = _setup(tmp_path, x, ev, outputs={"x_out": {"kind": "ctc", "blank": 0}})
    ctx = _context(tmp_path, recipe)
    delta = np.zeros(x.shape[1:], np.float32)
    delta[1, 7] = 9.0  # step 1 of every row decodes as class 7: one substitution per row
    ok, why, q = _verdict(ctx, tmp_path, delta)
    chars = sum(len([c for c in r[1::2] if c]) for r in ev.argmax(-1))
    # one edit per row whose step 1 was not 7 already (a substitution, or an insertion where
    # step 1 was a blank)
    edits = sum(int(r[1] != 7) for r in ev.argmax(-1))
    assert edits > 0 and q.declared["x_out"]["cer"] == pytest.approx(edits / chars)
    assert not ok and "ctc 'x_out' CER" in why
    small = np.full(x.shape[1:], 0.5, np.float32)  # no argmax changes
    ok, why, q = _verdict(ctx, tmp_path, small)
    assert ok and q.agreement == 1.0, why


DECODE = '''
import numpy as np

def decode(outputs):
    """[1, K, 6] rows of x1, y1, x2, y2, score, class: the boxes scoring above 0.5."""
    det = outputs["x_out"][0]
    keep = det[:, 4] > 0.5
    return det[keep][:, [0, 1, 2, 3, 5]]
'''


def _detections(rows: int, score: float) -> np.ndarray:
    x = np.zeros((rows, 4, 6), np.float32)
    for k in range(4):
        x[:, k] = [10 * k, 0, 10 * k + 8, 8, score if k < 2 else 0.1, k % 2]
    return x


def test_boxes_are_matched_and_report_recall_and_precision(tmp_path: Path) -> None:
    (tmp_path / "decode.py").write_text(DECODE)
    decl = {"x_out": {"kind": "boxes", "decode": "decode.py:decode"}}
    _, recipe = _setup(tmp_path, _detections(8, 0.9), _detections(4, 0.9), outputs=decl)
    ctx = _context(tmp_path, recipe)
    delta = np.zeros((4, 6), np.float32)
    delta[0, :4] = [6, 0, 6, 0]  # box 0 moved by 6 of its 8: IoU 2/14, unmatched
    delta[2, 4] = 0.8  # box 2 (score 0.1) now found: FP32 has no such box
    ok, why, q = _verdict(ctx, tmp_path, delta)
    f = q.declared["x_out"]
    assert (f["recall"], f["precision"], f["boxes_fp32"], f["boxes"]) == (0.5, 1 / 3, 8, 12)
    assert not ok and "box recall 0.5000, precision 0.3333" in why


def test_decode_finding_no_boxes_for_fp32_is_an_error_before_any_candidate(
    tmp_path: Path,
) -> None:
    (tmp_path / "decode.py").write_text(DECODE)
    decl = {"x_out": {"kind": "boxes", "decode": "decode.py:decode"}}
    _, recipe = _setup(tmp_path, _detections(8, 0.2), _detections(4, 0.2), outputs=decl)
    with pytest.raises(TaskError, match="returned no boxes for the FP32 model on any of the 4"):
        _context(tmp_path, recipe)


def test_kind_that_does_not_fit_is_one_line_naming_output_shape_and_kinds(
    tmp_path: Path,
) -> None:
    x = np.ones((8, 10), np.float32)
    _, recipe = _setup(tmp_path, x, x[:4], outputs={"x_out": {"kind": "ctc"}})
    with pytest.raises(RecipeError) as err:
        _context(tmp_path, recipe)
    msg = str(err.value)
    assert "\n" not in msg and "'x_out' has shape [N, 10] (2-D)" in msg
    assert "kinds that fit: logits, boxes" in msg


def test_declared_name_that_is_not_an_output(tmp_path: Path) -> None:
    x = np.ones((8, 10), np.float32)
    _, recipe = _setup(tmp_path, x, x[:4], outputs={"probs": {"kind": "logits"}})
    with pytest.raises(RecipeError, match=r"'probs' is not an output of the model .*x_out"):
        _context(tmp_path, recipe)


HOOKS = """
import numpy as np

def top1(outputs, labels):
    return float((outputs["x_out"].argmax(-1) == labels).mean())

def picky(outputs, labels):
    if outputs["x_out"].max() > 5:
        raise ValueError("scores above 5 are not probabilities")
    return 1.0

def nan_when_large(outputs, labels):
    return float("nan") if outputs["x_out"].max() > 5 else 1.0
"""


def _logit_rows(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.random.default_rng(seed).integers(0, 5, size=rows)
    return np.eye(5, dtype=np.float32)[labels], labels


def test_metric_hook_reads_every_output_and_the_labels_of_eval_samples(tmp_path: Path) -> None:
    (tmp_path / "hooks.py").write_text(HOOKS)
    x, _ = _logit_rows(16, 0)
    ev, labels = _logit_rows(8, 1)
    labels[:2] = (labels[:2] + 1) % 5  # FP32 gets 6 of 8 right
    _, recipe = _setup(
        tmp_path,
        x,
        ev,
        metric="hooks.py:top1",
        arrays={"labels": labels},
        outputs={"x_out": {"kind": "logits"}},
    )
    ctx = _context(tmp_path, recipe)
    assert ctx.reference.metric == 0.75 and ctx.task.metric_name == "top1"
    delta = np.zeros(5, np.float32)
    delta[0] = 2.0  # every row now says class 0
    ok, why, q = _verdict(ctx, tmp_path, delta)
    assert q.metric == pytest.approx(float((labels == 0).mean()))
    assert not ok and why.startswith("metric drop")


@pytest.mark.parametrize(
    ("hook", "error"),
    [
        ("picky", "metric hook picky failed: ValueError: scores above 5 are not probabilities"),
        ("nan_when_large", "metric hook nan_when_large returned nan, not a finite number"),
    ],
)
def test_metric_hook_failing_on_a_candidate_rejects_it_with_the_hooks_error(
    tmp_path: Path, hook: str, error: str
) -> None:
    (tmp_path / "hooks.py").write_text(HOOKS)
    x, _ = _logit_rows(16, 0)
    ev, labels = _logit_rows(8, 1)
    _, recipe = _setup(tmp_path, x, ev, metric=f"hooks.py:{hook}", arrays={"labels": labels})
    ctx = _context(tmp_path, recipe)
    ok, why, q = _verdict(ctx, tmp_path, np.full(5, 10.0, np.float32))
    assert not ok and why == error and q.metric_error == error


def test_metric_hook_needs_labels_in_eval_samples(tmp_path: Path) -> None:
    (tmp_path / "hooks.py").write_text(HOOKS)
    x, _ = _logit_rows(16, 0)
    _, recipe = _setup(tmp_path, x, x[:4], metric="hooks.py:top1")
    with pytest.raises(RecipeError, match="has no array named 'labels'"):
        _context(tmp_path, recipe)


def test_optimize_records_agreement_beside_cosine_and_profile_suggests(
    tmp_path: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SLIMLINE_CACHE", str(cache))
    kinds = {"x_out": {"kind": "probability_map", "threshold": 0.5}}
    model, recipe = _setup(
        tmp_path, _maps(16, 0), _maps(8, 1), outputs=kinds, steps=[{"graph": {}}]
    )
    out = tmp_path / "run"
    assert main(["optimize", str(recipe), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    base = next(c for c in m["candidates"] if c["name"] == "fp32-onnx")
    assert base["fidelity"]["agreement"] == 1.0 and base["fidelity"]["cosine_mean"] == 1.0
    assert base["fidelity"]["declared"]["x_out"]["kind"] == "probability_map"
    assert m["recipe"]["outputs"] == {"x_out": {"kind": "probability_map", "threshold": 0.5}}
    html = (out / "report.html").read_text()
    assert "Fidelity by output kind" in html and "agreement" in capsys.readouterr().out
    args = ["profile", str(model), "--samples", str(tmp_path / "calib.npz"), "--threads", "1"]
    assert main([*args, "--out", str(tmp_path / "prof")]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("suggestion:")]
    assert len(said) == 1 and "{x_out: {kind: probability_map" in said[0]
    prof = json.loads((tmp_path / "prof" / "manifest.json").read_text())
    assert "agreement" not in prof["candidates"][0]["fidelity"]  # suggested, never applied


def test_evaluate_rows_judges_the_first_rows_against_fp32s_on_the_same_rows(
    tmp_path: Path,
) -> None:
    kinds = {"outputs": {"x_out": {"kind": "probability_map", "threshold": 0.5}}}
    _, recipe = _setup(tmp_path, _maps(16, 0), _maps(8, 1), **kinds)
    ctx = _context(tmp_path, recipe)
    dims: list[int | None] = [None, 1, 8, 8]
    delta = np.zeros((1, 8, 8), np.float32)
    cand = Candidate(
        "c", "quantize", None, onnx=shifted_model(tmp_path / "c.onnx", dims, delta, 0.5)
    )
    q = ctx.evaluate_rows(cand, 3)
    assert q is not None and q.agreement == 0.0 and q.cosine_mean == pytest.approx(1.0)
    same = Candidate("s", "quantize", None, onnx=tmp_path / "fp32.onnx")
    q = ctx.evaluate_rows(same, 3)
    assert q is not None and q.agreement == 1.0 and q.metric == pytest.approx(1.0)


def test_a_torch_task_declares_its_one_output_as_output(
    tiny_task_file: Path, tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    from slimline.recipe import recipe_from_dict

    r = recipe_from_dict({**tiny_recipe, "outputs": {"output": {"kind": "logits"}}})
    task = load_task(str(tiny_task_file), outputs=r.outputs)
    ctx = api.context_for(task, r, tmp_path / "w", timed=False, cache=cache)
    q = ctx.evaluate(ctx.baseline)
    assert q.agreement == 1.0 and q.declared is not None
    assert q.declared["output"]["kind"] == "logits" and ctx.within_budget(q)[0]
    wrong = recipe_from_dict({**tiny_recipe, "outputs": {"logits": {"kind": "logits"}}})
    with pytest.raises(RecipeError, match=r"'logits' is not an output of the model .*output"):
        api.context_for(
            load_task(str(tiny_task_file), outputs=wrong.outputs),
            wrong,
            tmp_path / "x",
            timed=False,
            cache=cache,
        )
