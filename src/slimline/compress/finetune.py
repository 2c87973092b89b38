"""Fine-tuning by distillation from a frozen teacher, reusable by pruning recovery and QAT.

The student learns the teacher's outputs: KL divergence on temperature-softened logits (plus the
task loss where labels exist) for classifiers, cosine or MSE on the output vectors otherwise (for
example sentence embeddings learned from unlabelled text). The first ``val_batches`` batches of the
data are held out (more where they have fewer than ``min_val_rows`` rows: :func:`held_out_batches`);
every ``eval_every`` steps the distillation loss on them decides early stopping, and the best
weights seen are the ones kept.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from ..errors import RecipeError
from ..module_guard import eval_module
from ..recipe import Config
from ..task import Task
from .augment import AUGMENTS, augment_rows, augmentable
from .distill_loss import (
    EMBEDDING_LOSSES,
    check_losses,
    distill_loss,
    losses_by_position,
    outputs_loss,
)
from .features import FeatureTap, feature_loss, first_output
from .finetune_data import Batches, batch_stream, held_out_batches, resolve_data, trim_padding
from .train_state import EarlyStopping, FileCheckpoint, TrainCheckpoint

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn
    from torch.nn.modules.dropout import _DropoutNd

log = logging.getLogger(__name__)

__all__ = [
    "Batches",
    "DistillHooks",
    "EarlyStopping",
    "FeatureTap",
    "FileCheckpoint",
    "FinetuneConfig",
    "FinetuneResult",
    "TrainCheckpoint",
    "TrainingStep",
    "accumulate_gradients",
    "distill",
    "distill_loss",
    "feature_loss",
    "held_out_batches",
    "resolve_data",
    "to_tensors",
    "trim_padding",
]

DEFAULT_BASE_LR = 1e-3  # Adam-style learning rate assumed when the task names none


class FinetuneConfig(Config):
    not_in_key: ClassVar[frozenset[str]] = frozenset({"progress"})

    steps: int = Field(200, ge=0, description="max optimizer steps per fine-tuning run")
    lr: float | None = Field(None, gt=0.0, description="absolute learning rate; overrides lr_scale")
    lr_scale: float = Field(
        0.1, gt=0.0, le=1.0, description="x the task's LEARNING_RATE (or 1e-3) when lr is unset"
    )
    temperature: float = Field(4.0, gt=0.0, description="softmax temperature for logits KD")
    alpha: float = Field(
        0.7, ge=0.0, le=1.0, description="weight of distillation vs task loss where labels exist"
    )
    embedding_loss: EMBEDDING_LOSSES = Field(
        "cosine",
        description="loss between non-logit outputs: cosine, mse, or bce (outputs that are "
        "probabilities, e.g. a segmentation map after its sigmoid: binary cross-entropy "
        "against the teacher's probabilities); bce_rows: bce with each row weighted by the "
        "inverse of its text area in the teacher's map, as a mean of per-row IoUs weighs rows "
        "(compress/distill_loss.py)",
    )
    output_losses: dict[str, str] = Field(
        default_factory=dict,
        description="a model with several outputs (QAT of an ONNX detector): output name -> its "
        "own loss, one of cosine, mse, bce, bce_rows, kl (softmax over the last axis) or kl:N "
        "(groups of N bins, each a softmax: box-side distributions); the others keep "
        "embedding_loss (compress/distill_loss.py)",
    )
    features: str | None = Field(
        None,
        description="regex (full match) of module names whose outputs the student also learns "
        "from the teacher's (hidden-state distillation); their shapes must survive pruning",
    )
    feature_weight: float = Field(1.0, ge=0.0, description="weight of the hidden-state loss")
    eval_every: int = Field(50, ge=1, description="steps between held-out evaluations")
    patience: int = Field(2, ge=1, description="evaluations without gain before stopping")
    min_delta: float = Field(1e-4, ge=0.0, description="relative gain that counts as a gain")
    val_batches: int = Field(4, ge=1, description="leading batches held out for early stopping")
    min_val_rows: int = Field(
        16,
        ge=0,
        description="hold out more leading batches where val_batches of them have fewer rows, "
        "when the data has over twice as many batches: on large inputs in small batches, 8 "
        "held-out rows chose QAT's weights by noise (bench/RESULTS-qat-onnx.md)",
    )
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    dynamic_padding: bool = Field(
        True, description="cut batches to their longest attention_mask row (padded text inputs)"
    )
    data: Literal["auto", "train", "calibration"] = Field(
        "auto", description="auto: train_data() if the task has it, else calibration inputs"
    )
    dropout: bool = Field(
        True,
        description="false: the student's nn.Dropout layers are off while it distils (it learns "
        "the teacher's deterministic outputs, as it will run); restored afterwards",
    )
    augment: list[AUGMENTS] = Field(
        default_factory=list,
        description="views of image rows the student and teacher both see while distilling "
        "without labels: flip (mirrored left to right), mixup (blended with another row of the "
        "batch); compress/augment.py",
    )
    progress: bool = True

    @field_validator("output_losses")
    @classmethod
    def _known_losses(cls, v: dict[str, str]) -> dict[str, str]:
        """A loss name is checked when the recipe loads, not after the steps before QAT ran."""
        try:
            check_losses(v)
        except RecipeError as err:
            raise ValueError(str(err)) from None
        return v

    def key_dict(self) -> dict[str, Any]:
        """Without ``dropout`` while it is on, ``augment`` and ``output_losses`` while they are
        empty: a step's cache key stays what it was before the option existed (its result did
        not change)."""
        data = super().key_dict()
        if data.get("dropout") is True:
            data.pop("dropout")
        for empty in ("augment", "output_losses"):
            if not data.get(empty):
                data.pop(empty, None)
        return data


class DistillHooks:
    """Where a technique plugs into :func:`distill` without copying its loop: QAT inserts
    fake-quant modules in ``prepare_student`` and freezes observers or BatchNorm statistics in
    ``before_forward``; a technique can give parameters their own learning rates in
    ``param_groups``; depth pruning maps each kept layer's output to the teacher layer it came
    from in ``feature_taps``. Each method does nothing by default (``feature_taps``: the
    modules ``finetune.features`` names)."""

    def prepare_student(self, student: nn.Module) -> None:
        """Called once before the first held-out evaluation (and before a resumed state loads)."""

    def param_groups(self, student: nn.Module, params: list[Tensor]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups over the trainable ``params`` (AdamW options per
        group, e.g. ``lr``; unset ones take the run's)."""
        return [{"params": params}]

    def before_forward(self, step: int, student: nn.Module) -> None:
        """Called before the student's forward pass of training step ``step`` (1-based)."""

    def on_step(self, step: int, loss: float) -> None:
        """Called after training step ``step`` with its loss."""

    def state(self) -> dict[str, Any]:
        """What the hooks decided so far (plain numbers, strings and lists), saved with each
        checkpoint so that a resumed run continues with it."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` from a checkpoint (called before the first resumed step)."""

    def held_out_loss(
        self, student: nn.Module, teacher: nn.Module, val: list[Any], loss: float
    ) -> float:
        """What picks the kept weights and stops training early (lower is better), given the
        held-out batches and their distillation ``loss``: by default that loss. QAT scores the
        student as the task's declared output kind judges it (e.g. a thresholded map's IoU)."""
        return loss

    def feature_taps(
        self, student: nn.Module, teacher: nn.Module, cfg: FinetuneConfig
    ) -> tuple[FeatureTap, FeatureTap] | None:
        """The hidden states the student learns from the teacher's, as a pair of taps whose
        outputs pair up in call order: by default the modules ``cfg.features`` names in both
        (depth pruning maps each kept layer to the teacher layer it came from)."""
        if cfg.features and cfg.feature_weight > 0:
            return FeatureTap(student, cfg.features), FeatureTap(teacher, cfg.features)
        return None


