"""MLServer as the serving benchmarks' peer: the same ONNX file behind ``mlserver start``.

MLServer has no ONNX runtime of its own, so it serves the model through a small custom runtime
(an ``MLModel`` that runs one ONNX Runtime session, written beside the model settings at run
time): the same ``onnxruntime`` version, the same intra-op threads as slimline, spin-waiting
off as in slimline, full graph optimization. Its own adaptive batching (``max_batch_size``,
``max_batch_time``) merges requests along the first axis as slimline's batcher does.

MLServer runs from its own virtual environment, never the project's (its pins would move the
project's packages), as a separate process:

    python3 -m venv /tmp/mlserver-venv
    /tmp/mlserver-venv/bin/pip install mlserver==1.7.1 onnxruntime==<the project's version> numpy

and ``--mlserver /tmp/mlserver-venv/bin/mlserver`` points a script at it. It speaks the Open
Inference Protocol over REST with JSON tensors only (no binary tensor extension), so it is
compared over JSON with the same client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

RUNTIME = '''
import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OrtRuntime(MLModel):
    """One ONNX Runtime session; inputs decoded with MLServer's NumpyCodec."""

    async def load(self) -> bool:
        extra = self.settings.parameters.extra or {}
        so = ort.SessionOptions()
        so.intra_op_num_threads = int(extra["threads"])
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            self.settings.parameters.uri, so, providers=["CPUExecutionProvider"]
        )
        self.dtypes = {i.name: np.float32 if "float" in i.type else np.int64
                       for i in self.session.get_inputs()}
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feed = {i.name: NumpyCodec.decode_input(i).astype(self.dtypes[i.name], copy=False)
                for i in payload.inputs}
        names = [o.name for o in self.session.get_outputs()]
        outs = self.session.run(names, feed)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(n, o) for n, o in zip(names, outs)],
        )
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def mlserver(
    binary: Path,
    onnx: Path,
    name: str,
    *,
    threads: int,
    max_batch_size: int,
    max_batch_time_s: float,
    parallel_workers: int,
    ready_timeout_s: float = 120,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``mlserver start`` serving ``onnx`` as model ``name``; yields (URL, process) once ready."""
    with tempfile.TemporaryDirectory(prefix="slimline-mlserver-") as tmp:
        root = Path(tmp)
        port, grpc_port, metrics_port = _free_port(), _free_port(), _free_port()
        settings = {"host": "127.0.0.1", "http_port": port, "grpc_port": grpc_port,
                    "metrics_port": metrics_port, "parallel_workers": parallel_workers,
                    "debug": False, "gzip_enabled": False}  # fmt: skip
        (root / "settings.json").write_text(json.dumps(settings))
        model_dir = root / name
        model_dir.mkdir()
        (model_dir / "ort_runtime.py").write_text(RUNTIME)
        (model_dir / "model-settings.json").write_text(json.dumps({
            "name": name, "implementation": "ort_runtime.OrtRuntime",
            "max_batch_size": max_batch_size, "max_batch_time": max_batch_time_s,
            "parameters": {"uri": str(onnx.resolve()), "extra": {"threads": threads}},
        }))  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.pop("PYTHONPATH", None)
        log = root / "mlserver.log"
        with log.open("w") as sink:
            proc = subprocess.Popen([str(binary), "start", str(root)], cwd=root, env=env,
                                    stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                _wait_ready(url, name, proc, ready_timeout_s)
            except RuntimeError as err:
                tail = log.read_text().strip().splitlines()[-5:]
                raise RuntimeError(f"{err}; its log ends: {' | '.join(tail)}") from None
            yield url, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(url: str, name: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlserver exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/v2/models/{name}/ready", timeout=2).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"mlserver was not ready within {timeout_s:g} s")
