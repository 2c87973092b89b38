"""torch -> ONNX export with a dynamic batch axis, verified numerically against PyTorch."""

from __future__ import annotations

import io
import logging
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from .candidate import Candidate
from .context import StepContext
from .errors import ExportError
from .measure.quality import fidelity
from .measure.runners import OrtRunner, TorchRunner
from .module_guard import eval_module
from .recipe import StepConfig
from .record import atomic_write_bytes
from .steps import step
from .task import Inputs

__all__ = ["ExportConfig", "export_module", "verify_export"]

log = logging.getLogger("slimline.export")


class ExportConfig(StepConfig):
    kind: ClassVar[str] = "export"
    opset: int = Field(17, ge=17, le=23)
    max_abs_err: float = Field(1e-3, gt=0.0, description="export check: max abs error vs PyTorch")
    min_cosine: float = Field(
        0.9999, gt=0.0, le=1.0, description="export check: min cosine vs PyTorch"
    )
    check_samples: int = Field(8, ge=1, le=1024)


def export_module(module: Any, sample: Inputs, path: Path, opset: int = 17) -> Path:
    """Export ``module`` (called with ``sample`` as keyword arguments) to ``path``, atomically.

    The first axis of every input and of the output is dynamic ("batch").
    """
    import torch

    names = list(sample)
    args = tuple(torch.from_numpy(np.ascontiguousarray(sample[n])) for n in names)
    dynamic = {n: {0: "batch"} for n in [*names, "output"]}
    buf = io.BytesIO()
    module = eval_module(module)  # the caller's module keeps its training flags
    try:
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                buf,  # type: ignore[arg-type]
                input_names=names,
                output_names=["output"],
                dynamic_axes=dynamic,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    except Exception as err:
        msg = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ExportError(
            f"torch.onnx.export failed for {type(module).__name__}: {msg}; make forward() take the "
            f"inputs {names} as tensors and return one tensor"
        ) from None
    atomic_write_bytes(path, buf.getvalue())
    return path


def verify_export(
    module: Any, path: Path, sample: Inputs, cfg: ExportConfig, threads: int
) -> dict[str, Any]:
    """Compare ONNX Runtime against PyTorch on ``sample``; raise :class:`ExportError` on mismatch."""
    ref = TorchRunner("torch", module, threads).run(sample)
    got = OrtRunner("onnx", path, threads).run(sample)
    fid = fidelity(got, ref, logits=False)
    err, cos = float(fid["max_abs_err"] or 0.0), float(fid["cosine_min"] or 0.0)
    if err > cfg.max_abs_err or cos < cfg.min_cosine:
        raise ExportError(
            f"exported ONNX disagrees with PyTorch: max abs error {fid['max_abs_err']:.3g} "
            f"(limit {cfg.max_abs_err:g}), min cosine {fid['cosine_min']:.6f} (limit {cfg.min_cosine}); "
            "check for train-mode layers or data-dependent control flow in forward()"
        )
    return {"check_samples": len(ref), **{k: v for k, v in fid.items() if k != "top1_agreement"}}


@step(ExportConfig)
def export_step(cfg: ExportConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    if cand.module is None:
        raise ExportError(
            f"candidate {cand.name} has no torch module to export; an ONNX task starts exported"
        )
    sample = ctx.task.sample_inputs(cfg.check_samples)
    path = export_module(cand.module, sample, ctx.workdir / "model.onnx", cfg.opset)
    check = verify_export(cand.module, path, sample, cfg, ctx.threads)
    log.info(
        "export verified: max abs err %.3g, min cosine %.6f",
        check["max_abs_err"],
        check["cosine_min"],
    )
    return Candidate(
        name="fp32-onnx",
        step="export",
        parent=cand.name,
        onnx=path,
        module=cand.module,
        meta={"opset": cfg.opset, "export_check": check},
    )
