"""OpenVINO serving with several instances: one stream per instance, so batches run at once
(with the latency hint alone, a compiled model has one stream and concurrent batches queue)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from slimline.serve import load_served_models

pytest.importorskip("openvino", reason="the openvino extra is not installed")


@pytest.mark.parametrize("instances", [1, 2])  # OpenVINO caps streams at the cores
def test_each_instance_gets_its_own_stream_and_threads(
    model_dir: Path, expected_logits: Callable[[np.ndarray], np.ndarray], instances: int
) -> None:
    (served,) = load_served_models(
        [model_dir / "tiny.onnx"], threads=1, runtime="openvino", instances=instances
    )
    compiled = served.backend.compiled  # type: ignore[attr-defined]
    assert int(compiled.get_property("NUM_STREAMS")) == instances
    assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == instances  # 1 per stream
    # concurrent calls from the batcher's instance threads each get their own infer request
    rows = [np.random.default_rng(i).normal(size=(i + 1, 4)).astype(np.float32) for i in range(12)]
    with ThreadPoolExecutor(instances) as pool:
        outs = list(pool.map(lambda x: served.backend.run({"x": x})["logits"], rows))
    for x, out in zip(rows, outs, strict=True):
        np.testing.assert_allclose(out, expected_logits(x), rtol=1e-5, atol=1e-5)
