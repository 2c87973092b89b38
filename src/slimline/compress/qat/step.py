"""The ``qat`` step: quantization-aware fine-tuning by distillation, exported as QDQ ONNX.

A fake-quant copy of the candidate's torch model simulates the INT8 format the ``quantize`` step
deploys on this CPU (:func:`.fakequant.format_for`); its ranges start from post-training
calibration (MinMax, Entropy or Percentile: ``calibration``) and, with ``learn_ranges``, train
with the weights (LSQ); it learns from the FP32 teacher with :func:`..finetune.distill`
(softened logits plus the task loss where there are labels, output losses otherwise) at a small
learning rate. BatchNorm statistics and the range observers freeze after configurable steps.
Training is
checkpointed at every held-out evaluation in a work directory of the step cache, so a killed run
continues inside the step. The export is verified three ways: ONNX Runtime against the
fake-quant model (cosine), the kernels ONNX Runtime runs (fallback detection), and latency
against full-INT8 post-training quantization of the same format, measured interleaved.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from ...candidate import Candidate
from ...context import StepContext
from ...cpu import detect as detect_cpu
from ...errors import DataError, ExportError, StepError, error_text
from ...module_guard import private_copy, torch_threads
from ...recipe import StepConfig
from ...steps import Contract, step
from ..finetune import (
    DistillHooks,
    FileCheckpoint,
    FinetuneConfig,
    distill,
    held_out_batches,
    resolve_data,
)
from ..quant.config import QuantOps
from ..quant.fallback import kernel_report
from ..quant.float_inputs import float_inputs_file
from . import fakequant as fq
from .compare import PtqRows, compare_rows, ptq_rows
from .export_check import verify_export
from .export_where import failing_module, node_of_op
from .held_out import DeclaredScore, declared_output, kind_loss
from .oscillation import MIN_WINDOW, loss_oscillates
from .qdq import fold_constant_quantizers
from .qdq_fusable import make_file_fusable
from .sensitivity import (
    LayerGain,
    choose_float,
    cosine_score,
    declared_score,
    layer_gains,
    search_rows,
)
from .start import calibrated, pick_calibration

__all__ = ["QatConfig", "qat_step", "run_qat"]

log = logging.getLogger("slimline.qat")


def _default_finetune() -> FinetuneConfig:
    # 0.01x, the low end of the usual 0.01-0.1x: AdamW turns the tiny straight-through gradients
    # of weights near a rounding boundary into full-size steps, and at 0.05x the held-out
    # distillation loss of a trained CNN (the digits fixture) rose 8x in 25 steps; at 0.01x it
    # fell 27% in 150
    return FinetuneConfig(steps=150, lr_scale=0.01, eval_every=25, patience=3)


class QatConfig(StepConfig):
    """Quantization-aware training of the candidate's torch model (see ``docs/quantization.md``)."""

    kind: ClassVar[str] = "qat"
    not_in_key: ClassVar[frozenset[str]] = frozenset({"progress"})

    finetune: FinetuneConfig = Field(
        default_factory=_default_finetune,
        description="distillation settings; lr_scale 0.01: 0.01x the task's LEARNING_RATE",
    )
    freeze_bn_after: int | None = Field(
        0,
        ge=0,
        description="steps after which BatchNorm statistics freeze (0: from the start, the "
        "trained model's statistics as deployed; null: never)",
    )
    freeze_bn_on_oscillation: int | None = Field(
        None,
        ge=MIN_WINDOW,
        description="window of training steps: BatchNorm statistics also freeze as soon as the "
        "loss over the last N steps oscillates (goes up and down without going down); null: off",
    )
    freeze_observers_after: int | None = Field(
        100, ge=0, description="steps after which the ranges freeze (null: never)"
    )
    calibration_samples: int = Field(512, ge=1, le=100_000, description="rows for the ranges")
    calibration: Literal["auto", "minmax", "entropy", "percentile"] = Field(
        "auto",
        description="how the activation ranges start: min / max of the calibration rows "
        "(minmax), or the threshold of least KL divergence (entropy) or the central percentile "
        "(percentile) of their histograms, as the quantize step's calibration computes them; "
        "auto: minmax and percentile both, the start that scores best on the held-out training "
        "batches kept (compress/qat/start.py)",
    )
    percentile: float = Field(
        99.99, gt=90.0, lt=100.0, description="for calibration: percentile (as quantize's)"
    )
    learn_ranges: bool = Field(
        True,
        description="train the activation ranges with the weights (LSQ: the scale is a "
        "parameter with the straight-through gradient), starting from the calibrated ones",
    )
    learn_weight_ranges: bool = Field(
        False,
        description="with learn_ranges: train the weights' per-channel scales too (LSQ), "
        "starting from their min / max",
    )
    float_layers: int = Field(
        0,
        ge=0,
        le=64,
        description="keep up to this many compute layers in float: those whose float version "
        "gains the most cosine to FP32 on calibration rows, measured on the calibrated "
        "fake-quant model (compress/qat/sensitivity.py), within max_float_macs",
    )
    max_float_macs: float = Field(
        0.05, ge=0.0, le=1.0, description="for float_layers: the float layers' share of MACs"
    )
    float_search_rows: int = Field(
        32,
        ge=1,
        le=4096,
        description="for float_layers: calibration rows each layer is scored on; the search runs "
        "the model once per compute layer on them, so a large input (an 800 x 608 detector: "
        "about 30 s a layer at 32 rows on one core) may want fewer; float_search_seconds "
        "lowers it on its own",
    )
    float_search_seconds: float | None = Field(
        600.0,
        gt=0.0,
        description="for float_layers: about how long the search may take; one row of the "
        "model is timed first, and float_search_rows is lowered to what fits (not under 8 "
        "rows); null: no cap. The record says the rows used and why",
    )
    float_modules: list[str] = Field(
        default_factory=list, description="compute modules (by name) kept in float, always"
    )
    learn_zero_points: bool = Field(
        True,
        description="with learn_ranges: train the activations' zero points too (LSQ+ offsets, "
        "rounded to integers for export), so a range can move, not only stretch",
    )
    offset_lr: float = Field(
        0.2,
        gt=0.0,
        le=16.0,
        description="learning rate of the learned zero points, in quantization steps a step; "
        "only with learn_zero_points",
    )
    range_lr: float = Field(
        1e-3,
        gt=0.0,
        le=1.0,
        description="learning rate of the learned ranges' log-scales (a step changes a scale by "
        "about this share of itself); only with learn_ranges",
    )
    check_samples: int = Field(64, ge=1, le=10_000, description="rows for the export check")
    min_export_cosine: float = Field(0.999, gt=0.0, le=1.0)
    compare_ptq: bool = Field(
        True, description="also build full and mixed-precision PTQ of the same format to compare"
    )
    opset: int = Field(17, ge=13, le=21, description="per-channel QDQ needs opset 13 or later")
    quantize_ops: QuantOps = Field(
        "all",
        description="fake quantization at every op quantize's QDQ model quantizes (all), or "
        "around the compute layers only (compute: element-wise ops in float); the PTQ "
        "comparison uses the same",
    )
    judge_declared: bool = Field(
        True,
        description="where the task declares its output's kind (recipe outputs:): distill "
        "with the loss that matches it (probability_map: bce), rank float_layers by the "
        "declared agreement each gains, and keep the weights of the best declared agreement on "
        "the held-out training batches, not of the lowest loss",
    )
    progress: bool = True

    @field_validator("finetune", mode="before")
    @classmethod
    def _qat_defaults(cls, v: Any) -> Any:
        """Keys the recipe leaves out take QAT's defaults (0.01x learning rate...), not
        fine-tuning's."""
        if isinstance(v, dict):
            return {**_default_finetune().model_dump(), **v}
        return v


