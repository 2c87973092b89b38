"""Confidence scores of an edge model's output, one per row (higher: surer). A cascade escalates
the rows whose score is below its threshold.

``softmax``: the top-1 probability of the softmax over the last axis (the output is logits);
``probability``: the top-1 value itself (the output already is probabilities);
``margin``: the top-1 value minus the runner-up (logits or probabilities);
``FILE.py:FUNCTION``: a task-defined score, ``FUNCTION(outputs: np.ndarray) -> np.ndarray``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import SlimlineError

__all__ = ["BUILTIN_SCORES", "ScoreFn", "resolve_score"]

ScoreFn = Callable[[np.ndarray], np.ndarray]


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(x.shape[0], -1) if x.ndim != 2 else x


def softmax_top1(x: np.ndarray) -> np.ndarray:
    z = _rows(x)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e.max(axis=1) / e.sum(axis=1))


def probability_top1(x: np.ndarray) -> np.ndarray:
    return np.asarray(_rows(x).max(axis=1))


def margin(x: np.ndarray) -> np.ndarray:
    z = _rows(x)
    if z.shape[1] < 2:
        return np.asarray(z[:, 0])
    top2 = np.partition(z, -2, axis=1)[:, -2:]
    return np.asarray(top2[:, 1] - top2[:, 0])


BUILTIN_SCORES: dict[str, ScoreFn] = {
    "softmax": softmax_top1,
    "probability": probability_top1,
    "margin": margin,
}


def resolve_score(spec: str) -> ScoreFn:
    """A built-in score by name, or ``FILE.py:FUNCTION`` loaded from a Python file."""
    if spec in BUILTIN_SCORES:
        return BUILTIN_SCORES[spec]
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise SlimlineError(
            f"confidence score {spec!r} is unknown; use {', '.join(BUILTIN_SCORES)} or "
            "FILE.py:FUNCTION"
        )
    if not Path(path).is_file():
        raise SlimlineError(f"score file {path} does not exist; check the path")
    module_spec = importlib.util.spec_from_file_location(f"slimline_score_{Path(path).stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SlimlineError(f"{path} defines no function {name!r}; define {name}(outputs)")
    return fn  # type: ignore[no-any-return]
