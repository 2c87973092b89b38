"""The load generator against slimline's own server: JSON and binary tensors, auth, metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import SecretStr

from slimline.errors import LoadTestError
from slimline.loadtest.payload import build_payloads
from slimline.loadtest.run import LoadTestConfig, run_loadtest
from slimline.loadtest.scrape import read_metrics
from slimline.serve import ServeSettings, load_served_models, run_in_thread


def _linear(path: Path) -> Path:
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(w, "W")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_both_encodings_against_slimline_serve_with_a_token(
    tmp_path: Path, encoding: Literal["json", "binary"]
) -> None:
    models = load_served_models([_linear(tmp_path / "lin.onnx")])
    settings = ServeSettings(port=0, api_token=SecretStr("s3cret"))
    samples = {"x": np.random.default_rng(0).random((16, 4), dtype=np.float32)}
    payloads = build_payloads(samples, encoding, batch_size=2)  # [2, 4] per request
    with run_in_thread(models, settings) as url:
        with pytest.raises(LoadTestError, match=r"refused the request \(HTTP 401"):
            run_loadtest(LoadTestConfig(url=url, model="lin", rate=10.0), payloads=payloads)
        before = read_metrics(url, "lin", {"Authorization": "Bearer s3cret"})
        cfg = LoadTestConfig(url=url, model="lin", rate=40.0, duration_s=1.0, warmup_s=0.2,
                             encoding=encoding, token="s3cret", max_lag_ms=1000)  # fmt: skip
        res = run_loadtest(cfg, payloads=payloads)
        after = read_metrics(url, "lin", {"Authorization": "Bearer s3cret"})
    assert res["outcomes"]["ok"] == res["requests"] > 20, res["error_samples"]
    assert before is not None and after is not None
    rows = after["batch_size_sum"] - before["batch_size_sum"]
    assert rows >= 2 * res["requests"]  # the server saw every request's two rows
