"""The part of an inference request both protocols share: pre-processing, validation, the
batcher, the cascade and post-processing (:func:`infer_tensors`), and the one mapping from a
failure to a status and an outcome label (:func:`classify_error`). HTTP (:mod:`.app`) and gRPC
(:mod:`.grpc_server`) decode and encode around it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import RequestError
from .batcher import (
    BatcherStopped,
    DeadlineExceeded,
    InferenceFailed,
    InvalidRequest,
    QueueFull,
    ShuttingDown,
)
from .model import ModelInputError, ServedModel
from .protocol import InferRequest, ProtocolError, check_requested_outputs, validate_inputs
from .state import ServerState, Slot

__all__ = ["classify_error", "in_pool", "infer_tensors", "request_rows"]

log = logging.getLogger("slimline.serve.app")  # the server's log, whichever protocol


def classify_error(err: Exception, model: ServedModel) -> tuple[int, str, str]:
    """``(HTTP status, outcome label, message)`` of a failed request: the one mapping both
    protocols use (gRPC turns the HTTP status into its own code)."""
    if isinstance(err, ProtocolError):
        return err.status, "bad_request", str(err)
    if isinstance(err, InvalidRequest):
        return 400, "bad_request", str(err)
    if isinstance(err, QueueFull | ShuttingDown):
        return 503, "rejected", str(err)
    if isinstance(err, BatcherStopped):
        log.error("%s", err)
        return 503, "error", str(err)
    if isinstance(err, DeadlineExceeded):
        return 504, "timeout", str(err)
    if isinstance(err, InferenceFailed):
        if isinstance(err.__cause__, ModelInputError):
            return 400, "bad_request", f"model {model.name!r} rejected the inputs: {err.__cause__}"
        log.error("%s", err)
        return 500, "error", str(err)
    if isinstance(err, RequestError):  # a request's outcome with no status of its own above
        log.error("%s", err)
        return 500, "error", str(err)
    log.error("unexpected failure serving model %s", model.name, exc_info=err)
    return 500, "error", f"internal error serving model {model.name!r}; see the server log"


async def infer_tensors(
    state: ServerState, slot: Slot, req: InferRequest, timeout_s: float | None
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Run a decoded request through pre-processing, validation, the batcher, the cascade and
    post-processing: the part of a request both protocols share. ``timeout_s`` (a header's or
    a gRPC deadline's) wins over the request's own ``timeout`` parameter."""
    settings = state.settings
    model, batcher, monitor = slot.model, slot.batcher, slot.monitor
    check_requested_outputs(model, req)
    inputs = req.inputs
    if model.preprocess is not None:
        try:
            inputs = await in_pool(state, model.preprocess, inputs)
        except (ValueError, TypeError, KeyError) as err:  # the user's data, not the server
            raise ProtocolError(
                f"model {model.name!r}: pre-processing rejected the request ({err!r}); check "
                "the inputs"
            ) from None
    try:
        fed = validate_inputs(
            model,
            inputs,
            max_batch=batcher.config.max_batch_size,
            allow_nonfinite=settings.allow_nonfinite,
        )
    except ProtocolError:
        monitor.invalid_rows(request_rows(model, inputs))
        raise
    edge_started = time.perf_counter()
    outputs = await batcher.submit(fed, timeout_s if timeout_s is not None else req.timeout_s)
    monitor.observe(outputs)
    parameters = None
    if model.cascade is not None:
        model.cascade.observe_edge(time.perf_counter() - edge_started)
        outputs, parameters = await model.cascade.refine(inputs, outputs)
    if model.postprocess is not None:
        outputs = await in_pool(state, model.postprocess, outputs)
    return outputs, parameters


def request_rows(model: ServedModel, inputs: dict[str, np.ndarray]) -> int:
    """Rows a request carries: its batch dimension for a batchable model, else one."""
    first = next(iter(inputs.values()), None)
    if not model.batchable or first is None or first.ndim == 0:
        return 1
    return int(first.shape[0])


async def in_pool(state: ServerState, fn: Callable[[Any], Any], arg: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.processing, fn, arg)
