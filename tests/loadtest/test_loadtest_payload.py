from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slimline.errors import LoadTestError
from slimline.examples import EXAMPLES
from slimline.loadtest.payload import build_payloads, encode_request, load_samples


def _split_binary(body: bytes, header_len: int) -> tuple[dict[str, Any], bytes]:
    return json.loads(body[:header_len]), body[header_len:]


def test_json_encoding_carries_shape_datatype_and_values() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ids = np.array([[7, 8, 9], [1, 2, 3]], dtype=np.int64)
    p = encode_request({"x": x, "ids": ids}, "json")
    doc = json.loads(p.body)
    assert p.headers["Content-Type"] == "application/json" and p.rows == 2
    by_name = {t["name"]: t for t in doc["inputs"]}
    assert by_name["x"] == {
        "name": "x",
        "shape": [2, 3],
        "datatype": "FP32",
        "data": x.ravel().tolist(),
    }
    assert by_name["ids"]["datatype"] == "INT64" and by_name["ids"]["data"] == ids.ravel().tolist()


def test_binary_encoding_follows_the_tensor_extension() -> None:
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    ids = np.array([[5, 6]], dtype=np.int64)
    p = encode_request({"x": x, "ids": ids}, "binary")
    head, blob = _split_binary(p.body, int(p.headers["Inference-Header-Content-Length"]))
    assert p.headers["Content-Type"] == "application/octet-stream"
    sizes = [t["parameters"]["binary_data_size"] for t in head["inputs"]]
    assert sizes == [16, 16] and "data" not in head["inputs"][0]
    assert head["parameters"]["binary_data_output"] is True
    assert np.array_equal(np.frombuffer(blob[:16], "<f4").reshape(1, 4), x)
    assert np.array_equal(np.frombuffer(blob[16:], "<i8").reshape(1, 2), ids)


def test_bytes_tensors_are_length_prefixed() -> None:
    p = encode_request({"text": np.array(["ab", "c"], dtype=object)}, "binary")
    head, blob = _split_binary(p.body, int(p.headers["Inference-Header-Content-Length"]))
    assert head["inputs"][0]["datatype"] == "BYTES"
    assert blob == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


def test_build_payloads_batches_consecutive_rows() -> None:
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    payloads = build_payloads({"x": x}, "json", batch_size=3, limit=64)
    assert len(payloads) == 3
    assert [json.loads(p.body)["inputs"][0]["data"] for p in payloads] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
    ]
    with pytest.raises(LoadTestError, match="--batch-size 11"):
        build_payloads({"x": x}, "json", batch_size=11)


def test_samples_from_npz_and_task_file(tmp_path: Path) -> None:
    path = tmp_path / "s.npz"
    np.savez(path, x=np.ones((5, 2), np.float32))
    assert load_samples(str(path))["x"].shape == (5, 2)
    tiny = Path(__file__).parents[1] / "fixtures" / "tiny_task.py"
    rows = load_samples(str(tiny), limit=10)
    assert rows["x"].shape == (10, 1, 12, 12) and rows["x"].dtype == np.float32


def test_bad_sample_sources_raise_load_test_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadTestError, match="does not exist"):
        load_samples(str(tmp_path / "missing.npz"))
    with pytest.raises(LoadTestError, match=r"as a run directory: .* has no manifest\.json"):
        load_samples(str(tmp_path))
    with pytest.raises(LoadTestError, match="has no KServe v2 datatype"):
        encode_request({"x": np.zeros(2, np.complex64)}, "json")


def test_an_example_name_is_not_shadowed_by_an_unrelated_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mnist").mkdir()  # e.g. a folder of the user's own files, no manifest.json
    rows = load_samples("mnist", limit=4)
    assert rows["x"].shape == (4, 1, 28, 28) and rows["x"].dtype == np.float32


def test_a_failed_resolution_lists_every_reading_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoadTestError) as info:
        load_samples("stub")
    names = ", ".join(sorted(EXAMPLES))
    assert str(info.value).startswith(
        "cannot load sample inputs from 'stub'; tried, in order: 'stub' as a path: no such file "
        f"or folder; 'stub' as an example name: not one of {names}."
    )
    (tmp_path / "stub").mkdir()
    with pytest.raises(LoadTestError, match=r"'stub' as a run directory: stub has no manifest"):
        load_samples("stub")
    with pytest.raises(LoadTestError, match=r"'gone\.py' as a task file: task file gone\.py"):
        load_samples("gone.py")
