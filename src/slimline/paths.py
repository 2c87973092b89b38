"""Where slimline keeps its shared cache (step outputs, trained example weights)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(*parts: str) -> Path:
    """``$SLIMLINE_CACHE`` or ``~/.cache/slimline``, joined with ``parts``, created on demand."""
    root = Path(os.environ.get("SLIMLINE_CACHE") or Path.home() / ".cache" / "slimline")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
