"""bench/fidelity_decode.py, loaded as a recipe loads a decode function: ddddocr's YOLOX
post-processing (grid decoding, score threshold, NMS) on a crafted output."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slimline.hooks import load_hook

DECODE = Path(__file__).resolve().parents[1] / "bench" / "fidelity_decode.py"


def test_ddddocr_yolox_decodes_grid_cells_thresholds_and_suppresses_duplicates() -> None:
    decode = load_hook(f"{DECODE}:ddddocr_yolox", "outputs.output.decode")
    pred = np.zeros((1, 3549, 6), np.float32)
    pred[0, 0] = [0.5, 0.5, np.log(2), np.log(2), 0.9, 0.9]  # cell (0, 0), stride 8: centre 4, 4
    pred[0, 1] = [-0.5, 0.5, np.log(2), np.log(2), 0.7, 0.9]  # cell (1, 0): the same box, lower
    pred[0, 2] = [0.5, 0.5, 0.0, 0.0, 0.3, 0.3]  # score 0.09: below 0.1
    boxes = decode({"output": pred})
    np.testing.assert_allclose(boxes, [[-4.0, -4.0, 12.0, 12.0, 0.0]], atol=1e-5)
    assert decode({"output": np.zeros((1, 3549, 6), np.float32)}).shape == (0, 5)
