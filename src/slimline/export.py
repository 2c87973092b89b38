"""torch -> ONNX export with dynamic batch axes, every output verified numerically against
PyTorch within the tolerance of the model's kind (float, or fake-quant exported as QDQ)."""

from __future__ import annotations

import io
import logging
import warnings
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import onnx
from pydantic import Field

from .candidate import Candidate
from .context import StepContext
from .errors import ExportError
from .measure.quality import fidelity
from .measure.runners import ort_session
from .module_guard import eval_module
from .recipe import StepConfig
from .record import atomic_write_bytes
from .steps import Contract, step
from .task import Inputs

__all__ = [
    "TOLERANCES",
    "ExportConfig",
    "Tolerance",
    "export_kind",
    "export_module",
    "output_names",
    "tolerance",
    "verify_export",
]

log = logging.getLogger("slimline.export")


class ExportConfig(StepConfig):
    kind: ClassVar[str] = "export"
    opset: int = Field(17, ge=17, le=23)
    max_abs_err: float | None = Field(
        None,
        gt=0.0,
        description="export check: max abs error vs PyTorch (default: by the model's kind, "
        "see TOLERANCES)",
    )
    min_cosine: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="export check: min cosine vs PyTorch (default: by the model's kind)",
    )
    check_samples: int = Field(8, ge=1, le=1024)
    exporter: Literal["auto", "torchscript", "dynamo"] = Field(
        "auto",
        description="auto: the TorchScript exporter, then the dynamo exporter "
        "(torch.onnx.export(dynamo=True)) where the first fails to export or to verify",
    )


@dataclass(frozen=True)
class Tolerance:
    """How closely ONNX Runtime must agree with PyTorch; ``None`` leaves a figure unchecked."""

    max_abs_err: float | None
    min_cosine: float


# A float model must agree to rounding. A fake-quant (QDQ) model may differ by one quantization
# step where PyTorch and ONNX Runtime round a value on either side of a step boundary: no
# absolute bound fits every scale, the direction of the outputs must still hold.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(max_abs_err=1e-3, min_cosine=0.9999),
    "qdq": Tolerance(max_abs_err=None, min_cosine=0.999),
}
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


def export_kind(path: Path) -> str:
    """``"qdq"`` for a graph with Quantize/DequantizeLinear nodes (a fake-quant model's
    export), else ``"fp32"``: which :data:`TOLERANCES` its check uses."""
    model = onnx.load(str(path), load_external_data=False)
    return "qdq" if any(n.op_type in _QDQ_OPS for n in model.graph.node) else "fp32"


def tolerance(cfg: ExportConfig, kind: str) -> Tolerance:
    """The tolerance for a model of ``kind``, with what ``cfg`` sets in its place."""
    base = TOLERANCES[kind]
    return Tolerance(
        cfg.max_abs_err if cfg.max_abs_err is not None else base.max_abs_err,
        cfg.min_cosine if cfg.min_cosine is not None else base.min_cosine,
    )


def _flat_outputs(out: Any, where: str) -> list[tuple[str | None, Any]]:
    """A model's outputs as (name or None, tensor): one tensor, a tuple/list of tensors, or a
    dict of named tensors (in its order, as ``torch.onnx.export`` flattens it)."""
    if isinstance(out, dict):
        items: list[tuple[str | None, Any]] = [(str(k), v) for k, v in out.items()]
    elif isinstance(out, (tuple, list)):
        items = [(None, v) for v in out]
    else:
        items = [(None, out)]
    if not items or not all(hasattr(v, "detach") for _, v in items):
        raise ExportError(
            f"{where} returns {type(out).__name__}; make forward() return a tensor, a tuple of "
            "tensors or a dict of tensors"
        )
    return items


def output_names(module: Any, sample: Inputs) -> list[str]:
    """Names for the model's outputs: ``output`` for one tensor, the keys of a returned dict,
    else ``output_0``, ``output_1``, ..."""
    items = _flat_outputs(_torch_forward(module, sample), f"{type(module).__name__}.forward()")
    if len(items) == 1 and items[0][0] is None:
        return ["output"]
    return [name if name is not None else f"output_{i}" for i, (name, _) in enumerate(items)]


def _torch_forward(module: Any, sample: Inputs) -> Any:
    import torch

    with torch.no_grad():
        return module(**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sample.items()})


def export_module(
    module: Any, sample: Inputs, path: Path, opset: int = 17, exporter: str = "torchscript"
) -> Path:
    """Export ``module`` (called with ``sample`` as keyword arguments) to ``path``, atomically,
    with torch's TorchScript exporter or its dynamo exporter (``exporter``).

    Every output the model returns is exported under a name from :func:`output_names`; the
    first axis of every input and every output is dynamic ("batch").
    """
    import torch

    names = list(sample)
    module = eval_module(module)  # the caller's module keeps its training flags
    outputs = output_names(module, sample)
    args = tuple(torch.from_numpy(np.ascontiguousarray(sample[n])) for n in names)
    try:
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            data = (_dynamo if exporter == "dynamo" else _torchscript)(
                module, args, names, outputs, opset
            )
    except Exception as err:
        msg = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ExportError(
            f"torch.onnx.export ({exporter} exporter) failed for {type(module).__name__}: {msg}"
        ) from None
    atomic_write_bytes(path, data)
    return path


def _torchscript(
    module: Any, args: tuple[Any, ...], names: list[str], outputs: list[str], opset: int
) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.onnx.export(
        module,
        args,
        buf,  # type: ignore[arg-type]
        input_names=names,
        output_names=outputs,
        dynamic_axes={n: {0: "batch"} for n in [*names, *outputs]},
        opset_version=opset,
        do_constant_folding=True,
        dynamo=False,
    )
    return buf.getvalue()


