"""The task contract: model + data + metric, supplied by the user as a Python file.

A task file (or a built-in example module under ``slimline.examples``) defines these names:

=================  ==========  ==============================================================
name               required    what it is
=================  ==========  ==============================================================
``model()``        yes         returns the FP32 ``torch.nn.Module`` in eval mode. It is called
                               with the inputs as keyword arguments and returns one tensor.
``calibration_data()`` yes     returns an iterable of input batches: ``{name: np.ndarray}``
``eval_data()``    yes         returns an iterable of ``(inputs, labels)`` batches
``metric(outputs, labels)`` yes  float, higher is better; ``outputs`` and ``labels`` are the
                               batches' model outputs and labels concatenated along axis 0
``METRIC_NAME``    no          e.g. ``"top1"``; default ``"metric"``
``OUTPUT_KIND``    no          ``"logits"``, ``"embedding"`` or ``"other"`` (default)
``train_data()``   no          iterable of ``(inputs, labels or None)`` batches for fine-tuning
``loss(outputs, labels)`` no   torch loss for fine-tuning
``NAME``           no          the task's name; default: the file stem
=================  ==========  ==============================================================

An ONNX file plus an ``.npz`` of sample inputs is a task too: its model is the ONNX graph, its
calibration and evaluation inputs are the samples (evaluation rows held out, or a second file),
and its metric is the mean cosine of the outputs to the FP32 model's own outputs (``fidelity``).
Its :class:`~slimline.signature.Signature` says where each input's batch axis is; a task without
one (every Python task) has the batch on axis 0 of every input.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .errors import TaskError
from .signature import Signature, n_rows, slice_rows
from .taskspec import OutputKind, Task
from .tensors import Inputs, check_inputs, take_samples

if TYPE_CHECKING:
    from .outputs import OutputDecl

__all__ = ["Inputs", "OutputKind", "Task", "check_inputs", "load_task", "take_samples"]

EXAMPLES_PACKAGE = "slimline.examples"
_REQUIRED = ("model", "calibration_data", "eval_data", "metric")


def load_task(
    spec: str,
    samples: str | None = None,
    eval_samples: str | None = None,
    *,
    batch_axes: dict[str, int | None] | None = None,
    primary_output: str | None = None,
    outputs: Mapping[str, OutputDecl] | None = None,
    metric: str | None = None,
    constant_inputs: Mapping[str, Any] | None = None,
) -> Task:
    """Load a task from an example name, a task ``.py`` file, or an ``.onnx`` file + samples;
    ``outputs`` declares how outputs are judged (:mod:`slimline.outputs`), ``metric`` is an ONNX
    task's metric hook (``file.py:function``), ``constant_inputs`` an ONNX task's inputs that
    take one value in deployment (checked against the model and the samples)."""
    from .measure.judge import Judge

    if spec.endswith(".onnx"):
        from .onnx_task import onnx_task

        task = onnx_task(
            Path(spec),
            Path(samples) if samples else None,
            Path(eval_samples) if eval_samples else None,
            batch_axes=batch_axes,
            primary_output=primary_output,
            metric=metric,
            constant_inputs=constant_inputs,
        )
    elif metric is not None:
        raise TaskError(
            f"task {spec}: a metric hook applies to an ONNX task; a task file defines metric()"
        )
    elif spec.endswith(".py"):
        task = _task_from_module(_import_file(Path(spec)), spec, Path(spec).stem)
    else:
        task = _task_from_module(_import_example(spec), spec, spec)
    judge = Judge.from_declarations(outputs or {})
    return replace(task, judge=judge) if judge is not None else task


def _import_example(name: str) -> Any:
    from .examples import EXAMPLES

    if name not in EXAMPLES:
        raise TaskError(
            f"unknown task {name!r}: give a task .py file, a model .onnx file, or one of the "
            f"examples ({', '.join(sorted(EXAMPLES))}); `slimline examples` lists them"
        )
    return importlib.import_module(EXAMPLES[name])


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist; check the path in the recipe's `task`")
    mod_name = f"slimline_task_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"task file {path} cannot be imported as Python; it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # the task's own helper modules beside it import, in every
        sys.path.append(folder)  # process that loads it (last: installed packages come first)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[mod_name]
        raise TaskError(f"task file {path} failed to import: {type(err).__name__}: {err}") from err
    return module


def _task_from_module(module: Any, source: str, default_name: str) -> Task:
    missing = [n for n in _REQUIRED if not callable(getattr(module, n, None))]
    if missing:
        raise TaskError(
            f"task {source} does not define {', '.join(f'{m}()' for m in missing)}; "
            "a task file needs model(), calibration_data(), eval_data() and metric(outputs, labels)"
        )
    kind = getattr(module, "OUTPUT_KIND", "other")
    if kind not in ("logits", "embedding", "other"):
        raise TaskError(
            f"task {source}: OUTPUT_KIND must be 'logits', 'embedding' or 'other', not {kind!r}"
        )
    return Task(
        name=str(getattr(module, "NAME", default_name)),
        source=source,
        model=module.model,
        calibration_data=module.calibration_data,
        eval_data=module.eval_data,
        metric=module.metric,
        metric_name=str(getattr(module, "METRIC_NAME", "metric")),
        output_kind=cast(OutputKind, kind),
        train_data=getattr(module, "train_data", None),
        loss=getattr(module, "loss", None),
        module=module,
    )


def iter_rows(
    batches: Iterable[Inputs], limit: int | None, sig: Signature | None = None
) -> Iterator[Inputs]:
    """Yield batches, cut (along their batch axes) so that at most ``limit`` rows come out."""
    seen = 0
    for b in batches:
        n = n_rows(b, sig)
        if limit is not None and seen + n > limit:
            b = slice_rows(b, 0, limit - seen, sig)
            n = limit - seen
        if n > 0:
            yield b
        seen += n
        if limit is not None and seen >= limit:
            return
