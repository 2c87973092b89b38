"""slimline: take a trained model to a lean, served, measured model, with numbers for every step."""

from __future__ import annotations

__version__ = "0.1.0"

from . import api
from .candidate import Candidate
from .context import StepContext
from .errors import SlimlineError
from .recipe import Recipe, load_recipe, recipe_from_dict
from .task import Task, load_task

__all__ = [
    "Candidate",
    "Recipe",
    "SlimlineError",
    "StepContext",
    "Task",
    "__version__",
    "api",
    "load_recipe",
    "load_task",
    "recipe_from_dict",
]
