"""`slimline serve`: flags become settings, paths become served models, errors are one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from slimline.cli import build_parser, main
from slimline.errors import ManifestError, ModelFileError, ServeError
from slimline.serve import load_served_models, run_in_subprocess
from slimline.serve.cli import settings_from_args
from slimline.serve.model import resolve_model_path


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_flags_become_typed_settings(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    args = parse(
        "m.onnx", "--port", "0", "--max-batch-size", "16", "--max-queue-delay-ms", "3",
        "--max-queue-size", "64", "--timeout-ms", "250", "--instances", "2", "--threads", "1",
        "--api-token-file", str(token), "--max-body-mb", "1",
    )  # fmt: skip
    s = settings_from_args(args)
    assert (s.host, s.port, s.threads, s.max_body_bytes) == ("127.0.0.1", 0, 1, 1 << 20)
    b = s.batching
    assert (b.max_batch_size, b.max_queue_delay_ms, b.max_queue_size) == (16, 3.0, 64)
    assert (b.timeout_ms, b.instances) == (250.0, 2)
    assert s.api_token is not None and s.api_token.get_secret_value() == "abc"
    assert "abc" not in repr(s)


def test_impossible_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ServeError, match="max_batch_size"):
        settings_from_args(parse("m.onnx", "--max-batch-size", "0"))
    assert main(["serve", "missing.onnx", "--port", "0"]) == 2
    assert "missing.onnx does not exist" in capsys.readouterr().err


def test_run_dir_serves_its_selected_candidate_under_the_task_name(
    tmp_path: Path, model_dir: Path, make_run_dir: Callable[..., Path]
) -> None:
    run = make_run_dir(tmp_path, task="mnist", selected="quantize")
    name, path, meta = resolve_model_path(run)
    assert (name, path, meta["candidate"]) == ("mnist", run / "artifacts/quantize.onnx", "quantize")
    models = load_served_models([run, model_dir / "tiny.onnx"])
    assert [m.name for m in models] == ["mnist", "tiny"]
    with pytest.raises(ServeError, match="both named 'tiny'"):
        load_served_models([model_dir / "tiny.onnx", model_dir / "tiny.onnx"])


def test_broken_run_dirs_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"no manifest\.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"selected": "x", "task": {}}))
    with pytest.raises(ManifestError, match="selected candidate"):
        resolve_model_path(tmp_path)
    doc = {"selected": "fp32-torch", "task": {"name": "t"},
           "candidates": [{"name": "fp32-torch", "artifact": None}]}  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ServeError, match="no ONNX artifact"):
        resolve_model_path(tmp_path)
    with pytest.raises(ModelFileError):
        resolve_model_path(tmp_path / "gone.onnx")


def test_the_command_serves_over_http(model_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")
    flags = ["--max-batch-size", "4", "--api-token-file", str(token)]
    with run_in_subprocess([model_dir / "tiny.onnx"], flags) as (url, _):
        assert url.startswith("http://127.0.0.1:")
        auth = {"Authorization": "Bearer t0ken"}
        meta = httpx.get(url + "/v2/models/tiny", headers=auth).json()
        assert meta["inputs"][0]["shape"] == [-1, 4]
        assert httpx.get(url + "/v2/models/tiny").status_code == 401


def test_backend_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m.onnx", "--replicas", "2"]) == 2
    assert "--replicas needs --backend ray" in capsys.readouterr().err
    assert main(["serve", "m.onnx", "--backend", "ray", "--port", "0"]) == 2
    assert "fixed --port" in capsys.readouterr().err
