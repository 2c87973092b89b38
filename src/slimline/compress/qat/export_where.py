"""Where a QDQ export of a fake-quant model fails: the module (and op) to name in the error."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ExportError, error_text
from ..finetune import to_tensors

__all__ = ["failing_module", "node_of_op"]


def node_of_op(model: Any, message: str) -> str | None:
    """The module (and its class) whose traced code calls the op the exporter named, from the FX
    graph's module stack: FX inlines user modules, so the op is a node, not a leaf module."""
    found = re.search(r"aten::(\w+)", message)
    graph = getattr(model, "graph", None)
    if found is None or graph is None:
        return None
    op = found.group(1)
    for node in graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        if node.op in ("call_function", "call_method") and name == op:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            if not stack:
                return f"the model's own forward (op aten::{op})"
            path, cls = stack[-1]
            cls_name = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1])
            return f"module {path} ({cls_name}): op aten::{op}"
    return None


def failing_module(model: Any, sample: dict[str, np.ndarray], opset: int) -> str:
    """The first leaf module (in call order) that the exporter cannot export alone, with the
    exporter's message: it names the op."""
    import torch

    from ...export import export_module

    calls: list[tuple[str, Any, tuple[Any, ...]]] = []
    handles = [
        m.register_forward_hook(lambda mod, args, out, n=n: calls.append((n, mod, args)))
        for n, m in model.named_modules()
        if n and not list(m.children())
    ]
    try:
        with torch.no_grad():
            model(**to_tensors(sample))
    finally:
        for h in handles:
            h.remove()
    for name, mod, args in calls:
        if not args or not all(isinstance(a, torch.Tensor) for a in args):
            continue
        feed = {f"in{i}": a.detach().numpy() for i, a in enumerate(args)}
        try:
            export_module(_positional(mod, len(args)), feed, Path("/dev/null"), opset)
        except ExportError as err:
            return f"module {name} ({type(mod).__name__}): {error_text(err)}"
        except Exception:
            continue
    return "no single module fails alone"


def _positional(mod: Any, n: int) -> Any:
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mod

        def forward(self, *args: Any) -> Any:  # export_module passes the inputs in order
            return self.inner(*args[:n])

    return Wrapped()
