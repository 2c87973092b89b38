from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slimline.cli import main
from slimline.gate import environment_differences, hardware_differences

AMX = {
    "avx2": True,
    "avx512bw": True,
    "avx512_vnni": True,
    "avx_vnni": True,
    "amx_int8": True,
    "kind": "x86-amx-int8",
}
AVX2 = {**dict.fromkeys(AMX, False), "avx2": True, "kind": "x86-avx2"}


def manifest(
    int8: dict[str, Any] | None = AMX, cores: int = 2, threads: int = 2, ort: str = "1.32.0"
) -> dict[str, Any]:
    hw: dict[str, Any] = {"cpu": "x", "cores": cores, "flags": ["avx2"]}
    if int8 is not None:
        hw["int8"] = int8
    return {
        "schema": 1,
        "hardware": hw,
        "target": {"threads": threads},
        "versions": {"onnxruntime": ort},
        "candidates": [
            {
                "name": "fp32-onnx",
                "latency_ms": {"p50": 1.0, "band": [0.98, 1.02]},
                "metric": {"name": "m", "value": 1.0},
            }
        ],
    }


def _write(tmp_path: Path, name: str, m: dict[str, Any]) -> str:
    (tmp_path / name).write_text(json.dumps(m))
    return str(tmp_path / name)


def served_on(m: dict[str, Any], runtime: str, version: str) -> dict[str, Any]:
    return {**m, "selected_runtime": runtime, "runtimes": {runtime: {"version": version}}}


def test_the_serving_runtime_and_its_version_are_compared() -> None:
    ov = served_on(manifest(), "openvino", "2026.4.1")
    assert hardware_differences(ov, served_on(manifest(), "openvino", "2026.4.1")) == ([], [])
    differs, _ = hardware_differences(ov, served_on(manifest(), "openvino", "2025.1.0"))
    assert differs == ["serving runtime openvino 2026.4.1 vs baseline openvino 2025.1.0"]
    differs, _ = hardware_differences(ov, served_on(manifest(), "onnxruntime", "1.32.0"))
    assert differs == ["serving runtime openvino 2026.4.1 vs baseline onnxruntime 1.32.0"]
    _, unknown = hardware_differences(ov, manifest())
    assert unknown == ["serving runtime (not recorded in the baseline)"]


def test_like_targets_compare_cleanly() -> None:
    assert hardware_differences(manifest(), manifest()) == ([], [])


def test_each_kind_of_difference_is_named() -> None:
    differs, _ = hardware_differences(manifest(AVX2, cores=4, threads=4, ort="1.20.0"), manifest())
    assert differs == [
        "INT8 CPU features x86-avx2 (avx2) vs baseline x86-amx-int8 "
        "(avx2, avx512bw, avx512_vnni, avx_vnni, amx_int8)",
        "CPU cores 4 vs baseline 2",
        "threads 4 vs baseline 2",
        "onnxruntime 1.20.0 vs baseline 1.32.0",
    ]


