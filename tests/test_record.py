from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slimline.cache import StepCache
from slimline.errors import ManifestError
from slimline.record import atomic_write_json, data_hash, hardware, load_manifest, versions


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "m.json"
    atomic_write_json(p, {"a": np.float32(1.5), "b": np.arange(3)})
    assert json.loads(p.read_text()) == {"a": 1.5, "b": [0, 1, 2]}
    assert [f.name for f in p.parent.iterdir()] == ["m.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    atomic_write_json(p, {"ok": 1})
    with pytest.raises(TypeError):
        atomic_write_json(p, {"bad": object()})
    assert json.loads(p.read_text()) == {"ok": 1}
    assert len(list(tmp_path.iterdir())) == 1


def test_data_hash_is_content_sensitive() -> None:
    a = [{"x": np.zeros((2, 3), np.float32)}, ({"x": np.ones(2)}, np.array([1, 2]))]
    b = [{"x": np.zeros((2, 3), np.float32)}, ({"x": np.ones(2)}, np.array([1, 3]))]
    assert data_hash(a) == data_hash(list(a))
    assert data_hash(a) != data_hash(b)
    assert data_hash([np.zeros(4, np.float32)]) != data_hash([np.zeros(4, np.float64)])


def test_versions_and_hardware() -> None:
    v = versions()
    assert v["torch"] and v["onnxruntime"] and v["python"]
    hw = hardware()
    assert hw["cores"] >= 1 and isinstance(hw["flags"], list)


def test_load_manifest_rejects_non_manifests(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ManifestError, match="not JSON"):
        load_manifest(p)
    p.write_text('{"schema": 1}')
    with pytest.raises(ManifestError, match="not a slimline manifest"):
        load_manifest(p)
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "none.json")


def test_step_cache_publishes_whole_entries_only(tmp_path: Path) -> None:
    cache = StepCache(tmp_path)
    assert cache.step_dir("sha256:abc") is None

    def boom(d: Path) -> dict[str, Any]:
        (d / "half.onnx").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        cache.build_step("sha256:abc", boom)
    assert cache.step_dir("sha256:abc") is None
    assert list((tmp_path / "steps").iterdir()) == []

    def good(d: Path) -> dict[str, Any]:
        (d / "m.onnx").write_bytes(b"y")
        return {"ok": True}

    entry = cache.build_step("sha256:abc", good)
    assert cache.step_dir("sha256:abc") == entry and (entry / "m.onnx").read_bytes() == b"y"


def test_stale_tmp_of_dead_process_is_cleaned(tmp_path: Path) -> None:
    StepCache(tmp_path)
    stale = tmp_path / "steps" / "tmp-999999999-deadbeef"
    stale.mkdir()
    StepCache(tmp_path)
    assert not stale.exists()
