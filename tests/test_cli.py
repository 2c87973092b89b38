from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slimline.cli import main
from slimline.export import export_module
from slimline.task import load_task


def test_unknown_recipe_key_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("name: x\ntask: mnist\nsteps: [export]\nspeed: max\n")
    assert main(["optimize", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: recipe") and "speed: unknown key" in err and "\n" not in err


def test_print_recipe_round_trips(
    tmp_path: Path, tiny_recipe: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(tiny_recipe))
    assert main(["optimize", str(f), "--print-recipe", "--threads", "2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["target"]["threads"] == 2 and printed["steps"][0] == {
        "export": printed["steps"][0]["export"]
    }


def test_check_rejects_non_manifest_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "m.json").write_text(json.dumps({"schema": 1, "candidates": []}))
    (tmp_path / "bad.json").write_text("[]")
    assert main(["check", str(tmp_path / "m.json"), "--baseline", str(tmp_path / "bad.json")]) == 2
    assert "not a slimline manifest" in capsys.readouterr().err


def test_check_exit_codes(tmp_path: Path) -> None:
    def write(name: str, p50: float) -> Path:
        p = tmp_path / name
        p.write_text(
            json.dumps(
                {
                    "schema": 1,
                    "candidates": [
                        {
                            "name": "fp32-onnx",
                            "latency_ms": {"p50": p50, "band": [p50 * 0.98, p50 * 1.02]},
                            "metric": {"name": "m", "value": 1.0},
                        }
                    ],
                }
            )
        )
        return p

    base, slow = write("base.json", 1.0), write("slow.json", 1.5)
    assert main(["check", str(base), "--baseline", str(base)]) == 0
    assert main(["check", str(slow), "--baseline", str(base)]) == 1


def test_profile_onnx_with_mismatched_samples(tmp_path: Path, tiny_task_file: Path) -> None:
    t = load_task(str(tiny_task_file))
    assert t.model is not None
    onnx = export_module(t.model(), t.sample_inputs(2), tmp_path / "tiny.onnx")
    np.savez(tmp_path / "s.npz", x=np.zeros((3, 1, 12, 12), np.int64))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimline.cli",
            "profile",
            str(onnx),
            "--samples",
            str(tmp_path / "s.npz"),
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: samples s.npz for tiny.onnx: input 'x' is int64, but the model expects float32 "
        "[batch, 1, 12, 12]; save it with .astype(np.float32)"
    ]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage"])
def test_corrupt_onnx_profile(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    np.savez(tmp_path / "s.npz", x=np.zeros((3, 1, 12, 12), np.float32))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimline.cli",
            "profile",
            str(bad),
            "--samples",
            str(tmp_path / "s.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "re-export it" in proc.stderr and "Traceback" not in proc.stderr


def test_the_cli_and_the_torch_steps_import_without_torch() -> None:
    """torch types are imported for the type checker only (``if TYPE_CHECKING:``): starting the
    CLI, or importing the modules of the steps that run torch, does not load it."""
    code = (
        "import importlib, pkgutil, sys, slimline.cli, slimline.compress.finetune\n"
        "import slimline.compress.qat.fakequant, slimline.compress.pruning as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('slimline.compress.pruning.' + m.name)\n"
        "print(sorted(m for m in ('torch', 'torch_pruning') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
