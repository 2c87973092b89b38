from __future__ import annotations

import numpy as np

from slimline.signature import (
    Signature,
    concat_outputs,
    concat_rows,
    n_rows,
    rows_first,
    slice_rows,
    split_rows,
    tile_rows,
)
from slimline.task import iter_rows, take_samples

SIG = Signature(
    inputs={"input": 0, "state": 1, "sr": None}, outputs={"output": 0, "stateN": 1, "n": None}
)


def _batch(rows: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + rows, dtype=np.float32)
    return {
        "input": np.repeat(ids[:, None], 3, axis=1),
        "state": np.stack([np.repeat(ids[:, None], 2, axis=1)] * 2),  # [2, rows, 2]
        "sr": np.array(16000, np.int64),
    }


def test_rows_are_cut_and_joined_along_each_inputs_batch_axis() -> None:
    b = _batch(5)
    assert n_rows(b, SIG) == 5
    part = slice_rows(b, 1, 3, SIG)
    assert part["input"].shape == (2, 3) and part["state"].shape == (2, 2, 2)
    assert part["state"][1, :, 0].tolist() == [1.0, 2.0] and part["sr"].shape == ()
    joined = concat_rows([slice_rows(b, 0, 2, SIG), slice_rows(b, 2, 5, SIG)], SIG)
    assert all(np.array_equal(joined[k], b[k]) for k in b)
    assert [n_rows(p, SIG) for p in split_rows(b, 2, SIG)] == [2, 2, 1]
    tiled = tile_rows(slice_rows(b, 0, 2, SIG), 5, SIG)
    assert tiled["state"].shape == (2, 5, 2) and tiled["state"][0, :, 0].tolist() == [0, 1, 0, 1, 0]


def test_without_a_signature_axis_0_is_the_batch() -> None:
    b = {"x": np.arange(12).reshape(6, 2)}
    assert n_rows(b) == 6 and slice_rows(b, 4, 6)["x"].tolist() == [[8, 9], [10, 11]]


def test_take_samples_and_iter_rows_respect_the_batch_axis() -> None:
    batches = [_batch(3, 0), _batch(3, 3), _batch(3, 6)]
    taken = take_samples(batches, 5, SIG)
    assert taken["state"].shape == (2, 5, 2) and taken["state"][0, 4, 0] == 4.0
    assert taken["sr"].shape == ()
    cut = list(iter_rows(batches, 4, SIG))
    assert [n_rows(b, SIG) for b in cut] == [3, 1] and cut[1]["state"][0, 0, 0] == 3.0


def test_outputs_join_on_their_axis_and_come_out_rows_first() -> None:
    parts = [
        {"output": np.zeros((2, 3)), "stateN": np.zeros((2, 2, 4)), "n": np.array(1.0)},
        {"output": np.ones((1, 3)), "stateN": np.ones((2, 1, 4)), "n": np.array(2.0)},
    ]
    joined = concat_outputs(parts, SIG)
    assert joined["output"].shape == (3, 3) and joined["stateN"].shape == (2, 3, 4)
    assert joined["n"].tolist() == [1.0, 2.0]  # no batch axis: one entry per call
    assert concat_outputs(parts, SIG, stack_unbatched=False)["n"] == 2.0
    first = rows_first(joined, SIG)
    assert first["stateN"].shape == (3, 2, 4) and first["stateN"][2].min() == 1.0
