"""NNCF's documented OpenVINO path as a candidate: ``ov.convert_model`` on the float ONNX file,
``nncf.quantize`` on that OpenVINO model with NNCF's default settings and the same calibration
rows as the ONNX-backend candidate (:mod:`.nncf_ptq`), saved as OpenVINO IR (``ov.save_model``,
an ``.xml`` with its ``.bin``).

``quantize: {nncf: true}`` builds it beside the ONNX-backend candidate wherever the target runs
OpenVINO (``runtime: openvino`` or ``auto``); both compete with the quantize step's own choice on
the same budget, judged and timed on OpenVINO like other candidates, and the measured winner is
kept. An IR runs on OpenVINO only: with ``runtime: onnxruntime`` it is not built (a rejected
alternative says why), and under ``auto`` its ONNX Runtime verdict names the reason.

The one setting that departs from NNCF's defaults is the overflow fix on x86 without VNNI
(:func:`~slimline.compress.nncf_ptq.overflow_fix_for`). Constants are saved in FP32
(``compress_to_fp16=False``), so float layers compute as in the ONNX file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..candidate import Candidate, quantizable_graph
from ..context import StepContext
from ..cpu import CpuInt8
from ..cpu import detect as detect_cpu
from ..errors import CandidateError, RuntimeMissingError, error_text, is_user_error
from ..measure.ov import ov_message, require_openvino
from ..signature import Signature
from ..tensors import FROZEN_RT_INFO, Inputs, frozen_inputs, frozen_to_json
from .nncf_ptq import (
    COMPETES,
    NncfConfig,
    advanced_parameters,
    calibration_items,
    overflow_fix_for,
    require_nncf,
)

__all__ = ["NAME", "nncf_ov_alternative", "nncf_ov_quantize"]

NAME = "quantize-nncf-ov"


def nncf_ov_quantize(
    src: Path,
    calibration: Any,
    out: Path,
    cfg: NncfConfig,
    signature: Signature | None = None,
    cpu: CpuInt8 | None = None,
) -> dict[str, Any]:
    """``src`` (float ONNX) through ``ov.convert_model`` and ``nncf.quantize`` into ``out``
    (``.xml`` + ``.bin``); returns what was applied."""
    ov = require_openvino()
    nncf = require_nncf()
    t0 = time.perf_counter()
    try:
        model = ov.convert_model(str(src))
    except Exception as err:
        raise CandidateError(
            f"OpenVINO cannot convert {src.name} (ov.convert_model): {ov_message(err)}"
        ) from None
    items: list[Inputs] = calibration_items(calibration, signature, cfg.samples)
    fix = overflow_fix_for(cfg.overflow_fix, cpu or detect_cpu())
    quantized = nncf.quantize(
        model,
        nncf.Dataset(items),
        subset_size=len(items),
        advanced_parameters=advanced_parameters(fix),
    )
    frozen = frozen_inputs(src)
    if frozen:  # the IR says which inputs its graph was frozen for, as the ONNX file did
        quantized.set_rt_info(frozen_to_json(frozen), FROZEN_RT_INFO)
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    ops = [op.get_type_name() for op in quantized.get_ops()]
    return {
        "engine": f"nncf {nncf.__version__}, openvino {ov.__version__.split('-')[0]}",
        "backend": "openvino",
        "path": "ov.convert_model + nncf.quantize (defaults) + ov.save_model",
        "overflow_fix": fix or "nncf default (first_layer_only)",
        "calibration_items": len(items),
        "fake_quantize": ops.count("FakeQuantize"),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _runs_openvino(ctx: StepContext) -> bool:
    return ctx.recipe.target.runtime in ("openvino", "auto")


def _rejected(cand: Candidate, reason: str, err: BaseException | None = None) -> Candidate:
    meta: dict[str, Any] = {"nncf": {"backend": "openvino"}}
    if err is not None:
        meta["failure"] = {"type": type(err).__name__, "error": error_text(err)}
    return Candidate(
        name=NAME, step="nncf", parent=cand.name, accepted=False, reason=reason, meta=meta
    )


def nncf_ov_alternative(cand: Candidate, ctx: StepContext, samples: int) -> Candidate:
    """The documented-path candidate from ``cand``'s float graph, competing with the step's
    chosen candidate. Not built where the target never runs OpenVINO; a failure (OpenVINO
    cannot convert the graph, NNCF fails) is a rejected alternative with its reason."""
    if not _runs_openvino(ctx):
        return _rejected(
            cand,
            "not built: NNCF's OpenVINO path writes an OpenVINO IR, which runs on OpenVINO "
            "only, and target.runtime is onnxruntime; set runtime: openvino or auto to try it",
        )
    out = ctx.workdir / "nncf-ov" / f"{NAME}.xml"
    try:
        meta = nncf_ov_quantize(
            quantizable_graph(cand),
            ctx.task.calibration_data(),
            out,
            NncfConfig(samples=samples),
            ctx.task.signature,
        )
    except Exception as err:
        if is_user_error(err) and not isinstance(err, RuntimeMissingError):
            raise
        ctx.warn(f"quantize: the NNCF OpenVINO candidate was not built: {error_text(err)}")
        return _rejected(cand, f"failed: {error_text(err)}", err)
    return Candidate(
        name=NAME,
        step="nncf",
        parent=cand.name,
        onnx=out,
        meta={"nncf": meta, COMPETES: True},
    )