@dataclass
class FinetuneResult:
    steps: int
    lr: float
    val_before: float
    val_after: float
    best_step: int
    stopped_early: bool
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_from_step: int = 0  # > 0: a killed run's checkpoint was continued from this step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_lr(task: Task | None, cfg: FinetuneConfig) -> float:
    if cfg.lr is not None:
        return cfg.lr
    base = task.extra("LEARNING_RATE", DEFAULT_BASE_LR) if task is not None else DEFAULT_BASE_LR
    return float(base) * cfg.lr_scale


def to_tensors(inputs: dict[str, np.ndarray]) -> dict[str, Tensor]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}


def _outputs(out: Any, every: bool) -> Any:
    """The outputs distilled: the first of a tuple, or with ``every`` all of them."""
    return out if every and isinstance(out, (tuple, list)) else first_output(out)


def _val_loss(
    student: nn.Module,
    teacher: nn.Module,
    val: list[Any],
    output_kind: str,
    cfg: FinetuneConfig,
    all_outputs: bool = False,
    losses: Sequence[str | None] = (),
) -> float:
    import torch

    was_training = student.training
    student.eval()
    total = 0.0
    with torch.no_grad():
        for inputs, _ in val:
            x = to_tensors(trim_padding(inputs) if cfg.dynamic_padding else inputs)
            s_out, t_out = _outputs(student(**x), all_outputs), _outputs(teacher(**x), all_outputs)
            total += float(outputs_loss(s_out, t_out, None, output_kind, cfg, None, losses))
    student.train(was_training)
    return total / len(val)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    cfg: FinetuneConfig,
    *,
    output_kind: str,
    task: Task | None = None,
    desc: str = "fine-tune",
    on_step: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
    hooks: DistillHooks | None = None,
    all_outputs: bool = False,
    output_names: Sequence[str] | None = None,
) -> FinetuneResult:
    """Fine-tune ``student`` (the caller's own module: its weights, BatchNorm statistics and
    training flag change) in place to match ``teacher`` (run in eval mode, as an eval-mode copy
    if in training mode); returns what happened. ``batches()`` yields ``(inputs, labels or
    None)``; labels add the task loss (``task.loss``, or cross-entropy for integer labels on
    logits). The best held-out weights are kept. A ``checkpoint`` saves the whole training state
    at every held-out evaluation, and a run that finds one continues from it. ``hooks``
    (:class:`DistillHooks`) let a technique change the student, its parameter groups and each
    step. ``all_outputs``: a model that returns several outputs is distilled on all of them
    (:func:`.distill_loss.outputs_loss`), not only its first, ``output_names`` (in order) the
    names ``cfg.output_losses`` reads. Parts: :class:`TrainingStep`, :class:`EarlyStopping`."""
    from tqdm.auto import tqdm

    lr = resolve_lr(task, cfg)
    hooks = hooks or DistillHooks()
    losses = losses_by_position(cfg.output_losses, output_names if all_outputs else None)
    teacher = eval_module(teacher)
    hooks.prepare_student(student)
    val, skip = held_out_batches(batches, cfg)

    def held_out() -> float:
        loss = _val_loss(student, teacher, val, output_kind, cfg, all_outputs, losses)
        return hooks.held_out_loss(student, teacher, val, loss)

    before = held_out()
    result = FinetuneResult(0, lr, before, before, 0, False, [{"step": 0, "val_loss": before}])
    if cfg.steps == 0:
        return result
    train = TrainingStep(student, teacher, cfg, lr, output_kind, task, hooks, all_outputs, losses)
    stop = EarlyStopping(student, before, cfg.min_delta, cfg.patience)
    running, start = 0.0, 0
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None:
        start, running = _resume_training(saved, train, stop, result)
    train.open()
    try:
        student.train()
        bar = tqdm(total=cfg.steps, initial=start, desc=desc, disable=not cfg.progress, leave=False)
        # a resumed run continues where the data stream was, not at its start
        stream = itertools.islice(batch_stream(batches, skip), start, None)
        for step_i, (inputs, labels) in enumerate(stream, start=start + 1):
            if step_i > cfg.steps:
                break
            if cfg.augment and labels is None:
                inputs = _augmented(inputs, cfg.augment, step_i)
            value = train(step_i, inputs, labels)
            running = value if step_i == 1 else 0.9 * running + 0.1 * value
            bar.update(1)
            bar.set_postfix(loss=f"{running:.4f}", best=f"{stop.best:.4f}")
            if on_step is not None:
                on_step(step_i, value)
            hooks.on_step(step_i, value)
            result.steps = step_i
            if step_i % cfg.eval_every == 0 or step_i == cfg.steps:
                state = (step_i, train, stop, running, result)
                if _held_out_halts(held_out(), state, cfg.steps, checkpoint):
                    break
            if step_i >= cfg.steps:
                break
        bar.close()
        student.load_state_dict(stop.state)
        student.eval()
        result.val_after = stop.best
        return result
    finally:
        train.close()