class QatHooks(DistillHooks):
    """Freezes BatchNorm statistics after their configured steps or as soon as the training loss
    oscillates (whichever comes first), and the range observers after theirs; records when and
    why. The decisions are saved with each checkpoint, so a resumed run re-applies them."""

    def __init__(self, cfg: QatConfig, score: DeclaredScore | None = None) -> None:
        self.cfg, self.score = cfg, score
        self.bn_frozen_at: int | None = None
        self.bn_trigger: str | None = None  # "steps" or "oscillation"
        self.observers_frozen_at: int | None = None
        self.losses: deque[float] = deque(maxlen=cfg.freeze_bn_on_oscillation or MIN_WINDOW)
        self._applied: set[str] = set()  # what this student has had frozen

    def param_groups(self, student: Any, params: list[Any]) -> list[dict[str, Any]]:
        """The learned ranges' log-scales train at ``range_lr``, their zero points at
        ``offset_lr``, the weights at the run's."""
        ranges = {id(p) for p in fq.range_parameters(student)}
        offsets = {id(p) for p in fq.offset_parameters(student)}
        weights = [p for p in params if id(p) not in ranges | offsets]
        groups: list[dict[str, Any]] = [{"params": weights}]
        for own, lr in ((ranges, self.cfg.range_lr), (offsets, self.cfg.offset_lr)):
            learned = [p for p in params if id(p) in own]
            if learned:
                groups.append({"params": learned, "lr": lr})
        return groups

    def before_forward(self, step: int, student: Any) -> None:
        bn, obs = self.cfg.freeze_bn_after, self.cfg.freeze_observers_after
        if self.bn_frozen_at is None and bn is not None and step > bn:
            self.bn_frozen_at, self.bn_trigger = step - 1, "steps"
        if self.observers_frozen_at is None and obs is not None and step > obs:
            self.observers_frozen_at = step - 1
        if self.bn_frozen_at is not None:  # every step: distill puts the student back in train
            fq.freeze_bn(student)  # mode after each held-out evaluation
            self._applied.add("bn")
        if self.observers_frozen_at is not None and "observers" not in self._applied:
            fq.freeze_observers(student)
            self._applied.add("observers")

    def held_out_loss(self, student: Any, teacher: Any, val: list[Any], loss: float) -> float:
        """``1 - `` the declared agreement (:class:`.held_out.DeclaredScore`) where the task
        declares its output, else the distillation loss."""
        return loss if self.score is None else self.score(student, teacher, val, loss)

    def on_step(self, step: int, loss: float) -> None:
        if self.cfg.freeze_bn_on_oscillation is None or self.bn_frozen_at is not None:
            return
        self.losses.append(loss)
        full = len(self.losses) == self.losses.maxlen
        if full and loss_oscillates(list(self.losses)):
            self.bn_frozen_at, self.bn_trigger = step, "oscillation"

    def state(self) -> dict[str, Any]:
        return {
            "bn_frozen_at": self.bn_frozen_at,
            "bn_trigger": self.bn_trigger,
            "observers_frozen_at": self.observers_frozen_at,
            "losses": list(self.losses),
            "first_loss": self.score.first_loss if self.score is not None else None,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.bn_frozen_at, self.bn_trigger = state["bn_frozen_at"], state["bn_trigger"]
        self.observers_frozen_at = state["observers_frozen_at"]
        self.losses.extend(state["losses"])
        if self.score is not None:
            self.score.first_loss = state.get("first_loss")

    def _bn_record(self, steps: int) -> str:
        window, after = self.cfg.freeze_bn_on_oscillation, self.cfg.freeze_bn_after
        rules = [f"freeze after {after}" if after is not None else "no step count"]
        if window is not None:
            rules.append(f"or when the loss oscillates over {window} steps")
        rule = " ".join(rules)
        if self.bn_frozen_at is None:
            return f"never frozen during the {steps} steps run ({rule})"
        why = "the loss oscillated" if self.bn_trigger == "oscillation" else "its step count"
        return f"frozen after step {self.bn_frozen_at}: {why} ({rule})"

    def record(self, steps: int) -> dict[str, Any]:
        obs, after = self.observers_frozen_at, self.cfg.freeze_observers_after
        observers = (
            f"frozen after step {obs} (freeze after {after})"
            if obs is not None
            else f"never frozen during the {steps} steps run (freeze after {after})"
        )
        return {
            "batchnorm": self._bn_record(steps),
            "batchnorm_frozen_at": self.bn_frozen_at,
            "batchnorm_trigger": self.bn_trigger,
            "observers": observers,
            "observers_frozen_at": obs,
        }


def _input_module(cand: Candidate, ctx: StepContext) -> tuple[Any, dict[str, Any] | None]:
    """The torch model to train, and the record of its conversion where it came from the ONNX
    file of an ONNX task (:func:`.onnx_module.module_for`)."""
    if cand.module is not None:
        return cand.module, None
    if cand.onnx is None or not ctx.task.is_onnx:
        raise StepError(
            f"qat needs a torch model or an ONNX task's float graph, but candidate {cand.name} "
            "has neither; give a task .py whose model() returns the torch.nn.Module"
        )
    from .onnx_module import module_for

    return module_for(cand, ctx)


def _check_data(ctx: StepContext) -> None:
    if next(iter(ctx.task.calibration_data()), None) is None:
        raise DataError(
            f"task {ctx.task.name}: qat needs calibration_data() batches to set the INT8 ranges "
            "and train_data() (or the calibration inputs) to fine-tune on, and "
            "calibration_data() yielded none; define calibration_data() returning input batches"
        )


def _state_dir(cfg: QatConfig, cand: Candidate, ctx: StepContext) -> Path:
    return ctx.step_cache().work_dir(ctx.cache_key(cfg, cand, config=cfg.key_dict()))


def _frozen(module: Any) -> Any:
    teacher = private_copy(module).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


BCE_LOSSES = ("bce", "bce_rows")


def _started(
    cfg: QatConfig, module: Any, fmt: fq.FakeQuantFormat, ctx: StepContext, start: dict[str, Any]
) -> tuple[Any, int]:
    """The calibrated student; with ``calibration: auto`` the method is measured the first
    time (on ``start["val"]``, by ``start["score"]``) and kept in ``start`` for the next."""

    def build(method: fq.CalibrationMethod) -> tuple[Any, int]:
        return calibrated(module, fmt, ctx.task, cfg.calibration_samples, method, cfg.percentile)

    if "method" not in start:
        if cfg.calibration != "auto":
            start["method"] = cfg.calibration
        else:
            student, rows, start["method"], start["scores"] = pick_calibration(
                build, start["teacher"], start["val"], start["score"]
            )
            return student, rows
    return build(start["method"])


def gains_table(gains: list[LayerGain], limit: int = 16) -> list[dict[str, Any]]:
    """The record's table: the layers with the largest gains."""
    return [g.to_dict() for g in gains[:limit]]


def _judged(cfg: QatConfig, ctx: StepContext, outputs: list[str] | None) -> tuple[Any, Any]:
    """The fine-tuning settings with the declared kind's loss, and the held-out score by the
    declared kind (None: the distillation loss), where ``judge_declared`` and the task declare
    the trained outputs (:mod:`.held_out`). ``outputs``: the names of a converted ONNX graph's
    outputs, in the module's order (None: a torch task's module, judged on its first)."""
    ft_cfg = cfg.finetune.model_copy(update={"progress": cfg.progress and cfg.finetune.progress})
    judge = ctx.task.judge
    if not cfg.judge_declared or judge is None:
        return ft_cfg, None
    if outputs is not None and len(outputs) > 1:  # a decoder may read every output
        if not set(judge.declared) <= set(outputs):
            return ft_cfg, None
        return ft_cfg, DeclaredScore(judge, outputs[0], tuple(outputs[1:]))
    name = declared_output(ctx.task, outputs[0] if outputs else None)
    if name is None:
        return ft_cfg, None
    loss = kind_loss(ctx.task, name)
    if loss is not None and ft_cfg.embedding_loss not in BCE_LOSSES:  # a bce the recipe set stays
        ft_cfg = ft_cfg.model_copy(update={"embedding_loss": loss})
    return ft_cfg, DeclaredScore(judge, name)


def _float_search(
    cfg: QatConfig, student: Any, teacher: Any, score: Any, ctx: StepContext
) -> dict[str, Any]:
    """The float-layer search on the calibrated student, on the rows that fit
    ``float_search_seconds``: its record, the layers chosen among it."""
    ranked_by = declared_score(score.of_outputs) if score is not None else cosine_score
    t0 = time.perf_counter()
    calib = ctx.task.calibration_data
    fits = search_rows(student, calib(), cfg.float_search_rows, cfg.float_search_seconds)
    if fits.get("over_budget"):
        ctx.warn(
            f"qat: the float-layer search needs about {fits['estimated_s']:.0f} s on its fewest "
            f"rows ({fits['rows']}), over float_search_seconds ({cfg.float_search_seconds:g}); "
            "name the layers in float_modules with float_layers: 0 to skip it"
        )
    gains = layer_gains(student, teacher, calib(), fits["rows"], ranked_by, cfg.progress)
    return {
        **fits,
        "seconds": round(time.perf_counter() - t0, 3),
        "ranked_by": "declared agreement" if score is not None else "cosine",
        "chosen": choose_float(gains, cfg.float_layers, cfg.max_float_macs),
        "gains": gains_table(gains),
    }


def _train(
    cfg: QatConfig, module: Any, ctx: StepContext, state: Path, outputs: list[str] | None
) -> dict[str, Any]:
    """Prepare, calibrate and fine-tune the fake-quant student; returns it and its record."""
    fmt = fq.format_for(detect_cpu(), cfg.quantize_ops, tuple(cfg.float_modules))
    data, source, note = resolve_data(ctx.task, cfg.finetune)
    if note:
        ctx.warn(note)
    teacher = _frozen(module)
    ft_cfg, score = _judged(cfg, ctx, outputs)
    val = held_out_batches(data, cfg.finetune)[0]  # distill's held-out batches
    start: dict[str, Any] = {"teacher": teacher, "val": val, "score": score}
    student, rows = _started(cfg, module, fmt, ctx, start)
    search: dict[str, Any] | None = None
    if cfg.float_layers:
        search = _float_search(cfg, student, teacher, score, ctx)
        chosen = search["chosen"]
        if chosen:
            fmt = dataclasses.replace(fmt, float_modules=fmt.float_modules + tuple(chosen))
            student, rows = _started(cfg, module, fmt, ctx, start)
    learned = (
        fq.learn_ranges(student, cfg.learn_weight_ranges, cfg.learn_zero_points)
        if cfg.learn_ranges
        else 0
    )
    hooks = QatHooks(cfg, score)
    ft = distill(
        student,
        teacher,
        data,
        ft_cfg,
        output_kind=ctx.task.output_kind,
        task=ctx.task,
        desc="qat",
        checkpoint=FileCheckpoint(state / "train.pt", "qat"),
        hooks=hooks,
        all_outputs=True,
        output_names=outputs,
    )
    fq.freeze_observers(student)
    fq.freeze_bn(student)
    return {
        "student": student.eval(),
        "format": fmt,
        "record": {
            "format": fmt.to_dict(),
            "calibration_rows": rows,
            "calibration": start["method"],
            **({"calibration_scores": start["scores"]} if "scores" in start else {}),
            "learned_ranges": learned,
            "float_search": search,
            "data": source,
            "finetune": {k: v for k, v in ft.to_dict().items() if k != "history"},
            "loss": ft_cfg.embedding_loss,
            **({"output_losses": ft_cfg.output_losses} if ft_cfg.output_losses else {}),
            "kept_by": "declared agreement" if score is not None else "distillation loss",
            "history": _with_agreement(ft.history, score),
            "freezing": hooks.record(ft.steps),
        },
    }


def _export(cfg: QatConfig, student: Any, ctx: StepContext) -> tuple[Path, dict[str, Any]]:
    from ...export import export_module

    sample = ctx.task.sample_inputs(cfg.check_samples)
    model = fq.export_module_for(student)
    path = ctx.workdir / "qat.onnx"
    try:
        export_module(model, sample, path, cfg.opset)
        folded = fold_constant_quantizers(path)
        fusable = make_file_fusable(path)
        float_layers = float_inputs_file(path)  # e.g. a ConvTranspose QAT leaves in float
    except ExportError as err:
        where = node_of_op(model, error_text(err)) or failing_module(
            model, ctx.task.sample_inputs(2), cfg.opset
        )
        raise ExportError(
            f"QDQ export of the fake-quant model failed at {where} (whole model: "
            f"{error_text(err)}); keep that module out of QAT or give it an ONNX-exportable form"
        ) from None
    check = verify_export(model, path, sample, cfg.min_export_cosine, ctx.threads)
    return path, {**check, "int8_weights": folded, **fusable, "float_layers": float_layers}


def _with_agreement(history: list[dict[str, float]], score: Any) -> list[dict[str, float]]:
    """The fine-tuning history with each held-out evaluation's declared agreement."""
    if score is None:
        return history
    # the history's val_loss is the held-out score there; the distillation loss is the score's
    pairs = zip(history, score.history, strict=False)
    return [{**h, "score": h["val_loss"], **a} for h, a in pairs]


def run_qat(
    cfg: QatConfig, cand: Candidate, ctx: StepContext, ptq: PtqRows | None = None
) -> Candidate:
    """QAT on ``cand``'s torch model (an ONNX task's: its float graph converted); ``ptq``:
    post-training rows to compare against (the quantize step's, when it falls back to QAT), else
    built here when ``compare_ptq``."""
    t0 = time.perf_counter()
    _check_data(ctx)
    state = _state_dir(cfg, cand, ctx)
    with torch_threads(ctx.threads):
        module, converted = _input_module(cand, ctx)
        names = converted["outputs"] if converted is not None else None
        trained = _train(cfg, module, ctx, state, names)
        path, check = _export(cfg, trained["student"], ctx)
    if names is not None:  # the task's declarations and signature name the ONNX outputs
        from .onnx_module import rename_outputs

        rename_outputs(path, names)
    kernels = kernel_report(path, ctx.threads)
    qat = Candidate("qat", "qat", cand.name, onnx=path)
    if ptq is None and cfg.compare_ptq and cand.onnx is not None:
        method = trained["record"]["calibration"]
        ptq = ptq_rows(ctx, cand, trained["format"], method, cfg.percentile)
    table = compare_rows(ctx, qat, kernels, ptq)
    shutil.rmtree(state, ignore_errors=True)
    meta = {
        **({"from_onnx": converted} if converted is not None else {}),
        **trained["record"],
        "label": trained["format"].label,
        "export_check": check,
        "kernels": kernels,
        "fallback_report": kernels["summary"],
        "comparison": table,
        "step_wall_s": round(time.perf_counter() - t0, 2),
    }
    qat.meta, qat.measurement = meta, table.get("qat_measurement")
    return qat


@step(
    QatConfig,
    contract=Contract(consumes=("torch", "onnx"), produces=("onnx-int8",)),
    # 2: layers left in float (ConvTranspose) read a per-axis DequantizeLinear; 3: calibration
    # and learn_ranges (the record names both); 4: float_layers (the float-layer search), LSQ
    # gradient scale, learned zero points, export check's noise floor; 5: an ONNX task's float
    # graph converted to torch (onnx_module.py); 6: judge_declared (the declared kind's loss,
    # the weights of the best declared agreement kept); 7: float layers ranked by the declared
    # agreement where the task declares one, calibration: auto (the start measured); 8: an ONNX
    # graph's separate per-channel bias Add folded into its convolution (onnx_fold.py); 9: the
    # float-layer search's rows capped by float_search_seconds
    version=9,
    reads=("target", "budget", "outputs", "metric", "bench", "steps.quantize"),
    packages=("torch", "onnx", "onnxruntime", "numpy"),
)
def qat_step(cfg: QatConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    return run_qat(cfg, cand, ctx)
