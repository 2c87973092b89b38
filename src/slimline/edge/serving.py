"""The memory setting ``slimline serve`` runs a model with: the run's recorded memory profile,
or, under a ``--memory-mb`` budget the record does not cover, one measured at start-up on the
batch sizes the server will run (the warm-up's: powers of two up to ``--max-batch-size``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..measure.runners import ORT_TO_NP, ort_session
from .memory import choose, chosen_setting, memory_profile
from .setting import MemorySetting

__all__ = ["FREE_DIM", "serve_batch_sizes", "serving_memory"]

log = logging.getLogger(__name__)
FREE_DIM = 128  # the length a free non-batch dimension (a sequence) is measured at


def serve_batch_sizes(max_batch_size: int) -> list[int]:
    return sorted({*(1 << i for i in range(max_batch_size.bit_length())), max_batch_size})


def _ones_sampler(model: Path) -> Callable[[int], dict[str, np.ndarray]]:
    """Inputs of ones for a model without data: the batch on axis 0, other free dims FREE_DIM."""
    sess = ort_session(model, 1, level="disable", user_model=True)
    specs = [(i.name, ORT_TO_NP.get(i.type, "float32"), list(i.shape)) for i in sess.get_inputs()]

    def sample(batch: int) -> dict[str, np.ndarray]:
        out = {}
        for name, dtype, dims in specs:
            shape = [d if isinstance(d, int) and d > 0 else FREE_DIM for d in dims]
            if shape and not (isinstance(dims[0], int) and dims[0] > 0):
                shape[0] = batch
            out[name] = np.ones(shape, dtype=dtype)
        return out

    return sample


def _recorded(meta: dict[str, Any], budget_mb: float | None, sizes: list[int]) -> Any:
    """The recorded profile's answer, or ``...`` when it cannot give one."""
    profile = meta.get("memory_profile")
    if not profile:
        return ...
    if budget_mb is None:
        return chosen_setting(profile)
    if set(sizes) <= set(profile.get("batch_sizes") or []):
        row = choose(profile["rows"], budget_mb)
        return MemorySetting.model_validate(row["setting"])
    return ...


def serving_memory(
    budget_mb: float | None, threads: int, max_batch_size: int
) -> Callable[[Path, dict[str, Any]], MemorySetting | None]:
    """``(onnx_path, meta) -> setting`` for :func:`~slimline.serve.model.load_served_models`."""
    sizes = serve_batch_sizes(max_batch_size)

    def setting_for(model: Path, meta: dict[str, Any]) -> MemorySetting | None:
        recorded = _recorded(meta, budget_mb, sizes)
        if recorded is not ...:
            return recorded  # type: ignore[no-any-return]
        if budget_mb is None:
            return None
        log.info("measuring memory settings of %s at batch sizes %s", model.name, sizes)
        profile = memory_profile(model, _ones_sampler(model), sizes, threads, budget_mb)
        meta["memory_profile"] = profile
        setting = chosen_setting(profile)
        log.info("memory setting of %s: %s", model.name, setting.label if setting else "-")
        return setting

    return setting_for
