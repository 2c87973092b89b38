"""Sizing of the built-in ``mnist`` example: FP32 ONNX Runtime latency at batch 1 and the cost of
training it, on this machine.

    .venv/bin/python bench/examples_mnist_sizing.py

Prints, for the example's architecture (untrained weights time the same as trained ones):

* ONNX Runtime, batch 1, 2 intra-op threads: wall-clock ms per image (min, p10, p50 of 300 runs);
* the same with 1 thread as CPU time of the calling thread (``time.thread_time``): the compute a
  quiet core spends, which other processes on a shared machine do not inflate;
* one training step (batch 64, channels-last, AdamW) as 1-thread CPU time, times the number of
  steps of the example's training, and as 2-thread wall time.

The 2-thread wall figures are only meaningful on a quiet machine; on a shared one read the
1-thread CPU times (2 threads scale them by about 1/1.8).
"""

from __future__ import annotations

import io
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch

from slimline.examples import mnist


def _session(onnx: bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(onnx, so, providers=["CPUExecutionProvider"])


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
        loss.backward()
        opt.step()
        out.append(clock() - t)  # type: ignore[operator]
    return np.array(out[2:])


def main() -> None:
    net = mnist.build().eval()
    x = mnist._split()[0][:1]
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.from_numpy(x),),
            buf,  # type: ignore[arg-type]  # a file-like object is accepted at run time
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    params = sum(p.numel() for p in net.parameters())
    print(f"mnist example: {params / 1e6:.2f} M parameters, arch {mnist.ARCH}")
    wall = _ort_times(_session(buf.getvalue(), 2), x, time.perf_counter, 300)
    print(
        f"ORT batch 1, 2 threads, wall ms/image: min {wall.min():.2f} "
        f"p10 {np.percentile(wall, 10):.2f} p50 {np.median(wall):.2f}"
    )
    cpu = _ort_times(_session(buf.getvalue(), 1), x, time.thread_time, 300)
    print(
        f"ORT batch 1, 1 thread, CPU ms/image: p10 {np.percentile(cpu, 10):.2f} p50 {np.median(cpu):.2f}"
    )
    steps = mnist.TRAIN.epochs * -(-4000 // mnist.TRAIN.batch)
    st1 = _train_steps(1, time.thread_time)
    print(
        f"training: {steps} steps of batch {mnist.TRAIN.batch}; 1 thread CPU s/step p50 "
        f"{np.median(st1):.3f} -> {np.median(st1) * steps:.0f} CPU-s"
    )
    st2 = _train_steps(2, time.perf_counter)
    print(
        f"training, 2 threads, wall s/step min {st2.min():.3f} p50 {np.median(st2):.3f} -> "
        f"{st2.min() * steps:.0f} s (min) / {np.median(st2) * steps:.0f} s (p50)"
    )


if __name__ == "__main__":
    main()
