"""One exception hierarchy for slimline.

Every error a user can cause derives from :class:`SlimlineError` and carries a one-line message
that names the problem and the fix. The CLI prints that line and exits with status 2; it never
shows a traceback for these. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "DataError",
    "ExportError",
    "HardwareMismatchError",
    "InputMismatchError",
    "LoadTestError",
    "ManifestError",
    "ModelFileError",
    "RecipeError",
    "ServeError",
    "SlimlineError",
    "StepError",
    "TaskError",
]


class SlimlineError(Exception):
    """Base of every user-facing error: the message names the problem and the fix."""

    exit_code = 2


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


class ExportError(SlimlineError):
    """torch -> ONNX export failed, or the exported graph disagrees with PyTorch."""


class ManifestError(SlimlineError):
    """A file given as a run manifest is not one, or has an unsupported schema."""


class HardwareMismatchError(SlimlineError):
    """Two manifests compared by the gate come from different CPUs, threads or runtimes."""


class StepError(SlimlineError):
    """A compression step failed; the run keeps everything produced before it."""


class BudgetError(SlimlineError):
    """No candidate met the accuracy budget; the run ends cleanly and says why."""


class ServeError(SlimlineError):
    """The server cannot start with the given model or settings."""


class LoadTestError(SlimlineError):
    """A load test cannot start or its result is invalid."""
