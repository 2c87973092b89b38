"""The load generator's gRPC client against slimline's own server, and its status mapping."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from pydantic import SecretStr

from slimline.errors import LoadTestError
from slimline.loadtest.grpc_client import grpc_payloads, outcome_of_code
from slimline.loadtest.run import LoadTestConfig, run_loadtest
from slimline.loadtest.scrape import read_metrics
from slimline.serve import FakeBackend, ServedModel, ServeSettings, TensorSpec, serve_in_thread
from slimline.serve.proto import grpc_predict_v2_pb2 as pb


def _linear() -> ServedModel:
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
    specs = ([TensorSpec("x", "float32", (None, 4))], [TensorSpec("y", "float32", (None, 3))])
    return ServedModel("lin", FakeBackend(*specs, lambda t: {"y": t["x"] @ w}))


def test_grpc_load_test_against_slimline_serve_with_a_token() -> None:
    models = [_linear()]
    settings = ServeSettings(port=0, grpc_port=0, api_token=SecretStr("s3cret"))
    samples = {"x": np.random.default_rng(0).random((16, 4), dtype=np.float32)}
    payloads = grpc_payloads(samples, "lin", batch_size=2)  # [2, 4] per request
    with serve_in_thread(models, settings) as handle:
        cfg = LoadTestConfig(url=handle.url, model="lin", rate=40.0, duration_s=1.0,
                             warmup_s=0.2, token="s3cret", max_lag_ms=1000, protocol="grpc",
                             grpc_target=handle.grpc_target)  # fmt: skip
        wrong = cfg.model_copy(update={"grpc_target": "127.0.0.1:1"})
        with pytest.raises(LoadTestError, match=r"over gRPC at 127\.0\.0\.1:1 failed"):
            run_loadtest(wrong, payloads=payloads)
        auth = {"Authorization": "Bearer s3cret"}
        before = read_metrics(handle.url, "lin", auth)
        res = run_loadtest(cfg, payloads=payloads)
        after = read_metrics(handle.url, "lin", auth)
    assert res["outcomes"]["ok"] == res["requests"] > 20, res["error_samples"]
    assert res["config"]["protocol"] == "grpc"
    assert before is not None and after is not None
    assert after["batch_size_sum"] - before["batch_size_sum"] >= 2 * res["requests"]


def test_stream_load_test_answers_every_request_and_counts_bad_ones() -> None:
    """``--protocol grpc-stream``: every request on one ModelStreamInfer stream is answered and
    matched by its id; requests the server refuses count as bad requests, not lost ones."""
    samples = {"x": np.random.default_rng(0).random((16, 4), dtype=np.float32)}
    good = grpc_payloads(samples, "lin", batch_size=1)
    bad = grpc_payloads({"z": samples["x"]}, "lin", batch_size=1)[:1]  # the model has no z
    with serve_in_thread([_linear()], ServeSettings(port=0, grpc_port=0)) as handle:
        cfg = LoadTestConfig(url=handle.url, model="lin", rate=60.0, duration_s=1.0,
                             warmup_s=0.2, max_lag_ms=1000, protocol="grpc-stream",
                             grpc_target=handle.grpc_target)  # fmt: skip
        res = run_loadtest(cfg, payloads=good)
        mixed = run_loadtest(cfg.model_copy(update={"warmup_s": 0.0}), payloads=good + bad)
    assert res["outcomes"]["ok"] == res["requests"] > 30, res["error_samples"]
    assert res["config"]["protocol"] == "grpc-stream"
    outcomes = mixed["outcomes"]
    assert outcomes["bad_request"] > 0 and outcomes["ok"] > 0
    assert outcomes["ok"] + outcomes["bad_request"] == mixed["requests"]
    assert "INVALID_ARGUMENT" in mixed["error_samples"]["bad_request"]


def test_payloads_are_model_infer_requests_with_raw_contents() -> None:
    samples = {"x": np.arange(12, dtype=np.float32).reshape(6, 2)}
    payloads = grpc_payloads(samples, "m", batch_size=3)
    assert [p.rows for p in payloads] == [3, 3]
    request = pb.ModelInferRequest.FromString(payloads[1].body)
    assert request.model_name == "m" and list(request.inputs[0].shape) == [3, 2]
    got = np.frombuffer(request.raw_input_contents[0], "<f4").reshape(3, 2)
    np.testing.assert_array_equal(got, samples["x"][3:])


@pytest.mark.parametrize(
    ("code", "details", "outcome"),
    [
        (grpc.StatusCode.UNAVAILABLE, "the queue of model 'm' is full", "rejected"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", "connection"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", "timeout"),
        (grpc.StatusCode.INVALID_ARGUMENT, "input 'x'", "bad_request"),
        (grpc.StatusCode.INTERNAL, "", "server_error"),
    ],
)
def test_status_codes_map_to_the_http_outcomes(
    code: grpc.StatusCode, details: str, outcome: str
) -> None:
    assert outcome_of_code(code, details) == outcome


def test_the_command_line_builds_a_grpc_config() -> None:
    from slimline.cli import build_parser
    from slimline.loadtest.cli import build_config

    args = build_parser().parse_args(
        ["loadtest", "http://127.0.0.1:8000", "--model", "m", "--rate", "10", "--protocol", "grpc"]
    )
    cfg = build_config(args)
    assert (cfg.protocol, cfg.grpc_address) == ("grpc", "127.0.0.1:8001")
    args = build_parser().parse_args(
        ["loadtest", "http://h:1", "--model", "m", "--rate", "10", "--protocol", "grpc",
         "--grpc-target", "grpc://10.0.0.2:9001"]
    )  # fmt: skip
    assert build_config(args).grpc_address == "10.0.0.2:9001"
