"""compress/qat/compare.py: QAT's recovery is also given on the declared outputs' agreement (the
figure the budget's ``min_agreement`` judges), where the task declares them."""

from __future__ import annotations

from typing import Any

import pytest

from slimline.compress.qat.compare import _verdicts


def test_recovery_is_given_on_the_declared_agreement_where_there_is_one() -> None:
    rows: dict[str, dict[str, Any]] = {
        "fp32": {"metric": 1.0, "cosine_mean": 1.0, "agreement": None},
        "ptq_full": {"metric": 0.9, "cosine_mean": 0.8, "agreement": 0.6},
        "qat": {"metric": 0.95, "cosine_mean": 0.9, "agreement": 0.9},
    }
    v = _verdicts(rows)
    assert v["agreement_lost_by_ptq"] == pytest.approx(0.4)  # FP32 agrees with itself
    assert v["agreement_recovered_share"] == pytest.approx(0.75)
    assert v["cosine_mean_recovered_share"] == pytest.approx(0.5)
    for row in rows.values():
        row["agreement"] = None  # nothing declared: no agreement verdict
    assert "agreement_recovered_share" not in _verdicts(rows)
