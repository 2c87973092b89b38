"""Step registry: a step is a typed config plus one function ``candidate -> candidate``.

Handlers are registered by config *type* (the config class carries its recipe key in ``kind``), so
there is one table and nothing to keep in sync. Adding a technique means writing one config class
and one function decorated with :func:`step`, in a module listed in ``BUILTIN_STEP_MODULES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..recipe import StepConfig

if TYPE_CHECKING:
    from ..candidate import Candidate
    from ..pipeline import StepContext

__all__ = [
    "BUILTIN_STEP_MODULES",
    "config_class",
    "handler_for",
    "registered_kinds",
    "restorer_for",
    "step",
]

BUILTIN_STEP_MODULES: tuple[str, ...] = (
    "slimline.export",
    "slimline.compress.graph",
    "slimline.compress.quantize",
    "slimline.compress.pruning.step",
)

C = TypeVar("C", bound=StepConfig)
StepFn = Callable[[C, "Candidate", "StepContext"], "Candidate"]

# restore(entry_dir, meta, task) -> torch module: rebuilds the torch model a cached step produced
# (e.g. a pruned model) without pickles; steps whose outputs are ONNX-only need none.
Restore = Callable[[Any, dict[str, Any], Any], Any]

_HANDLERS: dict[type[StepConfig], tuple[Callable[..., Candidate], Restore | None]] = {}


def step(config_cls: type[C], restore: Restore | None = None) -> Callable[[StepFn[C]], StepFn[C]]:
    """Register ``fn`` as the handler of ``config_cls`` (and ``restore`` for cached modules)."""
    if not config_cls.kind:
        raise TypeError(f"{config_cls.__name__} must set the class attribute `kind`")

    def register(fn: StepFn[C]) -> StepFn[C]:
        for other in _HANDLERS:
            if other.kind == config_cls.kind and other is not config_cls:
                raise TypeError(f"step kind {config_cls.kind!r} registered twice")
        _HANDLERS[config_cls] = (fn, restore)
        return fn

    return register


def _load_builtins() -> None:
    for mod in BUILTIN_STEP_MODULES:
        importlib.import_module(mod)


def registered_kinds() -> list[str]:
    _load_builtins()
    return sorted(c.kind for c in _HANDLERS)


def config_class(kind: str) -> type[StepConfig]:
    _load_builtins()
    for cls in _HANDLERS:
        if cls.kind == kind:
            return cls
    raise KeyError(f"unknown step {kind!r}; known steps: {', '.join(registered_kinds())}")


def handler_for(config: StepConfig) -> Callable[..., Candidate]:
    _load_builtins()
    try:
        return _HANDLERS[type(config)][0]
    except KeyError:
        raise KeyError(f"no handler registered for {type(config).__name__}") from None


def restorer_for(config: StepConfig) -> Restore | None:
    _load_builtins()
    return _HANDLERS[type(config)][1]