def _dynamo(
    module: Any, args: tuple[Any, ...], names: list[str], outputs: list[str], opset: int
) -> bytes:
    """torch.export traces the module (it handles ops such as ``Tensor.unfold`` of a dynamic
    size that the TorchScript exporter cannot); one shared batch dimension on every input."""
    import torch

    batch = torch.export.Dim("batch")
    # it and its onnxscript passes log every opset conversion and folding step at INFO/WARNING
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(
            module,
            args,
            input_names=names,
            output_names=outputs,
            dynamic_shapes=tuple({0: batch} for _ in args),
            opset_version=opset,
            dynamo=True,
        )
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    assert program is not None  # dynamo=True without a destination returns the program
    return bytes(program.model_proto.SerializeToString())


def _worst(checks: dict[str, dict[str, float]]) -> dict[str, float]:
    """The worst figures over all outputs."""
    return {
        "max_abs_err": max(c["max_abs_err"] for c in checks.values()),
        "cosine_min": min(c["cosine_min"] for c in checks.values()),
        "cosine_mean": min(c["cosine_mean"] for c in checks.values()),
    }


def verify_export(
    module: Any, path: Path, sample: Inputs, cfg: ExportConfig, threads: int
) -> dict[str, Any]:
    """Compare every output of ONNX Runtime against PyTorch on ``sample``, within the tolerance
    of the model's kind (:func:`tolerance`); raise :class:`ExportError` on a mismatch."""
    import torch

    torch.set_num_threads(threads)
    ref = [v.detach().float().numpy() for _, v in _flat_outputs(_torch_forward(module, sample), "")]
    sess = ort_session(path, threads)
    names = [o.name for o in sess.get_outputs()]
    got = sess.run(names, {k: np.ascontiguousarray(v) for k, v in sample.items()})
    if len(got) != len(ref):
        raise ExportError(
            f"exported ONNX has {len(got)} outputs but PyTorch returns {len(ref)}; re-export it"
        )
    checks = {
        n: {k: v for k, v in fidelity(np.asarray(g, np.float32), r, False).items() if v is not None}
        for n, g, r in zip(names, got, ref, strict=True)
    }
    kind, tol = export_kind(path), tolerance(cfg, export_kind(path))
    for name, fid in checks.items():
        err, cos = fid["max_abs_err"], fid["cosine_min"]
        if (tol.max_abs_err is not None and err > tol.max_abs_err) or cos < tol.min_cosine:
            limit = f"{tol.max_abs_err:g}" if tol.max_abs_err is not None else "unchecked"
            raise ExportError(
                f"exported ONNX disagrees with PyTorch on output {name!r}: max abs error "
                f"{err:.3g} (limit {limit}), min cosine {cos:.6f} (limit {tol.min_cosine}; "
                f"{kind} model); check for train-mode layers or data-dependent control flow in "
                "forward()"
            )
    return {
        "check_samples": len(ref[0]),
        "kind": kind,
        "limits": {"max_abs_err": tol.max_abs_err, "min_cosine": tol.min_cosine},
        **_worst(checks),
        "outputs": checks,
    }


@step(
    ExportConfig,
    contract=Contract(
        consumes=("torch",), produces=("onnx",), keeps=("torch",), once=True, first=True
    ),
    version=3,  # 2: every output named and checked; 3: the dynamo exporter as a fallback
    reads=("target.threads",),
    packages=("torch", "onnx", "onnxruntime", "numpy"),
)
def export_step(cfg: ExportConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    if cand.module is None:
        raise ExportError(
            f"candidate {cand.name} has no torch module to export; an ONNX task starts exported"
        )
    sample = ctx.task.sample_inputs(cfg.check_samples)
    path, check, exporter, failed = _export_verified(cand.module, sample, cfg, ctx)
    log.info(
        "export (%s exporter) verified: max abs err %.3g, min cosine %.6f",
        exporter,
        check["max_abs_err"],
        check["cosine_min"],
    )
    return Candidate(
        name="fp32-onnx",
        step="export",
        parent=cand.name,
        onnx=path,
        module=cand.module,
        meta={
            "opset": _opset_of(path),  # the dynamo exporter may raise it to one it implements
            "exporter": exporter,
            **({"exporters_failed": failed} if failed else {}),
            "export_check": check,
        },
    )


def _opset_of(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _export_verified(
    module: Any, sample: Inputs, cfg: ExportConfig, ctx: StepContext
) -> tuple[Path, dict[str, Any], str, dict[str, str]]:
    """The first of the configured exporters whose file exports and agrees with PyTorch: its
    path, check and name, and why each exporter before it failed. Raises the last failure,
    naming every exporter's, when none succeeds. An exporter's failure is the step's: a module
    one exporter cannot trace may be fine for the other."""
    order: list[str] = ["torchscript", "dynamo"] if cfg.exporter == "auto" else [cfg.exporter]
    failed: dict[str, str] = {}
    for exporter in order:
        path = ctx.workdir / "model.onnx"  # a later exporter writes over a failed one
        try:
            export_module(module, sample, path, cfg.opset, exporter)
            check = verify_export(module, path, sample, cfg, ctx.threads)
        except ExportError as err:
            failed[exporter] = str(err)
            if exporter != order[-1]:
                log.info(
                    "export: %s; trying the %s exporter", err, order[order.index(exporter) + 1]
                )
            continue
        return path, check, exporter, failed
    raise ExportError("; ".join(failed.values()))
