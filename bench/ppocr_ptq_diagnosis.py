"""Where PTQ loses on PP-OCRv4's text detector (issue 16): fidelity of static INT8 by op placement
and calibration, and mixed precision with the float nodes as ONNX Runtime's quantizer leaves them
(their float weights re-quantized per tensor at load time) and as slimline now writes them.

    .venv/bin/python bench/ppocr_ptq_diagnosis.py [--out bench/RESULTS-ppocr-ptq-diagnosis.md]

Same model, inputs and metric as ``bench/qat_bench.py --zoo ppocr-det`` (160 x 160; the
evaluation rows of ``zoo_ppocr_torch_task.py``): the mean cosine of the probability map to FP32
and the text-mask IoU against FP32. Fidelity only: no timing, so a busy machine does not matter.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import zoo_ppocr_torch_task as task
from bench_out import publish, reproduce_command, reproduce_footer
from slimline.compress.quant.calibrate import calibrate
from slimline.compress.quant.config import QuantSpec
from slimline.compress.quant.engine import ort_quantize_static, quantize_model
from slimline.compress.quant.fallback import kernel_report
from slimline.compress.quant.layerwise import layer_errors
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import Prepared, prepare, quiet
from slimline.export import export_module
from slimline.measure.runners import ort_session

THREADS = 2


def _fidelity(path: Path, ref: list[np.ndarray], rows: np.ndarray) -> tuple[float, float]:
    """(mean cosine to FP32, text-mask IoU against FP32) over the evaluation rows."""
    sess = ort_session(path, THREADS)
    out = [sess.run(None, {"x": rows[i : i + 1]})[0] for i in range(len(rows))]
    cos = [
        float((a.ravel() @ b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))
        for a, b in zip(ref, out, strict=True)
    ]
    got = np.concatenate([o.ravel() for o in out]) > task.THRESHOLD
    want = np.concatenate([r.ravel() for r in ref]) > task.THRESHOLD
    return float(np.mean(cos)), float((got & want).sum() / (got | want).sum())


def _as_ort_leaves_it(
    src: Path, dst: Path, spec: QuantSpec, floats: list[str], caches: Any
) -> Path:
    """ONNX Runtime's quantizer output alone (no float-input rewrite): what slimline wrote before."""
    with quiet():
        ort_quantize_static(src, dst, spec, floats, caches)
    return dst


def _setup(work: Path) -> tuple[Prepared, Any, list[np.ndarray], np.ndarray]:
    _, rows, _ = task._rows()
    src = export_module(task.model(), {"x": rows[:1]}, work / "fp32.onnx", 17)
    prepared = prepare(src, work / "prepared", {"x": rows[:1]}, threads=THREADS)
    calib = calibrate(
        prepared.path,
        task.calibration_data(),
        work / "calibration",
        samples=512,
        methods={"minmax", "percentile", "entropy"},
        threads=THREADS,
    )
    fp32 = ort_session(prepared.path, THREADS)
    ref = [fp32.run(None, {"x": rows[i : i + 1]})[0] for i in range(len(rows))]
    return prepared, calib, ref, rows


def _quant_count(path: Path) -> int:
    return sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(path)).graph.node)


def _placements(
    work: Path, prepared: Prepared, calib: Any, ref: Any, rows: Any
) -> list[dict[str, Any]]:
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=True)
    out = []
    settings = [
        ("all", "minmax", True),
        ("all", "percentile", True),
        ("all", "entropy", True),
        ("all", "minmax", False),
        ("compute", "minmax", True),
        ("compute", "percentile", True),
        ("compute", "entropy", True),
    ]
    for ops, cal, per_channel in settings:
        spec = QuantSpec("static", calibration=cal, per_channel=per_channel, ops=ops)  # type: ignore[arg-type]
        path = quantize_model(
            prepared.path, work / f"{spec.slug}.onnx", spec, plan.float_nodes, calib.caches
        )
        cos, iou = _fidelity(path, ref, rows)
        gran = "per-channel" if per_channel else "per-tensor"
        out.append(
            {"ops": ops, "calibration": cal, "weights": gran, "quantize_linear": _quant_count(path),
             "cosine": cos, "iou": iou}
        )  # fmt: skip
    return out


