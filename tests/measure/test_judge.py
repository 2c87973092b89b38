"""The judge of declared outputs on crafted outputs: a decode function that fails on a
candidate's outputs gives that candidate agreement 0 with the error; one that returns a bad
shape is named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slimline.errors import TaskError
from slimline.measure.judge import Judge
from slimline.outputs import BoxesOutput

DECODE = """
import numpy as np

def boxes(outputs):
    det = outputs["det"][0]
    if det.max() > 100:
        raise ValueError("coordinates out of the image")
    return det

def flat(outputs):
    return np.zeros(7)
"""


def _judge(tmp_path: Path, func: str) -> Judge:
    (tmp_path / "decode.py").write_text(DECODE)
    decl = BoxesOutput(decode=f"{tmp_path / 'decode.py'}:{func}")
    judge = Judge.from_declarations({"det": decl})
    assert judge is not None
    return judge


def test_a_decode_failing_on_a_candidate_gives_agreement_zero_and_the_error(
    tmp_path: Path,
) -> None:
    judge = _judge(tmp_path, "boxes")
    ref = {"det": np.array([[[0, 0, 10, 10, 1]]] * 3, np.float32)}
    judge.check_reference(ref)
    assert judge.score(ref, ref)["det"]["agreement"] == 1.0
    bad = {"det": ref["det"] * 20}
    got = judge.score(bad, ref)["det"]
    assert got["agreement"] == 0.0
    assert "failed on row 0: ValueError: coordinates out of the image" in got["error"]


def test_a_decode_returning_a_bad_shape_is_named(tmp_path: Path) -> None:
    judge = _judge(tmp_path, "flat")
    with pytest.raises(TaskError, match=r"returned shape \[7\]; it must return boxes \[K, 5\]"):
        judge.check_reference({"det": np.zeros((2, 1, 5), np.float32)})
