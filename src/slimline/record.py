"""Run records: content hashes, atomic writes, package versions, hardware facts, the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from .cpu import detect as detect_cpu
from .errors import ManifestError

__all__ = [
    "MANIFEST_SCHEMA",
    "atomic_copy",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "data_hash",
    "hardware",
    "json_hash",
    "load_manifest",
    "now_iso",
    "package_versions",
    "versions",
]

MANIFEST_SCHEMA = 1
_PACKAGES = ("slimline", "torch", "onnx", "onnxruntime", "numpy", "transformers", "torch-pruning")
_CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "fma",
    "sse4_2",
)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def atomic_copy(src: Path, dst: Path) -> None:
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def json_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=_json_default).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def data_hash(batches: Iterable[Any]) -> str:
    """Content hash of a stream of batches (dicts/tuples/arrays/None), in order."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if x is None:
            h.update(b"<none>")
        elif isinstance(x, dict):
            for k in sorted(x):
                h.update(str(k).encode())
                feed(x[k])
        elif isinstance(x, (tuple, list)):
            h.update(f"<seq{len(x)}>".encode())
            for item in x:
                feed(item)
        else:
            a = np.ascontiguousarray(np.asarray(x))
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes() if a.dtype != object else repr(a.tolist()).encode())

    for batch in batches:
        feed(batch)
    return "sha256:" + h.hexdigest()


def code_hash() -> str:
    """Hash of slimline's own source files: recorded in the manifest (which code made a run),
    never part of a cache key (a step's key names its own ``version`` instead)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


def package_versions(packages: Iterable[str]) -> dict[str, str | None]:
    """Python's version and those of the named distributions (``None`` where not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in sorted(set(packages)):
        try:
            out[pkg.replace("-", "_")] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg.replace("-", "_")] = None
    return out


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            out[pkg.replace("-", "_")] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg.replace("-", "_")] = None
    out["slimline_code"] = code_hash()
    return out


def hardware() -> dict[str, Any]:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "flags": sorted(f for f in _CPU_FLAGS if f in flags),
        "int8": detect_cpu().to_dict(),
    }


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read a manifest (a file, or a run directory holding ``manifest.json``) and check its schema."""
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    if not p.is_file():
        raise ManifestError(f"{p} does not exist; pass a run directory or its manifest.json")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ManifestError(
            f"{p} is not JSON; pass the manifest.json written by `slimline optimize`"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("schema") != MANIFEST_SCHEMA
        or not isinstance(data.get("candidates"), list)
    ):
        raise ManifestError(
            f"{p} is not a slimline manifest (schema {MANIFEST_SCHEMA} with a candidates list); "
            "pass the manifest.json written by `slimline optimize`"
        )
    return data
