"""The verified version set: ``constraints.txt`` at the repository root, and whether the running
environment matches it.

``scripts/lock.sh`` generates the lock (``uv pip compile`` of pyproject.toml with the ``dev`` and
``openvino`` extras) and ``scripts/setup.sh`` installs with it as constraints, so a fresh machine
gets the versions CI passed with. A run records :func:`lock_record` in its manifest
(``environment.lock``) and ``slimline check`` names the packages that differ from it
(:func:`slimline.gate.environment_differences`).

The lock is found beside ``pyproject.toml`` two folders above this package, which is where it is
when slimline is installed from its repository (editable). Installed from a wheel elsewhere there
is none, and the record says so instead of guessing.
"""

from __future__ import annotations

import copy
import hashlib
import re
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_NAME",
    "canonical",
    "compare",
    "environment_record",
    "find_lock",
    "installed_versions",
    "lock_record",
    "parse_lock",
]

LOCK_NAME = "constraints.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;\\]+)")


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it (``PyYAML`` and ``pyyaml`` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def find_lock(package_dir: Path | None = None) -> Path | None:
    """The repository's lock file, or None where slimline is not installed from its repository."""
    root = (package_dir or Path(__file__).resolve().parent).parent.parent
    lock = root / LOCK_NAME
    return lock if lock.is_file() and (root / "pyproject.toml").is_file() else None


def parse_lock(text: str) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line; comments, annotations and
    options (``--find-links``, ``-c``) are skipped. A requirement that is not an exact pin is an
    error naming its line: a lock pins everything."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = _PIN.match(line)
        if m is None:
            raise ValueError(f"line {n} {raw.strip()!r} is not an exact pin (name==version)")
        pins[canonical(m.group(1))] = m.group(2)
    return pins


def installed_versions() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution on ``sys.path`` (the first found wins,
    as for an import): one scan, not one per package."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist.version)
    return out


def _same(locked: str, installed: str) -> bool:
    """PEP 440's ``==``: a pin without a local label (``+cpu``) accepts any local label."""
    return installed == locked or ("+" not in locked and installed.split("+", 1)[0] == locked)


def compare(pins: dict[str, str], installed: dict[str, str]) -> dict[str, dict[str, str | None]]:
    """The locked packages whose installed version differs (``None``: not installed)."""
    out: dict[str, dict[str, str | None]] = {}
    for name, locked in sorted(pins.items()):
        have = installed.get(name)
        if have is None or not _same(locked, have):
            out[name] = {"locked": locked, "installed": have}
    return out


def lock_record(lock: Path | None, installed: dict[str, str]) -> dict[str, Any]:
    """What a manifest records: the lock file, its hash, and whether ``installed`` matches it.
    ``matches`` is None where there is no lock to compare with (``state`` says why)."""
    if lock is None:
        return {"file": None, "state": "no lock file", "matches": None}
    data = lock.read_bytes()
    record: dict[str, Any] = {"file": str(lock), "sha256": hashlib.sha256(data).hexdigest()}
    try:
        pins = parse_lock(data.decode())
    except (ValueError, UnicodeDecodeError) as e:
        return {**record, "state": f"unreadable: {e}", "matches": None}
    differs = compare(pins, installed)
    state = "matches" if not differs else "differs"
    return {**record, "state": state, "matches": not differs, "differs": differs}


@cache
def _environment() -> dict[str, Any]:
    return {"lock": lock_record(find_lock(), installed_versions())}


def environment_record() -> dict[str, Any]:
    """The manifest's ``environment`` section: this process's packages against the repository's
    lock (read once per process: the installed packages do not change during a run)."""
    return copy.deepcopy(_environment())
