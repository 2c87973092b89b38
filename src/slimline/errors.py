"""One exception hierarchy for slimline.

Every error derives from :class:`SlimlineError` and carries a one-line message that names the
problem and the fix. The CLI prints that line; it never shows a traceback for these. ``assert``
is kept for internal invariants only.

Two kinds, told apart by ``user_error``:

* the user's input is at fault (a recipe, a task, samples, the user's model file): exit status 2,
  and the run stops before or as soon as the input is read;
* a step, or a candidate slimline itself wrote, failed (:class:`StepError` and its subclasses:
  an exporter, a pruning library, the quantizer, ONNX Runtime refusing a written candidate).
  That is never blamed on the user: the candidate or step is rejected with its reason and the
  run goes on from the parent; only when nothing after it can run does the run stop, with the
  manifest and report written, and exit status 3.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BudgetError",
    "CandidateError",
    "DataError",
    "ExportError",
    "HardwareMismatchError",
    "InputMismatchError",
    "LoadTestError",
    "ManifestError",
    "ModelFileError",
    "RecipeError",
    "RuntimeMissingError",
    "ServeError",
    "SlimlineError",
    "StepError",
    "TaskError",
    "error_text",
    "is_user_error",
]


class SlimlineError(Exception):
    """Base of every slimline error: the message names the problem and the fix."""

    exit_code = 2
    user_error = True  # the user's input is at fault


class TaskError(SlimlineError):
    """A task file or task spec is missing a piece or cannot be loaded."""


class RecipeError(SlimlineError):
    """A recipe has an unknown key, a wrong type, or an impossible setting."""


class ModelFileError(SlimlineError):
    """A model file is missing, corrupt, or not what it claims to be."""


class InputMismatchError(SlimlineError):
    """Sample inputs do not match the model's input names, dtypes or shapes."""


class DataError(SlimlineError):
    """Calibration, evaluation or training data is missing, empty or malformed."""


class ManifestError(SlimlineError):
    """A file given as a run manifest is not one, or has an unsupported schema."""


class HardwareMismatchError(SlimlineError):
    """Two manifests compared by the gate come from different CPUs, threads or runtimes."""


class StepError(SlimlineError):
    """A step failed as a whole, through no fault of the input (an exporter, a pruning library,
    the quantizer's internals). The step is recorded as rejected with this reason and the run
    goes on from the parent; ``details`` (JSON-serialisable) goes into the record."""

    exit_code = 3
    user_error = False

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class ExportError(StepError):
    """torch -> ONNX export failed, or the exported graph disagrees with PyTorch."""


class CandidateError(StepError):
    """A model slimline wrote cannot be checked, loaded, evaluated or timed: that candidate is
    rejected with the runtime's message, the node when known, and the config that produced it."""


class BudgetError(SlimlineError):
    """No candidate met the accuracy budget; the run ends cleanly and says why."""


class RuntimeMissingError(SlimlineError):
    """The recipe or a command names a runtime whose package is not installed."""


class ServeError(SlimlineError):
    """The server cannot start with the given model or settings."""


class LoadTestError(SlimlineError):
    """A load test cannot start or its result is invalid."""


def is_user_error(err: BaseException) -> bool:
    """True when ``err`` blames the user's input (fail fast, exit 2); anything else that goes
    wrong inside a step or a candidate rejects that step or candidate instead."""
    return isinstance(err, SlimlineError) and err.user_error


def error_text(err: BaseException) -> str:
    """One line for a failure's record: slimline's own message, or a library's exception type and
    message (whitespace folded, cut at 400 characters)."""
    if isinstance(err, SlimlineError):
        return str(err)
    text = " ".join(str(err).split())
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