def _augmented(
    inputs: dict[str, np.ndarray], kinds: Sequence[str], step: int
) -> dict[str, np.ndarray]:
    """``augment_rows``, with one warning where the inputs are not images (left as they are)."""
    if step == 1 and not augmentable(inputs):
        log.warning(
            "finetune.augment %s is not applied: it augments float image inputs [N, C, H, W] "
            "only, and these inputs are %s",
            kinds,
            {k: f"{v.dtype}{list(v.shape)}" for k, v in inputs.items()},
        )
    return augment_rows(inputs, kinds, step)


def _held_out_halts(
    v: float,
    state: tuple[int, TrainingStep, EarlyStopping, float, FinetuneResult],
    steps: int,
    checkpoint: TrainCheckpoint | None,
) -> bool:
    """Record held-out ``v``, update early stopping, save a checkpoint; True: training stops."""
    step_i, train, stop, running, result = state
    result.history.append({"step": step_i, "train_loss": running, "val_loss": v})
    halt = stop.update(step_i, v, train.student)
    result.best_step, result.stopped_early = stop.step, halt and step_i < steps
    if halt:
        return True
    if checkpoint is not None and step_i < steps:
        checkpoint.save(_training_state(step_i, train, stop, running, result))
    return False


class TrainingStep:
    """One optimizer step of distillation: the teacher's outputs, the student's loss against
    them (plus the task loss where labels exist, and the hidden-state loss where taps are set),
    backward, gradient clipping, AdamW and the cosine schedule. :meth:`open` attaches the taps
    and switches dropout off; :meth:`close` puts both back."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        cfg: FinetuneConfig,
        lr: float,
        output_kind: str,
        task: Task | None,
        hooks: DistillHooks,
        all_outputs: bool = False,
        losses: Sequence[str | None] = (),
    ) -> None:
        import torch

        self.student, self.teacher, self.cfg, self.hooks = student, teacher, cfg, hooks
        self.all_outputs, self.losses = all_outputs, losses  # losses: each output's own
        self.output_kind, self.task_loss = output_kind, task.loss if task is not None else None
        groups = hooks.param_groups(student, [p for p in student.parameters() if p.requires_grad])
        self.params = [p for g in groups for p in g["params"]]
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
        )
        self.taps: tuple[FeatureTap, FeatureTap] | None = None
        self.dropout: dict[_DropoutNd, float] = {}

    def open(self) -> None:
        """Attach the hidden-state taps and switch dropout off (``cfg.dropout: false``), after
        a resumed state is loaded; :meth:`close` undoes both."""
        self.taps = self.hooks.feature_taps(self.student, self.teacher, self.cfg)
        self.dropout = {} if self.cfg.dropout else _dropout_off(self.student)

    def __call__(self, step: int, inputs: dict[str, np.ndarray], labels: Any) -> float:
        """Train on one batch as step ``step`` (1-based); returns the batch's loss."""
        import torch

        cfg = self.cfg
        x = to_tensors(trim_padding(inputs) if cfg.dynamic_padding else inputs)
        if self.taps is not None:  # drop what held-out evaluations collected
            self.taps[0].take(), self.taps[1].take()
        with torch.no_grad():
            t_out = _outputs(self.teacher(**x), self.all_outputs)
        self.hooks.before_forward(step, self.student)
        s_out = _outputs(self.student(**x), self.all_outputs)
        loss = outputs_loss(
            s_out, t_out, labels, self.output_kind, cfg, self.task_loss, self.losses
        )
        if self.taps is not None:
            s_tap, t_tap = self.taps
            loss = loss + cfg.feature_weight * feature_loss(
                s_tap.take(), t_tap.take(), s_tap.names, x.get("attention_mask")
            )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.opt.step()
        self.sched.step()
        return float(loss.detach())

    def close(self) -> None:
        for mod, p in self.dropout.items():
            mod.p = p
        if self.taps is not None:
            for tap in self.taps:
                tap.close()


