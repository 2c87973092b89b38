"""Using a torch module without changing it: eval-mode views, private copies, thread settings.

A step is a function of its inputs: it never mutates what it did not create. A task's
``model()`` may return the same object on every call (tasks that load their weights once do), and
every candidate of a run may share its parent's module, so an in-place change anywhere would
silently change the FP32 baseline and every figure measured against it. Whatever changes a
module (pruning, history replay, fine-tuning, BatchNorm statistics, ``eval()``/``train()``)
works on :func:`private_copy`; whatever only runs it takes :func:`eval_module`; torch's global
thread count is set with :func:`torch_threads`, which puts it back.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import StepError

__all__ = ["eval_module", "private_copy", "torch_threads"]


def private_copy(module: Any) -> Any:
    """A deep copy of ``module`` to change in place (weights, buffers, flags, hooks included)."""
    try:
        return copy.deepcopy(module)
    except Exception as err:
        raise StepError(
            f"cannot copy {type(module).__name__} ({type(err).__name__}: {err}); slimline copies a "
            "model before changing it, so every attribute of the module must support "
            "copy.deepcopy (move open files, locks or sessions out of the module)"
        ) from err


def eval_module(module: Any) -> Any:
    """``module`` itself when it and all its submodules are in eval mode, else an eval-mode
    :func:`private_copy`: the caller's module keeps its own training flags."""
    if not any(m.training for m in module.modules()):
        return module
    return private_copy(module).eval()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, then restore the previous count
    (nothing is set when it is already ``threads``: no thread-pool churn per call)."""
    import torch

    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
