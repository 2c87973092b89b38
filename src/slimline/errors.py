"""One exception hierarchy for slimline.

Every error a user or a client can see derives from :class:`SlimlineError` and carries a
one-line message that names the problem and the fix. The CLI prints that line; it never shows a
traceback for these. ``assert`` is kept for internal invariants only. The whole tree::

    SlimlineError                 the user's input is at fault: exit status 2
    ├── TaskError                 a task file or spec cannot be loaded
    ├── RecipeError               unknown key, wrong type, impossible setting
    ├── ModelFileError            a model file is missing, corrupt or not a model
    ├── InputMismatchError        sample inputs do not match the model
    ├── DataError                 calibration, evaluation or training data is unusable
    ├── ManifestError             a file given as a manifest is not one
    ├── HardwareMismatchError     the gate compares runs of unlike targets
    ├── RuntimeMissingError       a named runtime is not installed
    ├── MemoryBudgetError         no measured runtime setting fits the memory budget (edge/)
    ├── CalibrationError          no cascade threshold meets the escalation rate (edge/)
    ├── ServeError                the server cannot start with this model or settings
    ├── LoadTestError             a load test cannot start, or its result is invalid
    ├── StepError                 a step failed, not the input's fault: exit status 3
    │   ├── ExportError           torch -> ONNX export failed or disagrees with PyTorch
    │   └── CandidateError        a model slimline wrote cannot be loaded, evaluated or timed
    └── RequestError              one served request gets no result; the server goes on
        ├── ProtocolError         the request is malformed (a 4xx status it carries)
        ├── ModelInputError       the runtime refused inputs that passed the metadata checks
        ├── CloudError            the cascade's cloud tier answered with an error
        └── BatcherError          the dynamic batcher gave no result
            ├── QueueFull         503, retry later
            ├── ShuttingDown      503, draining
            ├── BatcherStopped    503, the collector died
            ├── DeadlineExceeded  504
            ├── InvalidRequest    400
            └── InferenceFailed   500, or 400 when caused by a ModelInputError

Every class is defined here, so this is the one place to read; the modules that raise them
re-export the ones their callers import (``serve.batcher``, ``serve.protocol``, ``edge.memory``,
...). ``tests/test_errors.py`` fails on an exception class defined anywhere else in the package,
on a class here that nothing raises, and on a class missing from the tree above.

Three kinds, told apart by ``user_error`` and the branch:

* the user's input is at fault (a recipe, a task, samples, the user's model file): exit status 2,
  and the run stops before or as soon as the input is read;
* a step, or a candidate slimline itself wrote, failed (:class:`StepError` and its subclasses:
  an exporter, a pruning library, the quantizer, ONNX Runtime refusing a written candidate).
  That is never blamed on the user: the candidate or step is rejected with its reason and the
  run goes on from the parent; only when nothing after it can run does the run stop, with the
  manifest and report written, and exit status 3;
* a served request gets no result (:class:`RequestError`): the server answers that request
  with an HTTP status and the message, counts it in its metrics, and goes on serving. These
  never reach the CLI, so their exit status is moot.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatcherError",
    "BatcherStopped",
    "CalibrationError",
    "CandidateError",
    "CloudError",
    "DataError",
    "DeadlineExceeded",
    "ExportError",
    "HardwareMismatchError",
    "InferenceFailed",
    "InputMismatchError",
    "InvalidRequest",
    "LoadTestError",
    "ManifestError",
    "MemoryBudgetError",
    "ModelFileError",
    "ModelInputError",
    "ProtocolError",
    "QueueFull",
    "RecipeError",
    "RequestError",
    "RuntimeMissingError",
    "ServeError",
    "ShuttingDown",
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


class RuntimeMissingError(SlimlineError):
    """The recipe or a command names a runtime whose package is not installed."""


class ServeError(SlimlineError):
    """The server cannot start with the given model or settings."""


class LoadTestError(SlimlineError):
    """A load test cannot start or its result is invalid."""


class MemoryBudgetError(SlimlineError):
    """No measured setting keeps the peak RSS under the memory budget (the user's budget);
    ``profile`` holds what was measured, when a whole profile was."""

    def __init__(self, message: str, profile: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.profile = profile


class CalibrationError(SlimlineError):
    """No cascade threshold meets the requested escalation rate and metric loss together."""


# -- serving: one request's outcome, never the process's ------------------------------------
class RequestError(SlimlineError):
    """A served request that gets no result. The server answers it with an HTTP status and
    this message and goes on; the branch exists so that one ``except`` can tell a request's
    outcome from a failure of the server itself."""


class ProtocolError(RequestError):
    """A request the server will not run; ``status`` is the HTTP status (always 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ModelInputError(RequestError, ValueError):
    """The runtime refused inputs that passed metadata checks (e.g. unequal sequence lengths).
    Also a ``ValueError``, as it was before it joined the tree."""


class CloudError(RequestError):
    """The cascade's cloud tier answered with an error; ``kind`` labels it in the metrics
    (``rejected``, ``unavailable``, ``timeout``, ``error``), and the edge's answer is served."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class BatcherError(RequestError):
    """Base of the outcomes a request can meet in the batcher other than a result."""


class QueueFull(BatcherError):
    """The queue holds ``max_queue_size`` requests; retry later (HTTP 503)."""


class ShuttingDown(BatcherError):
    """The batcher is draining and takes no new requests (HTTP 503)."""


class DeadlineExceeded(BatcherError):
    """The request's deadline passed before its result was ready (HTTP 504); ``ran`` says
    whether its batch had started."""

    def __init__(self, message: str, *, ran: bool) -> None:
        super().__init__(message)
        self.ran = ran


class BatcherStopped(BatcherError):
    """The batch collector died; the model takes no requests until the server restarts."""


class InvalidRequest(BatcherError):
    """The request cannot be batched as sent (HTTP 400)."""


class InferenceFailed(BatcherError):
    """The model raised, or broke the one-result-per-input rule, on this request's batch."""


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
