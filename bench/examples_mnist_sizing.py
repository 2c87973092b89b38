"""Sizing of the built-in ``mnist`` example: FP32 ONNX Runtime latency at batch 1 and the cost of
training it, on this machine.

    .venv/bin/python bench/examples_mnist_sizing.py [--out bench/out/mnist-sizing.md]

Prints (and with ``--out`` writes), for the example's architecture (untrained weights time the
same as trained ones; the graph is the export step's, verified against PyTorch):

* ONNX Runtime, batch 1, 2 intra-op threads: wall-clock ms per image (min, p10, p50 of 300 runs);
* the same with 1 thread as CPU time of the calling thread (``time.thread_time``): the compute a
  quiet core spends, which other processes on a shared machine do not inflate;
* one training step (batch 64, channels-last, AdamW) as 1-thread CPU time, times the number of
  steps of the example's training, and as 2-thread wall time.

The 2-thread wall figures are only meaningful on a quiet machine; on a shared one read the
1-thread CPU times (2 threads scale them by about 1/1.8).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from bench_out import publish, reproduce_command, reproduce_footer
from slimline import api
from slimline.examples import mnist
from slimline.recipe import Recipe
from slimline.task import Task


def _untrained_task() -> Task:
    """The example's architecture with its initial weights, on 64 real digits."""
    net = mnist.build().eval()
    x = mnist._split()[0][:64]
    return Task(
        name="mnist-untrained",
        source="bench",
        calibration_data=lambda: iter([{"x": x}]),
        eval_data=lambda: iter([({"x": x}, None)]),
        metric=lambda out, labels: 0.0,  # untrained: timing only
        model=lambda: net,
    )


def _export(work: Path) -> tuple[Path, dict[str, Any]]:
    """The verified export (the export step's defaults) of the untrained architecture."""
    recipe = Recipe(name="mnist-sizing", task="bench", target={"threads": 2})
    ctx = api.context_for(_untrained_task(), recipe, work, timed=False)
    assert ctx.baseline.onnx is not None
    return ctx.baseline.onnx, ctx.baseline.meta


def _session(onnx: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(onnx), so, providers=["CPUExecutionProvider"])


def _ort_times(sess: ort.InferenceSession, x: np.ndarray, clock: object, n: int) -> np.ndarray:
    for _ in range(20):
        sess.run(None, {"x": x})
    out = []
    for _ in range(n):
        t = clock()  # type: ignore[operator]
        sess.run(None, {"x": x})
        out.append(clock() - t)  # type: ignore[operator]
    return np.array(out) * 1e3


def _train_steps(threads: int, clock: object, n: int = 8) -> np.ndarray:
    torch.set_num_threads(threads)
    net = mnist.build().train().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y, _, _ = mnist._split()
    xb = torch.from_numpy(x[:64]).contiguous(memory_format=torch.channels_last)
    yb = torch.from_numpy(y[:64])
    out = []
    for _ in range(n):
        t = clock()  # type: ignore[operator]
        loss = torch.nn.functional.cross_entropy(net(xb), yb)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(clock() - t)  # type: ignore[operator]
    return np.array(out[2:])


def sizing(work: Path) -> dict[str, Any]:
    net = mnist.build().eval()
    x = mnist._split()[0][:1]
    onnx, meta = _export(work)
    check = meta["export_check"]
    params = sum(p.numel() for p in net.parameters())
    wall = _ort_times(_session(onnx, 2), x, time.perf_counter, 300)
    cpu = _ort_times(_session(onnx, 1), x, time.thread_time, 300)
    steps = mnist.TRAIN.epochs * -(-4000 // mnist.TRAIN.batch)
    st1 = _train_steps(1, time.thread_time)
    st2 = _train_steps(2, time.perf_counter)
    return {
        "params": params,
        "arch": str(mnist.ARCH),
        "train_batch": mnist.TRAIN.batch,
        "export": {"opset": meta["opset"], **check},
        "ort_wall_ms_2t": wall.tolist(),
        "ort_cpu_ms_1t": cpu.tolist(),
        "train_steps": steps,
        "train_cpu_s_1t": st1.tolist(),
        "train_wall_s_2t": st2.tolist(),
    }


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    wall, cpu = np.array(doc["ort_wall_ms_2t"]), np.array(doc["ort_cpu_ms_1t"])
    st1, st2 = np.array(doc["train_cpu_s_1t"]), np.array(doc["train_wall_s_2t"])
    steps, check = doc["train_steps"], doc["export"]
    lines = [
        f"mnist example: {doc['params'] / 1e6:.2f} M parameters, arch {doc['arch']}; export (opset "
        f"{check['opset']}) verified against PyTorch: max abs error {check['max_abs_err']:.3g}",
        f"ORT batch 1, 2 threads, wall ms/image: min {wall.min():.2f} "
        f"p10 {np.percentile(wall, 10):.2f} p50 {np.median(wall):.2f}",
        f"ORT batch 1, 1 thread, CPU ms/image: p10 {np.percentile(cpu, 10):.2f} "
        f"p50 {np.median(cpu):.2f}",
        f"training: {steps} steps of batch {doc['train_batch']}; 1 thread CPU s/step p50 "
        f"{np.median(st1):.3f} -> {np.median(st1) * steps:.0f} CPU-s",
        f"training, 2 threads, wall s/step min {st2.min():.3f} p50 {np.median(st2):.3f} -> "
        f"{st2.min() * steps:.0f} s (min) / {np.median(st2) * steps:.0f} s (p50)",
    ]
    return "\n".join([*(f"- {line}" for line in lines), *reproduce_footer(doc["command"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = sizing(Path(tmp))
    doc["command"] = reproduce_command("examples_mnist_sizing.py", argv)
    publish(render(doc), doc, args.out, "examples_mnist_sizing.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
