"""Matplotlib helpers: figures rendered off-screen and embedded as PNG data URIs."""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["figure", "plt", "png_img"]


def figure(width: float = 7.0, height: float = 3.6) -> tuple[Any, Any]:
    return plt.subplots(figsize=(width, height), dpi=100)


def png_img(fig: Any, alt: str) -> str:
    """Render ``fig`` to an ``<img>`` tag with an embedded PNG, and close it."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img alt="{alt}" src="data:image/png;base64,{data}"/>'
