"""User functions named in a recipe as ``file.py:function`` (a metric hook, a box decoder).

The file is resolved against the recipe's folder when the recipe is loaded
(:func:`slimline.recipe.load_recipe`); here it is imported and the function looked up, with an
error that names the fix when either fails.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import RecipeError

__all__ = ["load_hook", "split_hook"]


def split_hook(ref: str) -> tuple[Path, str]:
    """(file, function) of ``file.py:function``."""
    file, _, func = ref.rpartition(":")
    return Path(file), func


def load_hook(ref: str, what: str) -> Callable[..., Any]:
    """The function ``ref`` (``file.py:function``) names; ``what`` says what it is for, in
    errors (e.g. ``"metric"``, ``"outputs.boxes.decode"``)."""
    path, func = split_hook(ref)
    if not path.is_file():
        raise RecipeError(f"recipe {what}: file {path} does not exist; give file.py:function")
    name = f"slimline_hook_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RecipeError(f"recipe {what}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            raise RecipeError(
                f"recipe {what}: {path} failed to import: {type(err).__name__}: {err}"
            ) from err
        sys.modules[name] = module
    fn = getattr(module, func, None)
    if not callable(fn):
        raise RecipeError(f"recipe {what}: {path} defines no function {func!r}; fix the name")
    return fn  # type: ignore[no-any-return]