def _training_state(
    step: int, train: TrainingStep, stop: EarlyStopping, running: float, result: FinetuneResult
) -> dict[str, Any]:
    """Everything a resumed run needs to continue after ``step`` as if never stopped."""
    import torch

    return {
        "step": step,
        "student": train.student.state_dict(),
        "optimizer": train.opt.state_dict(),
        "scheduler": train.sched.state_dict(),
        "rng": torch.get_rng_state(),
        "best": stop.best,
        "best_state": stop.state,
        "best_step": stop.step,
        "bad": stop.bad,
        "running": running,
        "val_before": result.val_before,
        "history": result.history,
        "hooks": train.hooks.state(),
    }


def _resume_training(
    saved: dict[str, Any], train: TrainingStep, stop: EarlyStopping, result: FinetuneResult
) -> tuple[int, float]:
    """Load a :func:`_training_state` into the run; returns (its step, its running loss)."""
    import torch

    train.student.load_state_dict(saved["student"])
    train.opt.load_state_dict(saved["optimizer"])
    train.sched.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    stop.best, stop.state, stop.bad = saved["best"], saved["best_state"], saved["bad"]
    stop.step = saved["best_step"]
    start = int(saved["step"])
    result.val_before, result.best_step = saved["val_before"], saved["best_step"]
    result.steps, result.history, result.resumed_from_step = start, saved["history"], start
    train.hooks.load_state(saved.get("hooks") or {})
    return start, float(saved["running"])