def test_a_baseline_from_another_cpu_is_an_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write(tmp_path, "run.json", manifest(AVX2))
    base = _write(tmp_path, "base.json", manifest())
    assert main(["check", run, "--baseline", base]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "x86-avx2" in err and "x86-amx-int8" in err and "--allow-hardware-change" in err


def test_the_flag_turns_the_mismatch_into_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write(tmp_path, "run.json", manifest(AVX2, threads=4))
    base = _write(tmp_path, "base.json", manifest())
    assert main(["check", run, "--baseline", base, "--allow-hardware-change"]) == 0
    out = capsys.readouterr().out
    assert "warning: the baseline ran on another target" in out and "threads 4" in out


def test_an_old_baseline_says_what_it_does_not_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = manifest(int8=None)
    del old["versions"]
    run = _write(tmp_path, "run.json", manifest())
    base = _write(tmp_path, "base.json", old)
    assert main(["check", run, "--baseline", base]) == 0
    out = capsys.readouterr().out
    assert "not compared: AVX512BW and AVX-VNNI (not recorded in the baseline" in out
    assert "not compared: onnxruntime (not recorded in the baseline)" in out
    # what the old manifest does record still counts: its CPU flags list
    other = manifest(int8=None)
    other["hardware"]["flags"] = ["avx2", "avx512_vnni"]
    assert main(["check", run, "--baseline", _write(tmp_path, "b2.json", other)]) == 2


def declared(agreement: float) -> dict[str, Any]:
    """A manifest whose fp32-onnx candidate declares a ``ctc`` output with ``agreement``."""
    m = manifest()
    m["candidates"][0]["fidelity"] = {
        "cosine_mean": 0.999,
        "agreement": agreement,
        "declared": {"logits": {"kind": "ctc", "agreement": agreement, "cer": 1 - agreement}},
    }
    return m


def test_a_drop_in_a_declared_outputs_agreement_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _write(tmp_path, "base.json", declared(0.99))
    # the metric (FP32-relative) and the latency are unchanged; only the decoded text moved
    assert main(["check", _write(tmp_path, "ok.json", declared(0.988)), "--baseline", base]) == 0
    assert main(["check", _write(tmp_path, "bad.json", declared(0.95)), "--baseline", base]) == 1
    out = capsys.readouterr().out
    assert "ctc agreement of output 'logits' 0.99 -> 0.95" in out
    # an output declared in one run only is not compared
    undeclared = _write(tmp_path, "u.json", manifest())
    assert main(["check", undeclared, "--baseline", base]) == 0


def with_lock(m: dict[str, Any], sha: str = "a" * 64, **differs: str) -> dict[str, Any]:
    lock: dict[str, Any] = {"file": "/repo/constraints.txt", "sha256": sha}
    pkgs = {name: {"locked": "1.0", "installed": v or None} for name, v in differs.items()}
    lock.update(state="differs" if pkgs else "matches", matches=not pkgs, differs=pkgs)
    return {**m, "environment": {"lock": lock}}


def test_packages_that_differ_from_the_lock_are_named() -> None:
    assert environment_differences(with_lock(manifest()), with_lock(manifest())) == ([], [])
    warnings, _ = environment_differences(with_lock(manifest(), numpy="2.0", ray=""), manifest())
    assert warnings[0] == (
        "this run's packages differ from its lock constraints.txt: numpy 2.0 (locked 1.0), "
        "ray not installed (locked 1.0)"
    )
    warnings, _ = environment_differences(with_lock(manifest()), with_lock(manifest(), "b" * 64))
    assert warnings == [
        "the baseline ran with another lock (sha256 bbbbbbbbbbbb, this run aaaaaaaaaaaa)"
    ]


def test_versions_that_differ_between_the_runs_are_named_but_not_slimline() -> None:
    cur, base = with_lock(manifest()), with_lock(manifest())
    cur["versions"] = {**cur["versions"], "numpy": "2.5.0", "slimline_code": "sha256:1"}
    base["versions"] = {**base["versions"], "numpy": "2.4.6", "slimline_code": "sha256:2"}
    warnings, _ = environment_differences(cur, base)
    assert warnings == [
        "package versions differ from the baseline's: numpy 2.5.0 vs baseline 2.4.6"
    ]


def test_a_run_without_a_lock_says_so() -> None:
    wheel = {
        **manifest(),
        "environment": {"lock": {"file": None, "state": "no lock file", "matches": None}},
    }
    _, unknown = environment_differences(wheel, manifest())
    assert unknown == [
        "package lock (this run: no lock file)",
        "package lock (not recorded in the baseline)",
    ]


def test_check_warns_naming_the_differing_packages_and_still_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write(tmp_path, "run.json", with_lock(manifest(), onnx="1.99"))
    base = _write(tmp_path, "base.json", with_lock(manifest()))
    assert main(["check", run, "--baseline", base]) == 0
    out = capsys.readouterr().out
    assert "warning: this run's packages differ from its lock constraints.txt: onnx 1.99" in out
    assert "check passed" in out
