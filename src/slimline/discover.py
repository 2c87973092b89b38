"""Import every module of the named packages (and the named plain modules), so that the step
handlers and report sections in them register themselves: nothing keeps a list of them."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

__all__ = ["import_all"]

_DONE: set[str] = set()


def import_all(names: Iterable[str]) -> None:
    """Import each of ``names`` and, for a package, all of its submodules (once per process)."""
    for name in names:
        if name in _DONE:
            continue
        _DONE.add(name)  # first, so that a module importing the registry does not recurse
        try:
            module = importlib.import_module(name)
            for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=name + "."):
                importlib.import_module(info.name)
        except BaseException:
            _DONE.discard(name)
            raise