def _dropout_off(model: nn.Module) -> dict[_DropoutNd, float]:
    """Set every ``nn.Dropout`` of ``model`` to p = 0 (attention implementations that read the
    module's ``p`` follow); returns the modules' rates, to restore."""
    import torch.nn as nn

    rates = {m: float(m.p) for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)}
    for mod in rates:
        mod.p = 0.0
    return rates


def _gradient_loss(
    out: Tensor, t_out: Tensor, labels: Any, output_kind: str, task: Task | None
) -> Tensor | None:
    """A loss with a non-zero gradient at student == teacher, or ``None`` where there is none."""
    import torch
    import torch.nn.functional as F

    if labels is not None:
        lab = torch.as_tensor(np.asarray(labels))
        if task is not None and task.loss is not None:
            task_loss: Callable[[Tensor, Tensor], Tensor] = task.loss
            return task_loss(out, lab)
        if output_kind == "logits" and not lab.is_floating_point():
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), lab.reshape(-1).long())
    if output_kind == "logits":  # the teacher's own predictions as labels
        return F.cross_entropy(
            out.reshape(-1, out.shape[-1]), t_out.reshape(-1, t_out.shape[-1]).argmax(-1)
        )
    return None


def accumulate_gradients(
    model: nn.Module,
    teacher: nn.Module,
    batches: Batches,
    n_batches: int,
    *,
    output_kind: str,
    task: Task | None = None,
) -> int:
    """Run forward/backward on up to ``n_batches`` so ``.grad`` holds the summed loss gradients
    (for first-order Taylor importance). Returns how many batches contributed; 0 means the data
    carries no gradient signal (unlabelled, non-logit outputs) and Taylor importance is unusable.

    ``model`` must be the caller's own module: its gradients and training flag change. The
    teacher is only run, in eval mode (an eval-mode copy when it is in training mode)."""
    import torch

    teacher = eval_module(teacher)
    model.zero_grad(set_to_none=True)
    model.eval()  # gradients of the deployed (eval-mode) function, without dropout noise
    used = 0
    for inputs, labels in batches():
        x = to_tensors(trim_padding(inputs))
        with torch.no_grad():
            t_out = first_output(teacher(**x))
        loss = _gradient_loss(first_output(model(**x)), t_out, labels, output_kind, task)
        if loss is None:
            break
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        used += 1
        if used >= n_batches:
            break
    return used
