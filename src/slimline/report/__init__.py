"""Self-contained HTML report built from a run's manifest.

Each feature area contributes sections with :func:`section`; a section is
``fn(manifest: dict, run_dir: Path) -> str | None`` returning an HTML fragment (``None`` or ``""``
to skip). Plots are embedded as PNG data URIs via :func:`slimline.report.plots.png_img`.
Section modules are listed in ``SECTION_MODULES`` and imported when a report is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SECTION_MODULES", "Section", "section", "sections"]

Section = Callable[[dict[str, Any], Path], "str | None"]

SECTION_MODULES: tuple[str, ...] = (
    "slimline.report.core",
    "slimline.loadtest.report",
    "slimline.report.pruning",
    "slimline.report.quantization",
)

_SECTIONS: list[tuple[int, str, Section]] = []


def section(order: int, title: str) -> Callable[[Section], Section]:
    """Register a report section; lower ``order`` comes first (core sections use 0-99)."""

    def register(fn: Section) -> Section:
        if not any(t == title for _, t, _ in _SECTIONS):
            _SECTIONS.append((order, title, fn))
        return fn

    return register


def sections() -> list[tuple[int, str, Section]]:
    import importlib

    for mod in SECTION_MODULES:
        importlib.import_module(mod)
    return sorted(_SECTIONS, key=lambda s: (s[0], s[1]))