def _placement_table(rows: list[dict[str, Any]]) -> list[str]:
    return [
        "| placement | calibration | weights | QuantizeLinear | cosine to FP32 | text-mask IoU |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['ops']} ops | {r['calibration']} | {r['weights']} | {r['quantize_linear']} | "
            f"{r['cosine']:.4f} | {r['iou']:.4f} |"
            for r in rows
        ),
    ]


def _mixed(work: Path, prepared: Prepared, calib: Any, ref: Any, rows: Any) -> list[dict[str, Any]]:
    out = []
    for ops in ("all", "compute"):
        spec = QuantSpec("static", ops=ops)
        base = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=False)
        full = quantize_model(prepared.path, work / f"full-{ops}.onnx", spec, [], calib.caches)
        rows_ = layer_errors(
            prepared.path, full, base.int8_nodes, ({"x": r[None]} for r in rows), 16, THREADS
        )
        ranking = [r["node"] for r in rows_ if r["sqnr_db"] is not None]
        for k in (0, 4, 16, 32):
            floats = ranking[:k]
            for how in ("ONNX Runtime's quantizer output", "slimline (per-axis input DQ)"):
                if k == 0 and how.startswith("slimline"):
                    continue
                dst = work / f"mixed-{ops}-{k}-{how[:4]}.onnx"
                if how.startswith("slimline"):
                    path = quantize_model(prepared.path, dst, spec, floats, calib.caches)
                else:
                    path = _as_ort_leaves_it(prepared.path, dst, spec, floats, calib.caches)
                report = kernel_report(path, THREADS)
                cos, iou = _fidelity(path, ref, rows)
                out.append(
                    {"ops": ops, "float_nodes": k, "how": how if k else "-",
                     "float_kernels": report["compute_kernels"] - report["int8_kernels"],
                     "compute_kernels": report["compute_kernels"], "cosine": cos, "iou": iou}
                )  # fmt: skip
    return out


def _mixed_table(rows: list[dict[str, Any]]) -> list[str]:
    return [
        "| placement | nodes kept float | float nodes as | float kernels run | cosine to FP32 | "
        "text-mask IoU |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['ops']} ops | {r['float_nodes']} | {r['how']} | {r['float_kernels']} of "
            f"{r['compute_kernels']} | {r['cosine']:.4f} | {r['iou']:.4f} |"
            for r in rows
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ppocr-ptq-") as tmp:
        work = Path(tmp)
        prepared, calib, ref, rows = _setup(work)
        doc = {
            "command": reproduce_command(
                "ppocr_ptq_diagnosis.py", ["--out", str(args.out)] if args.out else []
            ),
            "rows": len(rows),
            "calibration_rows": calib.samples,
            "placement": _placements(work, prepared, calib, ref, rows),
            "mixed": _mixed(work, prepared, calib, ref, rows),
        }
    publish(render(doc), doc, args.out, "ppocr_ptq_diagnosis.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return "\n".join(
        [
            "# PTQ on PP-OCRv4's text detector: where the error comes from (issue 16)",
            "",
            f"{doc['rows']} evaluation rows (160 x 160), {doc['calibration_rows']} calibration "
            "rows; U8S8 static QDQ; fidelity only (no timing).",
            "",
            "## Op placement and calibration (first and last compute layers float)",
            "",
            *_placement_table(doc["placement"]),
            "",
            "## Mixed precision: the worst nodes of the layer-wise ranking kept float",
            "",
            *_mixed_table(doc["mixed"]),
            *reproduce_footer(doc["command"]),
        ]
    )
