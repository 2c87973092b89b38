"""Self-contained HTML report built from a run's manifest.

Each feature area contributes sections with :func:`section`; a section is
``fn(manifest: dict, run_dir: Path) -> str | None`` returning an HTML fragment (``None`` or ``""``
to skip). Plots are embedded as PNG data URIs via :func:`slimline.report.plots.png_img`.
Every module of the packages in ``SECTION_PACKAGES`` is imported when a report is built, so a
new technique's section (e.g. ``slimline/report/qat.py``) registers itself without being listed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SECTION_PACKAGES", "Section", "section", "sections"]

Section = Callable[[dict[str, Any], Path], "str | None"]

SECTION_PACKAGES: tuple[str, ...] = ("slimline.report", "slimline.loadtest.report")

_SECTIONS: list[tuple[int, str, Section]] = []


def section(order: int, title: str) -> Callable[[Section], Section]:
    """Register a report section; lower ``order`` comes first (core sections use 0-99)."""

    def register(fn: Section) -> Section:
        if not any(t == title for _, t, _ in _SECTIONS):
            _SECTIONS.append((order, title, fn))
        return fn

    return register


def sections() -> list[tuple[int, str, Section]]:
    from ..discover import import_all

    import_all(SECTION_PACKAGES)
    return sorted(_SECTIONS, key=lambda s: (s[0], s[1]))
