"""The report section that compares FP32, full PTQ, mixed-precision PTQ and QAT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimline.report import sections


def _row(metric: float, cosine: float, p50: float, share: float) -> dict[str, Any]:
    return {
        "metric": metric,
        "cosine_mean": cosine,
        "latency_ms": {"p50": p50},
        "size_bytes": 1_000_000,
        "int8_share": share,
        "kernels": f"{int(share * 10)} of 10 quantizable ops run INT8",
    }


def test_the_section_is_registered_and_shows_every_row() -> None:
    comparison = {
        "rows": {
            "fp32": _row(0.98, 1.0, 2.0, 0.0),
            "ptq_full": _row(0.95, 0.97, 1.0, 1.0),
            "ptq_mixed": _row(0.975, 0.991, 1.6, 0.4),
            "qat": _row(0.978, 0.995, 1.02, 1.0),
        },
        "verdicts": {"metric_recovered_share": 0.9333, "latency_vs_ptq_full": 1.02},
        "notes": [],
    }
    meta = {"comparison": comparison, "label": "QAT QDQ U8S8 per-channel", "freezing": {}}
    manifest = {"candidates": [{"name": "qat", "accepted": True, "reason": "ok", "meta": meta}]}
    found = {title: fn for _, title, fn in sections()}
    html = found["Quantization-aware training"](manifest, Path("."))
    assert html is not None
    for text in ("FP32", "full INT8 PTQ", "PTQ, mixed precision", "QAT QDQ U8S8", "93%", "40%"):
        assert text in html
    assert found["Quantization-aware training"]({"candidates": []}, Path(".")) is None
